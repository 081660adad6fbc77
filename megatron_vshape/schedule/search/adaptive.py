"""Adaptive V scheduler: the fastest schedule under a memory limit, for measured costs.

Candidates, all V-shaped (two chunks per rank):

    blocks           V-Min, V-Half, V-ZB as the registry builds them, and V-Min and V-Half
                     squeezed and reordered pass by pass as the paper's code does
                     (slot_reorder.py); each only until the next larger one surely fits
                     the limit (``_outgrown``); then the V family's blocks, offsets
                     (k1, k2, split) of family.py, repeated, squeezed, cool-down reordered
    continuous       periodic.py's cost-aware blocks (real-time offsets), a few periods,
                     below V-Half's bound
    wave             V-ZB's cost-aware construction (wave.py) under the limit (at 1F1B's
                     memory, for small cases, and when nothing else fits: else the error,
                     ``InfeasibleMemoryError``)
    timed replay     the best few of the above replayed in real time under the limit (replay.py),
                     which fills the stalls of unbalanced costs with W, B and fitting F passes:
                     the 4 fastest, plus the fastest of up to 2 other memory peaks, since
                     replays reorder the candidates (3 and 1 for over 12,000 passes); the
                     slot-reordered and wave orders are not replayed: they are finished
                     orders, and taking replay slots from the blocks lost the best replay
                     (p = 4, m = 64, costs 2,2.4,1.6,0.5 at 3 units: 0.119 bubble, not 0.041)
    re-laid          the 4 fastest of the above and every finished construction, with each
                     rank's warm-up, and warm-up and cool-down, re-laid in the shapes the
                     paper code's adaptive search gives them (reshape_ends.py), at the limit's peak
                     (the warm-up also at the candidate's own): a rank runs chunk 1's F, B and
                     W back to back where the block's slots make it wait, and the last
                     gradients walk tight (costs 2,2,2, hop 0.1, p = 8 at 4 units: m = 16
                     0.254 -> 0.242 bubble, m = 64 0.124 -> 0.117; the reference's search
                     0.243 and 0.115); not replayed (at m = 64 that lost 0.001)
    polished         the 3 fastest of all the above, improved by the local search (local.py),
                     then the fastest of all polished once more with a larger budget
    W deferred       the 5 fastest of all with every W moved to where its rank would wait
                     (weight_deferral.py): the backlog the steady state builds within the
                     candidate's own peak fills the cool-down's waits for the last gradients
                     (H100 costs 2,2.78,0.7,0.05, p = 8, m = 64 at V-Half's memory: 1.043 ->
                     0.999 x 1F1B); the fastest, if it wins, polished once more; like the
                     re-laid ones, left out with ``shapes=False``
    gaps filled      last, the 3 fastest with their unit-slot bubbles filled by later passes
                     without raising the peak (gap_fill.py, the paper code's last step), the
                     best of those W-deferred, and a winner among them polished once more
                     (costs 2,2,2 at V-Min's limit, p = 16, hop 0.1, m = 16: 169.4 -> 169.0,
                     the reference's); left out with ``shapes=False`` and, over 2,000 passes,
                     at exactly 1F1B's memory or where F, B and W differ by over 2x
                     (settings.py's ``slot_spread``)
    repeated moves   at V-Min's memory or less and at most 768 passes, the winner improved by
                     local.py's moves made in every microbatch at once (``repeated_passes``)
    critical tail    last, the winner's cool-down re-scheduled critical path first
                     (critical_path_step.py), kept where faster: at the H100 costs (2, 2.78,
                     0.7, hop 0.05) and p = 16 it gains 0.2-1.1% at limits from V-Min's to 12 units
                     (m = 64, 12 units: 421.80 -> 417.25), up to 1.8% under a model where
                     B frees 0.75 of a chunk, for 12-27 ms

Each candidate is timed by the simulator with the real costs and kept only when its peak memory
is within the limit; the one with the smallest makespan wins (ties: less memory, then the order
above, so results are deterministic). Pruning: a family block whose lifespans alone exceed the
limit is skipped (lifespan / interval bounds the memory from below, paper section 4); the others'
memory is read off a short repeat (steady state is reached after a lifespan's worth of
microbatches) before anything else is built, and only the ``family_budget`` family blocks
closest under the limit are built in full: more memory buys fewer bubbles. Results are cached
per ``SearchRequest``: the model's ``Problem`` (model/problem.py: the V placement, m, costs,
memory model, limit in units) with what only the search has, ``shapes`` and the settings.

The constructions and the pruning are in constructions.py; the steps from the timed replay on,
in improvements.py; the constants that size every step (``filled``, ``slot_spread``, ...) and
what they were measured to buy, in settings.py (``STEPS`` writes its budgets from them); the
candidates the steps share, in pool.py.
This module holds the whole search as two tables: ``STEPS`` (name, gate, step, budget), run
in order over one pool under one memory model, and ``ALSO_TRY`` around it (under a model that
frees memory at B, the default model's answer first, refined under the model:
freeing_at_b.py); then the winner's critical-path cool-down, and the cache. A candidate's
provenance is the tuple of the steps that made it; descriptions are rendered from it, never
parsed back.

What the search does not reach (tests/schedule/test_search.py says why, with numbers): at
V-Min's memory with unbalanced costs (1, 1.2, 0.8) its bubble stays 14-55% above 1F1B's (at
p = 16 and large m no schedule can do better, bounds.py); at half of 1F1B's memory with p = 4
nothing can reach 0.6 x 1F1B's bubble (V-Min's 0.651 x is optimal there).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Callable

from ..model.costs import Costs, MemoryModel
from ..model.limits import memory_limit_units
from ..model.placement import Layout, Placement
from ..model.problem import Problem
from ..model.provenance import Chosen, Provenance
from ..model.provenance import Step as OrderStep  # a step that made an order; Step: the search's
from ..model.schedule import Schedule
from ..model.simulate import SimResult, peak_memory, simulate
from ..names import AUTO
from .constructions import (InfeasibleMemoryError, below_v_half, blocks, continuous_blocks,
                            tries_wave, wave_or_none_fits)
from .freeing_at_b import freeing_nothing_at_b, refined_under
from .gc_pause import collector_paused
from .improvements import (capped, defer_fastest, fill_fastest, fills_gaps, final_budget,
                           polishes, relays, repeat_moves, repeats, replays)
from .pool import Pool
from .settings import SETTINGS, Settings
from .critical_path_step import with_faster_tail

__all__ = ["InfeasibleMemoryError", "SearchResult", "search", "frontier", "memory_limit_units",
           "clear_cache", "SearchRequest", "search_steps", "STEPS", "Step", "ALSO_TRY", "AlsoTry"]

_EPS = 1e-9


@dataclass(frozen=True)
class Step:
    """One step of the search under one memory model: when its gate holds, it adds candidates
    to the pool (pool.py), which keeps those within the limit; no step removes any."""

    name: str
    when: Callable[[Pool], bool]
    run: Callable[[Pool], None]
    budget: str
    """How many candidates it adds at most, or passes timed, in words whose numbers are
    ``Settings`` fields (``{polished} x {polish_budget:,} passes``): the settings the search
    runs with fill them in (``budget_in``), so the table says what runs."""

    def budget_in(self, settings: Settings) -> str:
        """The budget in words under ``settings``."""
        return self.budget.format(**{field.name: getattr(settings, field.name)
                                     for field in dataclasses.fields(settings)})


def _always(pool: Pool) -> bool:
    return True


def _shapes(pool: Pool) -> bool:
    return pool.shapes


def _wave_or_nothing_fits(pool: Pool) -> bool:
    return tries_wave(pool) or not pool.candidates


STEPS = (
    #    name                  when                   run
    #        budget (``Settings`` fields in braces)
    Step("blocks",             _always,               blocks,
         "V-Min, V-Half, V-ZB (+2 slot-reordered), the {family_budget} family blocks closest "
         "under"),
    Step("continuous blocks",  below_v_half,          continuous_blocks,
         "periods x{period_scales}"),
    Step("wave",               _wave_or_nothing_fits, wave_or_none_fits,
         "1 (raises where still nothing fits)"),
    Step("replay",             _always,               replays,
         "{replays} x slacks {replay_slack} + {extra_peaks} peaks, window {replay_windows} "
         "({replays_large} + {extra_peaks_large} over {large_passes:,} passes)"),
    Step("re-lay",             _shapes,               relays,
         "{relaid} + finished, x 3 ({relaid_large} over {large_passes:,} passes)"),
    Step("polish",             _always,               polishes,
         "{polished} x {polish_budget:,} passes, then the winner {final_polish_budget:,} "
         "({final_polish_large:,} from {final_polish_large_passes:,} passes)"),
    Step("W deferral",         _shapes,               defer_fastest,
         "{filled} (+ a polish)"),
    Step("gap fill",           fills_gaps,            fill_fastest,
         "{gaps_filled} + 1 (+ a polish)"),
    Step("repeated moves",     repeats,               repeat_moves,
         "{repeated_budget:,} passes"),
)
"""The search under one memory model, in order (the module doc says what each buys)."""


@dataclass(frozen=True)
class SearchResult:
    schedule: Schedule
    result: SimResult
    seconds: float
    candidates: int
    """How many candidates were timed."""
    provenance: tuple[OrderStep, ...] = ()
    """The steps that made the schedule, first to last (model/provenance.py: data; the
    schedule's description renders them, and is never parsed back)."""


@collector_paused
def search(ranks: int, microbatches: int, costs: Costs | None = None, limit: float | None = None,
           memory: MemoryModel = MemoryModel(), shapes: bool = True,
           settings: Settings = SETTINGS) -> SearchResult:
    """The fastest V schedule whose peak memory is at most ``limit`` units (default: 1F1B's),
    found with the tuning constants ``settings`` (settings.py).

    ``shapes=False`` leaves out the re-laid warm-ups and cool-downs and the deferred W passes
    (module doc): the planner does so when a B *grows* the bytes kept (large TP: the output
    gradients W keeps outweigh what B frees), which no :class:`MemoryModel` can say, and the
    cool-down's W passes, free in units, would cost bytes (gpt-98.5b, TP 8, PP 5: 40 -> 56 GiB
    on the last rank)."""
    costs = costs or Costs.build(ranks)
    limit = float(min(ranks, microbatches) if limit is None else limit)
    problem = Problem(Placement(ranks, Layout.V), microbatches, costs, memory, limit)
    return _search_cached(SearchRequest(problem, shapes, settings))


@dataclass(frozen=True)
class SearchRequest:
    """What one search is asked: the problem (model/problem.py: the V placement, the
    microbatches, costs, memory model and the limit in units) and what only the search has,
    whether the re-laid shapes and deferred W passes may be used (``search``'s ``shapes``) and
    the tuning constants; also the search's cache key."""

    problem: Problem
    shapes: bool
    settings: Settings = SETTINGS


@dataclass(frozen=True)
class AlsoTry:
    """A step around the search under one model: when its gate holds, it adds answers, and
    the fastest of all answers is kept (ties: the first). Its gate and its step take what was
    asked (the ``SearchRequest``) and the answers so far."""

    name: str
    when: Callable[[SearchRequest, list], bool]
    run: Callable[[SearchRequest, list], list]


def _anyway(request: SearchRequest, found: list) -> bool:
    return True


def _refines(request: SearchRequest, found: list) -> bool:
    return request.shapes and freeing_nothing_at_b(request.problem.memory) is not None


def _searched(request: SearchRequest, found: list) -> list:
    """``STEPS`` over one pool: under a model whose B frees memory, under the model where B
    frees nothing, re-timed under the problem's (freeing_at_b.py: what fits there fits here),
    and under the problem's model itself only where nothing fits there; else under the
    problem's model."""
    problem = request.problem
    freeing_nothing = freeing_nothing_at_b(problem.memory)
    if freeing_nothing is not None:
        base = dataclasses.replace(problem, memory=freeing_nothing)
        try:
            other = _search_cached(dataclasses.replace(request, problem=base))
        except InfeasibleMemoryError:
            pass
        else:
            return [dataclasses.replace(other, result=simulate(other.schedule, problem.costs,
                                                               problem.memory))]
    return [search_steps(request)]


def _refined_first(request: SearchRequest, found: list) -> list:
    return _refined(found[0], request)


ALSO_TRY = (
    #       name                       when               run
    AlsoTry("the search",              _anyway,           _searched),
    AlsoTry("refined under the model", _refines,          _refined_first),
)
"""Around ``STEPS``: the search (under a model whose B frees memory, where B frees nothing
first: freeing_at_b.py), then that answer refined under the model."""


@functools.lru_cache(maxsize=256)
def _search_cached(request: SearchRequest) -> SearchResult:
    """The fastest of the ``ALSO_TRY`` answers, with its cool-down re-scheduled critical path
    first where that is faster (``_with_tail``), last."""
    started = time.perf_counter()
    found: list[SearchResult] = []
    for also in ALSO_TRY:
        if also.when(request, found):
            found.extend(also.run(request, found))
    best = min(found, key=lambda r: round(r.result.makespan, 9))  # ties: the first
    best = _with_tail(best, request)
    return dataclasses.replace(best, seconds=time.perf_counter() - started,
                               candidates=sum(r.candidates for r in found))


def clear_cache() -> None:
    """Forget every cached search (benchmarks time each search from nothing)."""
    _search_cached.cache_clear()


def _chosen(provenance: tuple[OrderStep, ...], limit: float) -> Provenance:
    """The search's steps, chosen by ``auto`` under ``limit`` units."""
    return Provenance(provenance, Chosen(AUTO, "limit", limit))


def _with_tail(found: SearchResult, request: SearchRequest) -> SearchResult:
    """``found`` with its cool-down re-scheduled critical path first where that is faster
    (critical_path_step.py); left out with ``shapes=False``, like the other re-laid cool-downs."""
    if not request.shapes:
        return found
    problem = request.problem
    costs, limit, memory = problem.costs, problem.limit, problem.memory
    tailed = with_faster_tail(problem, found.schedule, found.result.makespan, found.provenance)
    if tailed is None:
        return found
    orders, provenance = tailed
    schedule = found.schedule.with_actions(orders, provenance=_chosen(provenance, limit))
    return dataclasses.replace(found, schedule=schedule, result=simulate(schedule, costs, memory),
                               provenance=provenance)


def _refined(result: SearchResult, request: SearchRequest) -> list[SearchResult]:
    """``result`` refined under the problem's memory model (freeing_at_b.py) within its peak
    under the model where B frees nothing."""
    problem, settings = request.problem, request.settings
    costs, limit, memory = problem.costs, problem.limit, problem.memory
    schedule = result.schedule
    own = max(peak_memory(schedule, freeing_nothing_at_b(memory)))
    passes = sum(map(len, schedule.rank_actions))
    budget = final_budget(problem.ranks, problem.microbatches, settings)
    out = []
    for how, orders in refined_under(problem.with_limit(min(limit, own)), schedule.rank_actions,
                                     capped(budget, passes, settings), settings):
        provenance = result.provenance + (how,)
        refined = schedule.with_actions(orders, provenance=_chosen(provenance, limit))
        out.append(SearchResult(refined, simulate(refined, costs, memory), 0.0, 1, provenance))
    return out


def search_steps(request: SearchRequest) -> SearchResult:
    """The search under the problem's memory model alone: the ``STEPS`` in order over one
    pool, the fastest candidate (no ``ALSO_TRY`` around it, no critical-path cool-down, not
    cached)."""
    problem = request.problem
    started = time.perf_counter()
    pool = Pool(problem, request.shapes, request.settings)
    for step in STEPS:
        if step.when(pool):
            step.run(pool)
    winner = pool.fastest()
    limit = problem.limit
    schedule = Schedule(AUTO, problem.placement, problem.microbatches, winner.orders,
                        memory_bound=limit, provenance=_chosen(winner.provenance, limit))
    return SearchResult(schedule, simulate(schedule, problem.costs, problem.memory),
                        time.perf_counter() - started, len(pool.candidates), winner.provenance)


@collector_paused
def frontier(ranks: int, microbatches: int, costs: Costs | None = None,
             memory: MemoryModel = MemoryModel(), points: int = 12) -> list[SearchResult]:
    """Pareto frontier of (peak memory, makespan) from ``search`` at limits between V-Min's
    memory and 1F1B's, sorted by memory.

    Every search result is a point; a point is kept only if no other point has at most its
    memory and a smaller makespan, so along the frontier bubbles fall as memory grows.
    """
    costs = costs or Costs.build(ranks)
    top = float(min(ranks, microbatches))
    low = min(top, float((ranks + 4) // 3))
    limits = sorted({round(low + (top - low) * i / max(1, points - 1), 6) for i in range(points)})
    found = []
    for limit in limits:
        try:
            found.append(search(ranks, microbatches, costs, limit, memory))
        except InfeasibleMemoryError:
            continue
    found.sort(key=lambda f: (f.result.peak_memory_max, f.result.makespan))
    out: list[SearchResult] = []
    for point in found:
        if not out or point.result.makespan < out[-1].result.makespan - _EPS:
            out.append(point)
    return out
