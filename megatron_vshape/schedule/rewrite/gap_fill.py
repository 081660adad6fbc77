"""Bubbles filled greedily without raising the peak: the last reordering step of the paper
code's adaptive search (sail-sg/zero-bubble-pipeline-parallelism, ``v_auto_schedule.py``,
``reorder_greedily_without_increasing_peak_mem``: facts read there, nothing copied).

The order is squeezed into unit slots (every pass one slot, hops free:
:func:`.reshape_ends.unit_slots`). Going through the slots column by column, rank by rank, an empty
slot takes the first later pass of its rank, tried per (kind, stage) in the order they come, that

    has its dependencies in earlier columns, and
    keeps the rank within the peak: a forward raises the rank's level from the empty slot
    until its old one, so the highest level in between plus one forward must fit;

the pass moves into the slot and the scan goes on from there. Only the first later pass of each
(kind, stage) is tried, so every stage keeps its microbatch order and the result lowers like its
input; the peak never rises (B and W passes moved earlier only lower the levels between).

Why: after the warm-up is re-laid (reshape_ends.py), a rank waits in the transition for its first
chunk-0 gradient; the paper code runs the next chunk-0 F there (rank 0, p = 16: ``B1.5 W1.5
F0.11 B0.0``, where the re-laid order has ``B1.5 B0.0 W1.5 W0.0 F0.11``). At costs 2,2,2 with
hops that step was what put the reference's search ahead of ours at V-Min's limit (p = 16,
m = 16/32/64, hop 0.1: 169.0/274.0/483.8 vs 169.4/274.2/484.2; hop 0.5, m = 64: 647.0 vs 649.0).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

from ..model.actions import Action, PassKind
from ..model.indexed import PassIndex
from ..model.problem import Problem
from ..model.simulate import level_peak
from .reshape_ends import unit_slots

__all__ = ["fill_gaps"]

_EPS = 1e-9
_EMPTY = -1
"""A bubble in a rank's row of pass ids."""


def fill_gaps(problem: Problem, orders) -> tuple[tuple[Action, ...], ...]:
    """``orders`` with their unit-slot bubbles filled (module doc), within their own peak in
    chunk-activations under the problem's memory model: the peak never rises, so the
    problem's limit is not read. Works on pass ids (indexed.py), and a bubble's scan stops
    once every (kind, stage) of the rank was tried, a forward that does not fit too (every
    later pass is then of a tried kind): the 3 gap-filled candidates of v-min's search at
    p = 16, m = 64 took 0.115 s with their simulations on actions and a scan to the rank's
    end, 0.037 s now, same orders."""
    memory = problem.memory
    index = PassIndex.for_orders(problem.placement, orders)
    grid, column = _grid(index, orders)
    step = index.steps(memory)
    peak = max(level_peak((a.kind for a in order), memory) for order in orders)
    level = [0.0] * problem.ranks
    last = [max((j for j, a in enumerate(row) if a != _EMPTY), default=-1) for row in grid]
    group = [a // index.microbatches for a in range(len(index.actions))]  # kind and stage
    kinds = [len({group[a] for a in row if a != _EMPTY}) for row in grid]
    scan = _Scan(index, step, group, column, peak)
    for j in range(len(grid[0])):
        for rank, row in enumerate(grid):
            if row[j] == _EMPTY and j < last[rank]:
                k = scan.movable(row, j, last[rank], kinds[rank], level[rank])
                if k is not None:
                    row[j], row[k] = row[k], _EMPTY
                    column[row[j]] = j
                    if k == last[rank]:
                        last[rank] = max(i for i in range(k) if row[i] != _EMPTY)
            if row[j] != _EMPTY:
                level[rank] += step[row[j]]
    return index.decode([a for a in row if a != _EMPTY] for row in grid)


def _grid(index: PassIndex, orders) -> tuple[list[list[int]], list[int]]:
    """Per rank, the ids of its passes at their unit slots (``_EMPTY``: a bubble), and each
    id's slot (past every slot when the orders do not run it, e.g. a B fused into a BW)."""
    slots = unit_slots(index.placement, index.microbatches, orders)
    width = 1 + max(max(rank, default=-1) for rank in slots)
    grid = [[_EMPTY] * width for _ in orders]
    column = [width] * len(index.actions)
    for row, ids, rank_slots in zip(grid, index.encode(orders), slots):
        for a, slot in zip(ids, rank_slots):
            row[slot] = a
            column[a] = slot
    return grid, column


class _Scan:
    """What the search for a pass to fill a bubble reads (pass ids, per-id lists)."""

    def __init__(self, index: PassIndex, step: list, group: list, column: list, peak: float):
        self.dep, self.step, self.group, self.column = index.dep, step, group, column
        self.forward = [kind is PassKind.F for kind in index.kind]
        self.peak = peak + _EPS

    def movable(self, row: list, j: int, last: int, kinds: int, level: float) -> int | None:
        """The slot of the pass that may move into the bubble at ``j`` (module doc), or None;
        the scan ends once each of the rank's ``kinds`` (kind, stage) pairs was tried."""
        dep, step, group, column, forward = self.dep, self.step, self.group, self.column, \
            self.forward
        tried: set = set()
        rise = top = 0.0  # the level after each later slot, relative to ``level``, and its highest
        for k in range(j + 1, last + 1):
            a = row[k]
            if a == _EMPTY:
                continue
            before = top
            rise += step[a]
            if rise > top:
                top = rise
            if group[a] in tried:
                continue
            tried.add(group[a])
            if not (forward[a] and level + before + step[a] > self.peak):
                d = dep[a]
                if d < 0 or column[d] < j:
                    return k
            if len(tried) == kinds:  # every later pass's first of its kind was tried
                return None
        return None
