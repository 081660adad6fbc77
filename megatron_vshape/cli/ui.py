"""What every subcommand shares in front of the user: its help page and its progress output.

``subcommand`` gives a parser a description and examples (``vshape NAME --help`` shows both);
``progress`` and ``working`` draw a tqdm bar or an elapsed-time line on standard error, only
where a person watches (standard error is a terminal) and ``--no-progress`` was not given, so
piped output and logs stay clean.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

__all__ = ["subcommand", "add_progress_argument", "progress", "counting", "working", "DELAY_S",
           "REFRESH_S"]

T = TypeVar("T")

DELAY_S = 1.0
"""Progress shows only once a command has run this long: quick runs print nothing extra."""
REFRESH_S = 0.2
"""How often the elapsed-time line (``working``) is redrawn."""


def subcommand(sub, name: str, help: str, description: str,
               examples: Iterable[str]) -> argparse.ArgumentParser:
    """A subparser whose ``--help`` shows ``description`` (wrapped paragraphs, separated by
    blank lines) and, below the options, ``examples`` (one command line each)."""
    paragraphs = [textwrap.fill(" ".join(p.split()), 90) for p in description.split("\n\n")]
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    return sub.add_parser(name, help=help, description="\n\n".join(paragraphs), epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress output on standard error (it is off anyway when "
                             "standard error is not a terminal)")


def _shown(args) -> bool:
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def progress(items: Iterable[T], args, desc: str, unit: str) -> Iterator[T]:
    """``items``, with a tqdm bar on standard error while they are consumed."""
    if not _shown(args):
        yield from items
        return
    from tqdm import tqdm

    with tqdm(items, desc=desc, unit=unit, file=sys.stderr, delay=DELAY_S, leave=False) as bar:
        yield from bar


@contextmanager
def counting(args, total: int, desc: str, unit: str) -> Iterator[Callable[[], None]]:
    """A tqdm bar of ``total`` steps for work that reports its steps: yields the function to
    call after each one (a library's ``on_point``-style callback)."""
    if not _shown(args):
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=DELAY_S,
              leave=False) as bar:
        yield bar.update


@contextmanager
def working(args, desc: str) -> Iterator[None]:
    """An elapsed-time line on standard error (``desc: 00:03``) for work that reports no steps
    of its own (one library call), cleared when the work ends."""
    if not _shown(args):
        yield
        return
    from tqdm import tqdm

    stop = threading.Event()
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr, delay=DELAY_S,
              leave=False) as bar:
        ticker = threading.Thread(target=_tick, args=(bar, stop), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()


def _tick(bar, stop: threading.Event) -> None:
    while not stop.wait(REFRESH_S):
        bar.update(0)  # redraws the elapsed time; unlike refresh(), it honours ``delay``
