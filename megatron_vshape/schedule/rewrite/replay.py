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

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

from ..model.actions import Action, PassKind, ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.indexed import PassIndex
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
    """A rank's remaining order (pass ids), clock and activations while the pass runs."""

    def __init__(self, order: list[int], chunks: int):
        self.rest = order
        self.free_at = 0.0
        self.first = 0.0  # when its first pass started
        self.memory = 0.0
        self.forwards = [0] * chunks
        self.out: list[int] = []


@dataclass(frozen=True)
class _ReplayFacts:
    """What the replay reads per pass id (model/indexed.py) and its rules' settings."""

    index: PassIndex
    duration: list
    delay: list
    step: list
    cap: float
    forward: float
    """What a forward adds."""
    window: int
    abandon: float
    """The level past which the replay is given up (``replay_in_time``)."""


def replay_in_time(
    orders,
    placement: Placement,
    costs: Costs,
    cap: float,
    memory: MemoryModel = MemoryModel(),
    window: int = 24,
    abandon_above: float = float("inf"),
) -> Replay:
    """Per-rank orders from replaying ``orders`` under ``costs`` within ``cap`` chunk-activations,
    and the makespan they reach (the search ranks replays by it without simulating them).

    ``window`` bounds how far past the head of a rank's order a ready pass may be taken.
    Raises ScheduleError when the limit leaves the ranks waiting on each other, and as soon as
    a rank holds more than ``abandon_above`` chunk-activations (with 1e-6 to spare): the search
    replays with a chunk of slack over its limit and keeps only replays whose peak lands
    within it, so a replay past it is dropped anyway (at p = 16, m = 64 half of those replays
    are, each taking 11 ms in full).
    """
    index = PassIndex.for_orders(placement, orders)
    facts = _ReplayFacts(index, index.durations(pass_durations(placement, costs)),
                         index.delays(costs.comm), index.steps(memory), cap, memory.forward,
                         window, abandon_above + 1e-6)
    ranks = [_Rank(order, placement.chunks) for order in index.encode(orders)]
    kinds = frozenset(index.kind[a] for order in ranks for a in set(order.rest))
    wakes = index.wakes(costs.comm, kinds)
    finished = [-1.0] * len(index.actions)  # end by completion id, -1.0: not yet
    wake = [(0.0, r) for r in range(len(ranks))]  # (time, rank): when a rank may have work
    key, pop, push = index.key, heapq.heappop, heapq.heappush
    while wake:  # every end, and every arrival one hop later, wakes the ranks it concerns
        now = wake[0][0]
        limit = now + _TOLERANCE
        due = {pop(wake)[1]}
        while wake and wake[0][0] <= limit:
            due.add(pop(wake)[1])
        for rank in sorted(due) if len(due) > 1 else due:
            state = ranks[rank]
            if state.free_at > now:  # its own end wakes it again
                push(wake, (state.free_at, rank))
                continue
            if not state.rest:
                continue
            action = _pick(state, facts, finished, now)
            if action is None:
                continue
            _run(state, action, facts, now, finished)
            if state.memory > facts.abandon:
                raise ScheduleError(f"replay: rank {rank} holds {state.memory:g} chunk-activations "
                                    f"after {index.actions[action]}, over {abandon_above:g}")
            end = state.free_at
            push(wake, (end, rank))
            for woken, delay in wakes[key[action]]:
                if ranks[woken].free_at < end + delay:  # else its own end wakes it
                    push(wake, (end + delay, woken))
    if any(r.rest for r in ranks):
        stuck = [(i, index.actions[r.rest[0]]) for i, r in enumerate(ranks) if r.rest]
        raise ScheduleError(f"memory limit {cap:g} chunk-activations leaves ranks waiting: {stuck[:4]}")
    busy = [r for r in ranks if r.out]
    makespan = max((r.free_at for r in busy), default=0.0) - min((r.first for r in busy), default=0.0)
    return Replay(index.decode([r.out for r in ranks]), makespan)


def _run(state: _Rank, action: int, facts: _ReplayFacts, now: float, finished: list) -> None:
    """``state`` runs ``action`` from ``now``."""
    index = facts.index
    if not state.out:
        state.first = now
    end = state.free_at = now + facts.duration[action]
    state.memory += facts.step[action]
    state.out.append(action)
    if index.kind[action] is F:
        state.forwards[index.chunk[action]] += 1
    finished[index.key[action]] = end


def _pick(state: _Rank, facts: _ReplayFacts, finished: list, now: float) -> int | None:
    """The first pass within the window of the head that is ready at ``now`` and fits."""
    limit = now + _TOLERANCE
    rest, index, delay = state.rest, facts.index, facts.delay
    dep, kind = index.dep, index.kind
    for position, action in enumerate(rest[:facts.window]):
        if kind[action] is F and not _fits(state, index.chunk[action], facts):
            continue
        d = dep[action]
        if d >= 0:
            done = finished[d]
            if done < 0.0 or done + delay[action] > limit:
                continue
        return rest.pop(position)
    return None


def _fits(state: _Rank, chunk: int, facts: _ReplayFacts) -> bool:
    """Whether a forward keeps the rank within the cap. With lookahead, a chunk-0 forward must
    also leave room for an owed chunk-1 forward; a strict replay (window 1) follows an order
    that already fits, and the rule would only block it."""
    owed = facts.window > 1 and chunk == 0 and len(state.forwards) == 2 and \
        state.forwards[0] > state.forwards[1]
    return state.memory + facts.forward * (1 + owed) <= facts.cap + 1e-9
