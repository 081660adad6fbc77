"""How large a schedule the tools take: at most ``MAX_RANKS`` ranks and ``MAX_SIZE`` ranks x
microbatches.

Every pass (6 x p x m of them in a V) is built, searched, validated and simulated one at a
time, and the search's constructions grow faster than that in p. Measured (``vshape search``,
default costs and limit, on this project's CI-class CPU, one core of a shared machine): p = 8
m = 2048, 16 x 1024, 32 x 512, 64 x 256 and 128 x 128 each 35-60 s, p = 2 m = 8192 20 s;
beyond, p = 256 m = 16 70 s, 16 x 4096 83 s, 8 x 8192 100 s, 128 x 512 160 s, 512 x 8 over
2 minutes, and p = 100000 m = 8 never answered. Fixed orders are no escape: ``simulate
--schedule 1f1b -p 20000 -m 8`` ran past a minute. Real pipelines are far inside: megatron's
largest published pipelines have 16 to 64 ranks, a step rarely more than a few hundred
microbatches. The library's own functions take any size (training builds its schedule once);
the commands a person waits on check it first (cli/schedules.py, plan/candidates.py).
"""
from __future__ import annotations

from .actions import ScheduleError

__all__ = ["MAX_RANKS", "MAX_SIZE", "check_size", "too_large"]

MAX_RANKS = 128
MAX_SIZE = 16_384


def too_large(ranks: int, microbatches: int) -> bool:
    """Beyond what a search answers in about a minute (module doc)."""
    return ranks > MAX_RANKS or ranks * microbatches > MAX_SIZE


def check_size(ranks: int, microbatches: int, ranks_flag: str = "--ranks",
               microbatches_flag: str = "--microbatches") -> None:
    """A ScheduleError naming the flags, the bounds and why, for a schedule of fewer than two
    ranks, no microbatch, or more than the bounds."""
    if ranks < 2:
        raise ScheduleError(f"{ranks_flag} must be >= 2, got {ranks}: with one rank there is no "
                            "pipeline")
    if microbatches < 1:
        raise ScheduleError(f"{microbatches_flag} must be >= 1, got {microbatches}")
    if too_large(ranks, microbatches):
        raise ScheduleError(
            f"{ranks_flag} {ranks} {microbatches_flag} {microbatches} is too large: at most "
            f"{ranks_flag} {MAX_RANKS} and {ranks_flag} x {microbatches_flag} {MAX_SIZE:,} (here "
            f"{ranks * microbatches:,}), where a search still answers in about a minute; every "
            f"pass (6 x ranks x microbatches) is built, searched and simulated one at a time, "
            f"and p = 512, m = 8 already takes minutes")
