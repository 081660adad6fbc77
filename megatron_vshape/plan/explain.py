"""Why one configuration beats another: each pass's predicted time and fraction of peak
(``vshape plan --explain``). Returns text; the CLI prints it.

For the (TP, micro batch size) settings of the plan's best rows (the best row of each schedule),
one layer's F, B and W: time per microbatch, time per sample (what throughput sees) and the
fraction of the GPU's peak the pass reaches (FLOPs executed / time / peak; TP communication
included, as the simulator counts it). Then, for the best row's setting, every kernel of the
layer's passes with its time, fraction of peak and what bounds it (compute, memory or launch),
so a user sees where a small TP shard or a thin micro batch loses its time (docs/plan.md).
"""
from __future__ import annotations

from .layer_kernels import PassKernels, part_kernels
from .planner import PlanResult
from .table import best_per_schedule

__all__ = ["format_explanation"]

_PASSES = (("forward", "F"), ("backward", "B"), ("weight", "W"))


def _settings(result: PlanResult) -> list[tuple[tuple[int, int], list[str]]]:
    """(TP, micro batch) of the best row of each schedule, best first, with the rows' labels."""
    found: dict[tuple[int, int], list[str]] = {}
    for label, (place, row) in sorted(best_per_schedule(result).items(),
                                      key=lambda item: item[1][0]):
        key = (row.layout.tp, row.layout.micro_batch_size)
        found.setdefault(key, []).append(f"#{place} {label}")
    return list(found.items())


def _pass_cells(layer: PassKernels, micro_batch: int, peak: float) -> str:
    cells = []
    for kind, _ in _PASSES:
        seconds = layer.seconds(kind)
        fraction = layer.flops(kind) / (seconds * peak) if seconds else 0.0
        cells.append(f"{seconds * 1e3:8.3f} {seconds * 1e3 / micro_batch:8.3f} {fraction:6.1%}")
    return "  ".join(cells)


def format_explanation(result: PlanResult) -> str:
    """The explanation of ``result``'s best rows (empty when nothing fits; one line under the
    ``mfu`` cost model, where every pass runs at one rate by construction)."""
    if not result.feasible:
        return ""
    cluster, model, training = result.cluster, result.model, result.training
    if cluster.cost_model != "shapes":
        return (f"why: --cost-model {cluster.cost_model} runs every pass at one rate; "
                "--cost-model shapes explains times by kernel shapes")
    gpu = cluster.gpu
    lines = [f"why (shape cost model: {gpu.peak_tflops:g} TFLOP/s, {gpu.memory_tbps:g} TB/s, "
             f"{gpu.sms} SMs; one layer, one TP rank):"]
    if result.costs.startswith("profile"):
        lines.append("  (this plan used measured times, " + result.costs + "; the shape "
                     "model's view is shown for comparison)")
    head = "   ".join(f"{short} ms/mb  ms/smp  %peak" for _, short in _PASSES)
    lines += [f"  {'TP':>3} {'mbs':>4}   {head}   best rows there", "  " + "-" * 104]
    settings = _settings(result)
    for (tp, mbs), labels in settings:
        kernels = part_kernels(model, training, cluster, tp, mbs)
        lines.append(f"  {tp:>3} {mbs:>4}   {_pass_cells(kernels.layer, mbs, gpu.flops)}   "
                     + ", ".join(labels))
    (tp, mbs), labels = settings[0]
    kernels = part_kernels(model, training, cluster, tp, mbs)
    lines += ["", f"kernels of one layer at TP {tp}, micro batch {mbs} ({labels[0]}):",
              f"  pass  {'kernel':<34} {'ms':>8} {'%peak':>6}  bound"]
    for kind, short in _PASSES:
        for k in getattr(kernels.layer, kind):
            lines.append(f"  {short:<4}  {k.name:<34} {k.seconds * 1e3:8.3f} "
                         f"{k.fraction_of_peak(gpu):6.1%}  {k.bound}")
    lines.append("%peak: FLOPs executed (causal attention counts its half) / time / peak; "
                 "ms/smp: per sample, what throughput sees")
    return "\n".join(lines)
