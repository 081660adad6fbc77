"""Megatron-LM's own training loop with ``--transformer-impl transformer_engine`` under the
plugin's schedules, on the CPU stand-in of Transformer Engine (tests/support/te_stand_in).

The launch server of this tier imports the stand-in (``Launcher(te_stand_in=True)``), so
megatron builds its TE layer specs: TELayerNormColumnParallelLinear and TERowParallelLinear in
attention and MLP, TEDotProductAttention, TENorm, and with ``--moe-grouped-gemm`` TEGroupedMLP
over TE's GroupedLinear. Under zb-1p and the Vs the plugin builds them with TE's
delay_wgrad_compute, and W calls their ``backward_dw`` (TE's own B/W split, compute.py). Other
tiers' servers never see the stand-in.

Runs as the other real-loop tiers do (support.megatron_lm_tier): the tiny GPT, fp32, 4 gloo
processes, one 1f1b initial checkpoint per model, 4 iterations with validation at 2 and 4;
each schedule must give megatron's own 1f1b's losses, grad norms and validation losses (and
for MoE the logged load-balancing and z losses) within 1e-5 relative. Marked
``megatron_versions``: it runs in both CI environments, against the training code that pairs
with the installed megatron-core (core_v0.16.1 with 0.16.1, the 0.19 era with 0.19.2).

    case          model
    te-pp4        dense, PP 4
    te-moe-ep     grouped-GEMM experts, PP 2 x EP 2 (DP 2), alltoall, distributed optimizer,
                  expert capacity with padding, linear biases (support.MOE_CASES["moe-ep"])
    te-moe-pp4    grouped-GEMM experts, PP 4, allgather, global aux loss, z-loss, a shared
                  expert of TE linears (MOE_CASES["moe-pp4"])
    te-moe-edp    grouped-GEMM experts, PP 2 x DP 2 with EP 1 (every expert's gradient
                  reduced over the expert-data-parallel group, overlapped, from W), distributed
                  optimizer, dense and MoE layers mixed (MOE_CASES["moe-edp"]), v-half
    te-tp2pp2-sp  dense, TP 2 x PP 2 with sequence parallel (TE's own all-gathers and
                  reduce-scatters in its linears), v-min
    te-cp2pp2     dense, CP 2 x PP 2, tied embeddings, --cp-comm-type p2p, from te-pp4's
                  initial checkpoint (resharded), v-half and zb-1p
    te-cp2pp2-untied  the same untied, --cp-comm-type a2a (its own initial checkpoint), v-zb
    sft-cp2pp2    --sft (packed sequences, support/sft_run.py) at CP 2 x PP 2 from te-pp4's
                  initial checkpoint, v-min (the 0.19-era training code only: core_v0.16.1's
                  get_batch cannot split packs over CP, features.py refuses it there)
    te-fp8        dense, PP 4, FP8 (HYBRID, delayed scaling, amax history 4, "max"): its
                  linears cast inputs, weights and output gradients to torch's float8 types on
                  the stand-in; v-half and zb-1p; on core_v0.16.1 also tensorwise scaling (E4M3,
                  the first and last layer in bf16) under v-zb, and the first-microbatch faults

Context parallelism runs the stand-in's context-parallel attention (every CP rank's queries
against the whole sequence's keys and values, te_stand_in/.../attention/context_parallel.py);
each CP rank's V reads its slice of every microbatch with megatron's own
get_batch_on_this_cp_rank (batch.on_this_cp_rank), messages are a CP rank's share of the
sequence, and losses and gradients are reduced over CP as under 1f1b (megatron's forward_step
and finalize_model_grads).

FP8 is compared bit for bit where it can be, and two settings make that possible. Without
gradient clipping (``--clip-grad 0``): the clipping coefficient is the global gradient norm's,
summed over other parameters per rank under a V than under 1f1b (the fp16 row of
megatron_vshape/megatron/features.py), and FP8 turns its last-bit difference into flipped
FP8 values. Evaluating after the last step only (``--eval-interval 4``) for delayed scaling:
evaluation forwards record amaxes that the next training forward's autocast exit reduces for
every module of the rank, so on a rank with two chunks the second chunk's modules take them as
a history entry of their own, one forward before 1f1b's single chunk folds them into its
first forward's (TE's behaviour whenever a rank holds several chunks, megatron's interleaved
schedule too; tests/megatron/test_te_stand_in.py shows it on two modules). Tensorwise scaling
keeps no history, and evaluates every 2 iterations. Measured under v-half on core_v0.16.1:
with clipping, grad norms 3.3e-5 and validation losses 1.4e-5 apart from iteration 4; with
evaluation every 2 iterations, losses 1.9e-5, grad norms 7.4e-4 and validation losses 4.5e-5
apart from iteration 3 (relative); iterations before are bit-identical either way.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from support.megatron_lm_cpu import FIRST_MICROBATCH_LOG, WITHHOLD_FIRST_MICROBATCH
from support.megatron_lm_launch import MEGATRON_LM, TAKES_CONFIG_CONTAINER, Launcher
from support.megatron_lm_tier import (
    ITERS, MOE_CASES, PP4, REL, Run, Runs, assert_same_moe_metrics, assert_same_training,
    initial_checkpoint)
from support.megatron_lm_tier import trained as _trained
from support.sft_run import SFT_GPT

pytestmark = [pytest.mark.e2e, pytest.mark.megatron_versions]

if not (MEGATRON_LM / "megatron" / "training").is_dir():
    pytest.skip(f"Megatron-LM's training code is not at {MEGATRON_LM}", allow_module_level=True)

TE = ["--transformer-impl", "transformer_engine"]
GROUPED = TE + ["--moe-grouped-gemm"]
MODELS = {
    "te-pp4": TE + PP4,
    "te-moe-ep": GROUPED + MOE_CASES["moe-ep"],
    "te-moe-pp4": GROUPED + MOE_CASES["moe-pp4"],
    "te-moe-edp": GROUPED + MOE_CASES["moe-edp"],
    "te-tp2pp2-sp": TE + ["--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--sequence-parallel"],
    "te-cp2pp2": TE + ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
    "te-fp8": TE + PP4 + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                          "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max",
                          "--clip-grad", "0", "--eval-interval", "4"],
}
MODELS["te-cp2pp2-untied"] = MODELS["te-cp2pp2"] + ["--untie-embeddings-and-output-weights",
                                                    "--cp-comm-type", "a2a"]
FROM_PP4 = ("te-pp4", MODELS["te-pp4"])
"""te-pp4's initial checkpoint: the tied CP runs start from it (the same model at PP 4)."""
TENSORWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
              "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "1",
              "--eval-interval", "2"]
"""te-fp8 with tensorwise scaling (extra flags: the last value of a flag wins), from te-fp8's
checkpoint: its FP8 state is delayed scaling's, which TE replaces at the first forward under the
new recipe (module/base.py:1014-1025)."""
ONLY_016 = pytest.mark.skipif(TAKES_CONFIG_CONTAINER, reason="runs with core_v0.16.1's "
                              "training code only (the CI time of the 0.19 tier)")
SCHEDULES = ["zb-1p", "v-min", "v-half", "v-zb", "auto"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launcher = Launcher(te_stand_in=True)
    yield Runs(launcher, tmp_path_factory.mktemp("megatron-lm-te"))
    launcher.close()


def trained(runs, key, model, schedule, start_from=None):
    """The tier's run of ``model`` under ``schedule``, without checkpoints (no test here
    resumes one; saving costs seconds per run)."""
    return _trained(runs, key, model, schedule, save=False, start_from=start_from)


def _w_calls_backward_dw(log: str, *types: str) -> None:
    line = next((l for l in log.splitlines()
                 if l.startswith("[vshape] W passes call Transformer Engine's backward_dw")), "")
    for name in types:
        assert f"{name} x" in line, f"{name} is not among the TE modules W calls: {line!r}"


def test_1f1b_trains_transformer_engine_layers(runs):
    """Megatron's own 1f1b trains the TE model on the stand-in: finite losses and grad norms,
    the loss lower after 4 iterations than after the first."""
    run = trained(runs, "te-pp4", MODELS["te-pp4"], "1f1b")
    losses = run.records.losses()
    assert all(math.isfinite(x) for x in losses + run.records.grad_norms())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_transformer_engine_layers_train_like_1f1b(runs, schedule):
    """TE's linears split B and W themselves (delay_wgrad_compute; W calls backward_dw)."""
    reference = trained(runs, "te-pp4", MODELS["te-pp4"], "1f1b")
    got = trained(runs, "te-pp4", MODELS["te-pp4"], schedule)
    assert_same_training(got, reference, f"te-pp4 {schedule}")
    _w_calls_backward_dw(got.log(0), "TELayerNormColumnParallelLinear", "TERowParallelLinear")


@pytest.mark.parametrize("case", ["te-moe-ep", "te-moe-pp4"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grouped_gemm_experts_train_like_1f1b(runs, case, schedule):
    """--moe-grouped-gemm: the experts are TE's GroupedLinear (TEGroupedMLP), whose weight
    gradients -- reduced over the expert-data-parallel group -- run in W through TE's own
    split; the router keeps its gradient in B by design and nothing else is left in B."""
    reference = trained(runs, case, MODELS[case], "1f1b")
    got = trained(runs, case, MODELS[case], schedule)
    assert_same_training(got, reference, f"{case} {schedule}")
    assert_same_moe_metrics(got, reference, f"{case} {schedule}")
    _w_calls_backward_dw(got.log(0), "TEColumnParallelGroupedLinear",
                         "TERowParallelGroupedLinear")
    for rank in range(4):
        assert "weight gradients in B" not in got.log(rank), got.log(rank)[-2000:]


def test_grouped_gemm_expert_gradients_over_expert_data_parallel_like_1f1b(runs):
    """EP 1 on PP 2 x DP 2: both data-parallel ranks hold every expert; TE's backward_dw calls
    DDP's hooks, which start the expert buckets' reduction over the expert-data-parallel group
    (--overlap-grad-reduce). --moe-layer-freq mixes dense and MoE layers: before, turning on
    TE's split copied the V chunk's config without the V's stage layers, and chunk 1 got
    megatron's loop placement of the dense layer (loading 1f1b's checkpoint failed)."""
    reference = trained(runs, "te-moe-edp", MODELS["te-moe-edp"], "1f1b")
    got = trained(runs, "te-moe-edp", MODELS["te-moe-edp"], "v-half")
    assert_same_training(got, reference, "te-moe-edp v-half")
    assert_same_moe_metrics(got, reference, "te-moe-edp v-half")
    _w_calls_backward_dw(got.log(0), "TEColumnParallelGroupedLinear",
                         "TERowParallelGroupedLinear")


def test_tensor_and_sequence_parallel_te_layers_train_like_1f1b(runs):
    """TP 2 with sequence parallel: TE's linears gather and reduce-scatter along the sequence
    themselves, and their delayed weight GEMMs gather their saved input again in B; the norms'
    gradients are summed over TP by megatron (TE marks them sequence_parallel)."""
    reference = trained(runs, "te-tp2pp2-sp", MODELS["te-tp2pp2-sp"], "1f1b")
    got = trained(runs, "te-tp2pp2-sp", MODELS["te-tp2pp2-sp"], "v-min")
    assert_same_training(got, reference, "te-tp2pp2-sp v-min")
    _w_calls_backward_dw(got.log(0), "TELayerNormColumnParallelLinear", "TERowParallelLinear")


@pytest.mark.parametrize("case,schedule", [("te-cp2pp2", "v-half"), ("te-cp2pp2", "zb-1p"),
                                           ("te-cp2pp2-untied", "v-zb")])
def test_context_parallel_trains_like_1f1b(runs, case, schedule):
    """CP 2 x PP 2: each CP rank's V gets its load-balanced slice of every microbatch (its
    activations, so its messages, are half the sequence: a whole-sequence batch would fail
    the receive), its attention reaches the other rank's keys and values, and the loss (x CP)
    and gradients (over DP x CP) are reduced as 1f1b's; zb-1p keeps megatron's get_batch.
    Tied embeddings with --cp-comm-type p2p, untied with a2a (megatron passes it through to
    TE's attention); the run names context parallelism among its stand-in settings."""
    start = FROM_PP4 if case == "te-cp2pp2" else None
    reference = trained(runs, case, MODELS[case], "1f1b", start_from=start)
    got = trained(runs, case, MODELS[case], schedule, start_from=start)
    assert_same_training(got, reference, f"{case} {schedule}")
    _w_calls_backward_dw(got.log(0), "TELayerNormColumnParallelLinear", "TERowParallelLinear")
    notice = next(l for l in got.log(0).splitlines() if "proven on CPU with stand-ins" in l)
    assert "--context-parallel-size > 1" in notice, notice


SFT_RUNNER = Path(__file__).parents[1] / "support" / "sft_run.py"


def _packed(runs, schedule) -> Run:
    """--sft at CP 2 x PP 2 (support/sft_run.py's packs, each document padded by SFTDataset to
    a multiple of 2 x CP) from te-pp4's initial checkpoint: the same model."""
    start = initial_checkpoint(runs, *FROM_PP4)
    return runs.get(f"sft-cp2pp2-{schedule}",
                    SFT_GPT + TE + ["--context-parallel-size", "2", "--pipeline-schedule",
                                    schedule, "--train-iters", str(ITERS)] + start,
                    script=SFT_RUNNER)


def test_context_parallel_packed_sequences_train_like_1f1b(runs):
    """--sft with CP 2 on the 0.19-era training code: every document of a pack split over the
    CP ranks by TE's thd_get_partitioned_indices (megatron's per-document split, called by
    the V's batch on pipeline rank 0), the pack's offsets on every pipeline rank, thd
    attention over the whole pack's keys; lm loss, grad norm and validation loss of 1f1b.
    On core_v0.16.1, whose get_batch cannot split a pack over CP (1f1b fails too), the run
    stops at argument parsing, naming the way out (its parser lacks the 0.19 field the
    refusal looks for)."""
    if TAKES_CONFIG_CONTAINER:
        assert_same_training(_packed(runs, "v-min"), _packed(runs, "1f1b"), "sft-cp2pp2 v-min")
        return
    result = runs.attempt("sft-cp2pp2-refused", SFT_GPT + TE + [
        "--context-parallel-size", "2", "--pipeline-schedule", "v-min"], script=SFT_RUNNER)
    assert not result.ok
    assert "--pipeline-schedule v-min does not run packed sequences (--sft) with context " \
           "parallelism on Megatron-LM core_v0.16.1" in result.log(0), result.log(0)[-2000:]
    assert "initializing torch distributed" not in result.log(0)


# -- FP8 -------------------------------------------------------------------------------------------
def _first_microbatch_flags(run, chunks) -> None:
    """On every rank, each chunk in ``chunks`` had its forward called with is_first_microbatch
    once per forward_backward call (ITERS training steps, and each evaluation), always for
    microbatch 0, and no other chunk had it (support.megatron_lm_cpu's probe)."""
    calls = ITERS + len(run.records.eval_losses())
    for rank in range(4):
        flagged = [(words[-3], words[-1]) for words in
                   (line.split() for line in run.log(rank).splitlines()
                    if line.startswith(FIRST_MICROBATCH_LOG))]  # "... chunk C microbatch M"
        assert all(microbatch == "0" for _, microbatch in flagged), (rank, flagged)
        counts = {chunk: sum(c == str(chunk) for c, _ in flagged) for chunk in (0, 1)}
        assert counts == {c: calls if c in chunks else 0 for c in (0, 1)}, (rank, counts)


@pytest.mark.parametrize("schedule", ["v-half", "zb-1p"])
def test_fp8_delayed_scaling_trains_like_1f1b(runs, schedule):
    """FP8 with delayed scaling: every chunk's microbatch 0 sets is_first_microbatch, so TE
    casts its weights again after each optimizer step, under megatron's 1f1b as under the
    plugin's schedules (both chunks of a V); the amax history and scales, updated at each
    forward's autocast exit and at the end of each B, follow the same sequence; W runs
    backward_dw on the FP8 tensors B saved, and the biases TE's FP8 GEMM leaves to B are added
    in B order. Losses and validation losses bit for bit, grad norms to their summation order
    (REL)."""
    reference = trained(runs, "te-fp8", MODELS["te-fp8"], "1f1b")
    got = trained(runs, "te-fp8", MODELS["te-fp8"], schedule)
    assert_same_training(got, reference, f"te-fp8 {schedule}")
    assert got.records.losses() == reference.records.losses()
    assert got.records.eval_losses() == reference.records.eval_losses()
    _w_calls_backward_dw(got.log(0), "TELayerNormColumnParallelLinear", "TERowParallelLinear")
    _first_microbatch_flags(reference, chunks=(0,))
    _first_microbatch_flags(got, chunks=(0, 1) if schedule.startswith("v-") else (0,))


@ONLY_016
def test_fp8_tensorwise_scaling_with_bf16_first_and_last_layers_trains_like_1f1b(runs):
    """Tensorwise (current) scaling, E4M3 in both directions, the first and last layer in bf16
    (megatron's per-layer autocast, by global layer number: under a V layer 8 is rank 0's
    chunk 1): v-zb gives 1f1b's losses, grad norms and validation losses, evaluating every 2
    iterations."""
    model = MODELS["te-fp8"]
    reference = _trained(runs, "te-fp8", model, "1f1b", extra=TENSORWISE, save=False,
                         name="te-fp8-tensorwise-1f1b")
    got = _trained(runs, "te-fp8", model, "v-zb", extra=TENSORWISE, save=False,
                   name="te-fp8-tensorwise-v-zb")
    assert_same_training(got, reference, "te-fp8 tensorwise v-zb")
    assert got.records.losses() == reference.records.losses()
    _first_microbatch_flags(got, chunks=(0, 1))


@ONLY_016
@pytest.mark.parametrize("chunk", [0, 1])
def test_fp8_weights_go_stale_without_either_chunks_first_microbatch_flag(runs, chunk):
    """The fault the first-microbatch flag guards against, for each chunk of a V: with the
    flag withheld from one chunk (support.megatron_lm_cpu.WITHHOLD_FIRST_MICROBATCH), that
    chunk's TE linears keep the FP8 weights they cast at their first forward. Iteration 1 is
    still 1f1b's; from iteration 2 on the chunk computes with the weights before the optimizer
    step, and the losses leave 1f1b's by over 20 x the tolerance (measured 1.2e-3 and 8.5e-4
    relative at iteration 2, chunk 0 and 1)."""
    reference = trained(runs, "te-fp8", MODELS["te-fp8"], "1f1b")
    got = _trained(runs, "te-fp8", MODELS["te-fp8"], "v-half", save=False,
                   env={WITHHOLD_FIRST_MICROBATCH: str(chunk)},
                   name=f"te-fp8-v-half-stale-chunk{chunk}")
    _first_microbatch_flags(got, chunks=(1 - chunk,))
    losses, want = got.records.losses(), reference.records.losses()
    assert losses[0] == want[0], (losses, want)
    drift = [abs(a - b) / abs(b) for a, b in zip(losses[1:], want[1:])]
    assert min(drift) > 20 * REL, drift
