"""V schedules on megatron-core GPTModel (local spec, fp32) vs megatron's own 1F1B, on gloo.

Every parameter starts from values that depend only on its global name, so the 1F1B and V
models (different layers per rank) are the same model. Each step's losses and every gradient
(summed over ranks by global name) must agree to 1e-5 (fp32); so far they agree exactly.
"""
import pytest

pytest.importorskip("megatron.core")

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support.megatron_workers import compare_runs  # noqa: E402

V_SCHEDULES = ("zb-1p", "v-min", "v-half", "v-zb", "auto")
STEPS = 2


def _merge(values, name):
    """Per step: (losses from every rank, {(dp rank, global parameter name): grad}, weight
    gradients run in W, peak activation bytes per rank)."""
    steps = []
    for s in range(STEPS):
        losses = sorted(x for v in values for x in v[name][s]["losses"])
        ran = sum(v[name][s]["w_ran"] for v in values)
        peak = [v[name][s]["peak"] for v in values]
        grads = {}
        for v in values:
            for key, grad in v[name][s]["grads"].items():
                assert key not in grads, f"{key} has a gradient on two ranks"
                grads[key] = grad
        steps.append((losses, grads, ran, peak))
    evaluation = sorted(x for v in values for x in v[name][-1]["eval"])
    return steps, evaluation, values[0][name][-1].get("costs")


def _compare(world, layers, tied, microbatches=4, pp=None, ddp=None, tp=1, reference=None,
             sequence_parallel=False):
    outcomes = run_gloo(compare_runs, world, V_SCHEDULES, layers, microbatches, STEPS, tied, pp,
                        ddp, tp, sequence_parallel, reference, timeout=600)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[0].error
    values = [o.value for o in outcomes]
    return {name: _merge(values, name) for name in ("1f1b",) + V_SCHEDULES}


@pytest.fixture(scope="module")
def pp2_untied():
    return _compare(2, 4, tied=False)


@pytest.fixture(scope="module")
def pp4_tied():
    return _compare(4, 8, tied=True)


@pytest.fixture(scope="module")
def pp2_dp2_tied_overlap():
    """Megatron DDP per chunk with overlap_grad_reduce: W (not B) completes a weight's
    gradient, so its bucket's reduction starts from W through DDP's delay_wgrad hooks."""
    return _compare(4, 4, tied=True, pp=2, ddp={"overlap_grad_reduce": True})


@pytest.fixture(scope="module")
def pp2_distopt_tied():
    """Distributed-optimizer gradient buffers (DP = 1: with DP > 1 the buffers hold reduced
    values only in each rank's own shard, whose layout differs between 1F1B and V chunks)."""
    return _compare(2, 4, tied=True, ddp={"overlap_grad_reduce": True,
                                          "use_distributed_optimizer": True})


@pytest.fixture(scope="module")
def pp2_tp2_tied():
    """Tensor parallel 2 x pipeline 2: the deferred W of column/row parallel linears, and the
    tensor-parallel all-reduces, on gloo."""
    return _compare(4, 4, tied=True, tp=2)


@pytest.fixture(scope="module")
def pp2_tp2_sp_ddp():
    """TP = 2 with sequence parallel, under DDP (finalize_model_grads sums the norms' gradients
    over TP): B reduce-scatters the input gradient, W all-gathers the linear's input again.
    gloo has both collectives; megatron's torch LayerNorm refuses sequence parallel, so both
    schedules use the test-support norm that accepts it (tests/support/megatron_cpu.py)."""
    return _compare(4, 4, tied=True, tp=2, ddp={"overlap_grad_reduce": True},
                    sequence_parallel=True)


@pytest.fixture(scope="module")
def pp4_uneven_tied():
    """14 layers on PP = 4: the V's stages 0 and 7 (rank 0, which also holds the embedding and
    LM head) get one layer, the others two; megatron's 1F1B runs 2 / 4 / 4 / 4 layers."""
    return _compare(4, 14, tied=True, reference={"num_layers_in_first_pipeline_stage": 2,
                                                 "num_layers_in_last_pipeline_stage": 4})


FIXTURES = ["pp2_untied", "pp4_tied", "pp2_dp2_tied_overlap", "pp2_distopt_tied", "pp2_tp2_tied",
            "pp2_tp2_sp_ddp", "pp4_uneven_tied"]


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_weight_gradients_ran_in_w(fixture, name, request):
    runs = request.getfixturevalue(fixture)
    assert all(step[2] > 0 for step in runs[name][0])
    assert all(step[2] == 0 for step in runs["1f1b"][0])


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_losses_and_gradients_equal_megatrons_1f1b(fixture, name, request):
    runs = request.getfixturevalue(fixture)
    for (ref_losses, ref_grads, _, _), (losses, grads, _, _) in zip(runs["1f1b"][0],
                                                                    runs[name][0]):
        assert len(losses) == len(ref_losses) > 0
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
        assert set(grads) == set(ref_grads)
        for key, grad in grads.items():
            assert (grad - ref_grads[key]).abs().max().item() < 1e-5, key


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_evaluation_forward_only_equals_megatrons(fixture, name, request):
    runs = request.getfixturevalue(fixture)
    ref, got = runs["1f1b"][1], runs[name][1]
    assert len(got) == len(ref) > 0
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5


# Issue 5's limits at PP = 4: measured peak vs megatron's own 1F1B <= simulated ratio + 0.03.
LIMITS = {"v-half": 0.78, "v-min": 0.53, "v-zb": 1.03}


@pytest.fixture(scope="module")
def pp4_memory():
    return _compare(4, 24, tied=False, microbatches=8)


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_peak_activation_memory_vs_megatrons_1f1b(name, pp4_memory):
    from megatron_vshape.schedule import build_schedule, simulate

    base = max(pp4_memory["1f1b"][0][0][3])
    ratio = max(pp4_memory[name][0][0][3]) / base
    simulated = simulate(build_schedule(name, 4, 8)).peak_memory_vs_1f1b
    assert ratio <= simulated + 0.03
    if name in LIMITS:
        assert ratio <= LIMITS[name]


@pytest.mark.parametrize("world,src,dst,tied", [
    (2, "v", "1f1b", True), (2, "1f1b", "v", True), (2, "v", "v", False), (4, "v", "1f1b", False),
])
def test_checkpoints_move_between_v_and_standard_models_bit_exactly(world, src, dst, tied,
                                                                    tmp_path):
    from support.megatron_workers import checkpoint_round_trip

    outcomes = run_gloo(checkpoint_round_trip, world, str(tmp_path), src, dst, 2 * world, tied,
                        timeout=600)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[0].error
    saved, loaded = {}, {}
    for o in outcomes:
        saved.update(o.value["saved"])
        loaded.update(o.value["loaded"])
    assert set(saved) == set(loaded) and saved
    for key, value in saved.items():
        assert (value == loaded[key]).all(), key  # bit-exact


def test_profiled_costs_replan_auto(pp4_tied):
    """Per-pass profiling: every rank's measured F, B, W are positive, the same Costs on every
    rank, and auto re-plans from them into a valid schedule."""
    from megatron_vshape.schedule import build_schedule, validate

    costs = pp4_tied["v-half"][2]
    assert len(costs.forward) == 4
    assert min(costs.forward + costs.backward + costs.weight) > 0
    validate(build_schedule("auto", 4, 8, costs=costs, memory_limit=3.0), memory_limit=3.0)
