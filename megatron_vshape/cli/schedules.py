"""``vshape simulate | render | export | compare | search | frontier``: schedules on their own.

Output contracts (other tools rely on them): ``simulate --json`` and ``search --json`` print one
JSON object; ``compare --json`` and ``frontier --json`` one JSON object per line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..schedule import (SCHEDULES, VARIANTS, ScheduleError, build_schedule, parse_costs,
                        parse_memory_model, simulate, validate)
from ..schedule.search.bounds import makespan_floor
from ..schedule.model.limits import MemoryLimit, parse_bytes
from ..schedule.search import frontier, search
from ..schedule.io.render_image import render_png, render_svg
from ..schedule.io.render_text import render_grid
from ..schedule.io.torch_csv import to_torch_csv

__all__ = ["register", "add_schedule_arguments", "memory_limit"]


def add_schedule_arguments(parser: argparse.ArgumentParser, schedule: bool = True) -> None:
    if schedule:
        parser.add_argument("--schedule", required=True, choices=SCHEDULES, help="schedule name")
    parser.add_argument("--ranks", "-p", type=int, required=True, help="pipeline ranks (>= 2)")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches (>= 1)")
    parser.add_argument("--costs", default="1,1,1,0",
                        help="F,B,W[,COMM]: pass times of one rank's whole layer share, and one "
                             "pipeline hop (default 1,1,1,0)")
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
    sim = sub.add_parser("simulate", help="simulate one schedule")
    add_schedule_arguments(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(handler=_simulate)
    ren = sub.add_parser("render", help="draw a schedule's timeline")
    add_schedule_arguments(ren)
    ren.add_argument("--output", "-o", required=True, help="FILE.txt, FILE.svg or FILE.png")
    ren.set_defaults(handler=_render)
    exp = sub.add_parser("export", help="write a schedule as torch.distributed.pipelining CSV")
    add_schedule_arguments(exp)
    exp.add_argument("--format", choices=["torch-csv"], default="torch-csv")
    exp.add_argument("--output", "-o", help="file (default: standard output)")
    exp.set_defaults(handler=_export)
    cmp_ = sub.add_parser("compare", help="memory, bubble and makespan of every schedule")
    add_schedule_arguments(cmp_, schedule=False)
    cmp_.add_argument("--json", action="store_true", help="one JSON object per schedule")
    cmp_.set_defaults(handler=_compare)
    sea = sub.add_parser("search", help="the fastest V schedule under a memory limit (auto)")
    add_schedule_arguments(sea, schedule=False)
    sea.add_argument("--json", action="store_true", help="print one JSON object")
    sea.set_defaults(handler=_search)
    fro = sub.add_parser("frontier", help="Pareto frontier of peak memory vs bubble rate")
    add_schedule_arguments(fro, schedule=False)
    fro.add_argument("--json", action="store_true", help="one JSON object per frontier point")
    fro.add_argument("--output", "-o", help="plot the frontier to FILE.png (needs matplotlib)")
    fro.set_defaults(handler=_frontier)


def _report(name: str, args) -> tuple:
    ranks, microbatches = args.ranks, args.microbatches
    costs = parse_costs(args.costs, ranks)
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
        "description": schedule.description,
    }
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
    _print_record(record, args.json)
    return 0 if record["valid"] else 1


def _render(args) -> int:
    schedule, result, record = _report(args.schedule, args)
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
                              costs=parse_costs(args.costs, args.ranks), memory_limit=memory_limit(args),
                              memory=parse_memory_model(args.memory_model), variant=args.variant)
    text = to_torch_csv(schedule)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _compare(args) -> int:
    records = [_report(n, args)[2] for n in SCHEDULES]
    if args.json:
        for record in records:
            print(json.dumps(record))
        return 0
    print(f"p={args.ranks} m={args.microbatches} costs F,B,W,COMM={args.costs}   "
          "(memory in units of one microbatch's activations of one rank's layer share)")
    head = f"{'schedule':<18}{'peak mem':>9}{'vs 1F1B':>9}{'bubble':>9}{'bubble/span':>13}{'makespan':>10}{'valid':>7}"
    print(head)
    print("-" * len(head))
    for r in records:
        print(f"{r['schedule']:<18}{r['peak_memory_max']:>9g}{r['peak_memory_vs_1f1b']:>9.3f}"
              f"{r['bubble_rate']:>9.3f}{r['bubble_rate_span']:>13.3f}{r['makespan']:>10g}{str(r['valid']):>7}")
    return 0


def _search(args) -> int:
    costs = parse_costs(args.costs, args.ranks)
    found = search(args.ranks, args.microbatches, costs, memory_limit(args),
                   parse_memory_model(args.memory_model))
    _, _, record = _report("auto", args)
    record["search_seconds"] = round(found.seconds, 4)
    record["candidates"] = found.candidates
    limit = found.schedule.memory_bound  # the limit searched under, in units
    record["makespan_floor"] = round(
        makespan_floor(found.schedule.placement, args.microbatches, costs, limit), 6)
    _print_record(record, args.json)
    return 0


def _frontier(args) -> int:
    costs = parse_costs(args.costs, args.ranks)
    points = frontier(args.ranks, args.microbatches, costs, parse_memory_model(args.memory_model))
    rows = [{
        "peak_memory_max": round(f.result.peak_memory_max, 6),
        "peak_memory_vs_1f1b": round(f.result.peak_memory_vs_1f1b, 6),
        "bubble_rate": round(f.result.bubble_rate, 6), "makespan": round(f.result.makespan, 6),
        "description": f.schedule.description,
    } for f in points]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"p={args.ranks} m={args.microbatches} costs F,B,W,COMM={args.costs}")
        print(f"{'peak mem':>9}{'vs 1F1B':>9}{'bubble':>9}  schedule")
        for row in rows:
            print(f"{row['peak_memory_max']:>9g}{row['peak_memory_vs_1f1b']:>9.3f}{row['bubble_rate']:>9.3f}  "
                  f"{row['description']}")
    if args.output:
        _plot_frontier(args, costs, rows)
        print(f"wrote {args.output}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _plot_frontier(args, costs, rows) -> None:
    from ..schedule.io.render_image import plot_frontier

    fixed = []
    for name in ("1f1b", "zb-1p", "v-min", "v-half", "v-zb"):
        memory = parse_memory_model(args.memory_model)
        schedule = build_schedule(name, args.ranks, args.microbatches, costs, memory=memory,
                                  variant=args.variant)
        result = simulate(schedule, costs, memory)
        fixed.append((name, result.peak_memory_vs_1f1b, result.bubble_rate))
    if not str(args.output).endswith(".png"):
        raise ScheduleError(f"--output must end in .png, got {args.output!r}")
    title = f"p={args.ranks} m={args.microbatches} costs {args.costs}"
    plot_frontier([(r["peak_memory_vs_1f1b"], r["bubble_rate"]) for r in rows], fixed, args.output, title)
