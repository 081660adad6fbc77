"""A plan as text (the ranked table) and as CSV (every configuration). Returns strings; the
CLI prints or writes them.

CSV columns (:data:`CSV_COLUMNS`): one row per evaluated configuration, feasible ones first in
ranked order (``place`` 1, 2, ...); ``schedule`` is the row's name with its recomputation
(``1f1b-r``, ``v-half+sel``; plan/recompute.py), ``recompute`` the kind; memory in GiB on the fullest pipeline rank
(``peak_rank``), times in seconds; infeasible rows carry ``feasible=False`` and the ``reason``.
"""
from __future__ import annotations

import csv
import io

from ..schedule.names import REFERENCE
from .candidates import NO_PIPELINE
from .evaluate import Prediction
from .planner import PlanResult
from .recompute import REFERENCE_RECOMPUTED
from .settings import GIB

__all__ = ["CSV_COLUMNS", "format_table", "format_csv", "csv_rows", "best_per_schedule"]

CSV_COLUMNS = (
    "place", "schedule", "recompute", "dp", "tp", "pp", "ep", "micro_batch_size", "microbatches", "feasible",
    "tokens_per_s_per_gpu", "tflops_per_gpu", "iteration_s", "bubble_rate", "dp_comm_s",
    "p2p_hop_s", "peak_gib", "activations_gib", "weights_gib", "gradients_gib", "optimizer_gib",
    "dominant", "peak_rank", "activations_gib_per_rank", "costs", "description", "reason",
)


def csv_rows(result: PlanResult) -> list[dict]:
    """One dict per prediction, keys :data:`CSV_COLUMNS`."""
    rows = []
    for i, p in enumerate(result.predictions):
        lay = p.layout
        row = {
            "place": i + 1 if p.feasible else "", "schedule": lay.label,
            "recompute": lay.recompute, "dp": lay.dp,
            "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "micro_batch_size": lay.micro_batch_size,
            "microbatches": p.microbatches, "feasible": p.feasible,
            "tokens_per_s_per_gpu": round(p.tokens_per_second_per_gpu, 1) if p.feasible else "",
            "tflops_per_gpu": round(p.tflops_per_gpu, 1) if p.feasible else "",
            "iteration_s": round(p.iteration_seconds, 4) if p.feasible else "",
            "bubble_rate": round(p.bubble_rate, 4) if p.feasible else "",
            "dp_comm_s": round(p.dp_seconds, 4) if p.feasible else "",
            "p2p_hop_s": f"{p.p2p_seconds:.3g}" if p.feasible else "",
            "peak_gib": _gib(p.peak_bytes), "activations_gib": _gib(p.activation_bytes),
            "weights_gib": _gib(p.weight_bytes), "gradients_gib": _gib(p.gradient_bytes),
            "optimizer_gib": _gib(p.optimizer_bytes),
            "dominant": p.dominant if p.peak_bytes else "", "peak_rank": p.peak_rank,
            "activations_gib_per_rank": " ".join(f"{a / GIB:.2f}"
                                                 for a in p.activation_bytes_per_rank),
            "costs": p.costs, "description": p.description, "reason": p.reason,
        }
        rows.append(row)
    return rows


def _gib(value: float) -> float:
    return round(value / GIB, 3)


def format_csv(result: PlanResult) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_rows(result))
    return out.getvalue()


def _header(result: PlanResult) -> list[str]:
    m, t, c = result.model, result.training, result.cluster
    features = [t.precision, "flash attention" if t.flash_attention else "no flash attention",
                "sequence parallel" if t.sequence_parallel else "no sequence parallel",
                "distributed optimizer" if t.distributed_optimizer else "replicated optimizer",
                "dropout" if t.dropout else "no dropout"]
    if t.fp8:
        features.insert(1, "FP8 linears")
    if t.context_parallel > 1:
        features.insert(1, f"context parallel {t.context_parallel} (DP = GPUs / (TP x PP x "
                           f"{t.context_parallel}))")
    counts = result.infeasible_counts()
    lines = [
        f"{m.name}: {m.parameters() / 1e9:.2f}B parameters, {m.num_layers} layers, hidden "
        f"{m.hidden_size}"
        + (f", {m.num_experts} experts (top {m.moe_router_topk})" if m.moe else "")
        + f"; {c.gpus} GPUs x {c.gpu_memory_gib:g} GiB "
        f"({c.gpu_memory_gib - c.reserved_gib:g} GiB usable); seq {t.seq_length}, global batch "
        f"{t.global_batch}; {', '.join(features)}",
        f"costs: {result.costs}; pipeline hop and TP/DP communication from link bandwidths "
        f"({c.intra_node_gbps:g} GB/s in a node, {c.inter_node_gbps:g} GB/s across)",
        f"{len(result.predictions)} configurations in {result.seconds:.1f} s: "
        f"{len(result.feasible)} fit"
        + "".join(f", {n} {k}" for k, n in sorted(counts.items()))
        + "".join(f", {n} skipped ({k})" for k, n in result.skipped.items()),
    ]
    return lines


_COLUMNS = (("#", 3), ("schedule", 18), ("DP", 3), ("TP", 3), ("PP", 3), ("EP", 3), ("mbs", 4),
            ("m", 5), ("tok/s/GPU", 10), ("TFLOP/s", 8), ("iter s", 8), ("bubble", 7),
            ("peak GiB", 9), ("act", 6), ("w+g", 6), ("optim", 6), ("dominant", 12))
"""The table's columns; EP only for MoE models (:func:`_columns`)."""


def _columns(moe: bool) -> tuple:
    return tuple(c for c in _COLUMNS if moe or c[0] != "EP")


def _line(values, moe: bool) -> str:
    out = []
    for (name, width), value in zip(_columns(moe), values):
        out.append(f"{value:<{width}}" if name == "schedule" or name == "dominant"
                   else f"{value:>{width}}")
    return " ".join(out).rstrip()


def _row(i: int, p: Prediction, moe: bool) -> str:
    lay = p.layout
    return _line((i, lay.label, lay.dp, lay.tp, lay.pp) + ((lay.ep,) if moe else ())
                 + (lay.micro_batch_size, p.microbatches,
                    f"{p.tokens_per_second_per_gpu:.0f}", f"{p.tflops_per_gpu:.0f}",
                    f"{p.iteration_seconds:.3f}", f"{p.bubble_rate:.3f}",
                    f"{p.peak_bytes / GIB:.1f}", f"{p.activation_bytes / GIB:.1f}",
                    f"{(p.weight_bytes + p.gradient_bytes) / GIB:.1f}",
                    f"{p.optimizer_bytes / GIB:.1f}", p.dominant), moe)


_BASELINES = (REFERENCE, REFERENCE_RECOMPUTED)
"""The rows the others' speed-ups are against: megatron's 1F1B, and 1F1B-R, the paper's."""


def best_per_schedule(result: PlanResult) -> dict[str, tuple[int, Prediction]]:
    """Row label -> (place, fastest feasible row of that label)."""
    best: dict[str, tuple[int, Prediction]] = {}
    for i, p in enumerate(result.feasible):
        best.setdefault(p.layout.label, (i + 1, p))
    return best


def format_table(result: PlanResult, top: int = 15) -> str:
    """The header, the ``top`` fastest configurations, and the best row of each schedule with
    its speed-up over the best 1F1B row."""
    lines = _header(result) + [""]
    feasible = result.feasible
    moe = result.model.moe
    if not feasible:
        return "\n".join(lines + [result.failure_message()])
    lines.append(_line((name for name, _ in _columns(moe)), moe))
    lines.append("-" * len(lines[-1]))
    for i, p in enumerate(feasible[:top]):
        lines.append(_row(i + 1, p, moe))
    best = best_per_schedule(result)
    bases = [name for name in _BASELINES if name in best]
    lines += ["", "best per schedule" + (f" (speed-up vs the best {' / '.join(bases)})"
                                         if bases else "") + ":"]
    for name, (i, p) in sorted(best.items(), key=lambda kv: kv[1][0]):
        gain = " ".join(f"x{p.tokens_per_second_per_gpu / best[b][1].tokens_per_second_per_gpu:.3f}"
                        for b in bases)
        lines.append(_row(i, p, moe) + ("  " + gain if gain else ""))
    lines.append("")
    lines.append("memory on the fullest GPU: act = activations kept for backward at the "
                 "schedule's peak plus the running pass's scratch, w+g = bf16/fp32 weights + "
                 "fp32 main gradients, optim = Adam state" + (" (/DP, distributed optimizer)" if
                            result.training.distributed_optimizer else ""))
    if any(p.layout.schedule == NO_PIPELINE for p in feasible):
        lines.append(f"schedule {NO_PIPELINE}: PP = 1, gradient accumulation, no pipeline")
    if any(p.layout.recompute != "none" for p in feasible):
        lines.append("-r: full activation recomputation (each layer keeps its input, B replays "
                     "its forward; the paper's 1F1B-R); +sel: selective (the attention core)")
    return "\n".join(lines)
