"""``vshape gpu-check``'s report: the pipeline runs compared with the reference and the planner.

Pure data in, plain dicts out (``report.json``) and a markdown page (``report.md``), so the
report's assembly is tested on machines without a GPU (tests/harness/test_gpu_check.py) and whatever a
lent GPU sends back is read the same way. Keys, per pipeline run (one per dtype)::

    device, dtype, memory_measure, loss_tolerance, memory_tolerance, model, ranks,
    microbatches, micro_batch_size, steps, stage_layers, wall_seconds, passed,
    schedules: [{schedule, ran, max_loss_diff, final_loss, peak_bytes, tracked_bytes,
                 predicted_bytes, predicted_kept_bytes, measured_vs_predicted, step_seconds,
                 loss_ok, memory_ok}]

``predicted_bytes`` is the planner's prediction of what ``peak_bytes`` measures: on CUDA the
allocator's peak, so with the passes' scratch bytes (:class:`..plan.memory.Workspace`); on the
CPU the tracker's, bytes kept for backward. ``predicted_kept_bytes`` is always the latter, the
counterpart of ``tracked_bytes``. ``stage_layers``: the V schedules' layers per stage (the
uneven run), null for the even split; the predictions are for the layout each schedule ran.
"""
from __future__ import annotations

import dataclasses
import platform
import sys

from ..schedule.names import REFERENCE

__all__ = ["MEMORY_TOLERANCE", "REPORT_KEYS", "PIPELINE_KEYS", "SCHEDULE_KEYS", "machine",
           "pipeline_report", "predicted_bytes", "render_markdown"]

MEMORY_TOLERANCE = {"cpu": 0.25, "cuda": 0.10}
"""Largest |measured / predicted - 1| per rank. CPU: the tracker counts exactly what the
planner's formulas count (tests/plan/test_plan_memory.py holds them to 5%); 25% is the check's
bar. CUDA: the allocator's peak against the planner's kept bytes plus the passes' scratch
bytes; what neither counts (receive buffers, the runtime's small tensors) is the rest."""

REPORT_KEYS = ("command", "machine", "pipelines", "profiles", "passed", "complete",
               "wall_seconds")
PIPELINE_KEYS = ("device", "dtype", "memory_measure", "loss_tolerance", "memory_tolerance",
                 "model", "ranks", "microbatches", "micro_batch_size", "steps", "stage_layers",
                 "wall_seconds", "passed", "schedules")
SCHEDULE_KEYS = ("schedule", "ran", "max_loss_diff", "final_loss", "peak_bytes",
                 "tracked_bytes", "predicted_bytes", "predicted_kept_bytes",
                 "measured_vs_predicted", "step_seconds", "loss_ok", "memory_ok")


def machine(device: str) -> dict:
    """Where the check ran: device name, Python, torch, CUDA and megatron-core versions."""
    import torch

    try:
        from importlib.metadata import version

        megatron_core = version("megatron-core")
    except Exception:  # noqa: BLE001  (not installed as a distribution)
        megatron_core = ""
    from .profiling import cpu_name

    cuda = device == "cuda"
    return {"device": device,
            "device_name": torch.cuda.get_device_name(0) if cuda else cpu_name(),
            "python": sys.version.split()[0], "torch": str(torch.__version__),
            "cuda": torch.version.cuda if cuda else None, "megatron_core": megatron_core,
            "platform": platform.platform()}


def predicted_bytes(settings, schedule, workspace: bool, stage_layers=None) -> list[float]:
    """The planner's per-rank activation bytes for ``schedule`` (a built Schedule: what ran)
    on ``settings``' model, micro batch and dtype, with ``stage_layers`` per stage (None: the
    even split); ``workspace``: with the passes' scratch bytes (the CUDA allocator's measure),
    else the bytes kept for backward (the tracker's)."""
    from ..plan.candidates import GridPoint
    from ..plan.evaluate import Evaluator
    from ..plan.settings import ClusterConfig

    evaluator = Evaluator(settings.model, settings.training(),
                          ClusterConfig(settings.ranks, 1000.0))
    point = GridPoint(1, 1, settings.ranks, settings.micro_batch_size, settings.microbatches)
    return list(evaluator.activation_bytes(point, schedule, workspace,
                                           stage_layers=stage_layers))


def pipeline_report(settings, runs: dict, wall_seconds: float) -> dict:
    """One pipeline run's section (see the module doc); ``runs``: gpu_check.run_check's."""
    from .gpu_check import loss_tolerance

    tolerance = loss_tolerance(settings.dtype)
    memory = MEMORY_TOLERANCE[settings.device]
    reference = runs[REFERENCE]
    rows = [_row(settings, run, reference, tolerance, memory) for run in runs.values()]
    model = dataclasses.asdict(settings.model)
    return {"device": settings.device, "dtype": settings.dtype,
            "memory_measure": settings.memory_measure, "loss_tolerance": tolerance,
            "memory_tolerance": memory, "model": model, "ranks": settings.ranks,
            "microbatches": settings.microbatches, "micro_batch_size": settings.micro_batch_size,
            "steps": settings.steps,
            "stage_layers": None if settings.stage_layers is None else list(settings.stage_layers),
            "wall_seconds": round(wall_seconds, 1),
            "passed": all(r["loss_ok"] and r["memory_ok"] for r in rows), "schedules": rows}


def _row(settings, run, reference, tolerance: float, memory: float) -> dict:
    diff = max(abs(a - b) for got, want in zip(run.losses, reference.losses)
               for a, b in zip(sorted(got), sorted(want)))
    layers = settings.layers_of(run.schedule)
    predicted = predicted_bytes(settings, run.ran, settings.device == "cuda", layers)
    kept = predicted_bytes(settings, run.ran, False, layers)
    ratios = [m / p for m, p in zip(run.peak_bytes, predicted)]
    final = run.losses[-1]
    return {"schedule": run.schedule, "ran": run.ran.description, "max_loss_diff": diff,
            "final_loss": sum(final) / len(final), "peak_bytes": list(run.peak_bytes),
            "tracked_bytes": list(run.tracked_bytes),
            "predicted_bytes": [round(p) for p in predicted],
            "predicted_kept_bytes": [round(p) for p in kept],
            "measured_vs_predicted": [round(r, 4) for r in ratios],
            "step_seconds": run.step_seconds, "loss_ok": diff <= tolerance,
            "memory_ok": all(abs(r - 1) <= memory for r in ratios)}


def render_markdown(report: dict) -> str:
    """report.md: the machine, then per pipeline run one row per schedule."""
    m = report["machine"]
    lines = ["# vshape gpu-check", "",
             f"`{report['command']}`", "",
             f"{m['device_name']} ({m['device']}), Python {m['python']}, torch {m['torch']}"
             f"{', CUDA ' + m['cuda'] if m.get('cuda') else ''}, megatron-core "
             f"{m['megatron_core'] or '?'}; {report['wall_seconds']:.0f} s in all; "
             f"**{'passed' if report['passed'] else 'FAILED'}**", ""]
    for run in report["pipelines"]:
        lines += _pipeline_markdown(run)
    for profile in report["profiles"]:
        lines.append(f"- profile `{profile['file']}`: {profile['model']} TP {profile['tp']} "
                     f"seq {profile['seq_length']}")
    return "\n".join(lines) + "\n"


def _pipeline_markdown(run: dict) -> list[str]:
    model = run["model"]
    head = (f"## {run['device']} {run['dtype']}: {model['name']} ({model['num_layers']} layers, "
            f"hidden {model['hidden_size']}, seq {model['seq_length']}), PP {run['ranks']}, "
            f"{run['microbatches']} microbatches of {run['micro_batch_size']}, "
            f"{run['steps']} steps, {run['wall_seconds']:.0f} s")
    if run.get("stage_layers"):  # reports from before the uneven run lack the key
        head += (f"; V stage layers {' '.join(map(str, run['stage_layers']))}, vocabulary "
                 f"{model['vocab_size']} (1F1B: megatron's even split)")
    lines = [head, "",
             f"Losses against the 1F1B order run by our runtime (tolerance "
             f"{run['loss_tolerance']:g}); peak bytes per rank ({run['memory_measure']}) "
             f"against the planner (tolerance {run['memory_tolerance']:.0%}).", "",
             "| schedule | ran | max loss diff | peak MiB per rank | predicted MiB | "
             "measured / predicted | step s | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in run["schedules"]:
        mib = lambda xs: " ".join(f"{x / 2**20:.1f}" for x in xs)  # noqa: E731
        ok = "yes" if r["loss_ok"] and r["memory_ok"] else \
            ("memory" if r["loss_ok"] else "LOSS")
        lines.append(f"| {r['schedule']} | {r['ran']} | {r['max_loss_diff']:.2e} | "
                     f"{mib(r['peak_bytes'])} | {mib(r['predicted_bytes'])} | "
                     f"{' '.join(f'{x:.3f}' for x in r['measured_vs_predicted'])} | "
                     f"{r['step_seconds']:.3f} | {ok} |")
    return lines + [""]
