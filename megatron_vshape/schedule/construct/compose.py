"""Block -> schedule: repeat, then squeeze and reorder under the block's memory bound.

Paper, section 4: a schedule is a building block repeated every ``interval`` slots, then
squeezed (each pass as early as its dependencies allow) with the warm-up and cool-down
reordered so that bubbles shrink while the peak memory never exceeds the block's bound.

Orders are built in *slots* (every pass one slot, no communication), so they do not depend on
the costs; the simulator times them with real costs afterwards. A block names the reorder
variants worth trying (``BuildingBlock.reorders``):

    plain      the repeated order, squeezed only
    cooldown   plain until the rank's last chunk-0 F, then backwards tight, W last
               (cooldown_reorder.py)
    head       slot-level list scheduling in block order (list_scheduler.py)
    backward   the same, a ready B first
    zbv        the hand-written ZB-V order (zbv.py), for the V-ZB block

Each is scored in unit slots and the fastest kept; every candidate stays within the bound
(checked here: a variant that cannot make it is dropped, and the plain order is the fallback).
"""
from __future__ import annotations

import functools
import logging
import operator
from collections import deque

from ..model.actions import Action, PassKind, ScheduleError
from ..model.costs import MemoryModel
from .blocks import BuildingBlock
from .cooldown_reorder import cool_down
from .list_scheduler import POLICIES, list_schedule
from ..model.placement import Placement
from ..model.schedule import Schedule
from ..model.simulate import peak_memory, simulate
from .zbv import zbv_order

__all__ = ["repeat", "repeated_peak", "compose", "REORDERS"]

log = logging.getLogger(__name__)

F, B, W = PassKind.F, PassKind.B, PassKind.W
_SLOT = operator.itemgetter(0)
_COMPOSED_KEPT = 64
_REPEATED_KEPT = 256
"""Orders built and kept, per (block, microbatches): orders in slots depend on nothing else,
so one search (and the second one a B-freeing memory model runs, search/adaptive.py), the
memory levels and the frontier's limits share them instead of rebuilding. One search composes
about 10 blocks and repeats about 100 short probes; at p = 32, m = 256 an order holds 49,152
passes, so the kept composed orders stay bounded (about 200 MB at most). Typed: 8.0
microbatches is not served 8's orders but reaches the validation."""


@functools.lru_cache(maxsize=_REPEATED_KEPT, typed=True)
def repeat(block: BuildingBlock, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Place microbatch k's passes at block slot + interval*k; W passes go FIFO into the
    next free slot after their B. Returns each rank's passes sorted by slot."""
    placement = Placement(block.ranks, block.layout)
    orders = []
    for rank, rank_slots in enumerate(block.slots):
        timed = []
        for (kind, chunk), slot in rank_slots:
            stage = placement.stage_of(rank, chunk)
            timed.extend((slot + block.interval * k, Action(kind, stage, k))
                         for k in range(microbatches))
        timed.sort(key=_SLOT)
        passes = [a for _, a in timed]
        if block.split_backward:
            passes = _place_weight_passes([s for s, _ in timed], passes, block.interval)
        orders.append(tuple(passes))
    return tuple(orders)


def repeated_peak(block: BuildingBlock, microbatches: int, memory: MemoryModel) -> float:
    """The highest level (chunk-activations under ``memory``) any rank of :func:`repeat`'s
    orders reaches, without building them: the search reads the peaks of about 70 short
    repeats per search (p = 16). Each rank's passes sit at distinct slots, so they are laid
    on a line of slots and walked once, a free residue of the interval retiring the oldest
    owed W as ``_place_weight_passes`` places it (68 family blocks at p = 16, m = 64:
    32 -> 16 ms; tests/schedule/test_reorders.py compares it with the repeated orders' levels)."""
    deltas, interval = memory.deltas, block.interval
    highest = 0.0
    for rank_slots in block.slots:
        used = {slot % interval for _, slot in rank_slots}
        free = [residue not in used for residue in range(interval)]
        first = min(slot for _, slot in rank_slots)
        end = max(slot for _, slot in rank_slots) + interval * (microbatches - 1) + 1
        line = [None] * end
        for (kind, _), slot in rank_slots:
            line[slot:slot + interval * microbatches:interval] = [kind] * microbatches
        highest = max(highest, _line_peak(line, free, first - first % interval,
                                          deltas, block.split_backward))
    return highest


def _line_peak(line: list, free: list, start: int, deltas: dict, split: bool) -> float:
    """The highest level of one rank's ``line`` of slots (``repeated_peak``), from ``start``."""
    interval, end, weight = len(free), len(line), deltas[W]
    level = peak = 0.0
    owed, slot = 0, start
    while slot < end or owed:
        kind = line[slot] if slot < end else None
        if kind is None:
            if owed and free[slot % interval]:
                owed -= 1
                level += weight
        else:
            level += deltas[kind]
            if level > peak:
                peak = level
            if split and kind is B:
                owed += 1
        slot += 1
    return peak


def _place_weight_passes(slots: list, passes: list, interval: int) -> list:
    """``passes`` (at ``slots``, in increasing order) with W passes merged in, first in first
    out, into the free residues after their B. ``repeated_peak`` walks the same rule on a line
    of slots (one walker for both, building a list of kinds, took the probes' 15 ms to 24)."""
    free = sorted(set(range(interval)) - {slot % interval for slot in slots})
    queue, out = deque(), []
    base = slots[0] - slots[0] % interval
    index, count = 0, len(slots)
    while index < count or queue:
        for residue in free:
            slot = base + residue
            while index < count and slots[index] < slot:
                out.append(passes[index])
                if passes[index].kind is B:
                    queue.append(passes[index])
                index += 1
            if queue:
                b = queue.popleft()
                out.append(Action(W, b.stage, b.microbatch))
        base += interval
    return out


def _slot_score(placement: Placement, orders) -> tuple[int, int]:
    """Makespan of orders under unit slots, and the worst per-rank span; cost-independent."""
    result = simulate(Schedule("candidate", placement, 1, tuple(orders)))
    return (round(result.makespan * placement.chunks), round(result.bubble_rate_span * 1e9))


def _plain(block, orders, microbatches):
    return orders


def _cooldown(block, orders, microbatches):
    placement = Placement(block.ranks, block.layout)
    return tuple(tuple(o) for o in cool_down(orders, placement, block.memory_bound_chunks))


def _policy(name):
    return lambda block, orders, microbatches: list_schedule(block, orders, microbatches, POLICIES[name])


def _zbv(block, orders, microbatches):
    if block.layout.chunks != 2:
        raise ScheduleError("the ZB-V order needs the V layout")
    return zbv_order(block.ranks, microbatches)


REORDERS = {
    "plain": _plain,
    "cooldown": _cooldown,
    "head": _policy("head"),
    "backward": _policy("backward"),
    "zbv": _zbv,
}
"""Reorder variant name -> (block, repeated orders, microbatches) -> per-rank orders."""


@functools.lru_cache(maxsize=_COMPOSED_KEPT, typed=True)
def compose(block: BuildingBlock, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action orders for ``microbatches`` microbatches of ``block``.

    Each of the block's reorder variants is built and scored in unit slots; the fastest one
    within the block's memory bound is kept (ties: the first listed). Cached per (block,
    microbatches) (``_COMPOSED_KEPT``): the result is immutable and cost-independent.
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    unknown = [name for name in block.reorders if name not in REORDERS]
    if unknown:
        raise ScheduleError(f"block {block.name}: unknown reorders {unknown}; valid: {sorted(REORDERS)}")
    orders = repeat(block, microbatches)
    placement = Placement(block.ranks, block.layout)
    candidates = []
    for name in block.reorders:
        try:
            candidate = REORDERS[name](block, orders, microbatches)
        except ScheduleError as err:
            log.debug("reorder %s of %s dropped: %s", name, block.name, err)
            continue
        if _fits(placement, candidate, block.memory_bound):
            candidates.append(candidate)
    if not candidates:
        if not _fits(placement, orders, block.memory_bound):
            raise ScheduleError(f"block {block.name}: no reorder variant fits its memory bound")
        candidates.append(orders)
    if len(candidates) == 1:
        return candidates[0]
    return min(candidates, key=lambda c: _slot_score(placement, c))


def _fits(placement: Placement, orders, bound: float) -> bool:
    return max(peak_memory(Schedule("candidate", placement, 1, tuple(orders)))) <= bound + 1e-9
