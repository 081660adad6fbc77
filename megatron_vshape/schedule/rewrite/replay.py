"""Cost-aware list scheduling: replay a block's order in real time under a memory limit.

The building blocks fix an order in unit slots; with unbalanced costs (say F=1, B=1.2, W=0.8)
V-Min's rigid 6-slot pattern then stalls on every repeat (paper, "known weakness"). This pass
keeps the block's order as a *priority* but times it with the real costs: whenever a rank is
free it runs the first pass of its remaining order, within a lookahead window, that is

    ready now   (its dependencies have finished, plus one hop of communication across ranks)
    admissible  a forward only while the rank's activations stay within the problem's cap

so waits are filled with W passes (always admissible: they free memory), B passes (free of
memory) and forwards that fit. A chunk-0 forward never takes the last free unit while a chunk-1
forward is owed (the memory-deadlock rule of the list scheduler). Within each stage microbatches
keep their order, so the result lowers to matching sends and receives.

The returned orders are what the simulator then times: the same costs give the same timing,
so the replay's own makespan stands in for a simulation while the search compares candidates.

It runs on the list schedulers' one event loop (model/event_loop.py), batched: the wakes due
within 1e-12 of the earliest are one event, their ranks run in rank order (the order this
replay always had; the search's results depend on it).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from ..model.actions import Action, PassKind, ScheduleError
from ..model.event_loop import EventLoop
from ..model.indexed import PassIndex
from ..model.problem import Problem
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
    """A rank's remaining order (pass ids), its activations while the pass runs, its output."""

    def __init__(self, order: list[int], chunks: int):
        self.rest = order
        self.memory = 0.0
        self.forwards = [0] * chunks
        self.out: list[int] = []


@dataclass(frozen=True)
class _ReplayFacts:
    """What the replay reads per pass id (model/indexed.py) and its rules' settings."""

    index: PassIndex
    delay: list
    step: list
    cap: float
    forward: float
    """What a forward adds."""
    window: int
    abandon: float
    """The level past which the replay is given up (``replay_in_time``), chunk-activations
    (1e-6 to spare)."""


def replay_in_time(problem: Problem, orders, window: int,
                   abandon_above: float = float("inf")) -> Replay:
    """Per-rank orders from replaying ``orders`` under the problem's costs within its cap,
    and the makespan they reach (the search ranks replays by it without simulating them).

    ``window`` bounds how far past the head of a rank's order a ready pass may be taken (no
    default: the search's is ``Settings.replay_windows``, search/settings.py, with the
    measurement that chose it).
    Raises ScheduleError when the limit leaves the ranks waiting on each other, and as soon as
    a rank holds more than ``abandon_above`` units (the problem's unit, with 1e-6
    chunk-activations to spare): the search replays with a chunk of slack over its limit and
    keeps only replays whose peak lands within it, so a replay past it is dropped anyway (at
    p = 16, m = 64 half of those replays are, each taking 11 ms in full).
    """
    placement, costs, memory, cap = problem.placement, problem.costs, problem.memory, problem.cap
    index = PassIndex.for_orders(placement, orders)
    facts = _ReplayFacts(index, index.delays(costs.comm), index.steps(memory), cap,
                         memory.forward, window, abandon_above * placement.chunks + 1e-6)
    ranks = [_Rank(order, placement.chunks) for order in index.encode(orders)]
    kinds = frozenset(index.kind[a] for order in ranks for a in set(order.rest))
    loop = EventLoop(len(ranks), index.durations(pass_durations(placement, costs)), index.key,
                     index.wakes(costs.comm, kinds), batch=_TOLERANCE, busy=0.0)
    loop.run(functools.partial(_step, ranks, facts, loop.finished))
    if any(r.rest for r in ranks):
        stuck = [(i, index.actions[r.rest[0]]) for i, r in enumerate(ranks) if r.rest]
        raise ScheduleError(f"memory limit {cap:g} chunk-activations leaves ranks waiting: "
                            f"{stuck[:4]}")
    return Replay(index.decode([r.out for r in ranks]), loop.makespan())


def _step(ranks: list[_Rank], facts: _ReplayFacts, finished: list, rank: int,
          now: float) -> int | None:
    """The replay's policy (event_loop.py): the first pass within the window of the head of
    rank ``rank``'s order that is ready at ``now`` and fits, or None. One function: it runs
    at every event of the search's replays."""
    state = ranks[rank]
    rest = state.rest
    if not rest:
        return None
    limit = now + _TOLERANCE
    index, delay = facts.index, facts.delay
    dep, kind = index.dep, index.kind
    for position, action in enumerate(rest[:facts.window]):
        if kind[action] is F and not _fits(state, index.chunk[action], facts):
            continue
        d = dep[action]
        if d >= 0:
            done = finished[d]
            if done < 0.0 or done + delay[action] > limit:
                continue
        del rest[position]
        state.memory += facts.step[action]
        state.out.append(action)
        if kind[action] is F:
            state.forwards[index.chunk[action]] += 1
        if state.memory > facts.abandon:
            raise ScheduleError(f"replay: rank {rank} holds {state.memory:g} "
                                f"chunk-activations after {index.actions[action]}, over "
                                f"{facts.abandon:g}")
        return action
    return None


def _fits(state: _Rank, chunk: int, facts: _ReplayFacts) -> bool:
    """Whether a forward keeps the rank within the cap. With lookahead, a chunk-0 forward must
    also leave room for an owed chunk-1 forward; a strict replay (window 1) follows an order
    that already fits, and the rule would only block it."""
    owed = facts.window > 1 and chunk == 0 and len(state.forwards) == 2 and \
        state.forwards[0] > state.forwards[1]
    return state.memory + facts.forward * (1 + owed) <= facts.cap + 1e-9
