"""Megatron-LM's own layer-placing flags under the plugin's schedules, in its real training loop:
--pipeline-model-parallel-layout, --decoder-first/last-pipeline-num-layers and
--account-for-embedding/loss-in-pipeline-split, read on the V's 2 x PP stages in V order
(megatron_vshape/megatron/stage_layout.py; docs/training.md, "Stage layouts").

One tiny GPT whose LM head dominates (TINY_GPT with a 4096-word vocabulary against hidden size
32: the head holds about ten layers' parameters), 7 layers on PP 2, 2 gloo processes, from one
initial checkpoint. megatron's own 1f1b runs it with a layout of PP stages (2 and 5 layers);
each other run places the layers otherwise and must give 1f1b's losses, grad norms and
validation losses to 1e-5 relative (REL, fp32):

    v-half  --pipeline-model-parallel-layout "Et|ttt|ttt|L"   stages 1,3,3,0: rank 0's stage 3
                                                              holds the loss and no layer
    v-zb    --decoder-first/last-pipeline-num-layers 0 / 1    stages 0,3,3,1
    zb-1p   --decoder-last-pipeline-num-layers 2               megatron's 1F1B stages 5,2
    zb-1p   --account-for-loss-in-pipeline-split               megatron's 1F1B stages 4,3
    v-half  --account-for-embedding-in-pipeline-split          stages 1,2,2,2, resumed at
                                                              iteration 2 from 1f1b's checkpoint

and the same model with one MTP layer (rope, untied embeddings) under v-half with
"Et|ttt|ttt|mL" against 1f1b, the logged MTP loss too.

Checkpoints are keyed by global layer, so the last run loads 1f1b's (2,5 layers per rank) into
a V of another layout. Runs under Megatron-LM core_v0.16.1 with megatron-core 0.16 and the
0.19-era training code with megatron-core 0.19.2 (marker megatron_versions)::

    MEGATRON_LM=../shared/megatron-lm-0.19 python -m pytest -q -m megatron_versions \\
        tests/megatron/test_megatron_lm_layouts.py
"""
from __future__ import annotations

import pytest

from support.megatron_lm_launch import Launcher, unpaired_reason
from support.megatron_lm_tier import (
    ITERS, TINY_GPT, Run, Runs, assert_same_mtp_losses, assert_same_training,
    initial_checkpoint)

pytestmark = [pytest.mark.e2e, pytest.mark.megatron_versions]


if unpaired_reason() is not None:
    pytest.skip(unpaired_reason(), allow_module_level=True)

NPROC = 2
MODEL = ["--pipeline-model-parallel-size", "2", "--num-layers", "7", "--vocab-size", "4096"]
"""7 layers on PP 2 (no even split: every run places them), the LM head large (4096 x 32)."""
START = ["--account-for-embedding-in-pipeline-split"]
"""The initial checkpoint's 1f1b placement (3 and 4 layers)."""
REFERENCE = ["--pipeline-model-parallel-layout", "Ett|tttttL"]
"""1f1b's placement: 2 and 5 layers."""
CASES = {
    "v-half-layout": ("v-half", ["--pipeline-model-parallel-layout", "Et|ttt|ttt|L"]),
    "v-zb-first-last": ("v-zb", ["--decoder-first-pipeline-num-layers", "0",
                                 "--decoder-last-pipeline-num-layers", "1"]),
    "zb-1p-last": ("zb-1p", ["--decoder-last-pipeline-num-layers", "2"]),
    "zb-1p-loss": ("zb-1p", ["--account-for-loss-in-pipeline-split"]),
}
RESUMED = ("v-half", ["--account-for-embedding-in-pipeline-split"])
"""Stages 1,2,2,2, from 1f1b's checkpoint of iteration 2."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launcher = Launcher()
    yield Runs(launcher, tmp_path_factory.mktemp("megatron-lm-layouts"))
    launcher.close()


def _start(runs: Runs) -> list:
    return initial_checkpoint(runs, "layouts", MODEL + START, NPROC)


def _reference(runs: Runs) -> Run:
    save = ["--save", str(runs.path("layouts-1f1b") / "checkpoint"), "--save-interval", "2"]
    return runs.get("layouts-1f1b", TINY_GPT + MODEL + _start(runs) + REFERENCE + save +
                    ["--pipeline-schedule", "1f1b", "--train-iters", str(ITERS)], NPROC)


def _case(runs: Runs, name: str) -> Run:
    schedule, placement = CASES[name]
    return runs.get(f"layouts-{name}", TINY_GPT + MODEL + _start(runs) + placement +
                    ["--pipeline-schedule", schedule, "--train-iters", str(ITERS)], NPROC)


def _resumed(runs: Runs) -> Run:
    _reference(runs)
    schedule, placement = RESUMED
    folder = runs.path("layouts-1f1b") / "checkpoint"
    return runs.get("layouts-resumed", TINY_GPT + MODEL + placement + [
        "--pipeline-schedule", schedule, "--load", str(folder), "--ckpt-step", "2",
        "--train-iters", str(ITERS)], NPROC)


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_placing_flags_train_like_1f1b(runs, name):
    assert_same_training(_case(runs, name), _reference(runs), f"layouts {name}")


def test_a_v_of_another_layout_resumes_1f1bs_checkpoint(runs):
    """1f1b saved 2 and 5 layers per rank; the V loads them as stages 1,2,2,2 (global layer
    numbers) and goes on as 1f1b does."""
    assert_same_training(_resumed(runs), _reference(runs), "layouts 1f1b -> v-half account",
                         first=3)


def test_the_v_places_the_layers_the_flags_ask_for(runs):
    """Parameters per rank as Megatron-LM logs them: rank 1 holds stages 1 and 2, 6 layers
    under the layout (3 + 3) and 4 with the embedding counted (2 + 2), nothing else; rank 0
    holds the rest of the model, 1 and 3 layers beside the embedding and the LM head."""
    layout, counted = _case(runs, "v-half-layout"), _resumed(runs)
    v, c = _parameters_per_rank(layout), _parameters_per_rank(counted)
    assert v[1] * 4 == c[1] * 6, (v, c)
    layer = v[1] // 6
    assert c[0] - v[0] == 2 * layer, (v, c)
    head = v[0] - layer
    print({"layer": layer, "rank 0 without its layer (embedding, LM head)": head})
    assert head > 4 * layer  # the model of this tier: rank 0's ends outweigh 4 layers


MTP = MODEL + ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion",
               "--untie-embeddings-and-output-weights"]
"""The model with one multi-token prediction layer (rope and untied embeddings, as
support.megatron_lm_tier.MTP_CASES say why)."""


def test_mtp_beside_a_loss_stage_without_layers(runs):
    """"Et|ttt|ttt|mL": stage 3 holds the MTP layer and the loss but no decoder layer, so
    megatron puts the final norm in stage 2 (rank 1's chunk 1, where layer 7 is); equal to 1f1b
    with the logged MTP loss."""
    start = initial_checkpoint(runs, "layouts-mtp", MTP + START, NPROC)
    iters = ["--train-iters", str(ITERS)]
    reference = runs.get("layouts-mtp-1f1b", TINY_GPT + MTP + start + START +
                         ["--pipeline-schedule", "1f1b"] + iters, NPROC)
    got = runs.get("layouts-mtp-v-half", TINY_GPT + MTP + start + [
        "--pipeline-model-parallel-layout", "Et|ttt|ttt|mL", "--pipeline-schedule", "v-half"]
        + iters, NPROC)
    assert_same_training(got, reference, "layouts mtp v-half")
    assert_same_mtp_losses(got, reference, "layouts mtp v-half")


def _parameters_per_rank(run: Run) -> dict:
    """Megatron-LM's ' > number of parameters on (tensor, [...,] pipeline) model parallel rank
    (t, [...,] p): N' lines (each rank logs its own), by pipeline rank."""
    found = {}
    for rank in range(NPROC):
        for line in run.log(rank).splitlines():
            if "number of parameters on (tensor," in line:
                where, count = line.rsplit(":", 1)
                found[int(where.rsplit(",", 1)[1].strip(" )"))] = int(count)
    assert sorted(found) == list(range(NPROC)), found
    return found
