"""``vshape plan``: the fastest (DP, TP, PP, micro batch, schedule) that fits the GPUs.

Prints the ranked table (:func:`megatron_vshape.plan.table.format_table`) and writes every
configuration to ``--csv``. Exit status: 0 with a table, 1 when nothing fits (the reason goes
to standard error), 2 for bad flags.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..configs import config_names
from ..plan.candidates import STAGE_LAYOUTS, SearchSpace
from ..plan.explain import format_explanation
from ..plan.launch_flags import row_flags, shared_flags
from ..plan.model import load_model_config
from ..plan.planner import plan
from ..plan.profile_file import load_profile
from ..plan.recompute import RECOMPUTE
from ..plan.settings import COST_MODELS, PRECISIONS, ClusterConfig, TrainingConfig
from ..plan.table import format_csv, format_table
from ..schedule.registry import SCHEDULES
from .ui import add_progress_argument, subcommand, working

__all__ = ["register"]

_CLUSTER = ClusterConfig(gpus=1, gpu_memory_gib=80.0)  # only for the defaults shown in --help


def register(sub) -> None:
    """Add ``plan`` to the ``vshape`` parser."""
    p = subcommand(
        sub, "plan", help="rank DP x TP x PP x micro batch x schedule by predicted throughput",
        description="Before spending GPU hours: predict per-GPU memory (activations, weights, "
                    "gradients, optimizer state) and throughput of every (DP, TP, PP, micro "
                    "batch, schedule, recomputation) configuration of a model on your GPUs, "
                    "print the ones that fit, fastest first, and the Megatron-LM flags that "
                    "launch the best ones. Pass times come from a model of each kernel's shape "
                    "on the GPU, or from measured pass times (--profile). Pure Python: it runs "
                    "on a laptop.\n\nFormulas, defaults and how to read the table: docs/plan.md.",
        examples=["vshape plan --model gpt-9.6b --gpus 16 --gpu-memory 80",
                  "vshape plan --model gpt-21b --gpus 24 --gpu-memory 80 --seq-length 16384 "
                  "--explain",
                  "vshape plan --model my-model.yaml --gpus 64 --gpu-memory 141 "
                  "--memory-bandwidth 4.8 --schedules 1f1b v-half auto --csv plan.csv"])
    p.add_argument("--model", required=True, metavar="NAME|FILE", help=model_help())
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in all (DP x TP x PP)")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GIB",
                   help="memory of one GPU in GiB (e.g. 80)")
    p.add_argument("--seq-length", type=int, metavar="S", help="tokens per sample (default: the model's)")
    p.add_argument("--global-batch", type=int, default=128, metavar="B",
                   help="samples per iteration (default 128)")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                   metavar="B", help="micro batch sizes to try (1 2 4 8)")
    p.add_argument("--tp", type=int, nargs="+", metavar="T", help="TP sizes to try (default: all valid)")
    p.add_argument("--pp", type=int, nargs="+", metavar="P", help="PP sizes to try (default: all valid)")
    p.add_argument("--ep", type=int, nargs="+", metavar="E",
                   help="expert-parallel sizes to try for a MoE model (default: every divisor "
                        "of its experts; each point keeps those dividing its DP x TP)")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                   metavar="NAME", help=f"pipeline schedules ({', '.join(SCHEDULES)}; default all)")
    p.add_argument("--auto-candidates", type=int, default=SearchSpace().auto_candidates,
                   metavar="K", help="search auto only at the K best points of the fixed "
                                     "schedules (default %(default)s)")
    p.add_argument("--recompute", nargs="+", default=list(RECOMPUTE), choices=RECOMPUTE,
                   metavar="KIND", help="activation recomputation to plan: none, selective "
                   "(attention core; rows NAME+sel, only without flash attention), full (rows "
                   "1f1b-r, megatron's schedules only); default all")
    p.add_argument("--stage-layouts", choices=STAGE_LAYOUTS, default="best",
                   help="layers per pipeline stage: best (default: per schedule, the layout of "
                        "whole layers it runs fastest, printed as --pipeline-model-parallel-"
                        "layout) or even (the plugin's default)")
    _add_training(p)
    _add_cluster(p)
    p.add_argument("--top", type=int, default=15, metavar="K", help="table rows (default 15)")
    p.add_argument("--csv", metavar="FILE", help="write every configuration to FILE")
    p.add_argument("--flags", type=int, default=3, metavar="K",
                   help="print the Megatron-LM flags of the K best rows (default 3; 0: none)")
    add_progress_argument(p)
    p.add_argument("--explain", action="store_true",
                   help="after the table, each pass's predicted time and fraction of peak at "
                        "the best rows' TP and micro batch, and the best row's kernels")
    p.set_defaults(handler=_plan)


def model_help() -> str:
    """``--model``'s help, with the bundled models' names (plan, profile, demo)."""
    return f"a bundled model's name ({', '.join(config_names('models'))}) or a model YAML's path"


def _add_training(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="bf16 mixed precision (default) or fp32")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 linear layers (Transformer Engine, --fp8-format hybrid): their GEMMs "
                        "at twice the bf16 rate, their saved inputs and an FP8 weight copy in "
                        "one byte per element (needs --precision bf16; docs/plan.md)")
    p.add_argument("--cp", type=int, default=1, metavar="C",
                   help="context-parallel size: each of C ranks holds seq/C tokens (the "
                        "load-balanced causal split; the K/V ring's traffic is counted); takes "
                        "GPUs: DP = GPUs / (TP x PP x C) (default 1)")
    p.add_argument("--no-flash-attention", action="store_true",
                   help="keep the s x s attention scores (no fused attention)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="TP without sequence parallel (layernorm/dropout activations replicated)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="every DP replica keeps the whole Adam state")
    p.add_argument("--no-dropout", action="store_true", help="dropout 0: no dropout masks")


def _add_cluster(p: argparse.ArgumentParser) -> None:
    c = _CLUSTER
    p.add_argument("--profile", metavar="NAME|FILE",
                   help="measured per-layer F/B/W seconds (YAML/JSON, docs/plan.md) instead of "
                        "the FLOP model: a file's path or a bundled profile's name (%s)"
                        % ", ".join(config_names("profiles")))
    p.add_argument("--cost-model", choices=COST_MODELS, default=c.cost_model,
                   help="how pass times are predicted without --profile: shapes (default: "
                        "each kernel timed from its shape on the GPU, docs/plan.md) or mfu "
                        "(every pass at --mfu of --gpu-tflops)")
    p.add_argument("--mfu", type=float, default=c.mfu, metavar="X",
                   help="model FLOP utilisation under --cost-model mfu (default %(default)s)")
    p.add_argument("--gpu-tflops", type=float, default=c.gpu_tflops, metavar="TFLOPS",
                   help="peak 16-bit TFLOP/s per GPU (default %(default)s, H100 SXM dense)")
    p.add_argument("--memory-bandwidth", type=float, default=c.memory_tbps, metavar="TB/S",
                   help="HBM bandwidth per GPU for the shape model (default %(default)s, "
                        "H100 SXM; H200 4.8)")
    p.add_argument("--sms", type=int, default=c.sms, metavar="N",
                   help="streaming multiprocessors per GPU for the shape model (default "
                        "%(default)s, H100 SXM)")
    p.add_argument("--gpus-per-node", type=int, default=c.gpus_per_node, metavar="N",
                   help="GPUs per node (default %(default)s); TP stays inside a node")
    p.add_argument("--reserved-memory", type=float, default=c.reserved_gib, metavar="GIB",
                   help="GiB per GPU kept free for context, buffers, fragmentation "
                        "(default %(default)s)")
    p.add_argument("--intra-node-bandwidth", type=float, default=c.intra_node_gbps,
                   metavar="GB/S", help="achieved bandwidth in a node (default %(default)s)")
    p.add_argument("--inter-node-bandwidth", type=float, default=c.inter_node_gbps,
                   metavar="GB/S", help="achieved bandwidth per GPU across nodes "
                                        "(default %(default)s)")
    p.add_argument("--p2p-latency", type=float, default=c.p2p_latency_us, metavar="US",
                   help="fixed cost of one pipeline hop, microseconds (default %(default)s)")
    p.add_argument("--overlap-dp-comm", action="store_true",
                   help="the DP gradient reduction is hidden behind compute")


def _configs(args):
    try:
        model = load_model_config(args.model)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    training = TrainingConfig(
        seq_length=model.seq_length if args.seq_length is None else args.seq_length,
        global_batch=args.global_batch,
        precision=args.precision, fp8=args.fp8, context_parallel=args.cp,
        flash_attention=not args.no_flash_attention,
        sequence_parallel=not args.no_sequence_parallel,
        distributed_optimizer=not args.no_distributed_optimizer, dropout=not args.no_dropout)
    cluster = ClusterConfig(
        gpus=args.gpus, gpu_memory_gib=args.gpu_memory, gpus_per_node=args.gpus_per_node,
        reserved_gib=args.reserved_memory, gpu_tflops=args.gpu_tflops, mfu=args.mfu,
        memory_tbps=args.memory_bandwidth, sms=args.sms, cost_model=args.cost_model,
        intra_node_gbps=args.intra_node_bandwidth, inter_node_gbps=args.inter_node_bandwidth,
        p2p_latency_us=args.p2p_latency, overlap_dp_comm=args.overlap_dp_comm)
    space = SearchSpace(schedules=tuple(args.schedules),
                        micro_batch_sizes=tuple(args.micro_batch_sizes),
                        tensor_parallel=tuple(args.tp) if args.tp else None,
                        pipeline_parallel=tuple(args.pp) if args.pp else None,
                        expert_parallel=tuple(args.ep) if args.ep else None,
                        auto_candidates=args.auto_candidates,
                        recompute=tuple(args.recompute), stage_layouts=args.stage_layouts)
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.flags < 0:
        raise ValueError(f"--flags must be >= 0, got {args.flags}")
    return model, training, cluster, space


def _plan(args) -> int:
    model, training, cluster, space = _configs(args)
    profile = load_profile(args.profile) if args.profile else None
    with working(args, "planning"):
        result = plan(model, training, cluster, space, profile)
    if args.csv:
        Path(args.csv).write_text(format_csv(result))
    if not result.feasible:
        print(format_table(result, args.top).rsplit("\n", 1)[0])
        print(f"vshape: plan: {result.failure_message()}", file=sys.stderr)
        if args.csv:
            print(f"wrote {args.csv} ({len(result.predictions)} configurations)")
        return 1
    print(format_table(result, args.top))
    if args.flags:
        print()
        print(_flags_text(result, args.flags))
    if args.explain:
        print()
        print(format_explanation(result))
    if args.csv:
        print(f"wrote {args.csv} ({len(result.predictions)} configurations)")
    return 0


def _flags_text(result, rows: int) -> str:
    """The Megatron-LM flags of the ``rows`` best rows: the shared ones once."""
    import shlex

    lines = ["Megatron-LM flags (pretrain_gpt.py with the plugin installed, e.g. "
             "scripts/pretrain_gpt_vshape.py; DP follows from the GPUs launched):",
             "  all rows: " + shlex.join(shared_flags(result))]
    for place, row in enumerate(result.feasible[:rows], start=1):
        lines.append(f"  #{place} {row.layout.label}: " + shlex.join(row_flags(row, result)))
    return "\n".join(lines)
