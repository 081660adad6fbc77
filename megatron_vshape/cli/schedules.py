"""``vshape simulate | render | export | compare | search | frontier``: schedules on their own.

Output contracts (other tools rely on them): ``simulate --json`` and ``search --json`` print one
JSON object; ``compare --json`` and ``frontier --json`` one JSON object per line.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from ..schedule import (SCHEDULES, VARIANTS, Schedule, ScheduleError, SimResult, build_schedule,
                        parse_costs, parse_memory_model, simulate, validate)
from ..schedule.model.costs import Costs
from ..schedule.model.placement import Placement
from ..schedule.model.size import MAX_RANKS, MAX_SIZE
from ..schedule.model.size import check_size as check_schedule_size
from ..schedule.model.stage_costs import STAGE_COSTS_FORM, parse_stage_costs
from ..schedule.names import AUTO, MEGATRON_OWN_SCHEDULES, MEMORY_LEVELS, REFERENCE, schedule_info
from ..schedule.search.bounds import makespan_floor
from ..schedule.model.limits import MemoryLimit, parse_bytes
from ..schedule.search import frontier, search
from ..schedule.io.render_image import render_png, render_svg
from ..schedule.io.render_text import render_grid
from ..schedule.io.torch_csv import to_torch_csv
from .ui import add_progress_argument, progress, subcommand, working

__all__ = ["register", "add_schedule_arguments", "schedule_costs", "memory_limit", "describe",
           "check_size"]

def add_schedule_arguments(parser: argparse.ArgumentParser, schedule: bool = True) -> None:
    if schedule:
        parser.add_argument("--schedule", required=True, choices=SCHEDULES, help="schedule name")
    parser.add_argument("--ranks", "-p", type=int, required=True,
                        help=f"pipeline ranks (2 to {MAX_RANKS})")
    parser.add_argument("--microbatches", "-m", type=int, required=True,
                        help=f"microbatches (>= 1; ranks x microbatches <= {MAX_SIZE})")
    costs = parser.add_mutually_exclusive_group()
    costs.add_argument("--costs", default="1,1,1,0",
                       help="F,B,W[,COMM]: pass times of one rank's whole layer share (each "
                            "chunk takes its share), and one pipeline hop: finite numbers, "
                            "F, B, W > 0, COMM >= 0 (default 1,1,1,0)")
    costs.add_argument("--stage-costs", metavar="SPEC",
                       help="instead of --costs, pass times per global stage, where a rank's "
                            "chunks differ (rank 0's chunk 1 holds the LM head and loss): "
                            + STAGE_COSTS_FORM.replace("%", "%%"))
    parser.add_argument("--memory-model", default="1,0,-1",
                        help="F,B,W: activation memory each pass adds, in chunk-activations "
                             "(default 1,0,-1: W frees all; measured H100 e.g. 1,-0.75,-0.25: "
                             "B frees 3/4); schedules are built, checked and timed under it")
    parser.add_argument("--variant", choices=VARIANTS, default="fastest",
                        help="fastest: zb-1p, v-min, v-half, v-zb are the fastest orders found "
                             "within their memory bound for --costs; paper: the paper's fixed "
                             "orders (default fastest)")
    parser.add_argument("--memory-limit",
                        help="peak activation memory: a fraction of 1F1B's (0.5), or bytes with a "
                             "unit (40GiB) together with --activation-bytes; auto searches under "
                             "it, other schedules are checked against it")
    parser.add_argument("--activation-bytes",
                        help="bytes of one microbatch's activations of one rank's layer share "
                             "(e.g. 1.5GiB), for a --memory-limit in bytes")


def check_size(args) -> None:
    """Before any work: the schedule's size (``schedule/model/size.py``: at least a pipeline,
    no larger than the commands answer in about a minute)."""
    check_schedule_size(args.ranks, args.microbatches)


def _sized(handler):
    """``handler`` after :func:`check_size`."""
    @functools.wraps(handler)
    def checked(args) -> int:
        check_size(args)
        return handler(args)
    return checked


def schedule_costs(name: str, args) -> Costs:
    """The costs for schedule ``name``: ``--stage-costs`` for its placement's stages, else
    ``--costs`` per rank."""
    if getattr(args, "stage_costs", None) is None:
        return parse_costs(args.costs, args.ranks)
    return parse_stage_costs(args.stage_costs, Placement(args.ranks, schedule_info(name).layout))


def _costs_label(args) -> str:
    if getattr(args, "stage_costs", None) is None:
        return f"costs F,B,W,COMM={args.costs}"
    return f"stage costs {args.stage_costs}"


def _matching(names, args) -> list[str]:
    """The schedules of ``names`` that ``--stage-costs`` has the stage count for (all without
    it); a note on standard error for the others, the error when none fits."""
    if getattr(args, "stage_costs", None) is None:
        return list(names)
    fits, error = [], None
    for name in names:
        try:
            schedule_costs(name, args)
            fits.append(name)
        except ScheduleError as err:
            error = err
    if not fits:
        raise error
    if len(fits) < len(names):
        print(f"--stage-costs: skipping {', '.join(n for n in names if n not in fits)} (another "
              f"number of stages)", file=sys.stderr)
    return fits


def memory_limit(args) -> float | None:
    """The memory limit in units, or None when none was given."""
    if args.memory_limit is None:
        if args.activation_bytes is not None:
            raise ScheduleError("--activation-bytes only makes sense with a --memory-limit in bytes")
        return None
    limit = MemoryLimit.parse(args.memory_limit, "--memory-limit")
    if limit.needs_activation_bytes and args.activation_bytes is None:
        raise ScheduleError(f"--memory-limit {args.memory_limit} is in bytes: give --activation-bytes too")
    activation = (parse_bytes(args.activation_bytes, "--activation-bytes")
                  if limit.needs_activation_bytes else None)
    return limit.units(args.ranks, args.microbatches, activation)


def register(sub) -> None:
    """Add this module's subcommands to the ``vshape`` parser."""
    sim = subcommand(
        sub, "simulate", help="simulate one schedule",
        description="Build one schedule for P ranks and M microbatches, check it, and simulate "
                    "it with the given pass costs: time (makespan, bubble rate) and peak "
                    "activation memory per rank, in units of one microbatch's activations of "
                    "one rank's layer share (1F1B peaks at P of them). Exit status 1 when the "
                    "schedule breaks its memory bound or --memory-limit.",
        examples=["vshape simulate --schedule v-half --ranks 4 --microbatches 8",
                  "vshape simulate --schedule auto -p 8 -m 32 --costs 1,1.2,0.8,0.1 "
                  "--memory-limit 0.5 --json"])
    add_schedule_arguments(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    _add_verbose(sim)
    sim.set_defaults(handler=_sized(_simulate))
    ren = subcommand(
        sub, "render", help="draw a schedule's timeline",
        description="Draw one schedule's simulated timeline, one row per rank: text (.txt), "
                    "SVG, or PNG (needs matplotlib: pip install -e '.[plot]').",
        examples=["vshape render --schedule v-half --ranks 4 --microbatches 8 -o v-half.txt",
                  "vshape render --schedule auto -p 8 -m 32 --memory-limit 0.5 -o auto.png"])
    add_schedule_arguments(ren)
    ren.add_argument("--output", "-o", required=True, help="FILE.txt, FILE.svg or FILE.png")
    ren.set_defaults(handler=_sized(_render))
    exp = subcommand(
        sub, "export", help="write a schedule as torch.distributed.pipelining CSV",
        description="Write one schedule in the CSV format torch.distributed.pipelining's "
                    "_PipelineScheduleRuntime loads (one row per rank, one action per column), "
                    "to run it without megatron-core.",
        examples=["vshape export --schedule v-min --ranks 2 --microbatches 2 --format torch-csv",
                  "vshape export --schedule v-zb -p 4 -m 16 -o v-zb.csv"])
    add_schedule_arguments(exp)
    exp.add_argument("--format", choices=["torch-csv"], default="torch-csv")
    exp.add_argument("--output", "-o", help="file (default: standard output)")
    exp.set_defaults(handler=_sized(_export))
    cmp_ = subcommand(
        sub, "compare", help="memory, bubble and makespan of every schedule",
        description="Simulate every schedule (%s) for the same ranks, microbatches and costs, "
                    "and print one row each: peak activation memory, as a ratio of 1F1B's, "
                    "bubble rate and makespan." % ", ".join(SCHEDULES),
        examples=["vshape compare --ranks 8 --microbatches 32",
                  "vshape compare -p 4 -m 16 --costs 1,1.2,0.8,0.1 --plot compare.png"])
    add_schedule_arguments(cmp_, schedule=False)
    cmp_.add_argument("--json", action="store_true", help="one JSON object per schedule")
    cmp_.add_argument("--plot", metavar="FILE.png",
                      help="also draw peak memory and bubble rate of every schedule as bars "
                           "(needs matplotlib)")
    add_progress_argument(cmp_)
    cmp_.set_defaults(handler=_sized(_compare))
    sea = subcommand(
        sub, "search", help="the fastest V schedule under a memory limit (auto)",
        description="Search the fastest V-shape schedule whose peak activation memory stays "
                    "under --memory-limit (default: 1F1B's), for the given pass costs; prints "
                    "the schedule found (as simulate does), how many candidates were tried, "
                    "and makespan_floor, a lower bound for any schedule under the same limit.",
        examples=["vshape search --ranks 8 --microbatches 32 --costs 1,1.2,0.8,0.1 "
                  "--memory-limit 0.5",
                  "vshape search -p 8 -m 32 --memory-limit 40GiB --activation-bytes 6GiB",
                  "vshape search -p 2 -m 16 --stage-costs 1,1.4,0.4/1,1.4,0.4/1,1.4,0.4/3,3.5,0.4"])
    add_schedule_arguments(sea, schedule=False)
    sea.add_argument("--json", action="store_true", help="print one JSON object")
    _add_verbose(sea)
    add_progress_argument(sea)
    sea.set_defaults(handler=_sized(_search))
    fro = subcommand(
        sub, "frontier", help="Pareto frontier of peak memory vs bubble rate",
        description="Search the fastest V-shape schedule at memory limits from V-Min's to "
                    "1F1B's and keep the Pareto frontier: each row is the least bubble reached "
                    "with at most that much memory. Takes seconds (a search per limit).",
        examples=["vshape frontier --ranks 8 --microbatches 32",
                  "vshape frontier -p 8 -m 32 --output frontier.png"])
    add_schedule_arguments(fro, schedule=False)
    fro.add_argument("--json", action="store_true", help="one JSON object per frontier point")
    fro.add_argument("--output", "-o", help="plot the frontier to FILE.png (needs matplotlib)")
    _add_verbose(fro)
    add_progress_argument(fro)
    fro.set_defaults(handler=_sized(_frontier))


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also print how each schedule was built (details: the building "
                             "block, offsets and passes applied, in the paper's words)")


def describe(schedule: Schedule, result: SimResult | None = None, variant: str = "fastest") -> str:
    """A schedule in a user's words: what it is, its model chunks per rank and, with its
    simulation, its memory relative to 1F1B's and its bubble. ``schedule.description`` (how it
    was built) is the technical detail, shown under ``--verbose``."""
    what = schedule_info(schedule.name).what
    if variant == "paper" and schedule.name in MEMORY_LEVELS:
        what += ", the paper's order"
    chunks = schedule.placement.chunks
    words = [what, f"{chunks} model chunk{'s' if chunks > 1 else ''} per rank"]
    if result is not None:
        words += [f"peak activation memory {result.peak_memory_vs_1f1b:.2f} x 1F1B's",
                  f"bubble {result.bubble_rate:.1%}"]
    return "; ".join(words)


def _warn_few_microbatches(args, bubble: float | None = None) -> None:
    """``m < p``: legal, but the pipeline never fills, so say so once (on standard error)."""
    if args.microbatches >= args.ranks:
        return
    share = f" ({bubble:.0%} of the step here)" if bubble is not None else ""
    print(f"vshape: warning: {args.microbatches} microbatches < {args.ranks} ranks: the "
          f"pipeline never fills and the bubble dominates{share}; use --microbatches "
          f"{args.ranks} or more, better {4 * args.ranks} or more (4 x ranks) for a small "
          f"bubble (a larger global batch or a smaller micro batch gives more)", file=sys.stderr)


def _report(name: str, args) -> tuple:
    ranks, microbatches = args.ranks, args.microbatches
    costs = schedule_costs(name, args)
    memory = parse_memory_model(args.memory_model)
    limit = memory_limit(args)
    schedule = build_schedule(name, ranks, microbatches, costs=costs, memory_limit=limit,
                              memory=memory, variant=args.variant)
    try:
        validate(schedule, memory_limit=schedule.memory_bound if limit is None else limit,
                 memory=memory)
        valid = True
    except ScheduleError:
        valid = False
    result = simulate(schedule, costs, memory)
    record = {
        "schedule": name, "ranks": ranks, "microbatches": microbatches, "costs": costs.as_list(),
        "makespan": round(result.makespan, 6), "bubble_rate": round(result.bubble_rate, 6),
        "bubble_rate_span": round(result.bubble_rate_span, 6),
        "peak_memory": [round(x, 6) for x in result.peak_memory],
        "peak_memory_max": round(result.peak_memory_max, 6),
        "peak_memory_vs_1f1b": round(result.peak_memory_vs_1f1b, 6),
        "memory_bound": schedule.memory_bound, "memory_limit": limit, "valid": valid,
        "description": describe(schedule, result, args.variant),
    }
    if getattr(args, "verbose", False):
        record["details"] = schedule.description
    return schedule, result, record


def _print_record(record: dict, as_json: bool) -> None:
    """One JSON object, or one aligned ``key  value`` line per field."""
    if as_json:
        print(json.dumps(record))
        return
    width = max(len(k) for k in record)
    for key, value in record.items():
        print(f"{key:<{width}}  {value}")


def _simulate(args) -> int:
    _, _, record = _report(args.schedule, args)
    _warn_few_microbatches(args, record["bubble_rate"])
    _print_record(record, args.json)
    return 0 if record["valid"] else 1


def _render(args) -> int:
    schedule, result, record = _report(args.schedule, args)
    _warn_few_microbatches(args, record["bubble_rate"])
    path = Path(args.output)
    title = (f"{args.schedule}  p={args.ranks} m={args.microbatches}  bubble {record['bubble_rate']:.3f}"
             f"  peak {record['peak_memory_max']:g} units")
    if path.suffix == ".txt":
        path.write_text(title + "\n" + render_grid(schedule, result.start, result.end) + "\n")
    elif path.suffix == ".svg":
        path.write_text(render_svg(schedule, result.start, result.end, title))
    elif path.suffix == ".png":
        render_png(schedule, result.start, result.end, str(path), title)
    else:
        raise ScheduleError(f"--output must end in .txt, .svg or .png, got {path.name!r}")
    print(f"wrote {path}")
    return 0


def _export(args) -> int:
    schedule = build_schedule(args.schedule, args.ranks, args.microbatches,
                              costs=schedule_costs(args.schedule, args),
                              memory_limit=memory_limit(args),
                              memory=parse_memory_model(args.memory_model), variant=args.variant)
    text = to_torch_csv(schedule)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _compare(args) -> int:
    if args.plot and not args.plot.endswith(".png"):
        raise ScheduleError(f"--plot must end in .png, got {args.plot!r}")
    _warn_few_microbatches(args)
    names = _matching(SCHEDULES, args)
    records = [_report(n, args)[2]
               for n in progress(names, args, desc="simulating", unit="schedule")]
    if args.plot:
        _plot_compare(args, records)
    if args.json:
        for record in records:
            print(json.dumps(record))
        if args.plot:
            print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    print(f"p={args.ranks} m={args.microbatches} {_costs_label(args)}   "
          "(memory in units of one microbatch's activations of one rank's layer share)")
    head = f"{'schedule':<18}{'peak mem':>9}{'vs 1F1B':>9}{'bubble':>9}{'bubble/span':>13}{'makespan':>10}{'valid':>7}"
    print(head)
    print("-" * len(head))
    for r in records:
        print(f"{r['schedule']:<18}{r['peak_memory_max']:>9g}{r['peak_memory_vs_1f1b']:>9.3f}"
              f"{r['bubble_rate']:>9.3f}{r['bubble_rate_span']:>13.3f}{r['makespan']:>10g}{str(r['valid']):>7}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _plot_compare(args, records: list[dict]) -> None:
    """Two bar panels, one bar per schedule: peak activation memory as a ratio of 1F1B's, and
    bubble rate (matplotlib, imported here: the ``[plot]`` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScheduleError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    names = [r["schedule"] for r in records]
    fig, (mem, bub) = plt.subplots(1, 2, figsize=(9, 0.4 * len(names) + 1.6), sharey=True)
    try:
        for ax, key, label in ((mem, "peak_memory_vs_1f1b", "peak activation memory / 1F1B's"),
                               (bub, "bubble_rate", "bubble rate")):
            values = [r[key] for r in records]
            ax.barh(names, values, color=["tab:grey" if n in MEGATRON_OWN_SCHEDULES
                                          else "tab:blue" for n in names])
            for y, value in enumerate(values):
                ax.text(value, y, f" {value:.2f}", va="center", fontsize=8)
            ax.set_xlabel(label)
            ax.set_xlim(0, max(values + [1e-9]) * 1.2)
        mem.invert_yaxis()
        fig.suptitle(f"p={args.ranks} m={args.microbatches} {_costs_label(args)}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    finally:
        plt.close(fig)


def _search(args) -> int:
    costs = schedule_costs(AUTO, args)
    _warn_few_microbatches(args)
    with working(args, "searching"):
        found = search(args.ranks, args.microbatches, costs, memory_limit(args),
                       parse_memory_model(args.memory_model))
        _, _, record = _report(AUTO, args)
    record["search_seconds"] = round(found.seconds, 4)
    record["candidates"] = found.candidates
    limit = found.schedule.memory_bound  # the limit searched under, in units
    record["makespan_floor"] = round(
        makespan_floor(found.schedule.placement, args.microbatches, costs, limit), 6)
    _print_record(record, args.json)
    return 0


def _frontier(args) -> int:
    costs = schedule_costs(AUTO, args)
    _warn_few_microbatches(args)
    with working(args, "searching the frontier"):
        points = frontier(args.ranks, args.microbatches, costs,
                          parse_memory_model(args.memory_model))
    rows = [{
        "peak_memory_max": round(f.result.peak_memory_max, 6),
        "peak_memory_vs_1f1b": round(f.result.peak_memory_vs_1f1b, 6),
        "bubble_rate": round(f.result.bubble_rate, 6), "makespan": round(f.result.makespan, 6),
        "description": describe(f.schedule),
        **({"details": f.schedule.description} if args.verbose else {}),
    } for f in points]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"p={args.ranks} m={args.microbatches} {_costs_label(args)}")
        print(f"{'peak mem':>9}{'vs 1F1B':>9}{'bubble':>9}  schedule")
        for row in rows:
            print(f"{row['peak_memory_max']:>9g}{row['peak_memory_vs_1f1b']:>9.3f}{row['bubble_rate']:>9.3f}  "
                  f"{row['description']}")
            if args.verbose:
                print(f"{'':>29}{row['details']}")
    if args.output:
        _plot_frontier(args, rows)
        print(f"wrote {args.output}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _plot_frontier(args, rows) -> None:
    from ..schedule.io.render_image import plot_frontier

    fixed = []
    for name in _matching((REFERENCE,) + MEMORY_LEVELS, args):
        costs = schedule_costs(name, args)
        memory = parse_memory_model(args.memory_model)
        schedule = build_schedule(name, args.ranks, args.microbatches, costs, memory=memory,
                                  variant=args.variant)
        result = simulate(schedule, costs, memory)
        fixed.append((name, result.peak_memory_vs_1f1b, result.bubble_rate))
    if not str(args.output).endswith(".png"):
        raise ScheduleError(f"--output must end in .png, got {args.output!r}")
    title = f"p={args.ranks} m={args.microbatches} {_costs_label(args)}"
    plot_frontier([(r["peak_memory_vs_1f1b"], r["bubble_rate"]) for r in rows], fixed, args.output, title)
