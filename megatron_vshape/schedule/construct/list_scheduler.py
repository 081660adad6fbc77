"""Slot-level list scheduling of a repeated block: squeeze plus warm-up and steady reorders.

On each rank, at each slot, it picks:

    warm-up    (V blocks, before the first backward): chunk-1 F if ready and fewer than
               min(i+1, bound/2) so far, else chunk-0 F, up to ``bound`` forwards in all
    steady     a ready B first (it frees nothing and unblocks the pipeline), else the next
               pass in block order, else the oldest pending W, else any ready F that fits
               (policy "backward"; policy "head" tries the block order before the ready B)
    cool-down  (after the rank's last F): a ready B, else the oldest pending W (W last)

Every F is admitted only while the rank's activations stay within the bound, so the bound
holds by construction.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..model.actions import Action, PassKind, ScheduleError
from ..model.deps import completion_key, dependencies
from ..model.placement import Placement

__all__ = ["ReorderPolicy", "POLICIES", "list_schedule"]

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW
_INF = float("inf")


@dataclass
class _Rank:
    """Per-rank state of the list scheduler."""

    rank: int
    stages: tuple[int, ...]  # stage of each chunk
    order: list  # actions in block order
    position: dict  # action -> index in ``order``
    forwards: dict  # chunk -> deque of pending F actions, microbatch order
    backwards: dict  # chunk -> deque of pending B/BW actions
    warm_quota: dict  # chunk -> forwards allowed before the first backward
    memory: int = 0
    head: int = 0
    pending_w: deque = field(default_factory=deque)
    started_backward: bool = False
    done: set = field(default_factory=set)
    out: list = field(default_factory=list)


class _ListScheduler:
    """Slot-level list scheduling of block orders (see the module docstring)."""

    def __init__(self, block, orders, microbatches: int, cap: int, policy: "ReorderPolicy"):
        self.placement = Placement(block.ranks, block.layout)
        self.stages = self.placement.num_stages
        self.cap = cap
        self.microbatches = microbatches
        self.policy = policy
        self.finished: dict[Action, int] = {}
        self.ranks = [self._rank_state(r, orders[r], block, microbatches) for r in range(block.ranks)]

    def _rank_state(self, rank, order, block, microbatches) -> _Rank:
        chunks = range(self.placement.chunks)
        stages = tuple(self.placement.stage_of(rank, c) for c in chunks)
        up = min(rank + 1, self.cap // 2, microbatches)
        quota = {0: min(self.cap - up, microbatches), 1: up}
        return _Rank(
            rank=rank,
            stages=stages,
            order=list(order),
            position={a: i for i, a in enumerate(order)},
            forwards={c: deque(a for a in order if a.kind is F and a.stage == stages[c]) for c in chunks},
            backwards={c: deque(a for a in order if a.kind.is_backward and a.stage == stages[c]) for c in chunks},
            warm_quota=quota,
        )

    def ready(self, action: Action, t: int) -> bool:
        finished = self.finished
        for dep in dependencies(action, self.stages):
            if finished.get(dep, _INF) > t:
                return False
        return True

    def run(self) -> list[list[Action]]:
        total = sum(len(s.order) for s in self.ranks)
        count, t, idle_since = 0, 0, 0
        while count < total:
            for state in self.ranks:
                action = self._choose(state, t)
                if action is not None:
                    self._start(state, action, t)
                    count += 1
                    idle_since = t
            t += 1
            if t - idle_since > 1:
                raise ScheduleError(f"list scheduler made no progress at slot {t}")
        return [s.out for s in self.ranks]

    def _start(self, state: _Rank, action: Action, t: int) -> None:
        state.done.add(action)
        state.out.append(action)
        self.finished[completion_key(action)] = t + 1
        if action.kind is F:
            state.memory += 1
            state.forwards[state.stages.index(action.stage)].popleft()
        elif action.kind.is_backward:
            state.started_backward = True
            queue = state.backwards[state.stages.index(action.stage)]
            assert queue[0] == action, "backwards of a chunk run in microbatch order"
            queue.popleft()
            if action.kind is B:
                state.pending_w.append(Action(W, action.stage, action.microbatch))
            else:
                state.memory -= 1
        else:
            state.memory -= 1
            state.pending_w.remove(action)

    def _choose(self, state: _Rank, t: int) -> Action | None:
        if state.warm_quota and not state.started_backward:
            action = self._warmup(state, t)
            if action is not None:
                return action
        if not any(state.forwards.values()):
            return self._ready_backward(state, t) or self._oldest_w(state)
        if self.policy.backward_first:
            first = self._ready_backward(state, t) or self._head(state, t)
        else:
            first = self._head(state, t) or self._ready_backward(state, t)
        return first or self._oldest_w(state) or self._ready_forward(state, t)

    def _warmup(self, state: _Rank, t: int) -> Action | None:
        for chunk in sorted(state.forwards, reverse=True):
            queue = state.forwards[chunk]
            issued = self.microbatches - len(queue)
            if queue and issued < state.warm_quota[chunk] and self._fits(state, chunk):
                if self.ready(queue[0], t):
                    return queue[0]
        return None

    def _fits(self, state: _Rank, chunk: int) -> bool:
        """Whether one more forward of ``chunk`` keeps the rank within the bound.

        A chunk-0 forward may not take the last free slot while a chunk-1 forward is owed for a
        microbatch already forwarded through chunk 0: that slot is what lets the oldest
        microbatch in flight finish, so the pipeline can never lock up on memory.
        """
        owed = chunk == 0 and len(state.forwards) == 2 and len(state.forwards[1]) > len(state.forwards[0])
        return state.memory + 1 + owed <= self.cap

    def _ready_backward(self, state: _Rank, t: int) -> Action | None:
        heads = [q[0] for q in state.backwards.values() if q and self.ready(q[0], t)]
        if not heads:
            return None
        return min(heads, key=state.position.__getitem__)

    def _head(self, state: _Rank, t: int) -> Action | None:
        order = state.order
        while state.head < len(order) and order[state.head] in state.done:
            state.head += 1
        if state.head == len(order):
            return None
        action = order[state.head]
        if action.kind is W:
            return action if action in state.pending_w else None
        if action.kind is F and not self._fits(state, state.stages.index(action.stage)):
            return None
        return action if self.ready(action, t) else None

    def _oldest_w(self, state: _Rank) -> Action | None:
        return state.pending_w[0] if state.pending_w else None

    def _ready_forward(self, state: _Rank, t: int) -> Action | None:
        for chunk, queue in state.forwards.items():
            if queue and self._fits(state, chunk) and self.ready(queue[0], t):
                return queue[0]
        return None


@dataclass(frozen=True)
class ReorderPolicy:
    """One variant of the reorder passes; a block lists the variants ``compose`` tries."""

    backward_first: bool
    """In the steady phase, run a ready B before the next pass in block order."""


POLICIES = {
    "head": ReorderPolicy(backward_first=False),
    "backward": ReorderPolicy(backward_first=True),
}


def list_schedule(block, orders, microbatches: int, policy: "ReorderPolicy") -> tuple[tuple[Action, ...], ...]:
    """List-schedule ``orders`` (the repeated ``block``) within the block's memory bound."""
    scheduler = _ListScheduler(block, orders, microbatches, block.memory_bound_chunks, policy)
    return tuple(tuple(o) for o in scheduler.run())
