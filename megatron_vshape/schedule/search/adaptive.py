"""Adaptive V scheduler: the fastest schedule under a memory limit, for measured costs.

Candidates, all V-shaped (two chunks per rank):

    fixed blocks     V-Min, V-Half, V-ZB as the registry builds them, and V-Min and V-Half
                     squeezed and reordered pass by pass as the paper's code does
                     (slot_reorder.py); each only until the next larger one surely fits
                     the limit (``_outgrown``)
    block family     offsets (k1, k2, split) of family.py, repeated, squeezed, cool-down reordered
    wave             V-ZB's cost-aware construction (wave.py) under the limit (at 1F1B's
                     memory, for small cases, and when nothing else fits)
    continuous       periodic.py's cost-aware blocks (real-time offsets), a few periods,
                     below V-Half's bound
    timed replay     the best few of the above replayed in real time under the limit (timed.py),
                     which fills the stalls of unbalanced costs with W, B and fitting F passes:
                     the 4 fastest, plus the fastest of up to 2 other memory peaks, since
                     replays reorder the candidates (3 and 1 for over 12,000 passes); the
                     slot-reordered and wave orders are not replayed: they are finished
                     orders, and taking replay slots from the blocks lost the best replay
                     (p = 4, m = 64, costs 2,2.4,1.6,0.5 at 3 units: 0.119 bubble, not 0.041)
    re-laid          the 4 fastest of the above and every finished construction, with each
                     rank's warm-up, and warm-up and cool-down, re-laid in the shapes the
                     paper code's adaptive search gives them (shapes.py), at the limit's peak
                     (the warm-up also at the candidate's own): a rank runs chunk 1's F, B and
                     W back to back where the block's slots make it wait, and the last
                     gradients walk tight (costs 2,2,2, hop 0.1, p = 8 at 4 units: m = 16
                     0.254 -> 0.242 bubble, m = 64 0.124 -> 0.117; the reference's search
                     0.243 and 0.115); not replayed (at m = 64 that lost 0.001)
    polished         the 3 fastest of all the above, improved by the local search (local.py),
                     then the fastest of all (re-laid first if it is not yet) polished once
                     more with a larger budget
    W deferred       the 5 fastest of all with every W moved to where its rank would wait
                     (wfill.py): the backlog the steady state builds within the candidate's
                     own peak fills the cool-down's waits for the last gradients (H100 costs
                     2,2.78,0.7,0.05, p = 8, m = 64 at V-Half's memory: 1.043 -> 0.999 x
                     1F1B); the fastest, if it wins, polished once more; like the re-laid
                     ones, left out with ``shapes=False``
    gaps filled      last, the 3 fastest with their unit-slot bubbles filled by later passes
                     without raising the peak (gap_fill.py, the paper code's last step), the
                     best of those W-deferred, and a winner among them polished once more
                     (costs 2,2,2 at V-Min's limit, p = 16, hop 0.1, m = 16: 169.4 -> 169.0,
                     the reference's); left out with ``shapes=False`` and, over 2,000 passes,
                     at 1F1B's memory or where F, B and W differ by over 1.25x
                     (``_SLOT_SPREAD``)
    repeated moves   at V-Min's memory or less and at most 768 passes, the winner improved by
                     local.py's moves made in every microbatch at once (``_REPEATED_PASSES``)
    critical tail    last, the winner's cool-down re-scheduled critical path first
                     (tails.py), kept where faster: at the H100 costs (2, 2.78, 0.7, hop
                     0.05) and p = 16 it gains 0.2-1.1% at limits from V-Min's to 12 units
                     (m = 64, 12 units: 421.80 -> 417.25), up to 1.8% under a model where
                     B frees 0.75 of a chunk, for 12-27 ms

Each candidate is timed by the simulator with the real costs and kept only when its peak memory
is within the limit; the one with the smallest makespan wins (ties: less memory, then the order
above, so results are deterministic). Pruning: a family block whose lifespans alone exceed the
limit is skipped (lifespan / interval bounds the memory from below, paper section 4); the others'
memory is read off a short repeat (steady state is reached after a lifespan's worth of
microbatches) before anything else is built, and only the ``_FAMILY_BUDGET`` family blocks
closest under the limit are built in full: more memory buys fewer bubbles. Results are cached
per (p, m, costs, limit, memory model).

What the search does not reach (tests/test_search.py says why, with numbers): at V-Min's memory
with unbalanced costs (1, 1.2, 0.8) its bubble stays 14-55% above 1F1B's (at p = 16 and large m
no schedule can do better, bounds.py); at half of 1F1B's memory with p = 4 nothing can reach
0.6 x 1F1B's bubble (V-Min's 0.651 x is optimal there).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Callable

from ..model.actions import PassKind, ScheduleError
from ..build.blocks import V_HALF, V_MIN, V_ZB
from ..build.compose import compose, repeated_peak
from ..build.named import paper_schedule
from ..model.costs import Costs, MemoryModel
from ..model.limits import memory_limit_units
from ..build.family import v_block, v_family
from ..build.gap_fill import fill_gaps
from ..build.periodic import periodic_block, periodic_orders
from ..build.slot_reorder import slot_reorder
from ..build.shapes import reshape_cool_down, reshape_warm_up
from ..build.wave import wave_schedule
from ..build.wfill import defer_weight_passes
from ..model.placement import Layout, Placement
from ..model.schedule import Schedule
from ..model.simulate import SimResult, makespan_of, peak_memory, simulate
from ..build.timed import Replay, replay_in_time
from .freed import freeing_nothing_at_b, refined_under
from .gc_pause import collector_paused
from .tails import with_faster_tail
from .local import Improved, improve, improve_repeated

__all__ = ["InfeasibleMemoryError", "SearchResult", "search", "frontier", "memory_limit_units"]

_FAMILY_BUDGET = 6
_REPLAYS = 4
_REPLAYS_LARGE = 3
_LARGE_PASSES = 12_000
_EXTRA_PEAKS = 2
_EXTRA_PEAKS_LARGE = 1
_REPLAY_WINDOWS = (4,)
_REPLAY_SLACK = (0, 1)
_PERIOD_SCALES = (1.0, 1.1, 1.2, 1.35, 1.5)
_POLISHED = 3
_FILLED = 5
"""The fastest candidates (distinct orders) whose W passes are deferred (wfill.py), after the
last polish, so that the search up to there is unchanged and the deferred orders can only add
wins (0.003-0.12 s each at p = 4-16, m = 4p-8p; with 3, a relaid family block that the
deferral makes fastest fell out of them once the polishes improved the others: v-half at
p = 16, m = 64, H100 costs, 0.990 -> 0.992 x 1F1B). Deferred before the polish instead, they took
the polish's starts from orders that polished better: V-Half at p = 4, m = 16, H100 costs
0.950 -> 0.953 x 1F1B, V-Min at costs 1,1.2,0.8: 61.0 -> 61.1. Each is deferred within its own
peak, not the limit: the same makespans at the named levels (where the peak is the limit),
and a large limit is not filled with waiting W passes for a sliver of time (the planner's
gpt-9.6b at seq 1024 went from 20 to 54 GiB for 0.06% more throughput)."""
_GAPS_FILLED = 3
"""The fastest candidates (distinct orders) whose unit-slot bubbles are filled (gap_fill.py),
last, and the best of them with its W passes deferred: so they only add wins (filled among the
re-lays, they took an earlier step's starts: the planner's gpt-9.6b at seq 1024 lost 0.2%
where a wave no longer got polished). Costs 2,2,2 at V-Min's limit, where the reference's
search was ahead: p = 16, hop 0.1, m = 16/32/64: 169.4/274.2/484.2 -> 169.0/274.0/483.8 (the
reference's), hop 0.5, m = 64: 649.0 -> 647.0 (same); p = 8, m = 64, hop 0.1: 434.2 -> 432.8
(the reference: 434.0). 2 bases reach all five; 0.05-0.2 s at p = 16, m = 64."""
_SLOT_SPREAD = 1.25
_GAPS_CHEAP_PASSES = 2_000
"""Gaps are filled only below 1F1B's memory (p units) where, on every rank, the longest of F,
B and W takes at most ``_SLOT_SPREAD`` times the shortest, or where that is cheap (at most
this many passes): the fill counts every pass as one slot (gap_fill.py), so where passes take
different times its gaps are not the real ones. Over 720 searches (p 4-16, m 8-64, costs
2,2,2 / 2,2.4,1.6 / 1,1.2,0.8 with hop 0, 0.1 and 0.5, limits V-Min's, V-Half's, 3p/4 and p
units, both memory models) it won 24, all at costs 2,2,2 or on at most 2,000 passes: at V-Min's
limit and at 3p/4 (p = 16, m = 64, hop 0.1: 418.6 -> 418.0), never at V-Half's or at p units
over 2,000 passes, nor at spread 1.5 there; the same on the named levels' grid (p 4-16, m
p-8p, 9 cost sets: 396 builds) and of 198 searches at spreads 3-5 (p 4-16, m p-4p) it won 2,
at p = 4, m = 8 (costs 2,3,0.6,0.1 at 2 units: 72.9 against 73.1), where it takes 2 ms.
Where it does not win it costs 0.04 s at p = 16, m = 64 (v-half at costs 2,2.4,1.6,0.5, v-zb
at 2,2,2,0.1 and 1,1.2,0.8,0.1: over 0.5 s with it)."""
_RELAID = 4
_RELAID_LARGE = 1
"""The fastest candidates (distinct orders) whose warm-up and cool-down are re-laid, besides
every finished construction (slot-reordered blocks, the wave); over 12,000 passes only the
fastest (a re-lay times the order twice: p = 32, m = 256 took 12.6 s instead of 9.6 s)."""
_POLISH_BUDGET = 100_000
"""Passes the local search may time per start (a bound, so results repeat; local.py counts
what each move re-times and costs: about 10 ms per 100,000)."""
_FINAL_POLISH_BUDGET = 600_000
"""Passes for polishing the winner once more (about 0.4 s): at p = 4, m = 16, costs 1,1.2,0.8
at V-Min's memory it takes the makespan from 61.4 to issue 3's best known (CP-SAT) 61.1, and
67.2 to 66.6 with comm 0.1; 500,000 stop at 66.7, 200,000 at 61.4 and 66.9."""
_FINAL_POLISH_LARGE = 150_000
_FINAL_POLISH_LARGE_PASSES = 4_000
"""From this many passes (p = 16, m = 48) the winner's second polish gets the smaller budget:
over p = 16, m = 32 and 64, four cost ratios and four limits (32 points) 150,000 passes gave
the same makespans as 600,000 at every point, for 0.1-0.6 s less; at p = 8, m = 64 (3,072
passes, below the threshold) the larger budget still gained 0.05% at 2 of 16 points."""
_REPEATED_BUDGET = 1_000_000
_REPEATED_PASSES = 768
"""The winner's last improvement, moves repeated in every microbatch (local.py's
``improve_repeated``), runs at V-Min's memory or less on schedules of at most this many passes
(p = 4, m = 32), where it pays: at the H100 costs (2, 2.78, 0.7, hop 0.05), V-Min at p = 4
from 1.219 to 1.196 x 1F1B (m = 16) and from 1.296 to 1.253 x (m = 32), for 0.2-0.5 s more.
Run everywhere (periods 1-4), it gained at most 0.15% on the rest of the named levels' grid
(p 4-16, m 4p and 8p, both memory models; p = 8, m = 32, V-Min) for 0.6-1.3 s more, and at
V-Half's and V-ZB's memory 0.1% at most."""
_BUDGET_PER_PASS = 1_600
"""Both polish budgets are capped at this many passes timed per pass of the schedule: the local
search spends its whole budget, and a small schedule (p = 2, m = 2: 24 passes) would otherwise
be timed 25,000 times (4 s) for nothing; from 375 passes (p = 4, m = 16) the caps above bind."""
_WAVE_CHEAP_PASSES = 2_000
"""The wave is tried at 1F1B's memory, where it wins (V-ZB), and below it only when it is cheap
(at most this many passes) or nothing else fits: over p 4-16, m 8 and 32, three cost ratios,
two hop times and both memory models it won 42 of 72 points at p units, 2 of 72 at V-Min's and
none at V-Half's or 3p/4, and it costs about 0.3 s at p = 16, m = 64."""
_EPS = 1e-9
F, B = PassKind.F, PassKind.B
_FIXED = (V_MIN, V_HALF, V_ZB)
_TIMED = (Replay, Improved)
"""What a builder returns when it timed its orders itself (their makespan is the simulator's:
the same dataflow, rounded to 1e-9 by local.py, as ``_key`` rounds it)."""


class InfeasibleMemoryError(ScheduleError):
    """No V schedule fits the limit; names the smallest peak found and what reaches it."""

    def __init__(self, limit: float, smallest: float, schedule: str):
        super().__init__(
            f"memory limit {limit:g} units is below every V schedule for this setting: the "
            f"smallest achievable peak is {smallest:g} units, reached by {schedule}"
        )
        self.limit, self.smallest, self.schedule = limit, smallest, schedule


@dataclass(frozen=True)
class SearchResult:
    schedule: Schedule
    result: SimResult
    seconds: float
    candidates: int
    """How many candidates were timed."""


@dataclass(frozen=True)
class _Candidate:
    description: str
    orders: tuple
    peak: float
    makespan: float
    rank: int  # position in the candidate list, for deterministic ties
    replayable: bool = True
    """Whether the replays may start from it (module doc: not the finished constructions)."""


@collector_paused
def search(ranks: int, microbatches: int, costs: Costs | None = None, limit: float | None = None,
           memory: MemoryModel = MemoryModel(), shapes: bool = True) -> SearchResult:
    """The fastest V schedule whose peak memory is at most ``limit`` units (default: 1F1B's).

    ``shapes=False`` leaves out the re-laid warm-ups and cool-downs and the deferred W passes
    (module doc): the planner does so when a B *grows* the bytes kept (large TP: the output
    gradients W keeps outweigh what B frees), which no :class:`MemoryModel` can say, and the
    cool-down's W passes, free in units, would cost bytes (gpt-98.5b, TP 8, PP 5: 40 -> 56 GiB
    on the last rank)."""
    costs = costs or Costs.build(ranks)
    limit = float(min(ranks, microbatches) if limit is None else limit)
    return _search_cached(ranks, microbatches, costs, limit, memory, shapes)


@functools.lru_cache(maxsize=256)
def _search_cached(p: int, m: int, costs: Costs, limit: float, memory: MemoryModel,
                   shapes: bool = True) -> SearchResult:
    """The search under ``memory``; under a model whose B frees memory, the default model's
    answer re-timed and refined under ``memory`` (freed.py), the faster of them, and the
    search under ``memory`` itself only where nothing fits when B frees nothing. Either way its
    cool-down re-scheduled critical path first where faster (``_with_tail``), last."""
    started = time.perf_counter()
    base = freeing_nothing_at_b(memory)
    if base is None:
        best = _with_tail(_search_one(p, m, costs, limit, memory, shapes), costs, limit, memory,
                          shapes)
        return dataclasses.replace(best, seconds=time.perf_counter() - started)
    try:
        other = _search_cached(p, m, costs, limit, base, shapes)
        found = [dataclasses.replace(other, result=simulate(other.schedule, costs, memory))]
    except InfeasibleMemoryError:
        found = [_search_one(p, m, costs, limit, memory, shapes)]
    if shapes:
        found.extend(_refined(found[0], costs, limit, memory, base))
    best = min(found, key=lambda r: round(r.result.makespan, 9))  # ties: the first
    best = _with_tail(best, costs, limit, memory, shapes)
    return dataclasses.replace(best, seconds=time.perf_counter() - started,
                               candidates=sum(r.candidates for r in found))


def _with_tail(found: SearchResult, costs: Costs, limit: float, memory: MemoryModel,
               shapes: bool) -> SearchResult:
    """``found`` with its cool-down re-scheduled critical path first where that is faster
    (tails.py); left out with ``shapes=False``, like the other re-laid cool-downs."""
    if not shapes:
        return found
    tailed = with_faster_tail(found.schedule, costs, memory, limit, found.result.makespan,
                              f" (limit {limit:g} units)")
    if tailed is None:
        return found
    return dataclasses.replace(found, schedule=tailed, result=simulate(tailed, costs, memory))


def _refined(result: SearchResult, costs: Costs, limit: float, memory: MemoryModel,
             base: MemoryModel) -> list[SearchResult]:
    """``result`` refined under ``memory`` (freed.py) within its peak under ``base``."""
    schedule = result.schedule
    chunks = schedule.placement.chunks
    cap = min(limit, max(peak_memory(schedule, base))) * chunks
    passes = sum(map(len, schedule.rank_actions))
    head, _, tail = schedule.description.rpartition(" (limit")
    out = []
    for how, orders in refined_under(schedule, costs, memory, cap, _capped(
            _final_budget(schedule.placement.ranks, schedule.microbatches), passes)):
        refined = schedule.with_actions(orders, description=f"{head}, {how} (limit{tail}")
        out.append(SearchResult(refined, simulate(refined, costs, memory), 0.0, 1))
    return out


@dataclass
class _Pool:
    """The candidates of one search (module doc) and what its stages share: the setting,
    the peak of every order built (for the error when none fits) and the orders re-laid."""

    placement: Placement
    microbatches: int
    costs: Costs
    limit: float
    memory: MemoryModel
    shapes: bool
    candidates: list[_Candidate] = dataclasses.field(default_factory=list)
    smallest: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    """(peak, description) of every order built, within the limit or not."""
    relaid: set = dataclasses.field(default_factory=set)
    """The orders already re-laid (``_fresh``)."""
    peaks: dict = dataclasses.field(default_factory=dict)
    makespans: dict = dataclasses.field(default_factory=dict)
    """Per distinct orders, their peak and makespan (None: they deadlock): different builds
    often give the same orders (a polish that finds nothing, the W deferral of the block and
    of the wave; 4-12 of about 30 candidates per search at p = 16, m = 64), and a timing
    takes 1.3 ms there."""

    @property
    def cap(self) -> float:
        """The limit in chunk-activations (what the local search and the replays keep to)."""
        return self.limit * self.placement.chunks

    @property
    def full(self) -> int:
        """The limit in whole chunk-activations: the peak the re-lays lay out to."""
        return int(self.cap + _EPS)

    def consider(self, description: str, build: Callable[[], tuple | Replay | Improved],
                 replayable: bool = True) -> None:
        """Builds a candidate and keeps it when it fits the limit and its orders run; a
        construction that cannot be built (ScheduleError) adds nothing. A replay and the local
        search time their orders themselves (``_TIMED``): not timed again. Only the winner is
        simulated in full (``_search_one``)."""
        try:
            built = build()
        except ScheduleError:
            return
        timed = isinstance(built, _TIMED)
        orders = built.orders if timed else built
        peak = self._peak(orders)
        self.smallest.append((peak, description))
        if peak > self.limit + _EPS:
            return
        makespan = built.makespan if timed else self._makespan(orders)
        if makespan is None:  # a re-laid warm-up can deadlock across ranks
            return
        self.candidates.append(_Candidate(description, orders, peak, makespan,
                                          len(self.candidates), replayable))

    def _peak(self, orders) -> float:
        """The peak of ``orders`` in units, once per distinct orders (``peaks``)."""
        if orders not in self.peaks:
            schedule = Schedule("auto", self.placement, self.microbatches, orders)
            self.peaks[orders] = max(peak_memory(schedule, self.memory))
        return self.peaks[orders]

    def _makespan(self, orders) -> float | None:
        """The makespan of ``orders`` (None: they deadlock), once per distinct orders
        (``makespans``)."""
        if orders not in self.makespans:
            try:
                self.makespans[orders] = makespan_of(
                    Schedule("auto", self.placement, self.microbatches, orders), self.costs)
            except ScheduleError:
                self.makespans[orders] = None
        return self.makespans[orders]

    def fastest(self) -> _Candidate:
        return min(self.candidates, key=_key)

    def wave(self) -> tuple:
        """The V-ZB wave's orders under the limit (wave.py)."""
        return _wave(self.placement.ranks, self.microbatches, self.costs, self.limit, self.memory)


def _search_one(p: int, m: int, costs: Costs, limit: float, memory: MemoryModel,
                shapes: bool) -> SearchResult:
    """The search under one memory model, in the module doc's order: the constructions, their
    replays, re-lays and polishes, then what improves the winner (the moves repeated per
    microbatch too, where ``_repeats``)."""
    if not isinstance(p, int) or p < 2:
        raise ScheduleError(f"ranks must be an integer >= 2, got {p!r}")
    if not isinstance(m, int) or m < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {m!r}")
    started = time.perf_counter()
    pool = _Pool(Placement(p, Layout.V), m, costs, limit, memory, shapes)
    wave_tried, skipped = _constructions(pool)
    large = 6 * p * m > _LARGE_PASSES  # a replay costs time in proportion to the passes
    _replays(pool, large)
    _relays_and_polishes(pool, large)
    if not pool.candidates and not wave_tried:
        pool.consider("V-ZB wave, cost-aware", pool.wave)  # below every block it may still fit
    if not pool.candidates:
        raise _infeasible(pool, skipped)
    _improve_winner(pool)
    winner = pool.fastest()
    schedule = Schedule("auto", pool.placement, m, winner.orders, memory_bound=limit,
                        description=f"auto: {winner.description} (limit {limit:g} units)")
    return SearchResult(schedule, simulate(schedule, costs, memory), time.perf_counter() - started,
                        len(pool.candidates))


def _constructions(pool: _Pool) -> tuple[bool, list]:
    """The fixed blocks (also slot-reordered), the wave, the family blocks and the
    continuous-offset blocks as candidates. Returns whether the wave was tried and the family
    blocks skipped unprobed (``_family_within``)."""
    p, m, limit, memory = pool.placement.ranks, pool.microbatches, pool.limit, pool.memory
    for family in _FIXED:
        if _named_over(family, p, m, limit, memory):  # its peak is known: skip the build
            pool.smallest.append((family.memory_bound(p), f"{family.name} block"))
            continue
        if _outgrown(family, p, limit):
            continue
        pool.consider(f"{family.name} block", functools.partial(_named, family.name, p, m))
        if family is not V_ZB:
            pool.consider(f"{family.name} block, slot-reordered",
                          functools.partial(slot_reorder, family.build(p), m), replayable=False)
    wave_tried = limit >= p - _EPS or 6 * p * m <= _WAVE_CHEAP_PASSES
    if wave_tried:
        pool.consider("V-ZB wave, cost-aware", pool.wave, replayable=False)
    skipped: list = []
    for offsets, block in _family_within(p, m, limit, memory, pool.smallest, skipped):
        pool.consider(f"V family block, {offsets.describe()}",
                      functools.partial(compose, dataclasses.replace(block, memory_bound=limit), m))
    for scale in () if _outgrown(V_MIN, p, limit) else _PERIOD_SCALES:
        pool.consider(f"continuous-offset block, period x{scale:g}",
                      functools.partial(_periodic, p, m, pool.costs, scale))
    return wave_tried, skipped


def _replays(pool: _Pool, large: bool) -> None:
    """The replay bases (``_replay_bases``) replayed in real time under the limit (timed.py).

    A base whose orders an earlier base has too (the V-Min block and the family block of
    offsets 1 at p = 16) is not replayed again: its replay would be a copy of that one's,
    later in the pool, so never the first of its orders anywhere (ties go to the earlier)."""
    counts = (_REPLAYS_LARGE, _EXTRA_PEAKS_LARGE) if large else (_REPLAYS, _EXTRA_PEAKS)
    replayed = set()
    for base, slacks in _replay_bases(pool.candidates, *counts):
        for window in _REPLAY_WINDOWS:
            for slack in slacks:  # one chunk of slack: the replay's peak often lands lower
                if (base.orders, window, slack) in replayed:
                    continue
                replayed.add((base.orders, window, slack))
                pool.consider(f"{base.description}, replayed in time (window {window})",
                              functools.partial(replay_in_time, base.orders, pool.placement,
                                                pool.costs, pool.cap + slack, pool.memory,
                                                window, abandon_above=pool.cap))


def _relays_and_polishes(pool: _Pool, large: bool) -> None:
    """The fastest candidates and the finished constructions re-laid, then the fastest of all
    polished by the local search (module doc)."""
    finished = [] if large else [c for c in pool.candidates if not c.replayable]
    bases = _polish_bases(pool.candidates, _RELAID_LARGE if large else _RELAID)
    for base in _fresh(bases + _polish_bases(finished, len(finished)), pool.relaid, pool.shapes):
        _relay(pool, base, int(base.peak * pool.placement.chunks + _EPS))
    for base in _polish_bases(pool.candidates, _POLISHED):
        pool.consider(f"{base.description}, polished",
                      functools.partial(_polish, pool, base.orders, _POLISH_BUDGET))


def _infeasible(pool: _Pool, skipped: list) -> InfeasibleMemoryError:
    """The error when nothing fits: the smallest peak of anything built, of the family blocks
    skipped unprobed and of the wave at the least it can keep."""
    p, m = pool.placement.ranks, pool.microbatches
    pool.smallest.extend((_probe_peak(block, m, pool.memory),
                          f"V family block, {offsets.describe()}") for offsets, block in skipped)
    pool.smallest.extend(_least_wave(p, m, pool.costs, pool.memory))
    peak, description = min(pool.smallest)
    return InfeasibleMemoryError(pool.limit, peak, description)


def _improve_winner(pool: _Pool) -> None:
    """The winner so far re-laid (when a replay won) and polished once more; then the deferred
    and the gap-filled candidates, each polished once more when one of them wins; last, at
    V-Min's memory on small schedules, the moves repeated per microbatch."""
    winner = pool.fastest()
    for base in _fresh([winner], pool.relaid, pool.shapes and "re-laid" not in winner.description):
        _relay(pool, base, pool.full, cool_down_alone=True)  # a replay won
        winner = pool.fastest()
    _polish_further(pool, winner)
    _then_polished(pool, functools.partial(_defer_fastest, pool, _FILLED if pool.shapes else 0))
    _then_polished(pool, functools.partial(_fill_fastest, pool,
                                           _GAPS_FILLED if _fills_gaps(pool) else 0))
    if _repeats(pool.placement.ranks, pool.microbatches, pool.limit):
        _repeat_moves(pool, pool.fastest())


def _repeats(p: int, m: int, limit: float) -> bool:
    """Whether the search ends with the moves repeated per microbatch (``_REPEATED_PASSES``)."""
    return limit <= V_MIN.memory_bound(p) + _EPS and 6 * p * m <= _REPEATED_PASSES


def _repeat_moves(pool: _Pool, base: _Candidate) -> None:
    """Last, the winner improved by moves repeated in every microbatch (local.py), as a
    candidate: so it only adds wins."""
    pool.consider(f"{base.description}, moves repeated per microbatch",
                  functools.partial(_repeated, pool, base.orders))


def _deferred(pool: _Pool, base: _Candidate) -> None:
    """``base`` with its W passes deferred within its own peak (wfill.py) as a candidate."""
    pool.consider(f"{base.description}, W deferred",
                  functools.partial(defer_weight_passes, base.orders, pool.placement, pool.costs,
                                    base.peak * pool.placement.chunks, pool.memory),
                  replayable=False)


def _defer_fastest(pool: _Pool, count: int) -> None:
    for base in _polish_bases(pool.candidates, count):
        _deferred(pool, base)


def _fill_fastest(pool: _Pool, count: int) -> None:
    """The ``count`` fastest candidates with their bubbles filled (gap_fill.py), and the best
    of those with its W passes deferred."""
    before = len(pool.candidates)
    for base in _polish_bases(pool.candidates, count):
        pool.consider(f"{base.description}, gaps filled",
                      functools.partial(fill_gaps, pool.placement, base.orders, pool.memory),
                      replayable=False)
    for base in _polish_bases(pool.candidates[before:], 1):
        _deferred(pool, base)


def _fills_gaps(pool: _Pool) -> bool:
    """Whether the search fills unit-slot bubbles (``_GAPS_FILLED``): not with ``shapes=False``,
    and only below 1F1B's memory where F, B and W take about as long as each other, or where
    the schedule is small (``_SLOT_SPREAD``, ``_GAPS_CHEAP_PASSES``)."""
    costs, p = pool.costs, pool.placement.ranks
    if 6 * p * pool.microbatches <= _GAPS_CHEAP_PASSES:
        return pool.shapes
    return pool.shapes and pool.limit < p - _EPS and all(
        max(f, b, w) <= _SLOT_SPREAD * min(f, b, w)
        for f, b, w in zip(costs.forward, costs.backward, costs.weight))


def _then_polished(pool: _Pool, step: Callable[[], None]) -> None:
    """Runs ``step``, which adds candidates; when one of them wins, it gets the last polish."""
    before = len(pool.candidates)
    step()
    winner = pool.fastest()
    if winner.rank >= before:
        _polish_further(pool, winner)


def _replay_bases(pool: list[_Candidate], count: int, extra: int) -> list[tuple[_Candidate, tuple]]:
    """(base, slacks) to replay: the ``count`` fastest candidates with every slack, then the
    fastest candidate of each other memory peak with one chunk of slack (at most ``extra``).

    A replay fills stalls differently at each memory level, so the order before replay
    predicts the order after it poorly across levels (p = 16, m = 256, costs 1, 1.2, 0.8:
    the 7.5-unit block ranks fourth before replay and first after it).
    """
    ranked = sorted((c for c in pool if c.replayable), key=_key)
    bases = [(c, _REPLAY_SLACK) for c in ranked[:count]]
    peaks = {c.peak for c in ranked[:count]}
    for candidate in ranked[count:]:
        if candidate.peak not in peaks and len(bases) < count + extra:
            peaks.add(candidate.peak)
            bases.append((candidate, _REPLAY_SLACK[-1:]))
    return bases


def _polish_bases(pool: list[_Candidate], count: int) -> list[_Candidate]:
    """The ``count`` fastest candidates with distinct orders: the local search's starts."""
    bases, seen = [], set()
    for candidate in sorted(pool, key=_key):
        if candidate.orders not in seen and len(bases) < count:
            seen.add(candidate.orders)
            bases.append(candidate)
    return bases


def _polish(pool: _Pool, orders, budget: int) -> Improved:
    """``orders`` improved by the local search within the limit (local.py)."""
    passes = sum(len(order) for order in orders)
    return improve(pool.placement, pool.microbatches, orders, pool.costs, pool.cap, pool.memory,
                   _capped(budget, passes))


def _repeated(pool: _Pool, orders) -> Improved:
    """``orders`` improved by moves repeated per microbatch (local.py), budgeted as ``_polish``."""
    budget = _capped(_REPEATED_BUDGET, sum(len(order) for order in orders))
    return improve_repeated(pool.placement, pool.microbatches, orders, pool.costs, pool.cap,
                            pool.memory, budget)


def _final_budget(p: int, m: int) -> int:
    """The last polish's budget: the smaller one from ``_FINAL_POLISH_LARGE_PASSES`` on."""
    return _FINAL_POLISH_LARGE if 6 * p * m >= _FINAL_POLISH_LARGE_PASSES else _FINAL_POLISH_BUDGET


def _capped(budget: int, passes: int) -> int:
    """``budget``, at most ``_BUDGET_PER_PASS`` per pass of the schedule."""
    return min(budget, _BUDGET_PER_PASS * passes)


def _polish_further(pool: _Pool, base: _Candidate) -> None:
    """The last polish, with the larger budget (``_final_budget``), as a candidate."""
    budget = _final_budget(pool.placement.ranks, pool.microbatches)
    pool.consider(f"{base.description}, polished further",
                  functools.partial(_polish, pool, base.orders, budget))


def _key(candidate: _Candidate) -> tuple:
    return (round(candidate.makespan, 9), candidate.peak, candidate.rank)


def _fresh(bases: list[_Candidate], relaid: set, shapes: bool) -> list[_Candidate]:
    """The bases whose orders were not re-laid yet (none when ``shapes`` is off); marks them."""
    if not shapes:
        return []
    out = []
    for base in bases:
        if base.orders not in relaid:
            relaid.add(base.orders)
            out.append(base)
    return out


def _relay(pool: _Pool, base: _Candidate, own: int, cool_down_alone: bool = False) -> None:
    """Candidates from ``base`` re-laid (shapes.py): its warm-up at the limit's peak
    (``pool.full``) and at its ``own`` (chunk-activations), warm-up and cool-down at the
    limit's, and, for the winner of the replays, the cool-down alone."""
    full, placement = pool.full, pool.placement
    for peak in sorted({full, own}):
        pool.consider(f"{base.description}, warm-up re-laid (peak {peak})",
                      functools.partial(reshape_warm_up, placement, base.orders, peak),
                      replayable=False)
    pool.consider(f"{base.description}, warm-up and cool-down re-laid (peak {full})",
                  functools.partial(_relay_both, placement, base.orders, full), replayable=False)
    if cool_down_alone:
        pool.consider(f"{base.description}, cool-down re-laid (peak {full})",
                      functools.partial(reshape_cool_down, placement, base.orders, full),
                      replayable=False)


def _relay_both(placement: Placement, orders, peak: int) -> tuple:
    """The warm-up re-laid, then the cool-down (the order of the paper code's steps)."""
    return reshape_cool_down(placement, reshape_warm_up(placement, orders, peak), peak)


def _named(name: str, p: int, m: int) -> tuple:
    return paper_schedule(name, p, m).rank_actions


def _outgrown(family, p: int, limit: float) -> bool:
    """Whether the next larger fixed block surely fits the limit (its bound is at most the
    limit; a peak never exceeds the bound): then ``family``'s block, slot-reordered or not,
    and below V-Half's memory level the continuous-offset blocks, lose to what the room
    allows. Measured over the reference comparison's grid and the H100 and unbalanced costs
    (p 4-16, m 8-128, 90 points at each of p units, V-Half's and V-Min's bound and 3p/4):
    none of their candidates, nor what was built from them, was the fastest once that
    larger block fitted."""
    larger = _FIXED[_FIXED.index(family) + 1:]
    return bool(larger) and larger[0].memory_bound(p) <= limit + _EPS


def _named_over(family, p: int, m: int, limit: float, memory: MemoryModel) -> bool:
    """Whether a fixed block surely exceeds the limit. For m >= p (default memory model) its
    peak is exactly its bound, (p+4)//3, (p+2)//2 or p units (tests/test_search_pruning.py
    checks this for p up to 32), so building it only to reject it can be skipped."""
    return memory == MemoryModel() and m >= p and family.memory_bound(p) > limit + _EPS


def _wave(p: int, m: int, costs: Costs, limit: float, memory: MemoryModel) -> tuple:
    return wave_schedule(p, m, costs, limit * Layout.V.chunks, memory).orders


def _least_wave(p: int, m: int, costs: Costs, memory: MemoryModel) -> list:
    """(peak, description) of the wave at the least limit it can keep: one microbatch of each
    chunk in flight, the least any V order holds (rank 0 keeps both until the loss)."""
    least = memory.forward  # in units: two chunk-activations
    try:
        orders = _wave(p, m, costs, least, memory)
    except ScheduleError:
        return []
    peak = max(peak_memory(Schedule("probe", Placement(p, Layout.V), m, orders), memory))
    return [(peak, "V-ZB wave, cost-aware")]


def _periodic(p: int, m: int, costs: Costs, scale: float) -> tuple:
    return periodic_orders(periodic_block(p, costs, scale), m)


def _family_within(p: int, m: int, limit: float, memory: MemoryModel, smallest: list, skipped: list):
    """Family blocks whose steady-state memory fits, the ``_FAMILY_BUDGET`` largest first.

    A block whose lifespans alone exceed the limit (:func:`_lifespan_bound`) is not probed;
    it goes to ``skipped``, whose exact peaks matter only when nothing fits (the error message).
    """
    fitting = []
    for offsets in v_family(p):
        block = v_block(p, offsets)
        if block is None:
            continue
        if _steady(block, m) and memory == MemoryModel() and _lifespan_bound(block) > limit + _EPS:
            skipped.append((offsets, block))
            continue
        peak = _probe_peak(block, m, memory)
        smallest.append((peak, f"V family block, {offsets.describe()}"))
        if peak <= limit + _EPS:
            fitting.append((-peak, offsets, block))
    fitting.sort(key=lambda x: (x[0], x[1]))
    return [(offsets, block) for _, offsets, block in fitting[:_FAMILY_BUDGET]]


def _steady_microbatches(block) -> int:
    """Microbatches after which a repeated block is in its steady state (a lifespan's worth)."""
    return max(slot for rank in block.slots for _, slot in rank) // block.interval + 3


def _steady(block, m: int) -> bool:
    return m >= _steady_microbatches(block)


def _probe_peak(block, m: int, memory: MemoryModel) -> float:
    """Peak memory of a short repeat: steady state is reached after a lifespan of microbatches."""
    short = min(m, _steady_microbatches(block))
    return repeated_peak(block, short, memory) / Layout.V.chunks


def _lifespan_bound(block) -> float:
    """A lower bound (units) on a repeated V block's peak (paper: memory ~ lifespan / interval).

    On each rank a chunk's activation lives from its F to past its W, at least one slot after
    its B; in steady state the rank holds (lifespan of chunk 0 + lifespan of chunk 1) /
    interval chunk-activations on average, so at least the floor of that at its peak.
    """
    worst = 0
    for rank in block.slots:
        slot = dict(rank)
        lifespans = sum(slot[(B, c)] + 2 - slot[(F, c)] for c in (0, 1))
        worst = max(worst, lifespans // block.interval)
    return worst / 2


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
