"""``vshape plan`` prints the Megatron-LM flags of its best rows: they must be flags Megatron-LM's
own parser (with the plugin's) accepts, and they must say what the row chose."""
import json
import shlex
import subprocess
import sys

import pytest

from megatron_vshape.cli import main
from megatron_vshape.plan.candidates import SearchSpace
from megatron_vshape.plan.launch_flags import row_flags, shared_flags
from megatron_vshape.plan.model import load_model_config
from megatron_vshape.plan.planner import plan
from megatron_vshape.plan.settings import ClusterConfig, TrainingConfig
from support.megatron_lm_launch import MEGATRON_LM, megatron_lm_env

_PARSE = """
import json, sys
from megatron_vshape.harness.cpu import prepare_cpu_imports
prepare_cpu_imports()
from megatron.training.arguments import parse_args
from megatron_vshape.megatron.arguments import add_arguments
flags, keys = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["pretrain_gpt.py"] + flags
args = parse_args(extra_args_provider=add_arguments)
print(json.dumps({k: getattr(args, k, None) for k in keys}))
"""


@pytest.fixture(scope="module")
def result():
    space = SearchSpace(schedules=("1f1b", "interleaved-1f1b", "v-half", "auto"),
                        micro_batch_sizes=(1, 2), auto_candidates=1,
                        recompute=("none", "selective", "full"))
    training = TrainingConfig(3072, 64, flash_attention=False)
    return plan(load_model_config("gpt-9.6b"), training, ClusterConfig(16, 40.0), space)


def _row(result, predicate):
    return next(r for r in result.feasible if predicate(r.layout))


def test_each_row_says_what_it_chose(result):
    auto = _row(result, lambda lay: lay.schedule == "auto")
    flags = row_flags(auto, result)
    assert flags[flags.index("--pipeline-schedule") + 1] == "auto"
    limit = float(flags[flags.index("--pipeline-memory-limit") + 1].removesuffix("GiB"))
    assert auto.activation_bytes / 2**30 <= limit < auto.activation_bytes / 2**30 + 0.1
    full = _row(result, lambda lay: lay.recompute == "full")
    assert " ".join(row_flags(full, result)).endswith(
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    loop = _row(result, lambda lay: lay.schedule == "interleaved-1f1b")
    assert "--num-virtual-stages-per-pipeline-rank" in row_flags(loop, result)
    for row in result.feasible[:20]:
        flags = row_flags(row, result)
        lay = row.layout
        assert flags[:6] == ["--tensor-model-parallel-size", str(lay.tp),
                             "--pipeline-model-parallel-size", str(lay.pp),
                             "--micro-batch-size", str(lay.micro_batch_size)]
        assert ("--sequence-parallel" in flags) == (lay.tp > 1)
    shared = shared_flags(result)
    assert shared[shared.index("--attention-backend") + 1] == "unfused"
    assert "--use-distributed-optimizer" in shared and "--bf16" in shared


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_LM / "megatron" / "training" / "arguments.py").is_file(),
                    reason="Megatron-LM's training code is not beside the checkout")
def test_megatron_lms_parser_accepts_them(result):
    """Every flag of three rows (a V with selective recomputation where it exists, auto,
    1F1B-R) through Megatron-LM's parse_args with the plugin's flags."""
    rows = [_row(result, lambda lay: lay.schedule == "auto"),
            _row(result, lambda lay: lay.recompute == "full"),
            _row(result, lambda lay: lay.schedule == "interleaved-1f1b")]
    keys = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
            "pipeline_schedule", "recompute_granularity", "num_layers", "global_batch_size",
            "use_distributed_optimizer", "bf16"]
    for row in rows:
        argv = shared_flags(result) + row_flags(row, result)
        done = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(argv), json.dumps(keys)],
                              env=megatron_lm_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        parsed = json.loads(done.stdout.strip().splitlines()[-1])
        lay = row.layout
        assert (parsed["tensor_model_parallel_size"], parsed["pipeline_model_parallel_size"],
                parsed["micro_batch_size"], parsed["pipeline_schedule"]) == (
            lay.tp, lay.pp, lay.micro_batch_size, lay.schedule)
        assert parsed["recompute_granularity"] == (None if lay.recompute == "none"
                                                   else lay.recompute)
        assert parsed["num_layers"] == 30 and parsed["global_batch_size"] == 64
        assert parsed["use_distributed_optimizer"] and parsed["bf16"]


def test_plan_prints_the_flags_of_its_best_rows(capsys):
    assert main(["plan", "--model", "gpt-9.6b", "--gpus", "8", "--gpu-memory", "80", "--pp", "2",
                 "--schedules", "1f1b", "v-half", "--recompute", "none", "--flags", "2"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("Megatron-LM flags"):].splitlines()
    assert block[1].startswith("  all rows: --num-layers 30")
    assert block[2].startswith("  #1 ") and block[3].startswith("  #2 ") and len(block) >= 4
    assert "--pipeline-model-parallel-size 2" in block[2] and len(shlex.split(block[2])) > 6
    assert main(["plan", "--model", "gpt-9.6b", "--gpus", "8", "--gpu-memory", "80", "--pp", "2",
                 "--schedules", "1f1b", "--recompute", "none", "--flags", "0"]) == 0
    assert "Megatron-LM flags" not in capsys.readouterr().out
    assert main(["plan", "--model", "gpt-9.6b", "--gpus", "8", "--gpu-memory", "80",
                 "--flags", "-1"]) == 2
    assert "--flags must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_LM / "megatron" / "training" / "arguments.py").is_file(),
                    reason="Megatron-LM's training code is not beside the checkout")
def test_megatron_lms_parser_accepts_a_moe_row():
    space = SearchSpace(schedules=("v-half",), micro_batch_sizes=(1,), recompute=("none",),
                        pipeline_parallel=(2,), expert_parallel=(4,))
    moe = plan(load_model_config("moe-64e-top6"), TrainingConfig(4096, 64),
               ClusterConfig(16, 80.0), space)
    row = moe.feasible[0]
    keys = ["num_experts", "moe_router_topk", "moe_ffn_hidden_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "moe_token_dispatcher_type", "pipeline_schedule",
            "moe_shared_expert_intermediate_size"]
    argv = shared_flags(moe) + row_flags(row, moe)
    done = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(argv), json.dumps(keys)],
                          env=megatron_lm_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {"num_experts": 64, "moe_router_topk": 6, "moe_ffn_hidden_size": 1408,
                      "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1,
                      "moe_token_dispatcher_type": "alltoall", "pipeline_schedule": "v-half",
                      "moe_shared_expert_intermediate_size": 2816}
