"""Schedule names -> schedules. The one place the CLI and the runtime look names up (the
names and their facts: :mod:`.names`)."""
from __future__ import annotations

from .construct.named import paper_schedule
from .model.actions import ScheduleError
from .model.costs import Costs, MemoryModel
from .model.schedule import Schedule
from .search.adaptive import search
from .names import SCHEDULES, schedule_info
from .search.levels import fastest_at_level

__all__ = ["SCHEDULES", "VARIANTS", "build_schedule"]

VARIANTS = ("fastest", "paper")
"""``fastest``: zb-1p, v-min, v-half and v-zb are memory levels, the fastest order found for
the costs within the name's bound (search/levels.py); ``paper``: the paper's fixed order (what
the paper's tables and figures show), for reproduction."""


def _check(name: str, ranks, microbatches, variant: str) -> None:
    schedule_info(name)
    if variant not in VARIANTS:
        raise ScheduleError(f"unknown variant {variant!r}; valid choices: {', '.join(VARIANTS)}")
    if not isinstance(ranks, int) or ranks < 2:
        raise ScheduleError(
            f"ranks must be an integer >= 2, got {ranks!r}: with one rank there is no pipeline"
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")


def build_schedule(name: str, ranks: int, microbatches: int, costs: Costs | None = None,
                   memory_limit: float | None = None, memory: MemoryModel = MemoryModel(),
                   variant: str = "fastest") -> Schedule:
    """Build the named schedule for ``ranks`` pipeline ranks and ``microbatches`` microbatches.

    ``costs`` (default F = B = W, no comm) and ``memory`` (what F, B and W add, in
    chunk-activations) shape ``auto``, which searches for the fastest V schedule under
    ``memory_limit`` units (default 1F1B's peak), and the memory levels zb-1p, v-min, v-half
    and v-zb (``variant="fastest"``; ``"paper"`` gives their fixed orders). 1f1b and
    interleaved-1f1b are fixed orders.
    """
    _check(name, ranks, microbatches, variant)
    info = schedule_info(name)
    if info.memory_limited:
        return search(ranks, microbatches, costs, memory_limit, memory).schedule
    if info.level and variant == "fastest":
        return fastest_at_level(name, ranks, microbatches, costs, memory)
    return paper_schedule(name, ranks, microbatches)
