"""The cool-down re-scheduled critical path first (rewrite/critical_path_cooldown.py) as a last step
of the search and of the named levels: the fastest of the lines tried, kept only where it beats the
order it starts from (where the tail's W passes and forwards compete for memory the rule loses:
v-zb, small p).

Which lines: at 1F1B's memory (p units, v-zb's) only ``own``. The ``first`` and ``middle``
lines never beat such an order over 108 named builds (p 4-16, m 4p-8p, three cost ratios,
both memory models): it holds p units, so its last chunk-0 forwards come early and its tails
are long, and there three lines cost 36 ms at p = 16, m = 64 against 12 for one. Below that,
all three: each wins somewhere.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

from ..rewrite.critical_path_cooldown import LINES, critical_tails
from ..model.actions import ScheduleError
from ..model.problem import Problem
from ..model.provenance import CRITICAL_TAIL, Step, step
from ..model.schedule import Schedule
from ..model.simulate import makespan_of

__all__ = ["STEP", "tail_lines", "faster_tail", "with_faster_tail", "tail_step"]

STEP = CRITICAL_TAIL
"""The step's name in a provenance (model/provenance.py; ``again`` marks a second one)."""
_EPS = 1e-9


def tail_lines(ranks: int, limit: float) -> tuple[str, ...]:
    """The lines tried under ``limit`` units (module doc)."""
    return ("own",) if limit >= ranks - _EPS else LINES


def faster_tail(problem: Problem, schedule: Schedule, makespan: float
                ) -> tuple[float, tuple, str] | None:
    """(makespan, orders, line) of the fastest of ``schedule``'s critical tails from the lines
    the problem's limit tries (``tail_lines``), within that limit, or None where none runs or
    none beats ``makespan`` (the schedule's own, which the caller has)."""
    lines = tail_lines(problem.ranks, problem.limit)
    try:
        tails = critical_tails(problem, schedule.rank_actions, lines)
    except ScheduleError:
        return None
    best = None
    for line, orders in tails.items():  # in LINES' order: ties keep the earlier
        took = makespan_of(schedule.with_actions(orders), problem.costs)
        if took < (makespan if best is None else best[0]) - _EPS:
            best = (took, orders, line)
    return best


def with_faster_tail(problem: Problem, schedule: Schedule, makespan: float,
                     provenance: tuple[Step, ...]) -> tuple[tuple, tuple] | None:
    """(orders, provenance) of ``schedule`` with its fastest critical tail (``faster_tail``),
    the step added to ``provenance`` (``tail_step``), or None where none beats ``makespan``."""
    tail = faster_tail(problem, schedule, makespan)
    if tail is None:
        return None
    return tail[1], provenance + (tail_step(provenance, tail[2]),)


def tail_step(provenance: tuple[Step, ...], line: str) -> Step:
    """The step with its line, ``again`` where ``provenance`` has it already."""
    return step(STEP, line=line, again=any(done.name == STEP for done in provenance))
