"""The ``vshape`` command. The CLI package is the only code that prints.

Each module registers its own subcommands (``register(subparsers)``, each parser carrying its
``handler``): ``demo`` (the main job: a tiny GPT on CPU under every schedule), ``schedules``
(simulate, render, export, compare, search, frontier), ``plan`` (the planner), ``profile``
(measured costs for ``plan --profile``), ``experiments`` (grid, collect), ``gpu-check``
(every schedule and the planner checked on one device in one call).
"""
from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..schedule import ScheduleError
from . import demo, experiments, gpu_check, plan, profile, schedules

__all__ = ["main", "build_parser"]

_MODULES = (demo, schedules, plan, profile, experiments, gpu_check)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vshape", description="memory-controllable V-shape pipeline schedules for megatron-core")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ScheduleError, ValueError) as err:
        print(f"vshape: error: {err}", file=sys.stderr)
        return 2
