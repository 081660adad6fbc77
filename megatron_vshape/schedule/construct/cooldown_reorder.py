"""Cool-down reorder (paper, section 4, step 4): backwards tight, weight passes last.

The repeated block keeps its steady pattern to the very end, so the last microbatches' B passes
wait behind W passes while the gradient travels the whole V back to rank 0. This pass keeps each
rank's squeezed order until the rank has run its last chunk-0 forward (after that only the
up-leg forwards, the backwards and the W passes remain), then at every slot runs:

    the first ready pass in order that is not a W (an up-leg F only if it fits the bound)
    else the oldest W whose B is done          (W passes fill the waits of the backward chain)

Deferring W passes never raises memory once no forward follows; an up-leg forward that would
exceed the bound waits, and a W runs to make room.

Until the first rank reaches its tail every rank runs its order as early as it can, one pass
per slot: that is the order's unit-slot timing (model/indexed.py's dataflow, durations 1, no
hop), so one timing gives it, and the slot-by-slot walk, on pass ids, starts where the first
tail does (p = 16, m = 64: at slot 355 of 427; 4.2 -> 3.2 ms per compose).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import bisect

from ..model.actions import Action, PassKind, ScheduleError
from ..model.indexed import Dataflow, PassIndex, gather
from ..model.placement import Placement

__all__ = ["cool_down", "last_chunk0_forward"]

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW
_INF = float("inf")
_DELTA = {F: 1, B: 0, W: -1, BW: -1}


def last_chunk0_forward(index: PassIndex, rank: int, order: list[int]) -> int:
    """Position of the last chunk-0 forward in ``rank``'s order of pass ids (-1: none): after
    it only up-leg forwards, backwards and W passes are left, the rank's tail (here and in
    critical_path_cooldown.py)."""
    first = index.first_id(F, index.placement.stage_of(rank, 0))  # + microbatch: its forwards
    return max((i for i, a in enumerate(order) if first <= a < first + index.microbatches),
               default=-1)


class _RankCursor:
    """One rank's remaining passes (ids) and state while the pass walks the slots."""

    def __init__(self, order: list[int], index: PassIndex, rank: int):
        self.order = order
        self.next = 0
        self.switch = last_chunk0_forward(index, rank, order)
        """Index of the rank's last chunk-0 forward: the tail is reordered after it."""
        self.tail: list[int] | None = None
        self.memory = 0
        self.out: list[int] = []

    @property
    def done(self) -> bool:
        return self.next == len(self.order) and not self.tail

    def advance(self, to: int) -> None:
        """The passes before position ``to`` are run; past the switch the rest is the tail."""
        self.next = to
        if to > self.switch:
            self.tail, self.next = self.order[to:], len(self.order)


class _Walk:
    """What the slot walk reads per pass id, and the end slot of every pass run so far."""

    def __init__(self, index: PassIndex, cap: int):
        self.index, self.cap = index, cap
        self.delta = [_DELTA[kind] for kind in index.kind]
        self.finished = [_INF] * len(index.actions)
        """Per completion id, the slot from which what it completes is available."""

    def take(self, cursor: _RankCursor, action: int, t: int) -> None:
        cursor.out.append(action)
        cursor.memory += self.delta[action]
        self.finished[self.index.key[action]] = t + 1

    def ready(self, action: int, t: int) -> bool:
        dep = self.index.dep[action]
        return dep < 0 or self.finished[dep] <= t


def cool_down(orders, placement: Placement, cap: int) -> list[list[Action]]:
    """Reorder each rank's tail as in the module docstring; ``cap`` in chunk-activations."""
    microbatches = 1 + max((a.microbatch for order in orders for a in order), default=0)
    index = PassIndex.of(placement, microbatches)
    walk = _Walk(index, cap)
    ids = index.encode(orders)
    cursors = [_RankCursor(order, index, r) for r, order in enumerate(ids)]
    t = _until_first_tail(walk, ids, cursors)
    idle_since = max(t - 1, 0)
    while not all(c.done for c in cursors):
        started = [(cursor, action) for cursor in cursors
                   if (action := _pick(cursor, walk, t)) is not None]
        for cursor, action in started:  # what starts at t is available from t + 1 only
            walk.take(cursor, action, t)
        if started:
            idle_since = t
        t += 1
        if t - idle_since > 1:
            raise ScheduleError(f"cool-down reorder made no progress at slot {t} (memory bound {cap})")
    return [list(order) for order in index.decode([c.out for c in cursors])]


def _until_first_tail(walk: _Walk, ids: list, cursors: list) -> int:
    """Runs every rank's order up to the slot after the first rank takes its last chunk-0
    forward (module doc), as the walk would, and returns that slot (0 when the orders stall
    before it: the walk then starts from nothing and says where)."""
    index = walk.index
    timing = Dataflow(index, [1.0] * len(index.actions), 0.0).time(ids)
    ran = [len(order) for order in ids]
    if timing.stuck is not None:
        ran = [next((k for k, a in enumerate(order) if timing.done[index.key[a]] < 0.0),
                    len(order)) for order in ids]
    if any(c.switch >= count for c, count in zip(cursors, ran)):
        return 0
    first = 1 + int(min(starts[c.switch] for c, starts in zip(cursors, timing.starts)))
    key, finished = index.key, walk.finished
    for cursor, order, starts, count in zip(cursors, ids, timing.starts, ran):
        taken = bisect.bisect_left(starts, first, 0, count)  # starts rise along a rank
        cursor.out = order[:taken]
        cursor.memory = sum(gather(walk.delta, cursor.out))
        for action, start in zip(cursor.out, starts):
            finished[key[action]] = start + 1.0  # whole slots, as floats
        cursor.advance(taken)
    return first


def _pick(cursor: _RankCursor, walk: _Walk, t: int) -> int | None:
    if cursor.tail is None:
        if cursor.next == len(cursor.order):
            return None
        action = cursor.order[cursor.next]
        if not walk.ready(action, t):
            return None
        cursor.advance(cursor.next + 1)
        return action
    tail, kind = cursor.tail, walk.index.kind
    for position, action in enumerate(tail):
        if kind[action] is W:
            continue
        if kind[action] is F and cursor.memory + 1 > walk.cap:
            continue
        if walk.ready(action, t):
            return tail.pop(position)
    for position, action in enumerate(tail):
        if kind[action] is W and walk.ready(action, t):
            return tail.pop(position)
    return None
