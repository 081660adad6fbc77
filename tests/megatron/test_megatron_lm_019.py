"""Megatron-LM's 0.19-era training loop (``pretrain()`` with a config container, megatron-core
0.19.2) under the plugin's schedules: the real-loop tier of tests/megatron/test_megatron_lm_e2e.py for
the training code in ../shared/megatron-lm-0.19.

Run it in an environment whose megatron-core is 0.19.2, with that training code selected
(``MEGATRON_LM=../shared/megatron-lm-0.19``, the default there) and the marker CI selects::

    MEGATRON_LM=../shared/megatron-lm-0.19 python -m pytest -q -m megatron_versions \\
        tests/megatron/test_megatron_lm_019.py

Each run is ``scripts/pretrain_gpt_vshape.py`` on 4 gloo processes (support.megatron_lm_launch,
with support.megatron_lm_cpu's patches for this code), a tiny GPT in fp32 started from one
1f1b checkpoint (support.megatron_lm_tier). Each case compares a schedule with megatron's own
1f1b on the same flags: every iteration's lm loss and grad norm and every validation loss
within 1e-5 relative (REL: the schedules differ only in the order gradients accumulate over
microbatches).

megatron-core 0.18.2 with its own training code (../shared/megatron-lm-0.18, which takes a
config container too), and megatron-core 0.20.0 with Megatron-LM main (../shared/megatron-lm-main,
core and training code of one commit), run the tests marked ``megatron_matrix`` here
(.ci/megatron-versions).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from support.megatron_lm_launch import MEGATRON_LM, TAKES_CONFIG_CONTAINER, Launcher
from support.megatron_lm_tier import (
    ITERS, MOE_CASES, MTP_CASES, PP4, TINY_GPT, Runs, assert_same_moe_metrics,
    assert_same_mtp_losses, assert_same_training, initial_checkpoint, resumed, schedule_flags,
    trained, under_torchrun, uneven_runs, uneven_zb1p_runs)

pytestmark = pytest.mark.megatron_versions

if not TAKES_CONFIG_CONTAINER:
    pytest.skip(f"{MEGATRON_LM} is not the 0.19-era training code (set "
                "MEGATRON_LM=../shared/megatron-lm-0.19)", allow_module_level=True)


def _megatron_core() -> str:
    """The installed megatron-core's version, read without importing it (its import needs the
    CPU patches that only the launched processes apply)."""
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "none"


if not _megatron_core().startswith(("0.18.", "0.19.", "0.20.")):
    pytest.skip(f"the config-container training code (core_v0.18.2, the 0.19 era, main) pairs "
                f"with megatron-core 0.18, 0.19 or 0.20, not {_megatron_core()}",
                allow_module_level=True)

PP2DP2 = ["--pipeline-model-parallel-size", "2"]
"""PP 2 x DP 2 with megatron's plain optimizer, tied embeddings (rank 0's two copies of the word
embedding in one data-parallel group, saved with megatron's default fully parallel save)."""
DISTOPT = PP2DP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather"]
"""The same with megatron's distributed optimizer and both overlaps."""
MODELS = {"pp4": PP4, "pp2dp2": PP2DP2, "pp2dp2-distopt": DISTOPT}
TP_SP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--sequence-parallel"]
"""TP 2 x PP 2 with sequence parallelism."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launcher = Launcher()
    yield Runs(launcher, tmp_path_factory.mktemp("megatron-lm-019"))
    launcher.close()


@pytest.mark.megatron_matrix
@pytest.mark.parametrize("schedule", ["zb-1p", "v-min", "v-half", "v-zb", "auto"])
def test_every_schedule_trains_like_1f1b(runs, schedule):
    reference = trained(runs, "pp4", PP4, "1f1b")
    assert_same_training(trained(runs, "pp4", PP4, schedule), reference, f"0.19 pp4 {schedule}")


@pytest.mark.megatron_matrix
def test_distributed_optimizer_trains_like_1f1b(runs):
    reference = trained(runs, "pp2dp2-distopt", DISTOPT, "1f1b")
    got = trained(runs, "pp2dp2-distopt", DISTOPT, "v-half")
    assert_same_training(got, reference, "0.19 pp2dp2 distopt v-half")
    assert "[vshape] v-half runs two chunks per rank: align_param_gather=True again" in got.log(0)


def test_tied_embeddings_with_data_parallel_train_like_1f1b(runs):
    reference = trained(runs, "pp2dp2", PP2DP2, "1f1b")
    assert_same_training(trained(runs, "pp2dp2", PP2DP2, "v-half"), reference,
                         "0.19 pp2dp2 v-half")


def test_tensor_and_sequence_parallel_train_like_1f1b(runs):
    reference = trained(runs, "tp2pp2-sp", TP_SP, "1f1b")
    assert_same_training(trained(runs, "tp2pp2-sp", TP_SP, "v-min"), reference,
                         "0.19 tp2pp2 sp v-min")


def test_uneven_layers_train_like_1f1b(runs):
    """--num-layers 14 on PP 4 (k x p - 2): the V's stages 1,2,2,2,2,2,2,1; megatron's 1f1b
    with its own uneven layout (2,4,4,4)."""
    reference, got = uneven_runs(runs, "pp4-uneven", PP4 + ["--num-layers", "14"])
    assert_same_training(got, reference, "0.19 pp4 14 layers v-half")


def test_zb1p_runs_megatrons_own_uneven_stages_like_1f1b(runs):
    """zb-1p with --decoder-first-pipeline-num-layers and with a layout of exactly PP stages
    (2,4,4,4 both): megatron's placement, 1f1b's training."""
    reference, _ = uneven_runs(runs, "pp4-uneven", PP4 + ["--num-layers", "14"])
    first, layout = uneven_zb1p_runs(runs, "pp4-uneven", PP4 + ["--num-layers", "14"])
    assert_same_training(first, reference, "0.19 pp4 14 layers zb-1p decoder-first")
    assert_same_training(layout, reference, "0.19 pp4 14 layers zb-1p layout")


@pytest.mark.megatron_matrix
def test_moe_with_expert_parallelism_trains_like_1f1b(runs):
    """MoE (tests/megatron/test_megatron_lm_moe.py's PP 2 x EP 2 case: alltoall dispatcher, aux loss,
    distributed optimizer, expert capacity) under v-half: 1f1b's losses, grad norms and logged
    load-balancing loss (megatron-core 0.19's MoE metrics tracker)."""
    model = MOE_CASES["moe-ep"]
    reference = trained(runs, "moe-ep", model, "1f1b")
    got = trained(runs, "moe-ep", model, "v-half")
    assert_same_training(got, reference, "0.19 moe-ep v-half")
    assert_same_moe_metrics(got, reference, "0.19 moe-ep v-half")


@pytest.mark.parametrize("case,schedule", [
    (case, schedule) for case in sorted(MTP_CASES) for schedule in ("v-min", "v-half", "v-zb",
                                                                    "auto")] +
    [("mtp-pp4", "zb-1p")])
def test_multi_token_prediction_trains_like_1f1b(runs, case, schedule):
    """tests/megatron/test_megatron_lm_mtp.py's models (PP 2 x DP 2 with one MTP layer, PP 4
    with two): 1f1b's losses, grad norms and logged MTP losses (megatron-core 0.19's tracker,
    with its acceptance counts relayed too), the MTP layers' weight gradients in W."""
    reference = trained(runs, case, MTP_CASES[case], "1f1b")
    got = trained(runs, case, MTP_CASES[case], schedule)
    assert_same_training(got, reference, f"0.19 {case} {schedule}")
    assert_same_mtp_losses(got, reference, f"0.19 {case} {schedule}")
    assert "weight gradients in B" not in got.log(0)


@pytest.mark.parametrize("saved_by,resumed_by", [("v-half", "1f1b"), ("1f1b", "v-half")])
def test_multi_token_prediction_resumes_under_another_schedule(runs, saved_by, resumed_by):
    uninterrupted = trained(runs, "mtp-pp2", MTP_CASES["mtp-pp2"], "1f1b")
    got = resumed(runs, "mtp-pp2", MTP_CASES["mtp-pp2"], saved_by, resumed_by)
    label = f"0.19 mtp-pp2 {saved_by} -> {resumed_by}"
    assert_same_training(got, uninterrupted, label, first=3)
    assert_same_mtp_losses(got, uninterrupted, label, first=3)


@pytest.mark.parametrize("model,saved_by,resumed_by,extra", [
    pytest.param("pp4", "v-half", "1f1b", (), marks=pytest.mark.megatron_matrix),
    ("pp4", "1f1b", "v-half", ()),
    ("pp2dp2", "v-half", "v-half", ("--ckpt-fully-parallel-load",)),
    ("pp2dp2", "v-half", "1f1b", ()),
    ("pp2dp2-distopt", "v-half", "1f1b", ()),
    pytest.param("pp2dp2-distopt", "1f1b", "v-half", (), marks=pytest.mark.megatron_matrix)])
def test_resume_under_another_schedule_equals_uninterrupted_training(runs, model, saved_by,
                                                                     resumed_by, extra):
    """Saved at iteration 2 under one schedule, resumed under the other (or the V under
    itself, with megatron's fully parallel load): iterations 3 and 4 (and their validation) as
    the uninterrupted 1f1b run's. pp2dp2 saves tied embeddings at DP 2 with megatron's fully
    parallel save (the V's copy a replica written once), with megatron's plain optimizer and
    its distributed one, whose state is in the script's default fully reshardable format."""
    flags = MODELS[model]
    uninterrupted = trained(runs, model, flags, "1f1b")
    got = resumed(runs, model, flags, saved_by, resumed_by, extra=extra)
    assert_same_training(got, uninterrupted, f"0.19 {model} {saved_by} -> {resumed_by} {extra}",
                         first=3)


def test_v_runs_check_the_loop_calls_the_plugin_and_report_their_memory(runs):
    """The start-up check passed inside this training code (train() and evaluate() resolve the
    plugin's get_forward_backward_func), and the theoretical memory line is the V's."""
    log = trained(runs, "pp4", PP4, "v-half").log(0)
    assert ("[vshape] Megatron-LM's train() and evaluate() get their schedule from the plugin's "
            "get_forward_backward_func") in log
    assert "(v-half: activations 0.75 x 1F1B's)" in log
    assert "Memory penalty from interleaved schedule" not in log


def test_auto_replans_inside_the_loop(runs):
    log = trained(runs, "pp4", PP4, "auto").log(0)
    plans = [line for line in log.splitlines() if line.startswith("[vshape] schedule=auto")]
    assert len(plans) == 2, plans  # the provisional plan, then the re-planned one
    assert "[vshape] re-planning auto from measured costs F,B,W,COMM=" in log
    assert max(float(line.split("peak_memory_vs_1f1b=")[1].split()[0]) for line in plans) <= 0.75


@pytest.mark.parametrize("flags,needle", [
    (["--pipeline-schedule", "v-half", "--num-layers", "6"],
     "--num-layers must be >= 2 x --pipeline-model-parallel-size"),
    (["--pipeline-schedule", "v-quarter"], "invalid choice: 'v-quarter'"),
])
def test_bad_flags_stop_at_parsing_with_the_flag_named(runs, flags, needle):
    """Through the script's parse_and_validate_args (0.19 parses before pretrain()): the run
    stops before torch.distributed is initialised and names the flag."""
    result = runs.attempt(f"bad-{flags[1]}", TINY_GPT + PP4 + flags, nproc=4)
    assert not result.ok
    log = result.log(0)
    assert needle in log, log[-2000:]
    assert "initializing torch distributed" not in log



def test_dp_reshardable_checkpoint_of_another_layout_is_refused_with_the_way_out(runs):
    """checkpoints.py reads this training code's checkpoint metadata too: a v-half checkpoint
    saved in megatron's dp_reshardable format (tied embeddings at DP 2, megatron's fully
    parallel save: the V's copy of the embedding a replica, the optimizer's state by gradient
    bucket) stops a 1f1b resume before any load."""
    folder = runs.path("pp2dp2-distopt-dp-reshardable") / "checkpoint"
    runs.get("pp2dp2-distopt-dp-reshardable", TINY_GPT + DISTOPT + initial_checkpoint(
        runs, "pp2dp2-distopt", DISTOPT) + schedule_flags("v-half") + [
            "--train-iters", "2", "--save", str(folder), "--save-interval", "2",
            "--dist-ckpt-optim-dp-reshardable"])
    result = runs.attempt("dp-reshardable-to-1f1b", TINY_GPT + DISTOPT + [
        "--pipeline-schedule", "1f1b", "--load", str(folder), "--train-iters", "4"])
    assert not result.ok
    log = result.log(0)
    assert "ValueError: checkpoint" in log and "dp_reshardable format" in log
    assert "--pipeline-schedule v-half (v layout)" in log and "--no-load-optim" in log
    assert "Global shape mismatch" not in log


def test_a_run_under_torchrun_equals_the_launchers(runs, tmp_path):
    """The v-half run under a real ``torchrun`` (support/mlm_site applies the CPU patches in
    each process, as a user's GPU-less checkout would) records bit-identical losses, grad norms
    and validation losses to the launcher's."""
    launched = trained(runs, "pp4", PP4, "v-half")
    got = under_torchrun(TINY_GPT + PP4 + initial_checkpoint(runs, "pp4", PP4) +
                         schedule_flags("v-half") + ["--train-iters", str(ITERS)], tmp_path)
    assert got.train == launched.records.train and got.evals == launched.records.evals
