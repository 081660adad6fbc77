"""Cost-aware list scheduling: replay a block's order in real time under a memory limit.

The building blocks fix an order in unit slots; with unbalanced costs (say F=1, B=1.2, W=0.8)
V-Min's rigid 6-slot pattern then stalls on every repeat (paper, "known weakness"). This pass
keeps the block's order as a *priority* but times it with the real costs: whenever a rank is
free it runs the first pass of its remaining order, within a lookahead window, that is

    ready now   (its dependencies have finished, plus one hop of communication across ranks)
    admissible  a forward only while the rank's activations stay within ``cap``

so waits are filled with W passes (always admissible: they free memory), B passes (free of
memory) and forwards that fit. A chunk-0 forward never takes the last free unit while a chunk-1
forward is owed (the memory-deadlock rule of the list scheduler). Within each stage microbatches
keep their order, so the result lowers to matching sends and receives.

The returned orders are what the simulator then times: the same costs give the same timing,
so the replay's own makespan stands in for a simulation while the search compares candidates.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple

from ..model.actions import Action, PassKind, ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.deps import hop_table, wake_table
from ..model.placement import Placement
from ..model.simulate import pass_durations

__all__ = ["Replay", "replay_in_time"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
_TOLERANCE = 1e-12


class Replay(NamedTuple):
    """A replay's per-rank orders and their makespan (what :func:`.simulate.simulate` gives
    them under the same costs, up to rounding)."""

    orders: tuple[tuple[Action, ...], ...]
    makespan: float


class _Rank:
    """A rank's remaining order, clock and activations while the pass runs."""

    def __init__(self, order, placement: Placement, rank: int, durations: dict):
        self.rest = list(order)
        self.stages = tuple(placement.stage_of(rank, c) for c in range(placement.chunks))
        self.free_at = 0.0
        self.first = 0.0  # when its first pass started
        self.memory = 0.0
        self.forwards = [0] * placement.chunks
        self.durations = durations
        self.out: list[Action] = []


def replay_in_time(
    orders,
    placement: Placement,
    costs: Costs,
    cap: float,
    memory: MemoryModel = MemoryModel(),
    window: int = 24,
) -> Replay:
    """Per-rank orders from replaying ``orders`` under ``costs`` within ``cap`` chunk-activations,
    and the makespan they reach (the search ranks replays by it without simulating them).

    ``window`` bounds how far past the head of a rank's order a ready pass may be taken.
    Raises ScheduleError when the limit leaves the ranks waiting on each other.
    """
    delta = memory.deltas
    durations = pass_durations(placement, costs)
    ranks = [_Rank(o, placement, r, durations[r]) for r, o in enumerate(orders)]
    microbatches = 1 + max((a.microbatch for order in orders for a in order), default=0)
    kinds = frozenset(a.kind for order in orders for a in order)
    table = hop_table(placement, microbatches)
    wakes = wake_table(placement, costs.comm, microbatches, kinds)
    finished: dict[Action, float] = {}
    wake = [(0.0, r) for r in range(len(ranks))]  # (time, rank): when a rank may have work
    while wake:  # every end, and every arrival one hop later, wakes the ranks it concerns
        now = wake[0][0]
        due = set()
        while wake and wake[0][0] <= now + _TOLERANCE:
            due.add(heapq.heappop(wake)[1])
        for index in sorted(due):
            state = ranks[index]
            if state.free_at > now:  # its own end wakes it again
                heapq.heappush(wake, (state.free_at, index))
                continue
            if not state.rest:
                continue
            action = _pick(state, table, costs.comm, finished, now, cap, delta, window)
            if action is None:
                continue
            if not state.out:
                state.first = now
            end = now + state.durations[action.kind]
            state.free_at = end
            state.memory += delta[action.kind]
            state.out.append(action)
            if action.kind is F:
                state.forwards[state.stages.index(action.stage)] += 1
            key = table[action][0]
            finished[key] = end
            heapq.heappush(wake, (end, index))
            for rank, delay in wakes.get(key, ()):
                if ranks[rank].free_at < end + delay:  # else its own end wakes it after this
                    heapq.heappush(wake, (end + delay, rank))
    if any(r.rest for r in ranks):
        stuck = [(i, r.rest[0]) for i, r in enumerate(ranks) if r.rest]
        raise ScheduleError(f"memory limit {cap:g} chunk-activations leaves ranks waiting: {stuck[:4]}")
    busy = [r for r in ranks if r.out]
    makespan = max((r.free_at for r in busy), default=0.0) - min((r.first for r in busy), default=0.0)
    return Replay(tuple(tuple(r.out) for r in ranks), makespan)


def _pick(state: _Rank, table, comm, finished, now, cap, delta, window) -> Action | None:
    """The first pass within ``window`` of the head that is ready at ``now`` and fits."""
    limit = now + _TOLERANCE
    rest = state.rest
    for position in range(min(window, len(rest))):
        action = rest[position]
        if action.kind is F and not _fits(state, action, cap, delta, window > 1):
            continue
        _, dep, remote = table[action]
        if dep is not None:
            done = finished.get(dep)
            if done is None or done + (comm if remote else 0.0) > limit:
                continue
        return rest.pop(position)
    return None


def _fits(state: _Rank, action: Action, cap: float, delta: dict, owed_rule: bool) -> bool:
    """Whether a forward keeps the rank within ``cap``. With lookahead, a chunk-0 forward must
    also leave room for an owed chunk-1 forward; a strict replay (window 1) follows an order
    that already fits, and the rule would only block it."""
    chunk = state.stages.index(action.stage)
    owed = owed_rule and chunk == 0 and len(state.stages) == 2 and state.forwards[0] > state.forwards[1]
    return state.memory + delta[F] * (1 + owed) <= cap + 1e-9
