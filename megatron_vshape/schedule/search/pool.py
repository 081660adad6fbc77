"""The candidates of one adaptive search (adaptive.py) and what its steps share.

Every step of the search (constructions.py, improvements.py) adds candidates to one
:class:`Pool`; the pool times each (or takes the timing a replay or the local search made),
keeps it when it fits the limit, and ranks them: the smallest makespan first, then the least
memory, then the order they were built in, so the search's answer is deterministic.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..rewrite.replay import Replay
from ..model.actions import ScheduleError
from ..model.problem import Problem
from ..model.provenance import Step, describe
from ..model.schedule import Schedule
from ..model.simulate import makespan_of, peak_memory
from ..names import AUTO
from .local import Improved
from .settings import Settings

__all__ = ["Candidate", "Pool", "TIMED", "candidate_key", "describe", "fastest_distinct", "fresh"]

_EPS = 1e-9

TIMED = (Replay, Improved)
"""What a builder returns when it timed its orders itself (their makespan is the simulator's:
the same dataflow, rounded to 1e-9 by local.py, as ``candidate_key`` rounds it)."""


@dataclass(frozen=True)
class Candidate:
    """One order the search built, within the limit, with its peak (units) and makespan."""

    provenance: tuple[Step, ...]
    """The steps that made it, first to last (model/provenance.py: data; ``describe`` renders
    them for people)."""
    orders: tuple
    peak: float
    makespan: float
    position: int
    """Where it stands in the pool's list (the order it was built in): the last tie-breaker."""
    replayable: bool = True
    """Whether the replays may start from it (adaptive.py's module doc: not the finished
    constructions)."""

    @property
    def description(self) -> str:
        return describe(self.provenance)


@dataclass
class Pool:
    """The candidates of one search and what its steps share: the problem, the peak of every
    order built (for the error when none fits) and the orders re-laid."""

    problem: Problem
    """The setting and the limit every step keeps to (model/problem.py: ``cap`` and ``full``
    are the limit in chunk-activations)."""
    shapes: bool
    """Whether the re-laid shapes and deferred W passes may be used (adaptive.py's
    ``search``)."""
    settings: Settings
    """The tuning constants every step reads (settings.py)."""
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    smallest: list[tuple[float, tuple[Step, ...]]] = dataclasses.field(default_factory=list)
    """(peak, provenance) of every order built, within the limit or not."""
    skipped: list = dataclasses.field(default_factory=list)
    """(offsets, block) of the family blocks skipped unprobed (constructions.py)."""
    reshaped: set = dataclasses.field(default_factory=set)
    """The orders whose warm-up and cool-down were already re-laid (``fresh``)."""
    peaks: dict = dataclasses.field(default_factory=dict)
    makespans: dict = dataclasses.field(default_factory=dict)
    """Per distinct orders, their peak and makespan (None: they deadlock): different builds
    often give the same orders (a polish that finds nothing, the W deferral of the block and
    of the wave; 4-12 of about 30 candidates per search at p = 16, m = 64), and a timing
    takes 1.3 ms there."""

    def consider(self, provenance: tuple[Step, ...], build: Callable[[], tuple | Replay | Improved],
                 replayable: bool = True) -> None:
        """Builds a candidate and keeps it when it fits the limit and its orders run; a
        construction that cannot be built (ScheduleError) adds nothing. A replay and the local
        search time their orders themselves (``TIMED``): not timed again. Only the winner is
        simulated in full (adaptive.py's ``search_steps``)."""
        try:
            built = build()
        except ScheduleError:
            return
        timed = isinstance(built, TIMED)
        orders = built.orders if timed else built
        peak = self._peak(orders)
        self.smallest.append((peak, provenance))
        if peak > self.problem.limit + _EPS:
            return
        makespan = built.makespan if timed else self._makespan(orders)
        if makespan is None:  # a re-laid warm-up can deadlock across ranks
            return
        self.candidates.append(Candidate(provenance, orders, peak, makespan,
                                         len(self.candidates), replayable))

    def _peak(self, orders) -> float:
        """The peak of ``orders`` in units, once per distinct orders (``peaks``)."""
        if orders not in self.peaks:
            problem = self.problem
            schedule = Schedule(AUTO, problem.placement, problem.microbatches, orders)
            self.peaks[orders] = max(peak_memory(schedule, problem.memory))
        return self.peaks[orders]

    def _makespan(self, orders) -> float | None:
        """The makespan of ``orders`` (None: they deadlock), once per distinct orders
        (``makespans``)."""
        if orders not in self.makespans:
            problem = self.problem
            try:
                self.makespans[orders] = makespan_of(
                    Schedule(AUTO, problem.placement, problem.microbatches, orders),
                    problem.costs)
            except ScheduleError:
                self.makespans[orders] = None
        return self.makespans[orders]

    def fastest(self) -> Candidate:
        """The winner so far (``candidate_key``)."""
        return min(self.candidates, key=candidate_key)


def candidate_key(candidate: Candidate) -> tuple:
    """Rank of a candidate: makespan (rounded, as local.py rounds it), then peak, then the
    order it was built in."""
    return (round(candidate.makespan, 9), candidate.peak, candidate.position)


def fastest_distinct(pool: list[Candidate], count: int) -> list[Candidate]:
    """The ``count`` fastest candidates with distinct orders: the starts of the polishes,
    re-lays, deferrals and gap fills."""
    bases, seen = [], set()
    for candidate in sorted(pool, key=candidate_key):
        if candidate.orders not in seen and len(bases) < count:
            seen.add(candidate.orders)
            bases.append(candidate)
    return bases


def fresh(bases: list[Candidate], reshaped: set, shapes: bool) -> list[Candidate]:
    """The bases whose orders were not re-laid yet (none when ``shapes`` is off); marks them."""
    if not shapes:
        return []
    out = []
    for base in bases:
        if base.orders not in reshaped:
            reshaped.add(base.orders)
            out.append(base)
    return out
