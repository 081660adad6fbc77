"""The ``vshape`` command: simulate, render, export and compare pipeline schedules.

The only module that prints. Output contracts (other tools rely on them): ``simulate --json``
prints one JSON object; ``compare --json`` one JSON object per line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .schedule import (SCHEDULES, ScheduleError, build_schedule, parse_costs, simulate, validate)
from .schedule.render_image import render_png, render_svg
from .schedule.render_text import render_grid
from .schedule.torch_csv import to_torch_csv

__all__ = ["main", "build_parser"]


def _add_common(parser: argparse.ArgumentParser, schedule: bool = True) -> None:
    if schedule:
        parser.add_argument("--schedule", required=True, choices=SCHEDULES, help="schedule name")
    parser.add_argument("--ranks", "-p", type=int, required=True, help="pipeline ranks (>= 2)")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches (>= 1)")
    parser.add_argument("--costs", default="1,1,1,0",
                        help="F,B,W[,COMM]: pass times of one rank's whole layer share, and one "
                             "pipeline hop (default 1,1,1,0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vshape", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="simulate one schedule")
    _add_common(sim)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    ren = sub.add_parser("render", help="draw a schedule's timeline")
    _add_common(ren)
    ren.add_argument("--output", "-o", required=True, help="FILE.txt, FILE.svg or FILE.png")
    exp = sub.add_parser("export", help="write a schedule as torch.distributed.pipelining CSV")
    _add_common(exp)
    exp.add_argument("--format", choices=["torch-csv"], default="torch-csv")
    exp.add_argument("--output", "-o", help="file (default: standard output)")
    cmp_ = sub.add_parser("compare", help="memory, bubble and makespan of every schedule")
    _add_common(cmp_, schedule=False)
    cmp_.add_argument("--json", action="store_true", help="one JSON object per schedule")
    return parser


def _report(name: str, ranks: int, microbatches: int, costs_text: str) -> tuple:
    costs = parse_costs(costs_text, ranks)
    schedule = build_schedule(name, ranks, microbatches)
    try:
        validate(schedule, memory_limit=schedule.memory_bound)
        valid = True
    except ScheduleError:
        valid = False
    result = simulate(schedule, costs)
    record = {
        "schedule": name, "ranks": ranks, "microbatches": microbatches, "costs": costs.as_list(),
        "makespan": round(result.makespan, 6), "bubble_rate": round(result.bubble_rate, 6),
        "bubble_rate_span": round(result.bubble_rate_span, 6),
        "peak_memory": [round(x, 6) for x in result.peak_memory],
        "peak_memory_max": round(result.peak_memory_max, 6),
        "peak_memory_vs_1f1b": round(result.peak_memory_vs_1f1b, 6),
        "memory_bound": schedule.memory_bound, "valid": valid,
    }
    return schedule, result, record


def _simulate(args) -> int:
    _, _, record = _report(args.schedule, args.ranks, args.microbatches, args.costs)
    if args.json:
        print(json.dumps(record))
    else:
        width = max(len(k) for k in record)
        for key, value in record.items():
            print(f"{key:<{width}}  {value}")
    return 0 if record["valid"] else 1


def _render(args) -> int:
    schedule, result, record = _report(args.schedule, args.ranks, args.microbatches, args.costs)
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
    text = to_torch_csv(build_schedule(args.schedule, args.ranks, args.microbatches))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def _compare(args) -> int:
    records = [_report(n, args.ranks, args.microbatches, args.costs)[2] for n in SCHEDULES]
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"simulate": _simulate, "render": _render, "export": _export, "compare": _compare}
    try:
        return handler[args.command](args)
    except ScheduleError as err:
        print(f"vshape: error: {err}", file=sys.stderr)
        return 2
