"""megatron-core's HybridModel (``--hybrid-layer-pattern``) under the plugin's schedules, in
Megatron-LM's own training loop: ``scripts/pretrain_hybrid_vshape.py`` (pretrain_hybrid.py's
path with the plugin installed) on gloo processes, with the 0.19-era training code and
megatron-core 0.19.2, and with Megatron-LM main and megatron-core main (0.20.0), as CI runs it
(.ci/megatron-versions; hybrid_builders.py is absent from core_v0.16.1: the tier skips there).

One tiny hybrid model of attention (``*``), MLP (``-``) and MoE (``E``) layers, 8 layers
``*-E-*-E-`` (the tiny GPT's sizes, 4 experts top-2), built from megatron-core's own hybrid
layer specs (``hybrid_stack_spec``: Transformer Engine's layers only, so the launch server
imports the CPU stand-in of TE, tests/support/te_stand_in, as the TE tier does). From one 1f1b
initial checkpoint per pipeline size, each schedule must give megatron's own 1f1b's losses,
grad norms, validation losses and logged MoE losses within 1e-5 relative (REL):

    PP 2 (DP 2)   every V with the even split (no '|'), zb-1p, and v-half with the pattern's
                  '|' segments read as the V's 4 stages ("*-E|-*|-E|-": stages of 3,2,2,1
                  layers, rank 0 holding stages 0 and 3); v-half resumed at iteration 2 from
                  1f1b's checkpoint
    PP 4          every V and zb-1p (8 stages of one layer under the V)

1f1b runs ``*-E-|*-E-`` (PP segments: megatron's placement) at PP 2; PP 4 runs ``*E-E*E-E``
(1f1b: ``*E|-E|*E|-E``), so that every rank holds an MoE layer (PATTERN_PP4). Under the V the linears' weight gradients run in W (TE's own split: W calls backward_dw);
nothing but the router is left in B.

    MEGATRON_LM=../shared/megatron-lm-0.19 python -m pytest -q -m megatron_hybrid tests
"""
from __future__ import annotations

import pytest

from support.megatron_lm_launch import MEGATRON_LM, REPO, Launcher
from support.megatron_lm_tier import (
    ITERS, Run, Runs, TINY_GPT, assert_same_moe_metrics, assert_same_training,
    initial_checkpoint, schedule_flags)

pytestmark = [pytest.mark.e2e, pytest.mark.megatron_versions, pytest.mark.megatron_hybrid]

if not (MEGATRON_LM / "hybrid_builders.py").is_file():
    pytest.skip(f"{MEGATRON_LM} has no hybrid_builders.py (HybridModel's training code: the "
                "megatron-core 0.19 era)", allow_module_level=True)

SCRIPT = REPO / "scripts" / "pretrain_hybrid_vshape.py"
HYBRID = ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm",
          "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
          "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
          "--moe-router-load-balancing-type", "aux_loss", "--moe-token-dispatcher-type",
          "allgather"]
"""megatron's hybrid layer specs (TE's layers; TEGroupedMLP experts), MoE as the GPT tiers'."""
PATTERN = "*-E-*-E-"
PATTERN_PP4 = "*E-E*E-E"
"""At PP 4 every rank holds an MoE layer, under 1f1b and under the V (stage s and 7-s): with
PATTERN, 1f1b's ranks 0 and 2 hold none, and Megatron-LM's own pretrain_hybrid.py, without the
plugin, hangs in its first training step on this CPU tier (0.19.2 with the 0.19-era training
code, the TE stand-in, TINY_GPT + HYBRID flags: killed after 90 s, where PATTERN_PP4 trains 2
iterations in 9 s; docs/training.md), so no 1f1b reference exists for it."""
PP2 = HYBRID + ["--pipeline-model-parallel-size", "2"]
PP4 = HYBRID + ["--pipeline-model-parallel-size", "4"]
REFERENCE = {"pp2": PP2 + ["--hybrid-layer-pattern", "*-E-|*-E-"],
             "pp4": PP4 + ["--hybrid-layer-pattern", "*E|-E|*E|-E"]}
"""1f1b's placement: PP segments (and the initial checkpoint's)."""
EVEN = {"pp2": PP2 + ["--hybrid-layer-pattern", PATTERN],
        "pp4": PP4 + ["--hybrid-layer-pattern", PATTERN_PP4]}
"""The V's even split (no '|'); zb-1p: megatron's own even split."""
V_SEGMENTS = PP2 + ["--hybrid-layer-pattern", "*-E|-*|-E|-"]
"""The same layers as the V's 4 stages in V order: 3,2,2,1 layers."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launcher = Launcher(te_stand_in=True)
    yield Runs(launcher, tmp_path_factory.mktemp("megatron-lm-hybrid"), script=SCRIPT)
    launcher.close()


def _run(runs: Runs, key: str, name: str, model: list, schedule: str, extra=()) -> Run:
    start = initial_checkpoint(runs, f"hybrid-{key}", REFERENCE[key], _nproc(key))
    return runs.get(f"hybrid-{key}-{name}", TINY_GPT + model + start + schedule_flags(schedule)
                    + ["--train-iters", str(ITERS), *extra], _nproc(key))


def _nproc(key: str) -> int:
    return 4


def _reference(runs: Runs, key: str) -> Run:
    save = ["--save", str(runs.path(f"hybrid-{key}-1f1b") / "checkpoint"), "--save-interval",
            "2"]
    return _run(runs, key, "1f1b", REFERENCE[key], "1f1b", save)


W_SPLIT = ("TELayerNormColumnParallelLinear", "TERowParallelLinear",
           "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")
"""The hybrid specs' linears (attention and MLP layers, the MoE layers' experts): W calls
their backward_dw on rank 0, which holds all three layer families at PP 2 and PP 4."""


def _check(got: Run, reference: Run, label: str) -> None:
    """1f1b's numbers, and the weight gradients in W: every linear family's backward_dw is
    called and the plugin's check finds nothing but the router left in B."""
    assert_same_training(got, reference, label)
    assert_same_moe_metrics(got, reference, label)
    w_lines = " ".join(line for line in got.log(0).splitlines()
                       if line.startswith("[vshape] W passes call Transformer Engine's"))
    assert all(f"{name} x" in w_lines for name in W_SPLIT), w_lines
    for rank in range(4):
        assert "weight gradients in B" not in got.log(rank), got.log(rank)[-2000:]


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto", "zb-1p"])
def test_hybrid_pp2_trains_like_1f1b(runs, schedule):
    """PP 2 x DP 2, the pattern without '|': the V's even split (2 layers a stage)."""
    got = _run(runs, "pp2", schedule, EVEN["pp2"], schedule)
    _check(got, _reference(runs, "pp2"), f"hybrid pp2 {schedule}")
    if schedule != "zb-1p":
        assert "layers per V stage: 2,2,2,2" in got.log(0)


def test_hybrid_pattern_segments_are_the_v_stages(runs):
    """'|' segments read as the V's 4 stages in V order: 3,2,2,1 layers (rank 0 runs the
    first 3 and the last one), global layer numbers (1f1b's checkpoint loads)."""
    got = _run(runs, "pp2", "v-half-segments", V_SEGMENTS, "v-half")
    _check(got, _reference(runs, "pp2"), "hybrid pp2 v-half segments")
    assert "layers per V stage: 3,2,2,1" in got.log(0)


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto", "zb-1p"])
def test_hybrid_pp4_trains_like_1f1b(runs, schedule):
    """PP 4 x DP 1, 8 stages of one layer under the V."""
    got = _run(runs, "pp4", schedule, EVEN["pp4"], schedule)
    _check(got, _reference(runs, "pp4"), f"hybrid pp4 {schedule}")


def test_hybrid_v_resumes_1f1bs_checkpoint(runs):
    """1f1b saved PP segments at iteration 2; v-half loads them into the V's stages and goes
    on as 1f1b does."""
    reference = _reference(runs, "pp2")
    folder = runs.path("hybrid-pp2-1f1b") / "checkpoint"
    got = runs.get("hybrid-pp2-1f1b-to-v-half", TINY_GPT + EVEN["pp2"] + schedule_flags("v-half")
                   + ["--load", str(folder), "--ckpt-step", "2", "--train-iters", str(ITERS)], 4)
    assert_same_training(got, reference, "hybrid pp2 1f1b -> v-half", first=3)
