"""Grid points -> launch commands, a manifest and a slurm array job.

Every point becomes one line of ``commands.txt``, a complete shell command::

    RUN_NAME=<run> NNODES=2 GPUS_PER_NODE=8 bash scripts/slurm/pretrain_gpt_vshape.sbatch <flags>

run from the repository root. The launcher turns it into one torchrun per node (srun inside
slurm, plain torchrun outside) of ``scripts/pretrain_gpt_vshape.py`` and adds what belongs to
the cluster rather than the grid: data, tokenizer, checkpoints and the log file
``$LOG_DIR/<run>.log``. Line i (0-based) is slurm array task i; ``points.csv`` lists the same
points as columns for ``vshape collect`` and spreadsheets.
"""
from __future__ import annotations

import csv
import shlex
from pathlib import Path

from ..schedule import Layout
from .grid import Expansion, GridConfig, LayerSplit, Point

__all__ = ["LAUNCHER", "ARRAY_RUNNER", "point_args", "command_line", "array_script",
           "write_commands", "write_manifest", "write_array_job", "MANIFEST_COLUMNS"]

LAUNCHER = "scripts/slurm/pretrain_gpt_vshape.sbatch"
"""One run on one or more nodes (relative to the repository root)."""
ARRAY_RUNNER = "scripts/slurm/run_point.sbatch"
"""Runs line $SLURM_ARRAY_TASK_ID of a commands file."""

MANIFEST_COLUMNS = ("id", "run", "seq_length", "global_batch", "dp", "tp", "pp", "mbs",
                    "microbatches", "schedule", "label", "memory_limit", "layer_split", "nodes",
                    "gpus_per_node")

_SPLIT_ARGS = {
    LayerSplit.EMBEDDING_AND_LOSS: ("--account-for-embedding-in-pipeline-split",
                                    "--account-for-loss-in-pipeline-split"),
}


def _memory_interval(grid: GridConfig) -> int:
    """The last logged iteration: torch's max-allocated counters are high-water marks since
    start, so one memory report there holds the peak of the whole run (Megatron-LM also
    reports after iterations 1 and 2 by itself)."""
    return max(grid.log_interval, grid.train_iters - grid.train_iters % grid.log_interval)


def point_args(grid: GridConfig, point: Point) -> list[str]:
    """The flags of ``scripts/pretrain_gpt_vshape.py`` for one point: the model's Megatron-LM
    flags, the parallel layout, the schedule, the run length and the grid's fixed flags, with
    the schedule choice's own flags last (so they win)."""
    choice = point.choice
    args = list(grid.model.megatron_args(point.seq_length))
    args += ["--tensor-model-parallel-size", str(point.tp),
             "--pipeline-model-parallel-size", str(point.pp),
             "--micro-batch-size", str(point.mbs), "--global-batch-size", str(point.global_batch),
             "--pipeline-schedule", choice.schedule]
    if choice.memory_limit is not None:
        args += ["--pipeline-memory-limit", choice.memory_limit]
    if choice.replan_after is not None:
        args += ["--pipeline-replan-after", str(choice.replan_after)]
    if point.layout is Layout.LOOP:
        args += ["--num-virtual-stages-per-pipeline-rank", str(point.layout.chunks)]
    args += _SPLIT_ARGS.get(point.layer_split, ())
    args += ["--train-iters", str(grid.train_iters), "--log-interval", str(grid.log_interval),
             "--log-throughput", "--log-memory-interval", str(_memory_interval(grid))]
    return args + list(grid.extra_args) + list(choice.extra_args)


def command_line(grid: GridConfig, point: Point) -> str:
    """One line of commands.txt (see the module docstring)."""
    env = [f"RUN_NAME={point.name}", f"NNODES={grid.gpus.nodes}",
           f"GPUS_PER_NODE={grid.gpus.per_node}"]
    return " ".join(env + ["bash", LAUNCHER] + [shlex.quote(a) for a in point_args(grid, point)])


def write_commands(expansion: Expansion, path: Path) -> Path:
    """commands.txt: line i is point i, nothing else (no comments: line numbers are task ids)."""
    lines = [command_line(expansion.grid, p) for p in expansion.points]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_manifest(expansion: Expansion, path: Path) -> Path:
    """points.csv: one row per point, the columns of :data:`MANIFEST_COLUMNS`."""
    grid = expansion.grid
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(MANIFEST_COLUMNS)
        for p in expansion.points:
            writer.writerow([p.index, p.name, p.seq_length, p.global_batch, p.dp, p.tp, p.pp,
                             p.mbs, p.microbatches, p.choice.schedule, p.choice.name,
                             p.choice.memory_limit or "", p.layer_split.value, grid.gpus.nodes,
                             grid.gpus.per_node])
    return path


def array_script(expansion: Expansion, commands: Path, out_dir: Path, source: str) -> str:
    """The slurm array job: task i runs line i of ``commands`` through :data:`ARRAY_RUNNER`.
    ``commands`` and ``out_dir`` should be absolute (the job runs wherever slurm puts it)."""
    grid, count = expansion.grid, len(expansion.points)
    if count == 0:
        raise ValueError("the grid has no valid point: nothing to submit")
    array = f"0-{count - 1}" + (f"%{grid.slurm.max_parallel}" if grid.slurm.max_parallel else "")
    directives = [f"--job-name=vshape-{grid.name}", f"--array={array}",
                  f"--nodes={grid.gpus.nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={grid.gpus.per_node}", "--exclusive",
                  f"--time={grid.slurm.time}", f"--output={out_dir / 'slurm'}/%x-%A_%a.out"]
    directives += [f"--{k}={getattr(grid.slurm, k)}" for k in ("partition", "account")
                   if getattr(grid.slurm, k)]
    directives += list(grid.slurm.directives)
    header = [
        "#!/bin/bash",
        f"# Generated by `vshape grid {source} --format slurm`: {count} points of grid "
        f"{grid.name}",
        f"# ({grid.model.name}, {grid.gpus.nodes} nodes x {grid.gpus.per_node} GPUs). Task i runs "
        f"line i+1 of {commands.name} through",
        f"# {ARRAY_RUNNER}. Submit from the megatron-vshape repository root (or set",
        "# VSHAPE_ROOT), with the environment scripts/slurm/README.md describes:",
        f"#   sbatch {out_dir / 'grid.sbatch'}",
    ]
    body = [
        "set -euo pipefail",
        f"export LOG_DIR=\"${{LOG_DIR:-{out_dir / 'logs'}}}\"",
        "root=\"${VSHAPE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}\"",
        f"exec bash \"$root/{ARRAY_RUNNER}\" {shlex.quote(str(commands))}",
    ]
    return "\n".join(header + [f"#SBATCH {d}" for d in directives] + body) + "\n"


def write_array_job(expansion: Expansion, commands: Path, out_dir: Path, source: str) -> Path:
    """grid.sbatch next to commands.txt, and the slurm/ folder its --output needs (slurm does
    not create it)."""
    out_dir = out_dir.resolve()
    (out_dir / "slurm").mkdir(parents=True, exist_ok=True)
    path = out_dir / "grid.sbatch"
    path.write_text(array_script(expansion, commands.resolve(), out_dir, source))
    return path
