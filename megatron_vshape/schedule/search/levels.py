"""Named schedules as memory levels: the fastest order found at each name's own memory bound.

The paper names a schedule by its building block; a user picks ``v-half`` for half of 1F1B's
activation memory, not for one particular order. So each name stands for a limit::

    v-min    (p + 4) // 3 units      V layout     the adaptive search under that limit
    v-half   (p + 2) // 2 units      V layout     (its candidates include the paper's order,
    v-zb     p units                 V layout      so a name is never slower than the paper's)
    zb-1p    p units                 one chunk    the paper's order and cost-aware greedy orders
                                                  (construct/greedy.py); the fastest kept

The search re-schedules its answer's cool-down critical path first (search/critical_path_step.py),
kept where that is faster (at p = 16 it is: v-min at m = 64 and the H100 costs 615.36 -> 612.75).
Nothing else is tried around it: the paper's order, and under a model that frees at B the name
where B frees nothing, used to be "also tried", and over the search's referee
(scripts/bench/search_referee.py: 752 cases, 606 named builds) neither was ever faster than the
level's search, which has the paper's order among its candidates and, under such a model, the
answer where B frees nothing as its first (adaptive.py's ``ALSO_TRY``).

Levels are in units of one microbatch's activations of a rank's layer share, under the
default memory model; under another model (B freeing part of a chunk) the same number of units
is the limit, so a model that frees more can only make a name faster: a V name's search tries
the default model's answer first (adaptive.py's ``ALSO_TRY``), and zb-1p's starts include its
order where B frees nothing (``_fastest_zb``). With F = B = W and no
comm the paper's memory table holds exactly (every peak within the name's bound) and the
bubbles are at most the paper's (p = 8, m = 32: v-min 0.107 against the paper order's 0.123).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..construct.compose import compose, repeat
from ..construct.greedy import greedy_schedule
from ..construct.named import FAMILIES, paper_schedule
from ..construct.slot_reorder import slot_reorder
from ..model.actions import ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.problem import Problem
from ..model.provenance import Chosen, Provenance, Step, step
from ..model.schedule import Schedule
from ..model.placement import Layout
from ..names import MEMORY_LEVELS, schedule_info
from ..model.simulate import makespan_of, peak_memory
from .adaptive import clear_cache as clear_search_cache, search
from .freeing_at_b import freeing_nothing_at_b
from .gc_pause import collector_paused
from .settings import SETTINGS

__all__ = ["memory_level", "fastest_at_level", "clear_caches", "Level"]

_EPS = 1e-9


def memory_level(name: str, ranks: int) -> float:
    """The name's memory bound in units (module doc)."""
    schedule_info(name, "memory level", MEMORY_LEVELS)
    return float(FAMILIES[name].memory_bound(ranks))


@collector_paused
def fastest_at_level(name: str, ranks: int, microbatches: int, costs: Costs | None = None,
                     memory: MemoryModel = MemoryModel()) -> Schedule:
    """The fastest order found for ``name`` at its memory level (module doc)."""
    costs = costs or Costs.build(ranks)
    return _fastest_cached(Level(name, ranks, microbatches, costs, memory))[0]


@dataclass(frozen=True)
class Level:
    """What one named build is asked: the name, the setting and the memory model; also its
    cache key."""

    name: str
    ranks: int
    microbatches: int
    costs: Costs
    memory: MemoryModel

    @functools.cached_property
    def bound(self) -> float:
        """The name's memory level in units (``memory_level``)."""
        return memory_level(self.name, self.ranks)

    @property
    def one_chunk(self) -> bool:
        """Whether the name places one chunk per rank (zb-1p): its own orders, no V search."""
        return schedule_info(self.name).layout is Layout.SINGLE

    @functools.cached_property
    def paper(self) -> Schedule:
        """The paper's order for the name."""
        return paper_schedule(self.name, self.ranks, self.microbatches)


@functools.lru_cache(maxsize=128)
def _fastest_cached(level: Level) -> tuple[Schedule, tuple[Step, ...]]:
    """(schedule, provenance): zb-1p's fastest one-chunk order (``_fastest_zb``), a V name's
    search at its level (adaptive.py); its provenance is the steps chosen by the name at its
    level (``_chosen``)."""
    bound, paper = level.bound, level.paper
    if level.one_chunk:
        nothing = freeing_nothing_at_b(level.memory)
        b_frees_nothing = (() if nothing is None else
                           _fastest_cached(dataclasses.replace(level, memory=nothing))[0]
                           .rank_actions)
        orders, how = _fastest_zb(paper, level.costs, level.memory, bound, b_frees_nothing)
    else:
        result = search(level.ranks, level.microbatches, level.costs, bound, level.memory)
        orders, how = result.schedule.rank_actions, result.provenance
    return paper.with_actions(orders, memory_bound=bound,
                              provenance=_chosen(level.name, how, bound)), how


def _chosen(name: str, provenance: tuple[Step, ...], level: float) -> Provenance:
    """The steps, chosen by the name at its memory level."""
    return Provenance(provenance, Chosen(name, "level", level))


def _fastest_zb(paper: Schedule, costs: Costs, memory: MemoryModel, level: float,
                b_frees_nothing: tuple = ()):
    """(orders, provenance) of the fastest one-chunk order within ``level`` units.

    ``b_frees_nothing`` is the fastest order where B frees nothing (freeing_at_b.py's
    ``freeing_nothing_at_b``), tried under a model whose B frees memory: it fits there (B
    precedes W, so no moment holds more), and without it the greedy
    under that model can be slower (p 3, m 6, costs 1, 1, 0.8, 0.05, B freeing all: 19.9
    against 19.6, found by tests/schedule/test_levels.py's property in CI at stop 54).

    The orders are not polished by the local search: it never won. Over 220 builds (p 4 and 8
    at m = p to 8p, p 16 at m 16-64; costs 2,2,2 and 2,2.4,1.6 at hops 0, 0.1 and 0.5,
    2,2.78,0.7,0.05, 1,1.2,0.8,0.1, 1,1.39,0.35,0.05 and 1,1,1; both memory models) and the 48
    zb-1p points of scripts/bench/search_digest.py a polish of 100,000 passes per start made no
    order faster, and it took three quarters of those builds' time (23.5 s, 6.2 s without)."""
    placement, m = paper.placement, paper.microbatches
    problem = Problem(placement, m, costs, memory, level)
    starts = [(step("paper order"), paper.rank_actions)]
    for policy in SETTINGS.zb_policies:
        try:
            starts.append((step("greedy", policy=policy),
                           greedy_schedule(problem, policy).orders))
        except ScheduleError:
            continue
    if b_frees_nothing:  # last: it answers only where it is strictly faster
        starts.append((step("fastest where B frees nothing"), b_frees_nothing))
    best = None
    for how, orders in starts:
        if max(peak_memory(paper.with_actions(orders), memory)) > level + _EPS:
            continue
        makespan = makespan_of(paper.with_actions(orders), costs)
        if best is None or makespan < best[0] - _EPS:
            best = (makespan, orders, (how,))
    return best[1], best[2]


def clear_caches() -> None:
    """Forget every cached result: named levels, searches and the blocks built in slots.
    Benchmarks call it so that each timed build starts from nothing."""
    clear_search_cache()
    for cached in (_fastest_cached, compose, repeat, slot_reorder):
        cached.cache_clear()
