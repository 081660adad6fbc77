"""Named schedules as memory levels: the fastest order found at each name's own memory bound.

The paper names a schedule by its building block; a user picks ``v-half`` for half of 1F1B's
activation memory, not for one particular order. So each name stands for a limit::

    v-min    (p + 4) // 3 units      V layout     the adaptive search under that limit
    v-half   (p + 2) // 2 units      V layout     (its candidates include the paper's order,
    v-zb     p units                 V layout      so a name is never slower than the paper's)
    zb-1p    p units                 one chunk    the paper's order and cost-aware greedy orders
                                                  (construct/greedy.py); the fastest kept

The search re-schedules its answer's cool-down critical path first (search/critical_path_step.py),
kept where that is faster (at p = 16 it is: v-min at m = 64 and the H100 costs 615.36 -> 612.75);
where the paper's order, or under a model that frees at B the default model's answer, is faster than
the search's, that one gets the same step here.

Levels are in units of one microbatch's activations of a rank's layer share, under the
default memory model; under another model (B freeing part of a chunk) the same number of units
is the limit, so a model that frees more can only make the name faster. With F = B = W and no
comm the paper's memory table holds exactly (every peak within the name's bound) and the
bubbles are at most the paper's (p = 8, m = 32: v-min 0.107 against the paper order's 0.123).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import functools

from ..construct.compose import compose, repeat
from ..construct.greedy import Policy, greedy_schedule
from ..construct.named import FAMILIES, paper_schedule
from ..construct.slot_reorder import slot_reorder
from ..model.actions import ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.schedule import Schedule
from ..names import MEMORY_LEVELS
from ..model.simulate import makespan_of, peak_memory
from .adaptive import clear_cache as clear_search_cache, search
from .freeing_at_b import freeing_nothing_at_b
from .gc_pause import collector_paused
from .pool import describe
from .critical_path_step import with_faster_tail

__all__ = ["memory_level", "fastest_at_level", "clear_caches"]
"""The names that are memory levels (1f1b and interleaved-1f1b stay fixed orders)."""

_ZB_POLICIES = (Policy(), Policy(ranked_warm_up=True, alternate=True))
"""The greedy's policies for one chunk: between them the fastest of all 64 policies of
construct/greedy.py on every point of the reference comparison grid (p 4-16, m 8-64, two cost
ratios, three hop times)."""
_EPS = 1e-9


def memory_level(name: str, ranks: int) -> float:
    """The name's memory bound in units (module doc)."""
    if name not in MEMORY_LEVELS:
        raise ScheduleError(f"{name!r} is not a memory level; those are {', '.join(MEMORY_LEVELS)}")
    return float(FAMILIES[name].memory_bound(ranks))


@collector_paused
def fastest_at_level(name: str, ranks: int, microbatches: int, costs: Costs | None = None,
                     memory: MemoryModel = MemoryModel()) -> Schedule:
    """The fastest order found for ``name`` at its memory level (module doc)."""
    costs = costs or Costs.build(ranks)
    return _fastest_cached(name, ranks, microbatches, costs, memory)[0]


@functools.lru_cache(maxsize=128)
def _fastest_cached(name: str, p: int, m: int, costs: Costs,
                    memory: MemoryModel) -> tuple[Schedule, tuple[str, ...]]:
    """(schedule, provenance): the fastest for ``name`` under ``memory`` and the steps that
    made it (its description is rendered from them, ``_description``)."""
    level = memory_level(name, p)
    paper = paper_schedule(name, p, m)
    if name == "zb-1p":
        orders, how = _fastest_zb(paper, costs, memory, level)
    else:
        found = search(p, m, costs, level, memory)
        orders, how = found.schedule.rank_actions, found.provenance
    chosen = (paper.with_actions(orders, memory_bound=level,
                                 description=_description(name, how, level)), how)
    candidates = [chosen, (paper, (paper.description,))]  # the search has the paper's: a guard
    base = freeing_nothing_at_b(memory)
    if base is not None:  # what fits when B frees nothing fits here too
        candidates.append(_fastest_cached(name, p, m, costs, base))
    best, best_time = chosen, makespan_of(chosen[0], costs)
    for other in candidates[1:]:
        makespan = makespan_of(other[0], costs)
        if makespan < best_time - _EPS:
            best, best_time = other, makespan
    if name == "zb-1p" or best is chosen:  # the search re-scheduled its cool-down already
        return best
    tailed = with_faster_tail(best[0], costs, memory, level, best_time, best[1])
    if tailed is None:
        return best
    orders, how = tailed
    return best[0].with_actions(orders, description=_description(name, how, level)), how


def _description(name: str, provenance: tuple[str, ...], level: float) -> str:
    return f"{name}: {describe(provenance)} (level {level:g} units)"


def _fastest_zb(paper: Schedule, costs: Costs, memory: MemoryModel, level: float):
    """(orders, provenance) of the fastest one-chunk order within ``level`` units.

    The orders are not polished by the local search: it never won. Over 220 builds (p 4 and 8
    at m = p to 8p, p 16 at m 16-64; costs 2,2,2 and 2,2.4,1.6 at hops 0, 0.1 and 0.5,
    2,2.78,0.7,0.05, 1,1.2,0.8,0.1, 1,1.39,0.35,0.05 and 1,1,1; both memory models) and the 48
    zb-1p points of scripts/bench/search_digest.py a polish of 100,000 passes per start made no
    order faster, and it took three quarters of those builds' time (23.5 s, 6.2 s without)."""
    placement, m = paper.placement, paper.microbatches
    cap = level * placement.chunks
    starts = [("paper order", paper.rank_actions)]
    for policy in _ZB_POLICIES:
        try:
            starts.append((f"greedy ({policy.describe()})",
                           greedy_schedule(placement, m, costs, cap, memory, policy).orders))
        except ScheduleError:
            continue
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
