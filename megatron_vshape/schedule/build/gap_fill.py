"""Bubbles filled greedily without raising the peak: the last reordering step of the paper
code's adaptive search (sail-sg/zero-bubble-pipeline-parallelism, ``v_auto_schedule.py``,
``reorder_greedily_without_increasing_peak_mem``: facts read there, nothing copied).

The order is squeezed into unit slots (every pass one slot, hops free: :func:`.shapes.unit_
slots`). Going through the slots column by column, rank by rank, an empty slot takes the first
later pass of its rank, tried per (kind, stage) in the order they come, that

    has its dependencies in earlier columns, and
    keeps the rank within the peak: a forward raises the rank's level from the empty slot
    until its old one, so the highest level in between plus one forward must fit;

the pass moves into the slot and the scan goes on from there. Only the first later pass of each
(kind, stage) is tried, so every stage keeps its microbatch order and the result lowers like its
input; the peak never rises (B and W passes moved earlier only lower the levels between).

Why: after the warm-up is re-laid (shapes.py), a rank waits in the transition for its first
chunk-0 gradient; the paper code runs the next chunk-0 F there (rank 0, p = 16: ``B1.5 W1.5
F0.11 B0.0``, where the re-laid order has ``B1.5 B0.0 W1.5 W0.0 F0.11``). At costs 2,2,2 with
hops that step was what put the reference's search ahead of ours at V-Min's limit (p = 16,
m = 16/32/64, hop 0.1: 169.0/274.0/483.8 vs 169.4/274.2/484.2; hop 0.5, m = 64: 647.0 vs 649.0).
"""
from __future__ import annotations

from ..model.actions import Action, PassKind
from ..model.costs import MemoryModel
from ..model.deps import dependencies
from ..model.placement import Placement
from ..model.simulate import level_peak
from .shapes import unit_slots

__all__ = ["fill_gaps"]

_EPS = 1e-9


def fill_gaps(placement: Placement, orders, memory: MemoryModel = MemoryModel()
              ) -> tuple[tuple[Action, ...], ...]:
    """``orders`` with their unit-slot bubbles filled (module doc), within their own peak in
    chunk-activations under ``memory``."""
    microbatches = 1 + max(a.microbatch for order in orders for a in order)
    grid, column = _grid(placement, microbatches, orders)
    step = memory.deltas
    peak = max(level_peak((a.kind for a in order), memory) for order in orders)
    level = [0.0] * placement.ranks
    last = [max((j for j, a in enumerate(row) if a is not None), default=-1) for row in grid]
    kinds = [len({(a.kind, a.stage) for a in order}) for order in orders]
    for j in range(len(grid[0])):
        for rank, row in enumerate(grid):
            if row[j] is None and j < last[rank]:
                k = _movable(placement, row, j, last[rank], kinds[rank], level[rank], peak,
                             step, column)
                if k is not None:
                    row[j], row[k] = row[k], None
                    column[row[j]] = j
                    if k == last[rank]:
                        last[rank] = max(i for i in range(k) if row[i] is not None)
            if row[j] is not None:
                level[rank] += step[row[j].kind]
    return tuple(tuple(a for a in row if a is not None) for row in grid)


def _grid(placement: Placement, microbatches: int, orders) -> tuple[list[list], dict]:
    """Per rank, its passes at their unit slots (None: a bubble), and each pass's slot."""
    slots = unit_slots(placement, microbatches, orders)
    width = 1 + max(max(rank, default=-1) for rank in slots)
    grid: list[list] = [[None] * width for _ in orders]
    column = {}
    for row, order, rank_slots in zip(grid, orders, slots):
        for action, slot in zip(order, rank_slots):
            row[slot] = action
            column[action] = slot
    return grid, column


def _movable(placement: Placement, row: list, j: int, last: int, kinds: int, level: float,
             peak: float, step: dict, column: dict) -> int | None:
    """The slot of the pass that may move into the bubble at ``j`` (module doc), or None;
    the scan ends once each of the rank's ``kinds`` (kind, stage) pairs was tried."""
    tried: set = set()
    rise = top = 0.0  # the level after each later slot, relative to ``level``, and its highest
    for k in range(j + 1, last + 1):
        action = row[k]
        if action is None:
            continue
        before = top
        rise += step[action.kind]
        top = max(top, rise)
        if (action.kind, action.stage) in tried:
            continue
        tried.add((action.kind, action.stage))
        if action.kind is PassKind.F and level + before + step[action.kind] > peak + _EPS:
            continue
        if all(column.get(d, j) < j for d in dependencies(action, placement.num_stages)):
            return k
        if len(tried) == kinds:
            return None
    return None
