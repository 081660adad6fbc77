"""The adaptive search's constructions (adaptive.py's module doc, first rows): the fixed
blocks, also slot-reordered, the V-ZB wave, the V family blocks that fit and the
continuous-offset blocks, each a candidate of the pool (pool.py); and the error when none fits.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import dataclasses
import functools

from ..construct.blocks import V_HALF, V_MIN, V_ZB
from ..construct.compose import compose, repeated_peak
from ..construct.family import v_block, v_family
from ..construct.named import paper_schedule
from ..construct.periodic import periodic_block, periodic_orders
from ..construct.slot_reorder import slot_reorder
from ..construct.wave import wave_schedule
from ..model.actions import PassKind, ScheduleError
from ..model.costs import MemoryModel
from ..model.placement import Layout
from ..model.problem import Problem
from ..model.provenance import describe, step
from ..model.schedule import Schedule
from ..model.simulate import peak_memory
from .pool import Pool

__all__ = ["InfeasibleMemoryError", "WAVE", "blocks", "fixed_blocks", "tries_wave",
           "wave_or_none_fits", "family_blocks", "below_v_half", "continuous_blocks", "infeasible",
           "wave_orders",
           "fixed_block_over", "lifespan_bound", "probe_peak", "reaches_steady_state"]

_EPS = 1e-9
F, B = PassKind.F, PassKind.B
_FIXED = (V_MIN, V_HALF, V_ZB)
WAVE = (step("wave"),)
"""The wave's provenance (it is also the search's fallback where nothing else fits)."""


class InfeasibleMemoryError(ScheduleError):
    """No V schedule fits the limit; names the smallest peak found and what reaches it."""

    def __init__(self, limit: float, smallest: float, schedule: str):
        super().__init__(
            f"memory limit {limit:g} units is below every V schedule for this setting: the "
            f"smallest achievable peak is {smallest:g} units, reached by {schedule}"
        )
        self.limit, self.smallest, self.schedule = limit, smallest, schedule


def blocks(pool: Pool) -> None:
    """The V blocks repeated and squeezed: the paper's three (``fixed_blocks``), then the V
    family's closest under the limit (``family_blocks``); one job, on the paper's blocks and
    on the family's."""
    fixed_blocks(pool)
    family_blocks(pool)


def fixed_blocks(pool: Pool) -> None:
    """V-Min, V-Half and V-ZB as the paper builds them, V-Min and V-Half also slot-reordered;
    a block that surely exceeds the limit is not built (``fixed_block_over``), nor one whose
    next larger block surely fits (``_outgrown``)."""
    problem = pool.problem
    p, m, limit, memory = problem.ranks, problem.microbatches, problem.limit, problem.memory
    for family in _FIXED:
        if fixed_block_over(family, p, m, limit, memory):  # its peak is known: skip the build
            pool.smallest.append((family.memory_bound(p), (step("block", family=family.name),)))
            continue
        if _outgrown(family, p, limit):
            continue
        block = step("block", family=family.name)
        pool.consider((block,), functools.partial(_named, family.name, p, m))
        if family is not V_ZB:
            pool.consider((block, step("slot-reordered")),
                          functools.partial(slot_reorder, family.build(p), m), replayable=False)


def tries_wave(pool: Pool) -> bool:
    """Whether the wave is a construction (``wave_cheap_passes``); else it is only the
    fallback where nothing else fits."""
    p, m = pool.problem.ranks, pool.problem.microbatches
    return pool.problem.limit >= p - _EPS or 6 * p * m <= pool.settings.wave_cheap_passes


def wave_or_none_fits(pool: Pool) -> None:
    """The V-ZB wave under the limit (wave.py), a finished order (not replayed), last of the
    constructions; where still nothing fits, the error (``infeasible``)."""
    pool.consider(WAVE, functools.partial(wave_orders, pool), replayable=False)
    if not pool.candidates:
        raise infeasible(pool)


def family_blocks(pool: Pool) -> None:
    """The ``family_budget`` V family blocks closest under the limit (``_family_within``);
    those skipped unprobed go to ``pool.skipped`` (the error message's)."""
    problem = pool.problem
    p, m, limit = problem.ranks, problem.microbatches, problem.limit
    for offsets, block in _family_within(p, m, limit, problem.memory, pool.smallest,
                                         pool.skipped, pool.settings.family_budget):
        block = dataclasses.replace(block, memory_bound=limit)
        pool.consider((step("family block", offsets=offsets),),
                      functools.partial(compose, block, m))


def below_v_half(pool: Pool) -> bool:
    """Whether V-Half's block does not surely fit (``_outgrown``): the continuous blocks' room."""
    return not _outgrown(V_MIN, pool.problem.ranks, pool.problem.limit)


def continuous_blocks(pool: Pool) -> None:
    """periodic.py's cost-aware blocks at the ``period_scales`` periods."""
    for scale in pool.settings.period_scales:
        pool.consider((step("continuous block", scale=scale),),
                      functools.partial(_periodic, pool.problem, scale))


def wave_orders(pool: Pool) -> tuple:
    """The V-ZB wave's orders under the pool's limit (wave.py)."""
    return wave_schedule(pool.problem).orders


def infeasible(pool: Pool) -> InfeasibleMemoryError:
    """The error when nothing fits: the smallest peak of anything built, of the family blocks
    skipped unprobed and of the wave at the least it can keep."""
    problem = pool.problem
    m, memory = problem.microbatches, problem.memory
    pool.smallest.extend((probe_peak(block, m, memory), (step("family block", offsets=offsets),))
                         for offsets, block in pool.skipped)
    pool.smallest.extend(_least_wave(problem))
    peak, steps = min(pool.smallest, key=lambda smallest: (smallest[0], describe(smallest[1])))
    return InfeasibleMemoryError(problem.limit, peak, describe(steps))


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


def fixed_block_over(family, p: int, m: int, limit: float, memory: MemoryModel) -> bool:
    """Whether a fixed block surely exceeds the limit. For m >= p (default memory model) its
    peak is exactly its bound, (p+4)//3, (p+2)//2 or p units (tests/schedule/test_search_pruning.py
    checks this for p up to 32), so building it only to reject it can be skipped."""
    return memory == MemoryModel() and m >= p and family.memory_bound(p) > limit + _EPS


def _least_wave(problem: Problem) -> list:
    """(peak, provenance) of the wave at the least limit it can keep: one microbatch of each
    chunk in flight, the least any V order holds (rank 0 keeps both until the loss)."""
    least = problem.with_limit(problem.memory.forward)  # in units: two chunk-activations
    try:
        orders = wave_schedule(least).orders
    except ScheduleError:
        return []
    schedule = Schedule("probe", problem.placement, problem.microbatches, orders)
    return [(max(peak_memory(schedule, problem.memory)), WAVE)]


def _periodic(problem: Problem, scale: float) -> tuple:
    return periodic_orders(periodic_block(problem, scale), problem.microbatches)


def _family_within(p: int, m: int, limit: float, memory: MemoryModel, smallest: list,
                   skipped: list, budget: int):
    """Family blocks whose steady-state memory fits, the ``budget`` largest first.

    A block whose lifespans alone exceed the limit (:func:`lifespan_bound`) is not probed;
    it goes to ``skipped``, whose exact peaks matter only when nothing fits (the error message).
    """
    fitting = []
    for offsets in v_family(p):
        block = v_block(p, offsets)
        if block is None:
            continue
        if (reaches_steady_state(block, m) and memory == MemoryModel()
                and lifespan_bound(block) > limit + _EPS):
            skipped.append((offsets, block))
            continue
        peak = probe_peak(block, m, memory)
        smallest.append((peak, (step("family block", offsets=offsets),)))
        if peak <= limit + _EPS:
            fitting.append((-peak, offsets, block))
    fitting.sort(key=lambda x: (x[0], x[1]))
    return [(offsets, block) for _, offsets, block in fitting[:budget]]


def _steady_microbatches(block) -> int:
    """Microbatches after which a repeated block is in its steady state (a lifespan's worth)."""
    return max(slot for rank in block.slots for _, slot in rank) // block.interval + 3


def reaches_steady_state(block, m: int) -> bool:
    """Whether ``m`` microbatches of the repeated block reach its steady state (where
    :func:`lifespan_bound` bounds its peak)."""
    return m >= _steady_microbatches(block)


def probe_peak(block, m: int, memory: MemoryModel) -> float:
    """Peak memory of a short repeat: steady state is reached after a lifespan of microbatches."""
    short = min(m, _steady_microbatches(block))
    return repeated_peak(block, short, memory) / Layout.V.chunks


def lifespan_bound(block) -> float:
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
