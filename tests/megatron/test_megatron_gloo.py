"""V schedules on megatron-core GPTModel (local spec, fp32) vs megatron's own 1F1B, on gloo.

Every parameter starts from values that depend only on its global name, so the 1F1B and V
models (different layers per rank) are the same model. Each step's losses and every gradient
(summed over ranks by global name) must agree to 1e-5 (fp32); so far they agree exactly.
"""
import pytest

pytest.importorskip("torch")
from support.megatron_cpu import importorskip_megatron  # noqa: E402

importorskip_megatron()

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support.megatron_workers import compare_runs  # noqa: E402

pytestmark = pytest.mark.gloo

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
             sequence_parallel=False, options=None, schedules=V_SCHEDULES, raw=False):
    outcomes = run_gloo(compare_runs, world, schedules, layers, microbatches, STEPS, tied, pp,
                        ddp, tp, sequence_parallel, reference, options, timeout=600)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[0].error
    values = [o.value for o in outcomes]
    if raw:
        return values
    return {name: _merge(values, name) for name in ("1f1b",) + schedules}


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


MTP = {"config": {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}}
"""Two multi-token prediction layers (megatron's MTP block, rope), tied embeddings: the V puts
them on rank 0's chunk 1 with a copy of the word embedding that the LM head and MTP share;
megatron-core cannot checkpoint this model at PP > 1 (not even under its own 1f1b), so
Megatron-LM's loop, whose comparisons start from a checkpoint, runs untied MTP
(tests/megatron/test_megatron_lm_mtp.py) and tied MTP is proven here, from by-name weights."""


@pytest.fixture(scope="module")
def pp2_tied_mtp_raw():
    """PP 2 with megatron's DDP: megatron's finalize_model_grads sums the embedding copies'
    gradients over its embedding group in 1F1B (first and last rank), the V sums its two on
    rank 0 (model.sum_tied_embedding_grads). Without overlap_grad_reduce: with it megatron's
    own 1F1B fails at the second step, since the MTP stage's tied ``output_layer.weight``,
    which nothing uses, never reports its gradient ready (param_and_grad_buffer.py:206).
    Every rank's values."""
    return _compare(2, 4, tied=True, ddp={}, options=MTP, raw=True)


@pytest.fixture(scope="module")
def pp2_tied_mtp(pp2_tied_mtp_raw):
    return {name: _merge(pp2_tied_mtp_raw, name) for name in ("1f1b",) + V_SCHEDULES}


@pytest.mark.megatron_versions
@pytest.mark.parametrize("name", V_SCHEDULES[1:])
def test_mtp_sits_beside_the_lm_head_on_rank_0_with_megatrons_layer_numbers(
        pp2_tied_mtp_raw, name):
    """Megatron's 1F1B builds the MTP block on the last pipeline rank, a V on rank 0 (stage
    2p-1, chunk 1), with the same layer numbers (megatron-core 0.16: num_layers + depth)."""
    where = {}
    for values in pp2_tied_mtp_raw:
        for schedule in ("1f1b", name):
            numbers = values[schedule][-1]["mtp_layers"]
            if numbers:
                where.setdefault(schedule, set()).add((values[schedule][0]["pp_rank"],
                                                       tuple(numbers)))
    assert {rank for rank, _ in where["1f1b"]} == {1}
    assert {rank for rank, _ in where[name]} == {0}
    assert {n for _, n in where["1f1b"]} == {n for _, n in where[name]}
    assert len({n for _, n in where[name]}) == 1 and len(next(iter(where[name]))[1]) == 2


VERSIONS = pytest.mark.megatron_versions
"""CI runs these under megatron-core 0.19.2 too (.ci/megatron-versions): V model build (uneven
layers through megatron's placement functions), losses and gradients equal to megatron's own
1F1B (tied and untied, PP 2 and 4, DDP with W-started bucket reductions, the deferred W of
tensor- and sequence-parallel linears), checkpoints between V and standard models."""

FIXTURES = [pytest.param("pp2_untied", marks=VERSIONS), pytest.param("pp4_tied", marks=VERSIONS),
            pytest.param("pp2_dp2_tied_overlap", marks=VERSIONS), "pp2_distopt_tied",
            "pp2_tp2_tied", pytest.param("pp2_tp2_sp_ddp", marks=VERSIONS),
            pytest.param("pp4_uneven_tied", marks=VERSIONS),
            pytest.param("pp2_tied_mtp", marks=VERSIONS)]


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


RECOMPUTATION = {"selective": {"recompute_granularity": "selective"},
                 "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 1}}


@pytest.mark.parametrize("kind", RECOMPUTATION)
def test_recomputation_trains_like_megatrons_1f1b_with_it(kind):
    """What the planner's +sel (and -r) rows assume: megatron's activation recomputation (its
    CheckpointFunction replays the forward inside B) composes with the B/W split, so the
    schedules train bit-identically to megatron's 1F1B recomputing the same way."""
    runs = _compare(2, 4, tied=True, options={"config": RECOMPUTATION[kind]},
                    schedules=("zb-1p", "v-half"))
    for name in ("zb-1p", "v-half"):
        for (ref_losses, ref_grads, _, _), (losses, grads, ran, _) in zip(runs["1f1b"][0],
                                                                          runs[name][0]):
            assert ran > 0 and losses == ref_losses and set(grads) == set(ref_grads)
            assert all(bool((grads[k] == ref_grads[k]).all()) for k in grads), name


# At PP = 4 the measured peak over megatron's own 1F1B's stays within the simulated ratio + 0.03.
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
    pytest.param(2, "v", "1f1b", True, marks=VERSIONS),
    pytest.param(2, "1f1b", "v", True, marks=VERSIONS), (2, "v", "v", False),
    pytest.param(4, "v", "1f1b", False, marks=VERSIONS),
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


# -- what Megatron-LM's training loop adds on top of megatron-core ------------------------------
LOOP = {"per_token": True, "relay": True, "timers": True, "param_sync": True,
        "align_grad_reduce": True, "replan_after": 1, "memory_limit": "0.75"}


def _assert_step_equal(values, name, step, last_rank, num_losses):
    """One step of ``name`` against megatron's 1F1B (raw per-rank results): losses only on the
    last pipeline rank, where Megatron-LM reads them, equal to 1e-5; every gradient (per-token
    scaling included) equal to 1e-5. Returns ``name``'s per-rank results of that step."""
    ref = [v["1f1b"][step] for v in values]
    got = [v[name][step] for v in values]
    assert [bool(r["losses"]) for r in got] == [r["pp_rank"] == last_rank for r in got]
    ref_losses = sorted(x for r in ref for x in r["losses"])
    got_losses = sorted(x for r in got for x in r["losses"])
    assert len(got_losses) == len(ref_losses) == num_losses
    assert max(abs(a - b) for a, b in zip(got_losses, ref_losses)) < 1e-5
    ref_grads = {k: g for r in ref for k, g in r["grads"].items()}
    got_grads = {k: g for r in got for k, g in r["grads"].items()}
    assert set(got_grads) == set(ref_grads)
    for key, grad in got_grads.items():
        assert (grad - ref_grads[key]).abs().max().item() < 1e-5, key
    return got


@pytest.fixture(scope="module")
def pp4_training_loop():
    """PP = 4 under DDP with overlap_grad_reduce and align_grad_reduce (config.grad_sync_func:
    each chunk's reduction launched after its last W), pretrain_gpt's per-token loss
    (calculate_per_token_loss: the token count comes from the loss rank, rank 0 under a V and
    the last rank under zb-1p), losses relayed to the last pipeline rank (zb-1p has them there), megatron's timers, param_sync_func, and auto re-planned from the
    costs measured in its first iteration (limit 0.75 of 1F1B)."""
    return _compare(4, 8, tied=True, ddp={"overlap_grad_reduce": True}, options=LOOP,
                    schedules=("zb-1p", "v-half", "auto"), raw=True)


@pytest.mark.parametrize("name", ["zb-1p", "v-half", "auto"])
def test_training_loop_hooks_match_megatrons_1f1b(name, pp4_training_loop):
    values = pp4_training_loop
    chunks = 1 if name == "zb-1p" else 2
    for step in range(STEPS):
        got = _assert_step_equal(values, name, step, last_rank=3, num_losses=4)
        for r in got:  # timer starts so far (cumulative over steps)
            assert r["timers"].get("forward-backward") == step + 1
            assert r["timers"].get("forward-compute", 0) >= 4 * chunks * (step + 1)  # 4 mbs
            assert r["timers"].get("backward-compute", 0) >= 8 * chunks * (step + 1)  # B and W
            # param_sync_func once per chunk and step
            assert sorted(r["param_syncs"]) == sorted(list(range(chunks)) * (step + 1))
    evaluation = [x for v in values for x in v[name][-1]["eval"]]
    assert len(evaluation) == 4  # forward-only losses relayed too


def test_auto_replans_from_measured_costs_and_stays_equal(pp4_training_loop):
    last = [v["auto"][-1] for v in pp4_training_loop]
    assert all(r["replanned"] for r in last)
    # the same schedules on every rank, before and after re-planning (agreed costs)
    assert len({tuple(r["plans"]) for r in last}) == 1
    assert [steps for steps, _ in last[0]["plans"]] == [0, 1]
    costs = last[0]["costs"]
    assert min(costs.forward + costs.backward + costs.weight) > 0
    # the agreed costs are the mean over pipelines, on the scale of one pipeline's own profile
    replanned = last[0]["replanned_costs"]
    assert 0.5 < sum(replanned.forward) / sum(costs.forward) < 2
    # the memory model measured in the profiled iterations: B frees part of a chunk, W the
    # rest (megatron's deferred W keeps each linear's input), agreed on every rank
    models = {r["memory_model"] for r in last}
    assert len(models) == 1
    memory = models.pop()
    assert memory.forward == 1.0 and -1.0 < memory.backward < 0.0 < -memory.weight < 1.0


def test_auto_under_a_byte_limit_measures_its_unit_then_replans():
    """A limit in bytes: the first (profiled) iteration runs V-Min while the bytes kept for
    backward are tracked; then auto is searched under limit / measured bytes per unit."""
    values = _compare(2, 4, tied=False, options={"replan_after": 1, "memory_limit": "1MiB"},
                      schedules=("auto",), raw=True)
    last = [v["auto"][-1] for v in values]
    assert all(r["replanned"] for r in last)
    per_unit = {r["activation_bytes"] for r in last}
    assert len(per_unit) == 1 and 0 < per_unit.pop() < 2**20  # agreed on every rank
    plans = last[0]["plans"]  # V-Min while profiling, then auto
    assert [steps for steps, _ in plans] == [0, 1] and plans[0][1].startswith("v-min")
    assert plans[1][1].startswith("auto")
    for step in range(STEPS):
        ref = {k: g for v in values for k, g in v["1f1b"][step]["grads"].items()}
        got = {k: g for v in values for k, g in v["auto"][step]["grads"].items()}
        assert set(got) == set(ref)
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5


@pytest.fixture(scope="module")
def pp2_tp2_megatron_lm():
    """scripts/pretrain_gpt_vshape.py's pieces driven on megatron-core: chunks from
    VChunkProvider called once per vp stage (as Megatron-LM's get_model does), the V's batch
    read on pipeline rank 0 and broadcast over TP (VBatch), the forward step with pretrain_gpt's
    per-token loss (VForwardStep), DDP with overlap and align_grad_reduce, losses relayed."""
    options = {"megatron_lm": True, "per_token": True, "relay": True, "timers": True,
               "align_grad_reduce": True}
    return _compare(4, 4, tied=True, tp=2, ddp={"overlap_grad_reduce": True}, options=options,
                    schedules=("v-half", "v-zb"), raw=True)


@pytest.mark.parametrize("name", ["v-half", "v-zb"])
def test_megatron_lm_entry_pieces_equal_megatrons_1f1b(name, pp2_tp2_megatron_lm):
    values = pp2_tp2_megatron_lm
    for step in range(STEPS):
        got = _assert_step_equal(values, name, step, last_rank=1, num_losses=8)  # 4 mbs x 2 TP
        assert all(r["w_ran"] > 0 for r in got)
        assert all(r["timers"].get("batch-generator", 0) > 0 for r in got if r["pp_rank"] == 0)
