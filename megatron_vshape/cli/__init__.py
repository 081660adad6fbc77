"""The ``vshape`` command. The CLI package is the only code that prints.

Each module registers its own subcommands (``register(subparsers)``, each parser carrying its
``handler``): ``demo`` (the main job: a tiny GPT on CPU under every schedule), ``schedules``
(simulate, render, export, compare, search, frontier), ``plan`` (the planner), ``profile``
(measured costs for ``plan --profile``), ``experiments`` (grid, collect), ``gpu-check``
(every schedule and the planner checked on one device in one call), ``features`` (the
Megatron-LM settings accepted, refused, and how each is proven). ``ui`` gives them their
help pages (a description and examples) and progress output.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from .. import __version__
from ..schedule import ScheduleError
from . import demo, experiments, features, gpu_check, plan, profile, schedules, trial

__all__ = ["main", "build_parser"]

_MODULES = (demo, schedules, plan, profile, experiments, gpu_check, features, trial)
_OUTPUTS = ("output", "output_dir", "csv", "plot")
"""The arguments, in any subcommand, that name a file or folder it writes."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vshape", description="memory-controllable V-shape pipeline schedules for megatron-core")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Exit status 2, with one ``vshape: error: ...`` line on standard
    error, for anything the user can fix: a bad flag value, or an output path that cannot be
    written (checked before the work where it can be, else when the write fails)."""
    args = build_parser().parse_args(argv)
    try:
        _check_outputs(args)
        return args.handler(args)
    except (ScheduleError, ValueError) as err:
        print(f"vshape: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vshape ... | head` stopped reading: nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1
    except OSError as err:
        if err.filename is None:  # not about a path: not ours to word
            raise
        print(f"vshape: error: {_path_error(args, err)}", file=sys.stderr)
        return 2


def _outputs(args) -> list[Path]:
    return [Path(v) for v in (getattr(args, name, None) for name in _OUTPUTS) if v]


def _check_outputs(args) -> None:
    """Fail before the work (``plan`` may run for minutes) where an output cannot be written:
    the path is under a file, or its nearest existing folder is not writable. A missing parent
    folder is left to the subcommand (some create theirs)."""
    for path in _outputs(args):
        existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
        if existing != path and not existing.is_dir():
            raise OSError(errno.ENOTDIR, f"{existing} is a file, not a folder", str(path))
        if not os.access(existing, os.W_OK):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def _path_error(args, err: OSError) -> str:
    """``cannot write PATH: REASON`` when PATH is (under) one of the outputs, else
    ``PATH: REASON``."""
    reason = err.strerror or str(err)
    path = Path(err.filename)
    writes = any(path == out or out in path.parents for out in _outputs(args))
    return f"{'cannot write ' if writes else ''}{err.filename}: {reason}"
