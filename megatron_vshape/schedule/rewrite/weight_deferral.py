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
the cool-down's waits. It runs on the list schedulers' one event loop (model/event_loop.py),
one event at a time, every end waking every rank that waits for it. The returned orders keep
each stage's microbatch order, so they lower to matching sends and receives, and validate like
their source.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import collections
import functools

from ..model.actions import Action, PassKind, ScheduleError
from ..model.event_loop import EventLoop
from ..model.indexed import PassIndex
from ..model.problem import Problem
from ..model.simulate import pass_durations

__all__ = ["defer_weight_passes"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
_TOLERANCE = 1e-9


class _Rank:
    """A rank's F and B passes still to run (ids, indexed.py), its pending W passes and
    activations."""

    def __init__(self, order: list[int], kind: tuple):
        self.rest = collections.deque(a for a in order if kind[a] is not W)
        self.pending: collections.deque[int] = collections.deque()
        self.memory = 0.0
        self.out: list[int] = []


class _DeferralFacts:
    """The per-id facts the deferral reads (indexed.py), the hop time and the cap."""

    def __init__(self, problem: Problem, index: PassIndex):
        costs, memory, cap = problem.costs, problem.memory, problem.cap
        self.index, self.comm, self.limit, self.cap = index, costs.comm, cap, cap + _TOLERANCE
        self.duration = index.durations(pass_durations(index.placement, costs))
        self.step = index.steps(memory)
        self.forward = memory.deltas[F]
        self.weight_of = index.first_id(W, 0) - index.first_id(B, 0)
        """What turns a B's id into its W's (ids are laid out kind by kind)."""


def defer_weight_passes(problem: Problem, orders) -> tuple[tuple[Action, ...], ...]:
    """``orders`` with every W moved to where its rank would wait (module doc), within the
    problem's cap per rank. Raises ScheduleError when the F and B order cannot run within the
    cap (a forward that does not fit with no W left to free room) or the ranks wait on each
    other; fused BW passes are left as they are (no W to move). Runs on pass ids: on actions
    (hashing each at every lookup) a deferral took 14 ms at p = 16, m = 64."""
    if any(a.kind is PassKind.BW for order in orders for a in order):
        raise ScheduleError("fused BW passes have no W to defer")
    index = PassIndex.for_orders(problem.placement, orders)
    facts = _DeferralFacts(problem, index)
    ranks = [_Rank(order, index.kind) for order in index.encode(orders)]
    loop = EventLoop(len(ranks), facts.duration, index.key,
                     index.wakes(problem.costs.comm, frozenset({F, B})), busy=_TOLERANCE)
    loop.run(functools.partial(_step, ranks, facts, loop.finished, loop.free_at))
    stuck = [(i, index.actions[r.rest[0]]) for i, r in enumerate(ranks) if r.rest]
    if stuck:
        raise ScheduleError(f"deferring W within {facts.limit:g} chunk-activations leaves ranks "
                            f"waiting: {stuck[:4]}")
    return index.decode([r.out for r in ranks])


def _step(ranks: list[_Rank], facts: _DeferralFacts, finished: list, free_at: list, rank: int,
          now: float) -> int | None:
    """The deferral's policy (event_loop.py): the pass rank ``rank`` starts at ``now``, or
    None to wait (module doc's rules). One function: it runs at every event."""
    state = ranks[rank]
    rest, pending = state.rest, state.pending
    if not rest:
        if not pending:
            return None
        action = pending.popleft()
    else:
        head = rest[0]
        index = facts.index
        kind = index.kind[head]
        if kind is F and state.memory + facts.forward > facts.cap:
            if not pending:
                raise ScheduleError(f"{index.actions[head]} does not fit within "
                                    f"{facts.limit:g} chunk-activations and no W is left to "
                                    "free room")
            action = pending.popleft()
        else:
            # the earliest the head can start: its dependency's end plus a hop across ranks;
            # while the dependency has not started, no sooner than it could end if it started
            # now on its own rank
            dep = index.dep[head]
            ready = now
            if dep >= 0:
                ready = finished[dep]
                if ready < 0.0:
                    ready = max(now, free_at[index.rank[dep]]) + facts.duration[dep]
                if index.remote[head]:
                    ready += facts.comm
            if ready <= now + _TOLERANCE:
                action = rest.popleft()
                if kind is B:
                    pending.append(head + facts.weight_of)
            elif pending and now + facts.duration[pending[0]] <= ready + _TOLERANCE:
                action = pending.popleft()
            else:
                return None
    state.memory += facts.step[action]
    state.out.append(action)
    return action
