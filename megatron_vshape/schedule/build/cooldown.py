"""Cool-down reorder (paper, section 4, step 4): backwards tight, weight passes last.

The repeated block keeps its steady pattern to the very end, so the last microbatches' B passes
wait behind W passes while the gradient travels the whole V back to rank 0. This pass keeps each
rank's squeezed order until the rank has run its last chunk-0 forward (after that only the
up-leg forwards, the backwards and the W passes remain), then at every slot runs:

    the first ready pass in order that is not a W (an up-leg F only if it fits the bound)
    else the oldest W whose B is done          (W passes fill the waits of the backward chain)

Deferring W passes never raises memory once no forward follows; an up-leg forward that would
exceed the bound waits, and a W runs to make room.
"""
from __future__ import annotations

from ..model.actions import Action, PassKind, ScheduleError
from ..model.deps import completion_key, dependency_table
from ..model.placement import Placement

__all__ = ["cool_down"]

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW
_INF = float("inf")
_DELTA = {F: 1, B: 0, W: -1, BW: -1}


class _RankCursor:
    """One rank's remaining passes and state while the pass walks the slots."""

    def __init__(self, order, placement: Placement, rank: int):
        self.order = list(order)
        self.next = 0
        chunk0 = placement.stage_of(rank, 0)
        self.switch = max(i for i, a in enumerate(self.order) if a.kind is F and a.stage == chunk0)
        """Index of the rank's last chunk-0 forward: the tail is reordered after it."""
        self.tail: list[Action] | None = None
        self.memory = 0
        self.out: list[Action] = []

    @property
    def done(self) -> bool:
        return self.next == len(self.order) and not self.tail

    def take(self, action: Action) -> None:
        self.out.append(action)
        self.memory += _DELTA[action.kind]


def cool_down(orders, placement: Placement, cap: int) -> list[list[Action]]:
    """Reorder each rank's tail as in the module docstring; ``cap`` in chunk-activations."""
    microbatches = 1 + max((a.microbatch for order in orders for a in order), default=0)
    table = dependency_table(placement.num_stages, microbatches)
    finished: dict[Action, int] = {}
    cursors = [_RankCursor(order, placement, r) for r, order in enumerate(orders)]
    t, idle_since = 0, 0
    while not all(c.done for c in cursors):
        started = []
        for cursor in cursors:
            action = _pick(cursor, finished, table, t, cap)
            if action is not None:
                cursor.take(action)
                started.append(action)
        for action in started:
            finished[completion_key(action)] = t + 1
        if started:
            idle_since = t
        t += 1
        if t - idle_since > 1:
            raise ScheduleError(f"cool-down reorder made no progress at slot {t} (memory bound {cap})")
    return [c.out for c in cursors]


def _ready(action: Action, finished, table: dict, t: int) -> bool:
    for dep in table[action]:  # at most one: a loop, not all(), in this hot path
        if finished.get(dep, _INF) > t:
            return False
    return True


def _pick(cursor: _RankCursor, finished, table: dict, t: int, cap: int) -> Action | None:
    if cursor.tail is None:
        if cursor.next == len(cursor.order):
            return None
        action = cursor.order[cursor.next]
        if not _ready(action, finished, table, t):
            return None
        cursor.next += 1
        if cursor.next > cursor.switch:
            cursor.tail = cursor.order[cursor.next:]
            cursor.next = len(cursor.order)
        return action
    tail = cursor.tail
    for index, action in enumerate(tail):
        if action.kind is W:
            continue
        if action.kind is F and cursor.memory + 1 > cap:
            continue
        if _ready(action, finished, table, t):
            return tail.pop(index)
    for index, action in enumerate(tail):
        if action.kind is W and _ready(action, finished, table, t):
            return tail.pop(index)
    return None
