"""A plan row as the Megatron-LM flags that launch it (``vshape plan`` prints them).

The flags are Megatron-LM's ``pretrain_gpt.py`` ones plus the plugin's ``--pipeline-schedule``
(``scripts/pretrain_gpt_vshape.py`` or any entry point that installed the plugin). They split in
two: what every row shares (the model's shape, the global batch, precision and the memory-saving
features the plan assumed) and what a row chose (TP, PP, micro batch, schedule, recomputation).
Data parallelism is not a flag: Megatron-LM derives it from the GPUs it is launched on.

A row whose layout (its layers per global stage, plan/layout_search.py) is not the plugin's
even default gets ``--pipeline-model-parallel-layout`` (schedule/io/megatron_layout.py), which also gives
megatron the virtual stages of interleaved 1F1B (megatron refuses both flags together).
"""
from __future__ import annotations

from ..schedule.model.placement import Layout, stage_layer_counts
from ..schedule.names import schedule_info
from .candidates import NO_PIPELINE
from ..schedule.io.megatron_layout import layout_of_counts
from .evaluate import Prediction
from .planner import PlanResult
from .settings import GIB

__all__ = ["shared_flags", "row_flags"]

_RECOMPUTE = {
    "none": (),
    "selective": ("--recompute-granularity", "selective"),
    "full": ("--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"),
}
"""plan/recompute.py's kinds: selective replays the attention core, full each layer's forward
from its input (every layer: uniform, one layer per group)."""


def shared_flags(result: PlanResult) -> list[str]:
    """The flags every row of ``result`` shares."""
    training = result.training
    flags = result.model.megatron_args(training.seq_length)
    flags += ["--global-batch-size", str(training.global_batch)]
    if training.precision == "bf16":
        flags.append("--bf16")
    if training.fp8:
        flags += ["--fp8-format", "hybrid"]
    if training.context_parallel > 1:
        flags += ["--context-parallel-size", str(training.context_parallel),
                  "--cp-comm-type", "p2p"]
    flags += ["--attention-backend", "flash" if training.flash_attention else "unfused"]
    if training.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if not training.dropout:
        flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if result.cluster.overlap_dp_comm:
        flags += ["--overlap-grad-reduce", "--overlap-param-gather"]
    return flags


def row_flags(row: Prediction, result: PlanResult) -> list[str]:
    """The flags of one row's choices (``auto`` gets the activation memory it was planned for
    as its ``--pipeline-memory-limit``, rounded up to 0.1 GiB)."""
    lay = row.layout
    flags = ["--tensor-model-parallel-size", str(lay.tp),
             "--pipeline-model-parallel-size", str(lay.pp),
             "--micro-batch-size", str(lay.micro_batch_size)]
    if lay.tp > 1 and result.training.sequence_parallel:
        flags.append("--sequence-parallel")
    if result.model.moe:  # as the planner models it: experts split over EP only
        flags += ["--expert-model-parallel-size", str(lay.ep), "--expert-tensor-parallel-size",
                  "1", "--moe-token-dispatcher-type", "alltoall"]
    if lay.schedule != NO_PIPELINE:
        flags += ["--pipeline-schedule", lay.schedule]
    stages = row.stage_layers
    uneven = lay.pp > 1 and stages and tuple(stages) != stage_layer_counts(
        result.model.num_layers, len(stages))
    if uneven:
        flags += ["--pipeline-model-parallel-layout", layout_of_counts(stages)]
    elif lay.schedule != NO_PIPELINE and schedule_info(lay.schedule).layout is Layout.LOOP:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(Layout.LOOP.chunks)]
    if lay.schedule != NO_PIPELINE and schedule_info(lay.schedule).memory_limited:
        limit = -(-row.activation_bytes * 10 // GIB) / 10
        flags += ["--pipeline-memory-limit", f"{limit:.1f}GiB"]
    return flags + list(_RECOMPUTE[lay.recompute])
