"""Training logs -> one summary row per run: throughput, MFU, peak memory, schedule.

What the paper's grid search compares (throughput per GPU against peak memory, per schedule) is
read from the logs alone: the layout comes from Megatron-LM's argument dump, or from the run
name when the dump is missing (a run that died early); the timing is the median over the
iterations after a warm-up, so start-up costs and the first allocations do not count.
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from .logs import RunLog, parse_log, parse_run_name

__all__ = ["H100_BF16_TFLOPS", "RunSummary", "summarize", "find_logs", "collect", "write_csv",
           "plot_throughput_vs_memory"]

logger = logging.getLogger(__name__)

H100_BF16_TFLOPS = 989.0
"""Dense bf16 peak of an H100 SXM, TFLOP/s: the default MFU denominator."""


@dataclass(frozen=True)
class RunSummary:
    """One CSV row: a run's layout, speed and memory. None where the log does not say."""

    run: str
    """Run name (the log file's stem)."""
    status: str
    """ok (reached train_iters), oom, failed (an error or a non-zero exit), incomplete."""
    schedule: str | None
    """``--pipeline-schedule`` (or the plan line's, or the run name's)."""
    label: str | None
    """The grid's name for the schedule choice (e.g. ``1f1b-r``, ``auto-mem0.5``)."""
    world_size: int | None
    dp: int | None
    tp: int | None
    pp: int | None
    vp: int | None
    """Virtual stages per rank (interleaved-1f1b; Megatron-LM prints None otherwise)."""
    mbs: int | None
    seq_length: int | None
    global_batch: int | None
    microbatches: int | None
    """Per pipeline per iteration: global batch / (DP x mbs)."""
    iterations: int | None
    """The last logged iteration."""
    timed_iterations: int
    """How many logged iterations the medians are over."""
    iteration_ms: float | None
    """Median elapsed time per iteration."""
    tflops_per_gpu: float | None
    """Median of Megatron-LM's logged throughput per GPU (needs --log-throughput)."""
    tokens_per_s: float | None
    """global batch x sequence length / median iteration time."""
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    """tflops_per_gpu / the GPU's peak."""
    max_allocated_mb: float | None
    """Highest ``max allocated`` over every rank and report, and over every rank's
    ``[vshape] iteration`` lines where the run logged them (``VSHAPE_STEP_LOG=1``: Megatron-LM
    reports memory from a few ranks only)."""
    max_reserved_mb: float | None
    lm_loss: float | None
    """At the last logged iteration."""
    plan_schedule: str | None
    """From the last ``[vshape]`` line (after any re-plan)."""
    plan_peak_memory_vs_1f1b: float | None
    plan_bubble_rate: float | None
    plan_description: str | None
    replans: int
    """How often the ``[vshape]`` plan line changed (re-plans that changed the schedule; the
    same line repeated, e.g. by several ranks, counts once)."""
    error: str | None
    log: str
    """The log file."""
    max_activation_mb: float | None = None
    """From the ``[vshape] iteration`` lines of a CPU run: the highest bytes kept for backward
    on any rank (megatron/step_log.py)."""
    wait_share: float | None = None
    """From the ``[vshape] iteration`` lines: the median, over the iterations after the
    warm-up, of the largest share of an iteration any rank spent waiting outside its passes
    (wait_s / step_s)."""


COLUMNS = tuple(f.name for f in dataclasses.fields(RunSummary))


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _layout(log: RunLog, name: str) -> dict:
    """Layout fields from the argument dump, then from the run name."""
    args, named = log.arguments, parse_run_name(name) or {}
    keys = {"dp": "data_parallel_size", "tp": "tensor_model_parallel_size",
            "pp": "pipeline_model_parallel_size", "mbs": "micro_batch_size",
            "seq_length": "seq_length", "global_batch": "global_batch_size"}
    layout = {k: _int(args.get(arg)) or named.get(k) for k, arg in keys.items()}
    layout["world_size"] = _int(args.get("world_size"))
    if layout["world_size"] is None and None not in (layout["dp"], layout["tp"], layout["pp"]):
        layout["world_size"] = layout["dp"] * layout["tp"] * layout["pp"]
    layout["vp"] = _int(args.get("virtual_pipeline_model_parallel_size"))
    plan = log.plans[0] if log.plans else None
    schedule = args.get("pipeline_schedule") or (plan and plan.schedule)
    layout["label"] = named.get("label") or schedule
    layout["schedule"] = schedule or named.get("label")
    return layout


def _status(log: RunLog) -> str:
    last = log.iterations[-1] if log.iterations else None
    if log.oom:
        return "oom"
    if last is not None and last.iteration >= last.train_iters and log.exit_status in (None, 0):
        return "ok"
    if log.error or log.exit_status not in (None, 0):
        return "failed"
    return "incomplete"


def _timing(log: RunLog, warmup: int, tokens: int | None, world_size: int | None,
            peak_tflops: float) -> dict:
    timed = [i for i in log.iterations if i.iteration > warmup] or log.iterations
    ms = _median(i.elapsed_ms for i in timed)
    tflops = _median(i.tflops_per_gpu for i in timed)
    per_s = tokens / (ms / 1000) if tokens and ms else None
    return {"timed_iterations": len(timed), "iteration_ms": ms, "tflops_per_gpu": tflops,
            "tokens_per_s": round(per_s, 1) if per_s else None,
            "tokens_per_s_per_gpu": round(per_s / world_size, 1) if per_s and world_size else None,
            "mfu": round(tflops / peak_tflops, 5) if tflops is not None else None}


def _plan(log: RunLog) -> dict:
    last = log.plans[-1] if log.plans else None
    return {"plan_schedule": last and last.schedule,
            "plan_peak_memory_vs_1f1b": last and last.number("peak_memory_vs_1f1b"),
            "plan_bubble_rate": last and last.number("bubble_rate"),
            "plan_description": last and last.description,
            "replans": sum(a.fields != b.fields for a, b in zip(log.plans, log.plans[1:]))}


def _step_peak_mb(log: RunLog, key: str) -> float | None:
    values = [s.number(key) for s in log.steps if s.number(key) is not None]
    return max(values) / 2**20 if values else None


def _highest(*values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _wait_share(log: RunLog, warmup: int) -> float | None:
    """See RunSummary.wait_share."""
    shares: dict[int, float] = {}
    for step in log.steps:
        iteration, wait, seconds = (step.integer("iteration"), step.number("wait_s"),
                                    step.number("step_s"))
        if iteration is None or wait is None or not seconds:
            continue
        shares[iteration] = max(shares.get(iteration, 0.0), wait / seconds)
    timed = [v for i, v in shares.items() if i > warmup] or list(shares.values())
    return round(statistics.median(timed), 4) if timed else None


def summarize(log: RunLog, name: str, path: str = "", peak_tflops: float = H100_BF16_TFLOPS,
              warmup: int = 3) -> RunSummary:
    """The row of one run; ``warmup`` logged iterations (by number) are left out of the medians
    unless nothing else was logged."""
    if peak_tflops <= 0:
        raise ValueError(f"--peak-tflops must be > 0, got {peak_tflops}")
    layout = _layout(log, name)
    last = log.iterations[-1] if log.iterations else None
    dp, mbs, batch = layout["dp"], layout["mbs"], layout["global_batch"]
    tokens = batch * layout["seq_length"] if batch and layout["seq_length"] else None
    return RunSummary(
        run=name, status=_status(log), **layout,
        microbatches=batch // (dp * mbs) if batch and dp and mbs else None,
        iterations=last and last.iteration,
        **_timing(log, warmup, tokens, layout["world_size"], peak_tflops),
        max_allocated_mb=_highest(*(m.max_allocated_mb for m in log.memory),
                                  _step_peak_mb(log, "peak_allocated")),
        max_reserved_mb=_highest(*(m.max_reserved_mb for m in log.memory),
                                 _step_peak_mb(log, "peak_reserved")),
        lm_loss=last and last.lm_loss, **_plan(log), error=log.error, log=path,
        max_activation_mb=_step_peak_mb(log, "activation_peak"),
        wait_share=_wait_share(log, warmup))


def find_logs(paths) -> list[Path]:
    """``*.log`` files under the given folders (recursively), and files given directly."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(path.rglob("*.log"))
        elif path.is_file():
            found.append(path)
        elif path.exists():
            raise ValueError(f"log path {str(path)!r} is neither a file nor a folder of *.log "
                             "files")
        else:
            raise ValueError(f"log path {str(path)!r} does not exist")
    return found


def collect(paths, peak_tflops: float = H100_BF16_TFLOPS, warmup: int = 3) -> list[RunSummary]:
    """One row per log file found under ``paths``."""
    rows = []
    for path in find_logs(paths):
        with path.open(errors="replace") as handle:
            log = parse_log(handle)
        if not (log.arguments or log.iterations or log.plans or log.steps):
            logger.info("%s: no Megatron-LM output, skipped", path)
            continue
        rows.append(summarize(log, path.stem, str(path), peak_tflops, warmup))
    return rows


def write_csv(rows: list[RunSummary], path: str | Path) -> None:
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow(["" if v is None else v for v in dataclasses.astuple(row)])


def plot_throughput_vs_memory(rows: list[RunSummary], path: str | Path) -> int:
    """Throughput per GPU against peak memory, one marker per schedule choice and one panel per
    sequence length (the paper's trade-off: a schedule is worth its memory if it moves up).
    Runs that ran out of memory or failed are left out; runs still going (incomplete) are
    drawn from the iterations they logged. Returns how many runs were drawn."""
    from matplotlib.figure import Figure

    drawn = [r for r in rows if r.status in ("ok", "incomplete")
             and r.tflops_per_gpu is not None and r.max_allocated_mb is not None]
    if not drawn:
        raise ValueError("no finished run has both a logged throughput (--log-throughput) and "
                         "a memory report: nothing to plot")
    seqs = sorted({r.seq_length or 0 for r in drawn})
    labels = sorted({r.label or "?" for r in drawn})
    markers = "os^Dv<>pPX*h"
    fig = Figure(figsize=(5 * len(seqs), 4.2), layout="constrained")
    axes = fig.subplots(1, len(seqs), squeeze=False)[0]
    for ax, seq in zip(axes, seqs):
        for k, label in enumerate(labels):
            mine = [r for r in drawn if (r.seq_length or 0) == seq and (r.label or "?") == label]
            if mine:
                ax.scatter([r.max_allocated_mb / 1024 for r in mine],
                           [r.tflops_per_gpu for r in mine], marker=markers[k % len(markers)],
                           color=f"C{k % 10}", label=label)
        ax.set_title(f"sequence length {seq}" if seq else "sequence length unknown")
        ax.set_xlabel("peak memory, max allocated over ranks (GiB)")
        ax.set_ylabel("throughput (TFLOP/s/GPU)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(str(path), dpi=120)
    return len(drawn)
