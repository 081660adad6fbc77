"""Schedule names -> schedules. The one place the CLI and the runtime look names up."""
from __future__ import annotations

from .build.named import interleaved_1f1b, paper_schedule
from .model.actions import ScheduleError
from .model.costs import Costs
from .model.schedule import Schedule
from .search.adaptive import search

__all__ = ["SCHEDULES", "build_schedule", "interleaved_1f1b"]

SCHEDULES = ("1f1b", "zb-1p", "interleaved-1f1b", "v-min", "v-half", "v-zb", "auto")
"""Every schedule name; ``auto`` is the adaptive search (search/adaptive.py) under a memory
limit."""


def _check(name: str, ranks, microbatches) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; valid choices: {', '.join(SCHEDULES)}")
    if not isinstance(ranks, int) or ranks < 2:
        raise ScheduleError(
            f"ranks must be an integer >= 2, got {ranks!r}: with one rank there is no pipeline"
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")


def build_schedule(name: str, ranks: int, microbatches: int, costs: Costs | None = None,
                   memory_limit: float | None = None) -> Schedule:
    """Build the named schedule for ``ranks`` pipeline ranks and ``microbatches`` microbatches.

    ``costs`` and ``memory_limit`` (units; default 1F1B's peak) matter only to ``auto``, which
    searches for the fastest V schedule under the limit with those costs; the fixed schedules
    are cost-independent orders (check them against a limit with ``validate``).
    """
    _check(name, ranks, microbatches)
    if name == "auto":
        return search(ranks, microbatches, costs, memory_limit).schedule
    return paper_schedule(name, ranks, microbatches)
