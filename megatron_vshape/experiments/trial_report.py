"""``vshape trial``'s report: every schedule's run, read from its log, beside 1F1B's and the
simulator's (``DIR/trial.json``, ``DIR/trial.md``, ``DIR/trial.png``).

Per schedule (``trial.json``'s ``schedules`` rows)::

    schedule, status (ok, failed, oom, timeout, not run), reason, seconds, iterations,
    tokens_per_s (per GPU), step_s {median, p90}, peak_bytes {allocated, reserved,
    activations: one value per global rank, null where the device has no such measure},
    peak_vs_1f1b (fullest rank over 1F1B's fullest, activations on the CPU, allocated on a GPU),
    simulated_peak_vs_1f1b, losses, grad_norms, max_loss_diff, max_grad_norm_diff, loss_ok,
    bubble {measured, simulated: per pipeline rank}, stand_in {settings, checked},
    predicted {activation_bytes per pipeline rank, peak_bytes, tokens_per_s}
    (trial_predict.py; ``{error}`` where the planner cannot model the flags)

All timing is over the iterations after the warm-up: a step's time is its slowest rank's
train_step; tokens/s per GPU = global batch x sequence length / median step time / ranks.
Losses and grad norms are the full-precision values the step log prints (megatron/step_log.py);
``max_loss_diff`` is the largest relative difference from 1F1B's loss at the same iteration
(all iterations, warm-up included: the schedules start from one checkpoint).

The measured bubble of pipeline rank r is 1 - busy_r / makespan per iteration (median over the
measured iterations), makespan from the earliest train_step start to the latest pass end of any
rank, busy_r the time inside r's passes: the simulator's definition. The simulated one is the
simulator's for the order that ran (each rank's logged order; megatron's own 1F1B: the
registry's) with each rank's measured F, B, W (or fused BW) times per microbatch, no
communication cost: what is left between them is what the simulator leaves out (messaging,
the runtime's host work).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..schedule.model.actions import parse_action
from ..schedule.model.costs import Costs
from ..schedule.model.placement import Layout, Placement
from ..schedule.model.schedule import Schedule
from ..schedule.model.simulate import simulate
from ..schedule.names import REFERENCE
from ..schedule.registry import build_schedule
from .logs import RunLog, parse_log

__all__ = ["LOSS_TOLERANCE", "loss_tolerance", "ran_order", "schedule_row", "trial_report",
           "render_markdown", "plot_trial", "write_report"]

LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3, "fp8": 1e-2}
"""Largest relative difference from 1F1B's loss at any iteration. fp32: the schedules run the
same arithmetic per microbatch; only the order in which microbatches' weight gradients are
summed differs, a few ulps over a step (the real-loop tests hold 1e-5; most runs agree bit for
bit). bf16 / fp16: the same sums in fp32 main gradients, but each iteration's forward runs on
16-bit weights, so an ulp of difference in a master weight can flip a 16-bit rounding (2^-8
relative) and the losses drift apart over iterations; gpu-check measured bf16 within 2e-2 of a
10.4 loss (0.2%) after SGD steps on an H100, hence 2e-3. fp8: Transformer Engine's FP8 GEMMs
round to 2^-4 relative (E4M3) from the same scaling factors, which every schedule updates at the
same microbatches; not yet measured on a GPU, so a looser 1e-2 until a GPU trial has measured
it."""


def loss_tolerance(arguments: dict) -> tuple[str, float]:
    """(precision, tolerance) of a run, from Megatron-LM's argument dump."""
    if arguments.get("fp8") not in (None, "None", ""):
        precision = "fp8"
    elif arguments.get("bf16") == "True":
        precision = "bf16"
    elif arguments.get("fp16") == "True":
        precision = "fp16"
    else:
        precision = "fp32"
    return precision, LOSS_TOLERANCE[precision]


def _int(arguments: dict, key: str) -> int | None:
    try:
        return int(arguments.get(key))
    except (TypeError, ValueError):
        return None


def _by_iteration(log: RunLog) -> dict[int, list]:
    steps: dict[int, list] = {}
    for step in log.steps:
        steps.setdefault(step.integer("iteration"), []).append(step)
    return steps


def _series(steps: dict[int, list], key: str) -> list:
    """One value of ``key`` per iteration (from the first rank that logged it)."""
    out = []
    for iteration in sorted(steps):
        values = [s.number(key) for s in steps[iteration] if s.number(key) is not None]
        out.append(values[0] if values else None)
    return out


def _per_rank_peak(timed: list, key: str) -> list | None:
    """Max of ``key`` per global rank over the measured iterations (None: never logged)."""
    peaks: dict[int, float] = {}
    for steps in timed:
        for s in steps:
            value = s.number(key)
            if value is not None:
                peaks[s.integer("rank")] = max(peaks.get(s.integer("rank"), 0), value)
    if not peaks:
        return None
    return [int(peaks.get(r, 0)) for r in range(max(peaks) + 1)]


def _percentile(values: list, share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def _first_per_pp_rank(steps: list) -> dict[int, object]:
    chosen = {}
    for s in sorted(steps, key=lambda s: s.integer("rank")):
        chosen.setdefault(s.integer("pp_rank"), s)
    return chosen


def measured_bubble(timed: list) -> tuple[list, dict]:
    """(bubble per pipeline rank, per-microbatch-iteration pass seconds per pipeline rank) over
    the measured iterations (module doc), medians."""
    bubbles: dict[int, list] = {}
    passes: dict[int, dict] = {}
    for steps in timed:
        makespan = max(max(s.number("end") for s in steps) -
                       min(s.number("start") for s in steps), 1e-9)
        for pp, s in _first_per_pp_rank(steps).items():
            bubbles.setdefault(pp, []).append(1.0 - s.number("busy_s") / makespan)
            for kind in ("F", "B", "W", "BW"):
                passes.setdefault(pp, {}).setdefault(kind, []).append(s.number(f"{kind}_s") or 0)
    ranks = sorted(bubbles)
    return ([round(statistics.median(bubbles[r]), 4) for r in ranks],
            {r: {k: statistics.median(v) for k, v in passes[r].items()} for r in ranks})


def ran_order(log: RunLog, name: str, p: int, m: int) -> Schedule:
    """The order that ran: the ranks' last logged orders, else the registry's (megatron's
    own schedules log none)."""
    rows = {}
    for line in log.orders:
        rows[line.integer("pp_rank")] = line
    if len(rows) != p:
        return build_schedule(name, p, m, variant="paper")
    layout = Layout(rows[0].fields["layout"])
    actions = tuple(tuple(parse_action(a) for a in rows[r].fields["actions"].split(","))
                    for r in range(p))
    return Schedule(name, Placement(p, layout), m, actions)


def simulated_bubble(order: Schedule, passes: dict, m: int) -> list:
    """The simulator's bubble per rank of ``order`` with the measured pass times (seconds per
    iteration per rank, divided by ``m`` for one microbatch of the rank's share)."""
    tiny = 1e-9  # the simulator needs every time positive; megatron's 1F1B fuses B and W
    forward = [max(passes[r]["F"] / m, tiny) for r in range(order.ranks)]
    backward = [max((passes[r]["B"] or passes[r]["BW"]) / m, tiny) for r in range(order.ranks)]
    weight = [max(passes[r]["W"] / m, tiny) for r in range(order.ranks)]
    result = simulate(order, Costs.build(order.ranks, forward, backward, weight))
    busy = [sum(e - s for s, e in zip(result.start[r], result.end[r]))
            for r in range(order.ranks)]
    return [round(1.0 - b / result.makespan, 4) for b in busy]


def _microbatches(args: dict, log: RunLog) -> int:
    """Microbatches per pipeline per iteration: global batch / (DP x micro batch), else what
    the order lines say, else 1."""
    batch, dp, mbs = (_int(args, k) for k in ("global_batch_size", "data_parallel_size",
                                              "micro_batch_size"))
    if batch and mbs:
        return max(1, batch // ((dp or 1) * mbs))
    return int(log.orders[0].fields.get("microbatches", 1)) if log.orders else 1


def _status(outcome, log: RunLog) -> tuple[str, str | None]:
    if outcome is None:
        return "not run", "the initial checkpoint's run failed"
    if outcome.timed_out:
        return "timeout", f"no exit after {outcome.seconds:.0f} s: killed (a hang?)"
    if log.oom:
        return "oom", log.error or "out of memory"
    if outcome.returncode != 0:
        return "failed", log.error or f"exit status {outcome.returncode}"
    if not log.steps:
        return "failed", "no [vshape] iteration lines in the log (is this the plugin's script?)"
    return "ok", None


def _read(path: Path) -> RunLog:
    if not path.is_file():
        return RunLog()
    with path.open(errors="replace") as handle:
        return parse_log(handle)


def schedule_row(schedule: str, outcome, warmup: int) -> dict:
    """One schedule's row, from its log (see the module doc); 1F1B comparisons are added by
    :func:`trial_report`."""
    log = RunLog() if outcome is None else _read(outcome.log)
    status, reason = _status(outcome, log)
    row = {"schedule": schedule, "status": status, "reason": reason,
           "seconds": None if outcome is None else round(outcome.seconds, 1),
           "log": None if outcome is None else str(outcome.log)}
    if status != "ok":
        return row
    args = log.arguments
    steps = _by_iteration(log)
    timed = [steps[i] for i in sorted(steps) if i > warmup] or [steps[i] for i in sorted(steps)]
    world = _int(args, "world_size") or len(timed[0])
    step_times = [max(s.number("step_s") for s in it) for it in timed]
    tokens = (_int(args, "global_batch_size") or 0) * (_int(args, "seq_length") or 0)
    p = _int(args, "pipeline_model_parallel_size") or 1
    m = _microbatches(args, log)
    bubble, passes = measured_bubble(timed)
    order = ran_order(log, schedule, p, m)
    precision, tolerance = loss_tolerance(args)
    row.update(
        iterations=len(steps), measured_iterations=len(timed), ranks=world,
        pipeline_ranks=p, microbatches=m, precision=precision, loss_tolerance=tolerance,
        tokens_per_s=round(tokens / statistics.median(step_times) / world, 2),
        step_s={"median": round(statistics.median(step_times), 6),
                "p90": round(_percentile(step_times, 0.9), 6)},
        peak_bytes={k: _per_rank_peak(timed, key) for k, key in
                    (("allocated", "peak_allocated"), ("reserved", "peak_reserved"),
                     ("activations", "activation_peak"))},
        losses=_series(steps, "loss"), grad_norms=_series(steps, "grad_norm"),
        bubble={"measured": bubble, "simulated": simulated_bubble(order, passes, m),
                "order": order.description or order.name},
        simulated_peak_vs_1f1b=(log.plans[-1].number("peak_memory_vs_1f1b") if log.plans
                                else 1.0),
        stand_in={"settings": log.stand_in_settings, "checked": False})
    return row


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _fullest(row: dict) -> float | None:
    peaks = row["peak_bytes"]["allocated"] or row["peak_bytes"]["activations"]
    return max(peaks) if peaks else None


def _compare(row: dict, reference: dict) -> None:
    """Add the 1F1B comparisons to ``row`` (in place: the row is being built)."""
    pairs = [(a, b) for a, b in zip(row["losses"], reference["losses"]) if None not in (a, b)]
    norms = [(a, b) for a, b in zip(row["grad_norms"], reference["grad_norms"])
             if None not in (a, b)]
    row["max_loss_diff"] = max((_relative(a, b) for a, b in pairs), default=None)
    row["max_grad_norm_diff"] = max((_relative(a, b) for a, b in norms), default=None)
    row["loss_ok"] = bool(pairs) and len(pairs) == len(reference["losses"]) and \
        row["max_loss_diff"] <= row["loss_tolerance"]
    row["stand_in"]["checked"] = bool(row["stand_in"]["settings"]) and row["loss_ok"]
    mine, theirs = _fullest(row), _fullest(reference)
    row["peak_vs_1f1b"] = round(mine / theirs, 4) if mine and theirs else None


def trial_report(settings, init, outcomes: list, wall_seconds: float | None = None) -> dict:
    """``trial.json``'s content: the settings, the initial run, one row per schedule."""
    rows = [schedule_row(s, o, settings.warmup) for s, o in zip(settings.schedules, outcomes)]
    if init is not None and not init.ok:
        why = _status(init, _read(init.log))[1]
        rows = [{**r, "reason": f"{r['reason']} ({why}; log {init.log})"} for r in rows]
    reference = next(r for r in rows if r["schedule"] == REFERENCE)
    for row in rows:
        if row["status"] == "ok" and reference["status"] == "ok":
            _compare(row, reference)
    return {"command": list(settings.command), "schedules": rows,
            "iters": settings.iters, "warmup": settings.warmup,
            "initial_checkpoint": None if init is None else
            {"ok": init.ok, "log": str(init.log), "seconds": round(init.seconds, 1)},
            "wall_seconds": None if wall_seconds is None else round(wall_seconds, 1)}


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def render_markdown(report: dict) -> str:
    """trial.md: one table of speed, memory and losses, one of the bubble, then the notes."""
    lines = ["# vshape trial", "", f"Command: `{' '.join(report['command'])}`", "",
             f"{report['warmup']} warm-up + {report['iters']} measured iterations per schedule, "
             "all from one initial checkpoint; step time = the slowest rank's train_step.", "",
             "| schedule | status | tokens/s/GPU | step s (median / p90) | peak MiB, fullest rank "
             "| peak vs 1F1B (simulated) | max loss diff vs 1F1B | losses agree |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["schedules"]:
        if row["status"] != "ok":
            lines.append(f"| {row['schedule']} | {row['status']}: {row['reason']} "
                         "| - | - | - | - | - | - |")
            continue
        step = row["step_s"]
        lines.append(
            f"| {row['schedule']} | ok | {row['tokens_per_s']:.1f} | {step['median']:.4f} / "
            f"{step['p90']:.4f} | {_mib(_fullest(row))} | {_cell(row.get('peak_vs_1f1b'))} "
            f"({_cell(row['simulated_peak_vs_1f1b'])}) | {_cell(row.get('max_loss_diff'), 2)} "
            f"(tolerance {row['loss_tolerance']:g}, {row['precision']}) | "
            f"{'yes' if row.get('loss_ok') else 'NO'} |")
    lines += ["", "Peak memory per rank (MiB; activations kept for backward on the CPU, the "
              "allocator's peak on a GPU) and bubble per pipeline rank, measured (simulated for "
              "the same order with the measured pass times):", "",
              "| schedule | peak per rank | bubble per pipeline rank | predicted by the planner |",
              "|---|---|---|---|"]
    for row in report["schedules"]:
        if row["status"] != "ok":
            continue
        peaks = row["peak_bytes"]["allocated"] or row["peak_bytes"]["activations"] or []
        bubble = row["bubble"]
        pairs = ", ".join(f"{m:.2f} ({s:.2f})" for m, s in zip(bubble["measured"],
                                                               bubble["simulated"]))
        lines.append(f"| {row['schedule']} | {', '.join(_mib(p) for p in peaks)} | {pairs} | "
                     f"{_predicted(row.get('predicted'))} |")
    notes = [f"- {row['schedule']}: uses {row['stand_in']['settings']}, proven on CPU with "
             f"stand-ins only; {'checked here: losses agree with 1F1B' if row['stand_in']['checked'] else 'NOT checked: losses do not agree'}"
             for row in report["schedules"] if row.get("stand_in", {}).get("settings")]
    if notes:
        lines += ["", "Settings not yet proven on a GPU before this trial:", "", *notes]
    return "\n".join(lines) + "\n"


def _predicted(predicted: dict | None) -> str:
    if not predicted:
        return "-"
    if predicted.get("error"):
        return predicted["error"]
    per_rank = ", ".join(_mib(b) for b in predicted["activation_bytes"])
    speed = predicted.get("tokens_per_s")
    return f"activations {per_rank} MiB" + ("" if speed is None else f"; {speed:.0f} tokens/s/GPU")


def plot_trial(report: dict, path: Path) -> None:
    """Tokens/s per GPU and the fullest rank's peak memory per schedule, as bars, the
    planner's predictions marked (where it made some)."""
    from matplotlib.figure import Figure

    rows = [r for r in report["schedules"] if r["status"] == "ok"]
    names = [r["schedule"] for r in rows]
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    speed, memory = fig.subplots(1, 2)
    speed.bar(names, [r["tokens_per_s"] for r in rows], color="C0")
    memory.bar(names, [(_fullest(r) or 0) / 2**20 for r in rows], color="C1")
    for k, row in enumerate(rows):
        predicted = row.get("predicted") or {}
        if predicted.get("tokens_per_s"):
            speed.plot([k], [predicted["tokens_per_s"]], "k_", markersize=24,
                       label="planner" if k == 0 else None)
        if predicted.get("activation_bytes"):
            memory.plot([k], [max(predicted["activation_bytes"]) / 2**20], "k_", markersize=24,
                        label="planner" if k == 0 else None)
    speed.set_ylabel("tokens/s per GPU")
    memory.set_ylabel("peak MiB, fullest rank")
    for ax in (speed, memory):
        ax.tick_params(axis="x", labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(str(path), dpi=110)


def write_report(report: dict, output: Path) -> list[Path]:
    """trial.json, trial.md and trial.png under ``output``; the paths written."""
    paths = [output / "trial.json", output / "trial.md", output / "trial.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(render_markdown(report), encoding="utf-8")
    if any(r["status"] == "ok" for r in report["schedules"]):
        plot_trial(report, paths[2])
    else:
        paths.pop()
    return paths
