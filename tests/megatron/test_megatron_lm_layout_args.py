"""Megatron-LM's layer-placing flags through its real parse_args and the validate_args that
scripts/pretrain_gpt_vshape.py installs (support.megatron_lm_parse: no process group, no
model), under every V schedule and zb-1p: what each accepts, the V's stage layers it hands the
model provider (VShapeConfig.stage_layers: stage_layout.py), and each refusal's message.

One worker process per megatron-core version, about 10-20 s; both CI environments run it
(megatron-core 0.16.1 with core_v0.16.1, 0.19.2 with the 0.19-era training code)::

    MEGATRON_LM=../shared/megatron-lm-0.19 python -m pytest -q -m megatron_versions \\
        tests/megatron/test_megatron_lm_layout_args.py
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_vshape
from support.megatron_lm_launch import REPO, megatron_lm_env, unpaired_reason
from support.megatron_lm_tier import TINY_GPT

pytestmark = [pytest.mark.megatron_versions, pytest.mark.slow]

SCRIPT = REPO / "scripts" / "pretrain_gpt_vshape.py"
V = ("v-min", "v-half", "v-zb", "auto")
SCHEDULES = V + ("zb-1p",)
MODEL = TINY_GPT + ["--pipeline-model-parallel-size", "2", "--num-layers", "7"]

ACCEPTED = {
    # name: (flags, the V's stage layers or None (refused), accepted under zb-1p)
    "layout": (["--pipeline-model-parallel-layout", "Et|ttt|ttt|L"], [1, 3, 3, 0], False),
    "layout-repeat": (["--pipeline-model-parallel-layout", "E|(tt|)*2tttL"], [0, 2, 2, 3],
                      False),
    "first": (["--decoder-first-pipeline-num-layers", "1"], [1, 2, 2, 2], True),
    "last": (["--decoder-last-pipeline-num-layers", "1"], [2, 2, 2, 1], True),
    "first-last": (["--decoder-first-pipeline-num-layers", "0",
                    "--decoder-last-pipeline-num-layers", "1"], [0, 3, 3, 1], None),
    "embedding": (["--account-for-embedding-in-pipeline-split"], [1, 2, 2, 2], True),
    "loss": (["--account-for-loss-in-pipeline-split"], [2, 2, 2, 1], True),
    "pp-stages": (["--pipeline-model-parallel-layout", "Ett|tttttL"], None, True),
}
"""zb-1p: megatron's own 1F1B meaning (None: not asked here; first = 0 is megatron's to refuse
when it builds the model); a layout of 2 x PP stages is virtual pipelining there."""

REFUSED = {
    "empty-middle": (["--pipeline-model-parallel-layout", "Et|ttttt||tL"],
                     "V stages [2] hold no transformer layer"),
    "rank-0-empty": (["--pipeline-model-parallel-layout", "E|tttt|ttt|L"],
                     "rank 0 (stages 0 and 3) holds no transformer layer"),
    "embedding-not-first": (["--pipeline-model-parallel-layout", "|Ett|tttt|tL"],
                      "the embedding is in stage 0 and the loss in stage 2p-1 = 3"),
    "uneven-middle": (["--decoder-first-pipeline-num-layers", "2"],
                      "num_layers - first - last is a positive multiple of 3"),
    "with-virtual": (["--pipeline-model-parallel-layout", "Et|ttt|tt|tL",
                      "--num-virtual-stages-per-pipeline-rank", "2"],
                     "drop --num-layers-per-virtual-pipeline-stage"),
    "both-ways": (["--decoder-first-pipeline-num-layers", "1",
                   "--account-for-loss-in-pipeline-split"], "place layers two ways"),
}


@pytest.fixture(scope="module")
def parsed():
    """Every case under every schedule, in one worker process: {case: {schedule: run}}."""
    if unpaired_reason() is not None:
        pytest.skip(unpaired_reason())
    cases = {**{k: v[0] for k, v in ACCEPTED.items()}, **{k: v[0] for k, v in REFUSED.items()}}
    request = {"script": str(SCRIPT), "recipes": [
        {"name": name, "argv": MODEL + flags, "env": {}, "world_size": 2, "droppable": [],
         "schedules": list(SCHEDULES)} for name, flags in cases.items()]}
    result = subprocess.run([sys.executable, "-m", "support.megatron_lm_parse"],
                            input=json.dumps(request), capture_output=True, text=True, cwd=REPO,
                            env=megatron_lm_env([REPO]), timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    reply = json.loads(result.stdout)
    assert Path(reply["plugin"]) == Path(megatron_vshape.__file__), "another checkout's plugin"
    return {r["name"]: r["runs"] for r in reply["recipes"]}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_megatrons_flags_place_the_v_and_keep_their_1f1b_meaning_under_zb1p(parsed, name):
    _, stages, zb = ACCEPTED[name]
    for schedule in V:
        run = parsed[name][schedule]
        if stages is None:
            assert run["outcome"] == "plugin" and "write 2 x PP stages" in run["message"], run
            continue
        assert run["outcome"] == "accepted", (name, schedule, run)
        assert (run["installed"], run["stage_layers"]) == (schedule, stages), run
    run = parsed[name]["zb-1p"]
    if zb is not None:
        assert (run["outcome"] == "accepted") is zb, (name, run)
    if run["outcome"] == "accepted":
        assert (run["installed"], run["stage_layers"]) == ("zb-1p", None), run


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_placements_a_v_cannot_run_stop_at_parsing(parsed, name):
    needle = REFUSED[name][1]
    for schedule in V:
        run = parsed[name][schedule]
        assert run["outcome"] == "plugin", (name, schedule, run)
        assert needle in run["message"] and f"--pipeline-schedule {schedule}" in run["message"]
