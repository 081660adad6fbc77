"""Mixture-of-Experts under every schedule of the plugin, in Megatron-LM's own training loop.

MoE GPTs (4 experts, top-2, load-balancing loss; local spec: SequentialMLP experts of
megatron linears; support.megatron_lm_tier.MOE_CASES) run ``scripts/pretrain_gpt_vshape.py``
on 4 gloo processes, as tests/megatron/test_megatron_lm_e2e.py runs the dense one (one initial
checkpoint, 4 iterations, a validation step at iterations 2 and 4):

    case     parallelism         dispatcher  balancing        also on
    moe-ep   PP 2 x EP 2 (DP 2)  alltoall    aux_loss         distributed optimizer, expert
                                                              capacity 1.0 with padding
                                                              (token dropping), untied
    moe-pp4  PP 4                allgather   global_aux_loss  z-loss, a shared expert
    moe-edp  PP 2 x DP 2, EP 1   allgather   seq_aux_loss     expert-data-parallel gradients,
                                                              overlapped reduction, distributed
                                                              optimizer, dense and MoE layers
                                                              mixed (--moe-layer-freq); v-half
    and 14 layers on PP 4 (uneven V stages) with a dense first layer, v-half.

Each of zb-1p, v-min, v-half, v-zb and auto (v-half alone for moe-edp) must give 1f1b's losses,
grad norms, validation losses and logged MoE metrics (the balancing losses, z_loss: megatron's
tracker, reduced over the pipeline, so both chunks of a V rank count) to 1e-5 relative (fp32);
so far they agree to the last bit or a few ulps. The aux losses' backward scale
(MoEAuxLossAutoScaler) is set by megatron's own forward_step, which the V's F passes call for
every microbatch as megatron's schedules do; a wrong scale would show in the grad norms.
Checkpoints saved under a V resume under 1f1b and the reverse, with megatron's plain optimizer
(moe-pp4) and its distributed optimizer (moe-ep). megatron-core's two CPU problems with MoE
(``te_general_gemm``, gloo's all-to-all split sizes) are patched in support.megatron_lm_cpu,
each naming its line.

Which weights keep their gradient in B is checked in one process on megatron-core alone
(:func:`test_expert_weight_gradients_run_in_w`, both megatron-core versions).
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
from support.megatron_cpu import importorskip_megatron  # noqa: E402

importorskip_megatron()

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support.megatron_lm_launch import MEGATRON_LM, TAKES_CONFIG_CONTAINER  # noqa: E402
from support.megatron_lm_tier import (  # noqa: E402
    MOE_CASES, PP4, TINY_GPT, assert_same_moe_metrics, assert_same_training, resumed, trained,
    uneven_runs)
from support.megatron_workers import moe_weight_grads_in_w  # noqa: E402

def _real_loop_or_skip() -> None:
    if not (MEGATRON_LM / "megatron" / "training").is_dir():
        pytest.skip(f"Megatron-LM's training code is not at {MEGATRON_LM}")
    if TAKES_CONFIG_CONTAINER:
        pytest.skip(f"{MEGATRON_LM} holds the 0.19-era training code: tests/test_megatron_lm_019"
                    ".py runs its MoE case")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _real_loop_or_skip()
    from support.megatron_lm_launch import Launcher
    from support.megatron_lm_tier import Runs

    launcher = Launcher()
    yield Runs(launcher, tmp_path_factory.mktemp("megatron-lm-moe"))
    launcher.close()


def _assert_trains_like_1f1b(runs, case: str, schedule: str) -> None:
    reference = trained(runs, case, MOE_CASES[case], "1f1b")
    got = trained(runs, case, MOE_CASES[case], schedule)
    assert_same_training(got, reference, f"{case} {schedule}")
    assert_same_moe_metrics(got, reference, f"{case} {schedule}")
    for rank in range(4):
        assert "weight gradients in B" not in got.log(rank), got.log(rank)[-2000:]
    # re-planned inside the loop from the measured F, B, W of MoE layers (all-to-all included)
    assert f"[vshape] re-planning {schedule} from measured costs" in got.log(0)


@pytest.mark.parametrize("case", ["moe-ep", "moe-pp4"])
@pytest.mark.parametrize("schedule", [
    pytest.param(name, marks=pytest.mark.megatron_matrix) if name == "v-half" else name
    for name in ("zb-1p", "v-min", "v-half", "v-zb", "auto")])
def test_moe_trains_like_1f1b(runs, case, schedule):
    """(The matrix tier, .ci/megatron-versions, runs v-half on both cases.)"""
    _assert_trains_like_1f1b(runs, case, schedule)


def test_expert_data_parallel_gradients_and_mixed_layers_like_1f1b(runs):
    """EP 1 on PP 2 x DP 2: both data-parallel ranks hold every expert, whose gradients DDP
    reduces in its expert buckets over the expert-data-parallel group, started from the W
    passes (--overlap-grad-reduce), with the distributed optimizer. --moe-layer-freq mixes
    dense and MoE layers: Megatron-LM's gpt_builder slices that pattern by parallel_state's
    rank, which the V answers with chunk 1's mirrored rank (layers.py); before, chunk 1 got
    the loop's layer types, another model than 1f1b's."""
    _assert_trains_like_1f1b(runs, "moe-edp", "v-half")


def test_uneven_moe_layers_like_1f1b(runs):
    """--num-layers 14 on PP 4 (the V's stages 1,2,2,2,2,2,2,1; 1f1b's 2,4,4,4) with a dense
    first layer (--moe-layer-freq): gpt_builder's block spec takes its layer count and types
    from the V's stages (layers.py), as the e2e tier's dense uneven case does."""
    model = PP4 + ["--num-layers", "14", "--num-experts", "4", "--moe-router-topk", "2",
                   "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "allgather",
                   "--disable-bias-linear", "--moe-layer-freq", "[0]+[1]*13"]
    reference, got = uneven_runs(runs, "moe-uneven", model)
    assert_same_training(got, reference, "moe-uneven v-half")
    assert_same_moe_metrics(got, reference, "moe-uneven v-half")


@pytest.mark.parametrize("case,saved_by,resumed_by", [
    ("moe-pp4", "v-half", "1f1b"), ("moe-pp4", "1f1b", "v-half"),
    ("moe-ep", "v-zb", "1f1b"), ("moe-ep", "1f1b", "v-zb")])
def test_moe_checkpoint_resumes_under_another_schedule(runs, case, saved_by, resumed_by):
    """Saved at iteration 2, resumed: iterations 3 and 4 equal the uninterrupted 1f1b run's
    (moe-pp4: megatron's plain optimizer; moe-ep: its distributed optimizer, saved fully
    reshardable, with expert-parallel shards)."""
    uninterrupted = trained(runs, case, MOE_CASES[case], "1f1b")
    got = resumed(runs, case, MOE_CASES[case], saved_by, resumed_by)
    label = f"{case} {saved_by} -> {resumed_by}"
    assert_same_training(got, uninterrupted, label, first=3)
    assert_same_moe_metrics(got, uninterrupted, label, first=3)


@pytest.mark.parametrize("flags,needle", [
    (MOE_CASES["moe-pp4"] + ["--moe-grouped-gemm"], "drop --moe-grouped-gemm"),
])
def test_untested_moe_settings_stop_at_parsing(runs, flags, needle):
    """Through the script's real parse_args: grouped-GEMM experts of the local spec (megatron's
    legacy GroupedMLP; TE's run in tests/megatron/test_megatron_lm_te.py) stop before
    torch.distributed is initialised, with the way out."""
    result = runs.attempt(f"bad-{abs(hash(tuple(flags)))}",
                          TINY_GPT + flags + ["--pipeline-schedule", "v-half"], nproc=4)
    assert not result.ok
    log = result.log(0)
    assert needle in log, log[-2000:]
    assert "initializing torch distributed" not in log


@pytest.mark.megatron_versions
def test_expert_weight_gradients_run_in_w():
    """Every expert's fc1 and fc2 and the shared expert's run their weight gradients in W
    (defer_weight_grads, as V chunks and zb-1p do), with megatron's gradients exactly; the
    router's weight keeps its gradient in B by design (providers._IN_B_BY_DESIGN says why),
    and nothing else is left in B unannounced."""
    [outcome] = run_gloo(moe_weight_grads_in_w, 1, timeout=300)
    assert outcome.ok, outcome.error
    result = outcome.value
    experts = result["experts"]
    assert len(experts) == 2 * (4 * 2 + 2)  # 2 layers x (4 experts + 1 shared) x fc1, fc2
    assert not set(experts) & set(result["in_b"]), result["in_b"]
    assert [n for n in result["in_b"] if "linear" in n] == [], result["in_b"]
    assert {n for n in result["in_b"] if "router" in n} == \
        {f"decoder.layers.{i}.mlp.router.weight" for i in (0, 1)}
    assert result["kept"] == [] and result["pending"] == []
    assert result["diff"] == 0.0
