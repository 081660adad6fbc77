"""Weight passes as fillers: keep an order's F and B passes, time them with the real costs, and
run each W only where its rank would otherwise wait.

Every builder places a W at a fixed spot, mostly right after its B. In the steady state that
costs nothing, but in the cool-down a rank then waits for each gradient to come back along the
pipeline with no W left to run. The zero-bubble paper's rule is the cure: a W unblocks nothing,
so it can wait while the rank has other work and fill the gaps later, as long as the activation
leftover it holds fits the memory limit (V-Half's paper order at H100 costs 2,2.78,0.7,0.05,
p = 8: m = 32 1.031 -> 0.997 x 1F1B, m = 64 1.053 -> 1.012). When B frees most of a chunk
(``--memory-model 1,-0.75,-0.25``) a deferred W holds a quarter of a chunk, so more can wait.
Where the order already holds the limit's worth of activations all through its steady state
(the V-ZB wave keeps 15 chunk-0 microbatches in flight on rank 0 at p = 8), no backlog can grow
and the order comes back unchanged in effect.

Per rank, in simulated time, with the rank's F and B passes in their given order::

    next F or B ready          run it (a forward only within ``cap``; if it does not fit, the
                               oldest pending W runs first to make room)
    not ready, W pending       run the oldest pending W if it ends by the time the pass can
                               start (its dependency's end plus a hop, or, while the dependency
                               has not started, the earliest it could end)
    order done                 the pending W passes, oldest first

so the backlog of W passes grows in the steady state until the limit stops it, and drains into
the cool-down's waits. The returned orders keep each stage's microbatch order, so they lower to
matching sends and receives, and validate like their source.
"""
from __future__ import annotations

import collections
import heapq

from ..model.actions import Action, PassKind, ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.deps import hop_table, wake_table
from ..model.placement import Placement
from ..model.simulate import pass_durations

__all__ = ["defer_weight_passes"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
_TOLERANCE = 1e-9


class _Rank:
    """A rank's F and B passes still to run, its pending W passes, clock and activations."""

    def __init__(self, order, durations: dict):
        self.rest = collections.deque(a for a in order if a.kind is not W)
        self.pending: collections.deque[Action] = collections.deque()
        self.durations = durations
        self.free_at = 0.0
        self.memory = 0.0
        self.out: list[Action] = []


def defer_weight_passes(orders, placement: Placement, costs: Costs, cap: float,
                        memory: MemoryModel = MemoryModel()) -> tuple[tuple[Action, ...], ...]:
    """``orders`` with every W moved to where its rank would wait (module doc), within ``cap``
    chunk-activations per rank. Raises ScheduleError when the F and B order cannot run within
    ``cap`` (a forward that does not fit with no W left to free room) or the ranks wait on each
    other; fused BW passes are left as they are (no W to move)."""
    if any(a.kind is PassKind.BW for order in orders for a in order):
        raise ScheduleError("fused BW passes have no W to defer")
    delta = memory.deltas
    durations = pass_durations(placement, costs)
    ranks = [_Rank(order, durations[r]) for r, order in enumerate(orders)]
    microbatches = 1 + max((a.microbatch for order in orders for a in order), default=0)
    table = hop_table(placement, microbatches)
    rank_of = [placement.rank_of(s) for s in range(placement.num_stages)]
    wakes = wake_table(placement, costs.comm, microbatches, frozenset({F, B}))
    finished: dict[Action, float] = {}  # completion key -> end time
    wake = [(0.0, r) for r in range(len(ranks))]
    while wake:
        now, index = heapq.heappop(wake)
        state = ranks[index]
        if state.free_at > now + _TOLERANCE or not (state.rest or state.pending):
            continue
        action = _choose(state, table, rank_of, ranks, finished, costs.comm, now, cap, delta)
        if action is None:
            continue  # waits for its dependency: that pass's end wakes it
        state.free_at = finished[action] = now + state.durations[action.kind]
        state.memory += delta[action.kind]
        state.out.append(action)
        heapq.heappush(wake, (state.free_at, index))
        for rank, hop in wakes.get(action, ()):
            heapq.heappush(wake, (state.free_at + hop, rank))
    stuck = [(i, r.rest[0]) for i, r in enumerate(ranks) if r.rest]
    if stuck:
        raise ScheduleError(f"deferring W within {cap:g} chunk-activations leaves ranks "
                            f"waiting: {stuck[:4]}")
    return tuple(tuple(r.out) for r in ranks)


def _choose(state: _Rank, table, rank_of, ranks, finished, comm, now, cap, delta) -> Action | None:
    """The pass ``state`` starts at ``now``, or None to wait (module doc's rules)."""
    if not state.rest:
        return state.pending.popleft()
    head = state.rest[0]
    if head.kind is F and state.memory + delta[F] > cap + _TOLERANCE:
        if not state.pending:
            raise ScheduleError(f"{head} does not fit within {cap:g} chunk-activations "
                                "and no W is left to free room")
        return state.pending.popleft()
    ready = _ready_at(head, table, rank_of, ranks, finished, comm, now)
    if ready <= now + _TOLERANCE:
        state.rest.popleft()
        if head.kind is B:
            state.pending.append(Action(W, head.stage, head.microbatch))
        return head
    if state.pending and now + state.durations[W] <= ready + _TOLERANCE:
        return state.pending.popleft()
    return None


def _ready_at(action: Action, table, rank_of, ranks, finished, comm, now) -> float:
    """When ``action`` can start at the earliest: its dependency's end plus a hop across
    ranks; while the dependency has not started, no sooner than it could end if it started
    now on its own rank."""
    _, dep, remote = table[action]
    if dep is None:
        return now
    hop = comm if remote else 0.0
    end = finished.get(dep)
    if end is None:
        owner = ranks[rank_of[dep.stage]]
        end = max(now, owner.free_at) + owner.durations[dep.kind]
    return end + hop
