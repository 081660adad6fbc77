"""Adaptive V scheduler: the fastest schedule under a memory limit, for measured costs.

Candidates, all V-shaped (two chunks per rank):

    fixed blocks     V-Min, V-Half, V-ZB as the registry builds them
    block family     offsets (k1, k2, split) of family.py, repeated, squeezed, cool-down reordered
    continuous       periodic.py's cost-aware blocks (real-time offsets), a few periods
    timed replay     the best few of the above replayed in real time under the limit (timed.py),
                     which fills the stalls of unbalanced costs with W, B and fitting F passes

Each candidate is timed by the simulator with the real costs and kept only when its peak memory
is within the limit; the one with the smallest makespan wins (ties: less memory, then the order
above, so results are deterministic). Pruning: a block's memory is read off a short repeat
(steady state is reached after a lifespan's worth of microbatches) before anything else is
built, and only the ``_FAMILY_BUDGET`` family blocks closest under the limit are built in full:
more memory buys fewer bubbles. Results are cached per (p, m, costs, limit, memory model).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Callable

from .actions import ScheduleError
from .compose import compose, repeat
from .costs import Costs, MemoryModel
from .family import v_block, v_family
from .periodic import periodic_block, periodic_orders
from .placement import Layout, Placement
from .schedule import Schedule
from .simulate import SimResult, peak_memory, simulate
from .timed import timed_list_schedule

__all__ = ["InfeasibleMemoryError", "SearchResult", "search", "frontier", "memory_limit_units"]

_FAMILY_BUDGET = 6
_REPLAYS = 2
_REPLAY_WINDOWS = (4,)
_PERIOD_SCALES = (1.0, 1.1, 1.2, 1.35, 1.5)
_EPS = 1e-9


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


def memory_limit_units(ranks: int, microbatches: int, fraction: float | None = None,
                       limit_bytes: float | None = None, activation_bytes: float | None = None) -> float:
    """A memory limit in units (one microbatch's activations of one rank's share of layers).

    Either ``fraction`` of 1F1B's peak (min(p, m) units), or ``limit_bytes`` together with
    ``activation_bytes`` (the bytes of one such unit).
    """
    if fraction is not None:
        if limit_bytes is not None:
            raise ScheduleError("give the memory limit as a fraction of 1F1B or in bytes, not both")
        if not fraction > 0:
            raise ScheduleError(f"memory limit fraction must be > 0 (e.g. 0.5), got {fraction!r}")
        return fraction * min(ranks, microbatches)
    if limit_bytes is None or activation_bytes is None:
        raise ScheduleError("a memory limit in bytes needs the per-microbatch activation bytes too")
    if limit_bytes <= 0 or activation_bytes <= 0:
        raise ScheduleError(f"memory limit bytes and activation bytes must be > 0, got "
                            f"{limit_bytes!r}, {activation_bytes!r}")
    return limit_bytes / activation_bytes


@dataclass(frozen=True)
class _Candidate:
    description: str
    orders: tuple
    peak: float
    makespan: float
    rank: int  # position in the candidate list, for deterministic ties


def search(ranks: int, microbatches: int, costs: Costs | None = None, limit: float | None = None,
           memory: MemoryModel = MemoryModel()) -> SearchResult:
    """The fastest V schedule whose peak memory is at most ``limit`` units (default: 1F1B's)."""
    costs = costs or Costs.build(ranks)
    limit = float(min(ranks, microbatches) if limit is None else limit)
    return _search_cached(ranks, microbatches, costs, limit, memory)


@functools.lru_cache(maxsize=256)
def _search_cached(p: int, m: int, costs: Costs, limit: float, memory: MemoryModel) -> SearchResult:
    if not isinstance(p, int) or p < 2:
        raise ScheduleError(f"ranks must be an integer >= 2, got {p!r}")
    if not isinstance(m, int) or m < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {m!r}")
    started = time.perf_counter()
    placement = Placement(p, Layout.V)
    pool: list[_Candidate] = []
    smallest: list[tuple[float, str]] = []

    def consider(description: str, build: Callable[[], tuple]) -> None:
        try:
            orders = build()
        except ScheduleError:
            return
        schedule = Schedule("auto", placement, m, orders)
        peak = max(peak_memory(schedule, memory))
        smallest.append((peak, description))
        if peak <= limit + _EPS:
            result = simulate(schedule, costs, memory)
            pool.append(_Candidate(description, orders, peak, result.makespan, len(pool)))

    for name in ("v-min", "v-half", "v-zb"):
        consider(f"{name} block", functools.partial(_named, name, p, m))
    for offsets, block in _family_within(p, m, limit, memory, smallest):
        consider(f"V family block, {offsets.describe()}",
                 functools.partial(compose, dataclasses.replace(block, memory_bound=limit), m))
    for scale in _PERIOD_SCALES:
        consider(f"continuous-offset block, period x{scale:g}",
                 functools.partial(_periodic, p, m, costs, scale))
    best = sorted(pool, key=_key)[:_REPLAYS]
    for base in best:
        for window in _REPLAY_WINDOWS:
            for slack in (0, 1):  # one chunk of slack: the replay's peak often lands lower
                consider(f"{base.description}, replayed in time (window {window})",
                         functools.partial(timed_list_schedule, base.orders, placement, costs,
                                           limit * placement.chunks + slack, memory, window))
    if not pool:
        peak, description = min(smallest)
        raise InfeasibleMemoryError(limit, peak, description)
    winner = min(pool, key=_key)
    schedule = Schedule("auto", placement, m, winner.orders, memory_bound=limit,
                        description=f"auto: {winner.description} (limit {limit:g} units)")
    return SearchResult(schedule, simulate(schedule, costs, memory),
                        time.perf_counter() - started, len(pool))


def _key(candidate: _Candidate) -> tuple:
    return (round(candidate.makespan, 9), candidate.peak, candidate.rank)


def _named(name: str, p: int, m: int) -> tuple:
    from .registry import build_schedule  # registry imports search for "auto"

    return build_schedule(name, p, m).rank_actions


def _periodic(p: int, m: int, costs: Costs, scale: float) -> tuple:
    return periodic_orders(periodic_block(p, costs, scale), m)


def _family_within(p: int, m: int, limit: float, memory: MemoryModel, smallest: list):
    """Family blocks whose steady-state memory fits, the ``_FAMILY_BUDGET`` largest first."""
    fitting = []
    for offsets in v_family(p):
        block = v_block(p, offsets)
        if block is None:
            continue
        max_slot = max(slot for rank in block.slots for _, slot in rank)
        short = min(m, max_slot // block.interval + 3)
        schedule = Schedule("probe", Placement(p, Layout.V), short, repeat(block, short))
        peak = max(peak_memory(schedule, memory))
        smallest.append((peak, f"V family block, {offsets.describe()}"))
        if peak <= limit + _EPS:
            fitting.append((-peak, offsets, block))
    fitting.sort(key=lambda x: (x[0], x[1]))
    return [(offsets, block) for _, offsets, block in fitting[:_FAMILY_BUDGET]]


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
