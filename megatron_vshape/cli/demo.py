"""``vshape demo``: the main job. A tiny megatron-core GPT on CPU gloo processes, every schedule.

Prints one row per schedule (losses and gradients against megatron's own 1F1B, measured peak
activation memory per rank, CPU step time and simulated bubble, then the step time with
emulated device time next to the simulator's makespan for the same costs), then the
heavy-head case (V-ZB with the even and a balanced stage layout, the LM head emulated as
``--head-layers`` layers), and writes each run's measured timelines as pictures, plus
``demo.json`` and ``layouts.json`` with the numbers.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..schedule.names import AUTO, PLUGIN_SCHEDULES, REFERENCE, V_HALF, V_MIN, V_ZB, schedule_info
from .plan import model_help
from .ui import subcommand

__all__ = ["register", "missing_backend_warnings_hidden", "demo_settings", "layout_rows"]

_MISSING_BACKENDS = ("Transformer Engine and Apex are not installed", "Apex is not installed")
"""How megatron-core's warnings that it falls back to its local (torch) kernels begin: once
per module and rank, a screenful before the demo's table."""


def register(sub) -> None:
    demo = subcommand(
        sub, "demo", help="train a tiny megatron-core GPT on CPU under every schedule "
                          "(needs pip install -e '.[megatron]')",
        description="Train a tiny megatron-core GPT on CPU gloo processes (one per pipeline "
                    "rank) under megatron's own 1F1B and under every schedule of the plugin, "
                    "and print one row per schedule: losses and gradients against 1F1B's, "
                    "measured peak activation memory per rank, step times and the simulated "
                    "bubble; then the same with emulated device time, and V-ZB with the even and "
                    "a balanced stage layout where the LM head costs --head-layers layers. "
                    "Writes each run's measured timeline as a picture, demo.json and "
                    "layouts.json. It takes about a minute.",
        examples=["vshape demo", "vshape demo --ranks 4 --microbatches 8 --schedules "
                                 "v-half,auto --no-emulate -o /tmp/vshape-demo"])
    demo.add_argument("--ranks", "-p", type=int, default=4, help="gloo processes (default 4)")
    demo.add_argument("--microbatches", "-m", type=int, default=8, help="default 8")
    demo.add_argument("--steps", type=int, default=4, help="training iterations (default 4)")
    demo.add_argument("--model", metavar="NAME|FILE",
                      help=f"{model_help()} (default: the embedded tiny GPT, the bundled tiny's "
                           "shape)")
    demo.add_argument("--schedules", default=",".join((REFERENCE,) + PLUGIN_SCHEDULES),
                      help="comma-separated (default: all; 1f1b is always run as the reference)")
    demo.add_argument("--memory-limit", default="0.75",
                      help="auto's limit: fraction of 1F1B (default 0.75) or bytes (2MiB)")
    demo.add_argument("--emulate-ms", type=float, default=40.0, metavar="F",
                      help="emulated device time: F of one rank's layer share in ms, B and W by "
                           "the H100 ratios 1 : 1.39 : 0.35 (default 40)")
    demo.add_argument("--no-emulate", action="store_true",
                      help="skip the emulated-device runs (CPU times only; no layout runs)")
    demo.add_argument("--head-layers", type=float, default=2.0, metavar="K",
                      help="the heavy-head case: the LM head and loss emulated as K layers "
                           "on the V's last stage, V-ZB run with the even and a balanced stage "
                           "layout (default 2, about Llama-3-8B's head; 0: skip)")
    demo.add_argument("--output-dir", "-o", default="vshape-demo",
                      help="where timelines, demo.json and layouts.json go (default "
                           "./vshape-demo)")
    demo.add_argument("--json", action="store_true",
                      help="one JSON object per schedule, then per stage layout")
    demo.set_defaults(handler=_demo)


@contextmanager
def missing_backend_warnings_hidden():
    """Hide megatron-core's "Transformer Engine and Apex are not installed" warnings here and
    in the rank processes the demo spawns (multiprocessing hands ``sys.warnoptions`` to them as
    ``-W`` flags); yields the backends that are missing (what the one summary line names).
    ``sys.warnoptions`` and the warning filters are restored on exit."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"),
                                         ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    options = [f"ignore:{message}:UserWarning" for message in _MISSING_BACKENDS]
    saved = list(sys.warnoptions)
    sys.warnoptions.extend(options)
    try:
        with warnings.catch_warnings():
            for message in _MISSING_BACKENDS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            yield missing
    finally:
        sys.warnoptions[:] = saved


def demo_settings(args):
    """The demo's settings and schedule names (1f1b, the reference, first) from ``vshape
    demo``'s arguments; bad ones refused here, before any process starts."""
    from ..harness.demo import DEMO_SCHEDULES, DemoSettings
    from ..schedule.model.limits import MemoryLimit

    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    for name in names:
        schedule_info(name, "--schedules", DEMO_SCHEDULES)
    MemoryLimit.parse(args.memory_limit, "--memory-limit")  # fail before any work
    kwargs = dict(ranks=args.ranks, microbatches=args.microbatches, steps=args.steps,
                  memory_limit=args.memory_limit,
                  emulate_ms=None if args.no_emulate else args.emulate_ms,
                  head_layers=args.head_layers)
    if args.model:
        kwargs["model"] = _tiny_from_config(args.model)
    return DemoSettings(**kwargs), [REFERENCE] + [n for n in names if n != REFERENCE]


def _tiny_from_config(path):
    from ..harness.tiny_gpt import TinyGPT
    from ..plan.model import load_model_config

    return TinyGPT.from_model(load_model_config(path), micro_batch_size=2)


def _demo(args) -> int:
    try:
        from ..harness.demo import run_schedules
        from tqdm import tqdm
    except ImportError as err:
        raise ValueError(f"vshape demo needs torch and megatron-core: pip install -e '.[megatron]' "
                         f"({err})") from None
    settings, names = demo_settings(args)
    with missing_backend_warnings_hidden() as missing:
        if missing:
            print(f"megatron-core: {' and '.join(missing)} not installed, using its local torch "
                  f"fallbacks (fine on CPU; their warnings are hidden)", file=sys.stderr)
        total = len(names) + len(settings.stage_layouts())
        with tqdm(total=total, desc="training under each schedule, then layout", unit="run",
                  disable=args.json) as progress:
            def done(name):
                progress.set_postfix_str(f"{name} done")
                progress.update()
            result = run_schedules(settings, names, on_done=done)
    runs = result.schedules
    rows = _rows(settings, runs)
    by_layout = layout_rows(settings, result.layouts, runs[REFERENCE])
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pictures = _pictures(settings, runs, rows, out) + _layout_pictures(settings, result.layouts,
                                                                       by_layout, out)
    (out / "demo.json").write_text(json.dumps(rows, indent=1))
    (out / "layouts.json").write_text(json.dumps(by_layout, indent=1))
    if args.json:
        for row in rows + by_layout:
            print(json.dumps(row))
    else:
        _print_table(settings, rows, runs)
        _print_layouts(settings, by_layout)
        print(f"wrote {len(pictures)} timelines, demo.json and layouts.json to {out}/")
    return 0 if all(r["max_loss_diff"] < 1e-5 and r["max_grad_diff"] < 1e-5
                    for r in rows + by_layout) else 1


def _rows(settings, runs) -> list[dict]:
    from ..schedule import build_schedule, simulate

    ref = runs[REFERENCE]
    base = max(ref.peak_bytes)
    costs = _measured_costs(settings, runs)
    rows = []
    for name, run in runs.items():
        schedule = run.last_schedule or build_schedule(name, settings.ranks, settings.microbatches)
        loss_diff, grad_diff = _max_diffs((run, run.emulated), ref)
        rows.append({
            "schedule": name, "final_loss": sum(run.losses[-1]) / len(run.losses[-1]),
            "max_loss_diff": loss_diff, "max_grad_diff": grad_diff,
            "peak_activation_bytes": run.peak_bytes,
            "peak_activation_vs_1f1b": max(run.peak_bytes) / base,
            "simulated_peak_vs_1f1b": simulate(schedule).peak_memory_vs_1f1b,
            "step_time_s": run.step_seconds,
            "simulated_bubble": simulate(schedule, costs).bubble_rate,
            "plans": [d for _, d in run.plans],
            **_emulated_columns(settings, run.emulated),
        })
    return rows


def _max_diffs(runs, ref) -> tuple[float, float]:
    """Largest loss and gradient difference from ``ref`` over every step of ``runs`` (the CPU
    run and the emulated one: both start from the same weights and data, step by step)."""
    loss = grad = 0.0
    for run in (r for r in runs if r is not None):
        loss = max([loss] + [abs(a - b) for got, want in zip(run.losses, ref.losses)
                             for a, b in zip(sorted(got), sorted(want))])
        grad = max([grad] + [(g[k] - w[k]).abs().max().item()
                             for g, w in zip(run.grads, ref.grads) for k in w])
    return loss, grad


def _emulated_columns(settings, emulated) -> dict:
    """The emulated run's step time against the simulator's makespan of the schedule it ran,
    for the costs it was slowed to (all None without emulated runs)."""
    from ..schedule import simulate

    if emulated is None:
        return dict.fromkeys(("emulated_costs", "emulated_step_time_s", "simulated_makespan_s",
                              "emulated_vs_simulated", "emulated_schedule"))
    costs = settings.emulated_costs()
    makespan = simulate(emulated.last_schedule, costs).makespan
    return {"emulated_costs": costs.as_list(), "emulated_step_time_s": emulated.step_seconds,
            "simulated_makespan_s": makespan,
            "emulated_vs_simulated": emulated.step_seconds / makespan,
            "emulated_schedule": emulated.last_schedule.description}


def layout_rows(settings, layouts, ref) -> list[dict]:
    """Per stage layout of the heavy-head case: losses against 1F1B's, rank loads, the
    emulated step against the simulator's makespan of the same schedule and per-stage costs."""
    from ..schedule import simulate

    rows = []
    for layout in layouts:
        run = layout.run
        loss_diff, grad_diff = _max_diffs((run,), ref)
        makespan = simulate(run.last_schedule, layout.costs).makespan
        placement = run.last_schedule.placement
        rows.append({
            "layout": layout.label, "schedule": run.schedule, "stage_layers": list(
                layout.stage_layers), "head_layers": settings.head_layers,
            "rank_loads": [sum(layout.stage_layers[placement.stage_of(r, c)] for c in (0, 1))
                           + (settings.head_layers if r == 0 else 0)
                           for r in range(settings.ranks)],
            "max_loss_diff": loss_diff, "max_grad_diff": grad_diff,
            "emulated_costs": layout.costs.as_list(),
            "emulated_step_time_s": run.step_seconds, "simulated_makespan_s": makespan,
            "emulated_vs_simulated": run.step_seconds / makespan,
            "emulated_schedule": run.last_schedule.description})
    even = rows[0] if rows else None
    for row in rows:
        row["emulated_vs_even"] = row["emulated_step_time_s"] / even["emulated_step_time_s"]
        row["simulated_vs_even"] = row["simulated_makespan_s"] / even["simulated_makespan_s"]
    return rows


def _print_layouts(settings, rows) -> None:
    """The heavy-head case: one line per stage layout."""
    if not rows:
        return
    p = settings.ranks
    print(f"\nheavy LM head: stage {2 * p - 1} (rank 0) emulated as {settings.head_layers:g} "
          f"layers more, one layer's F, B, W = "
          f"{', '.join(f'{1000 * x:.3g}' for x in settings.layer_costs())} ms; "
          f"{rows[0]['schedule']} built for each layout's per-stage costs")
    stages = max([16] + [len(" ".join(map(str, r["stage_layers"]))) for r in rows]) + 2
    loads = max([10] + [len(_loads(r)) for r in rows]) + 2
    head = (f"{'layout':<10}{'layers per stage':<{stages}}{'rank loads':<{loads}}{'|dloss|':>9}"
            f"{'|dgrad|':>10} |{'step ms':>9}{'sim. ms':>9}{'ratio':>7} |{'vs even: step':>14}"
            f"{'sim.':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['layout']:<10}{' '.join(map(str, r['stage_layers'])):<{stages}}"
              f"{_loads(r):<{loads}}{r['max_loss_diff']:>9.1e}{r['max_grad_diff']:>10.1e} |"
              f"{1000 * r['emulated_step_time_s']:>9.1f}{1000 * r['simulated_makespan_s']:>9.1f}"
              f"{r['emulated_vs_simulated']:>7.3f} |{r['emulated_vs_even']:>14.3f}"
              f"{r['simulated_vs_even']:>6.3f}")
    print("rank loads: layers per rank, the head counted on rank 0; step ms: emulated device, "
          "sim. ms: the simulator\n  with the same per-stage costs (Costs.for_stages); "
          "|dloss|, |dgrad|: against 1F1B, as above")
    if len(rows) == 1:
        print("  (the even layout is already balanced for this head)")


def _loads(row) -> str:
    return " ".join(f"{x:g}" for x in row["rank_loads"])


def _measured_costs(settings, runs):
    """Per-rank F, B, W measured under the V (auto re-planned from these)."""
    for name in (AUTO, V_HALF, V_MIN, V_ZB):
        if name in runs and runs[name].costs is not None:
            return runs[name].costs
    return None


def _print_table(settings, rows, runs) -> None:
    m = settings.model
    print(f"tiny GPT ({m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}) on "
          f"{settings.ranks} gloo processes (CPU), {settings.microbatches} microbatches, "
          f"{settings.steps} SGD steps per schedule; reference: megatron-core's own 1F1B")
    costs = settings.emulated_costs()
    if costs is not None:
        print(f"emulated device: F, B, W = {_ms(costs)} ms per rank's layer share (H100 ratios "
              f"1 : 1.39 : 0.35), {settings.emulate_steps} more steps per schedule, each "
              "schedule built for these costs")
    peaks = [" ".join(f"{b / 1024:.0f}" for b in r["peak_activation_bytes"]) for r in rows]
    width = max([30] + [len(p) + 2 for p in peaks])
    left = (f"{'schedule':<9}{'final loss':>11}{'|dloss|':>10}{'|dgrad|':>10}  "
            f"{'peak activation KiB per rank':<{width}}{'vs 1F1B':>8}{'sim.':>6}")
    cpu = f"{'step ms':>9}{'sim. bubble':>12}"
    emulated = f"{'step ms':>9}{'sim. ms':>9}{'ratio':>7}" if costs is not None else ""
    groups = [" " * len(left), "CPU, real time".center(len(cpu))]
    if emulated:
        groups.append("emulated device".center(len(emulated)))
    head = " |".join([left, cpu] + ([emulated] if emulated else []))
    print(" |".join(groups).rstrip())
    print(head)
    print("-" * len(head))
    for r, peak in zip(rows, peaks):
        line = (f"{r['schedule']:<9}{r['final_loss']:>11.5f}{r['max_loss_diff']:>10.1e}"
                f"{r['max_grad_diff']:>10.1e}  {peak:<{width}}{r['peak_activation_vs_1f1b']:>8.3f}"
                f"{r['simulated_peak_vs_1f1b']:>6.2f} |{1000 * r['step_time_s']:>9.1f}"
                f"{r['simulated_bubble']:>12.3f}")
        if r["emulated_step_time_s"] is not None:
            mark = "*" if r["schedule"] == REFERENCE else " "
            line += (f" |{1000 * r['emulated_step_time_s']:>8.1f}{mark}"
                     f"{1000 * r['simulated_makespan_s']:>9.1f}{r['emulated_vs_simulated']:>7.3f}")
        print(line)
    _print_footer(settings, runs, emulated=costs is not None)


def _print_footer(settings, runs, emulated: bool) -> None:
    """What each column is; why the CPU step times are not device time."""
    auto = runs.get(AUTO)
    if auto is not None and auto.plans:
        print("auto ran: " + "; then ".join(f"{d} (from iteration {i})" for i, d in auto.plans))
    print(f"|dloss|, |dgrad|: largest difference from 1F1B over all steps"
          f"{', CPU and emulated' if emulated else ''} (fp32); 'sim.': the simulator's peak ratio")
    measured = _measured_costs(settings, runs)
    passes = f" (measured F, B, W = {_ms(measured)} ms)" if measured is not None else ""
    print(f"CPU step ms: real time of {settings.ranks} processes sharing {_cores()} cores, "
          f"passes of milliseconds{passes}:\n  Python and messaging overhead, not device "
          "time; sim. bubble: simulated with the measured F, B, W")
    if emulated:
        print("emulated device: every pass lasts its emulated F, B or W (the real work runs, "
              "then it sleeps for the rest),\n  so a step takes device time; sim. ms: the "
              "simulator's makespan of the same schedule and costs; ratio: step / sim.\n"
              "* the 1F1B order run by our runtime (megatron's own 1F1B cannot be slowed per "
              "pass)")


def _ms(costs) -> str:
    """Mean F, B, W over ranks in milliseconds, e.g. ``20, 27.8, 7``."""
    means = [sum(v) / len(v) for v in (costs.forward, costs.backward, costs.weight)]
    return ", ".join(f"{1000 * x:.3g}" for x in means)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pictures(settings, runs, rows, out: Path) -> list[Path]:
    """Per schedule, its timeline (measured for ours, simulated for megatron's 1F1B) and that
    of its emulated run (``NAME-emulated``)."""
    written = []
    for row, (name, run) in zip(rows, runs.items()):
        note = f"peak activation {row['peak_activation_vs_1f1b']:.2f} of 1F1B"
        written.append(_picture(settings, name, run, out / name, note))
        if run.emulated is not None:
            note = (f"emulated device, F, B, W = {_ms(settings.emulated_costs())} ms, "
                    f"{row['emulated_vs_simulated']:.2f} of simulated")
            written.append(_picture(settings, name, run.emulated, out / f"{name}-emulated", note))
    return written


def _layout_pictures(settings, layouts, rows, out: Path) -> list[Path]:
    """Per stage layout of the heavy-head case, its emulated run's measured timeline."""
    return [_picture(settings, layout.run.schedule, layout.run,
                     out / f"{layout.run.schedule}-{layout.label}-layout",
                     f"{layout.label} layout {' '.join(map(str, layout.stage_layers))}, head "
                     f"{settings.head_layers:g} layers, {row['emulated_vs_simulated']:.2f} of "
                     "simulated")
            for layout, row in zip(layouts, rows)]


def _picture(settings, name, run, stem: Path, note: str) -> Path:
    from ..schedule import build_schedule, parse_action, simulate
    from ..schedule.model.provenance import Provenance, step
    from ..schedule.model.schedule import Schedule

    template = run.last_schedule or build_schedule(name, settings.ranks, settings.microbatches)
    if run.timeline and all(run.timeline):
        actions = tuple(tuple(parse_action(a) for a, _, _ in rank) for rank in run.timeline)
        schedule = Schedule(name, template.placement, settings.microbatches, actions,
                            template.memory_bound, Provenance((step("measured"),)))
        start = [[s for _, s, _ in rank] for rank in run.timeline]
        end = [[e for _, _, e in rank] for rank in run.timeline]
        what = "measured"
    else:
        result = simulate(template)
        schedule, start, end, what = template, result.start, result.end, "simulated"
    title = f"{name} ({what}), p={settings.ranks} m={settings.microbatches}, {note}"
    return _draw(schedule, start, end, stem, title)


def _draw(schedule, start, end, stem: Path, title: str) -> Path:
    """PNG with matplotlib, else SVG."""
    from ..schedule.io.render_image import render_png, render_svg

    try:
        render_png(schedule, start, end, str(stem.with_suffix(".png")), title)
        return stem.with_suffix(".png")
    except RuntimeError:  # no matplotlib
        stem.with_suffix(".svg").write_text(render_svg(schedule, start, end, title))
        return stem.with_suffix(".svg")
