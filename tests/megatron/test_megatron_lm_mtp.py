"""Multi-token prediction (``--mtp-num-layers``, ``--mtp-loss-scaling-factor``) under every
schedule of the plugin, in Megatron-LM's own training loop (tag core_v0.16.1).

MTP GPTs (support.megatron_lm_tier.MTP_CASES: PP 2 x DP 2 with one MTP layer and the distributed
optimizer, PP 4 with two and a loss scaling factor; rope, untied embeddings) run
``scripts/pretrain_gpt_vshape.py`` on 4 gloo processes from one initial checkpoint, 4
iterations, a validation step at iterations 2 and 4, as tests/megatron/test_megatron_lm_e2e.py
runs the dense GPT. Under a V the MTP block sits on rank 0's chunk 1 beside the LM head, with
its copy of the word embedding kept equal to chunk 0's (megatron_vshape/megatron/model.py), the
MTP layers' linears run their weight gradients in W, and the step's MTP loss values are relayed
to the last rank, where Megatron-LM logs them (mtp.py). Each of v-min, v-half, v-zb and auto at
both sizes, and zb-1p at PP 4, must give 1f1b's losses, grad norms, validation losses and logged
MTP losses ("mtp_1 loss", "mtp_2 loss") to 1e-5 relative (fp32); checkpoints saved under a V
(at DP 2 with megatron's fully parallel save) resume under 1f1b and the reverse.

Tied embeddings with MTP are left to the megatron-core tier
(tests/megatron/test_megatron_gloo.py, weights by global name): megatron-core cannot checkpoint
them at PP > 1, under its own 1f1b too, so no run here could start from a common checkpoint. The
0.19-era training code runs the same cases in tests/megatron/test_megatron_lm_019.py.
"""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from support.megatron_lm_launch import MEGATRON_LM, TAKES_CONFIG_CONTAINER, Launcher  # noqa: E402
from support.megatron_lm_tier import (  # noqa: E402
    MTP_CASES, Runs, assert_same_mtp_losses, assert_same_training, resumed, trained)

pytestmark = pytest.mark.e2e

if not (MEGATRON_LM / "megatron" / "training").is_dir():
    pytest.skip(f"Megatron-LM's training code is not at {MEGATRON_LM} (../shared/megatron-lm)",
                allow_module_level=True)
if TAKES_CONFIG_CONTAINER:
    pytest.skip(f"{MEGATRON_LM} holds the 0.19-era training code: tests/megatron/"
                "test_megatron_lm_019.py runs its MTP cases", allow_module_level=True)

MTP_LAYERS = {"mtp-pp2": 1, "mtp-pp4": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launcher = Launcher()
    yield Runs(launcher, tmp_path_factory.mktemp("megatron-lm-mtp"))
    launcher.close()


@pytest.mark.parametrize("case,schedule", [
    (case, schedule) for case in sorted(MTP_CASES) for schedule in ("v-min", "v-half", "v-zb",
                                                                    "auto")] +
    [("mtp-pp4", "zb-1p")])
def test_mtp_trains_like_1f1b(runs, case, schedule):
    reference = trained(runs, case, MTP_CASES[case], "1f1b")
    got = trained(runs, case, MTP_CASES[case], schedule)
    assert_same_training(got, reference, f"{case} {schedule}")
    report = assert_same_mtp_losses(got, reference, f"{case} {schedule}")
    assert sorted(set(report) - {"case"}) == [f"mtp_{d + 1} loss"
                                              for d in range(MTP_LAYERS[case])]
    for rank in range(4):  # the MTP layers' linears split their weight gradients too
        assert "weight gradients in B" not in got.log(rank), got.log(rank)[-2000:]


@pytest.mark.parametrize("case,saved_by,resumed_by", [
    ("mtp-pp2", "v-half", "1f1b"), ("mtp-pp2", "1f1b", "v-half"), ("mtp-pp4", "v-zb", "1f1b")])
def test_mtp_checkpoint_resumes_under_another_schedule(runs, case, saved_by, resumed_by):
    """Saved at iteration 2, resumed: iterations 3 and 4 equal the uninterrupted 1f1b run's.
    The V saves the MTP layers under megatron's keys (mtp.layers.<depth>) and its embedding
    copy as megatron's MTP stage does (a replica of embedding.word_embeddings.weight), which
    megatron's fully parallel save, at DP 2 here, writes once (replicas.py)."""
    uninterrupted = trained(runs, case, MTP_CASES[case], "1f1b")
    got = resumed(runs, case, MTP_CASES[case], saved_by, resumed_by)
    label = f"{case} {saved_by} -> {resumed_by}"
    assert_same_training(got, uninterrupted, label, first=3)
    assert_same_mtp_losses(got, uninterrupted, label, first=3)
