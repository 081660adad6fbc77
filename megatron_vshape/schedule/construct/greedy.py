"""Cost-aware list scheduling under a memory limit: orders built in simulated time.

The building blocks fix an order in unit slots and only then meet the real costs. Here the
order is made *with* them (the zero-bubble paper's greedy for ZB-H1 and the V-ZB generator of
the controllable-memory paper are of this kind): ranks advance in simulated time, and whenever
one is free it starts the most urgent pass that is ready, one hop of ``comm`` after a remote
dependency::

    priority   B (input gradients unblock other ranks; chunk 1's first or the oldest first)
               F (chunk 1 first: it leads to the loss), admitted only within the memory limit
               W (frees memory, unblocks nothing), last
    lookahead  a pass of lower priority starts only if it ends before a more urgent pass
               becomes ready, give or take ``slack`` of its own duration; a forward must also
               leave room for a chunk-1 forward the rank owes (the V's memory deadlock rule)
    forced     a W runs when the memory limit keeps the ready forward out

Arrival times are known once the producing pass has started; otherwise they are bounded below
by the producer's rank becoming free plus the producer's duration and the hop. The memory
model (:class:`.MemoryModel`) says what F, B and W add, so a B that frees most of a chunk's
activations lets W wait longer and more microbatches be in flight.

It runs on the list schedulers' one event loop (model/event_loop.py), one event at a time; an
end wakes the ranks on the other side of a hop (its own rank is woken by the end), and a rank
that waits asks to be woken when the first arrival it bounded is due.

Within each stage microbatches keep their order, so the result lowers to matching sends and
receives. The makespan returned is the greedy's own timing, an upper bound of what the
simulator gives the same orders (it may have waited on purpose where the simulator would not).

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

from ..model.actions import Action, PassKind, ScheduleError
from ..model.event_loop import EventLoop
from ..model.indexed import PassIndex
from ..model.problem import Problem
from ..model.simulate import pass_durations

__all__ = ["Policy", "POLICIES", "greedy_schedule", "GreedyResult"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
_EPS = 1e-9
_DEPTH = 2 * 16
"""How far up the dependency chain an unknown arrival is bounded (p <= 16: all of it)."""


@dataclass(frozen=True)
class Policy:
    """How the greedy chooses among ready passes."""

    oldest_backward_first: bool = False
    """Among ready B passes: the oldest microbatch first (else chunk 1's first)."""
    w_slack: float = 0.0
    """A W may delay a more urgent pass by this fraction of its own duration."""
    f_slack: float = 0.0
    """A forward may delay a ready-soon backward by this fraction of its own duration."""
    warm_up: float = 1.0
    """Before its first B a rank admits chunk-0 forwards up to this fraction of the limit."""
    ranked_warm_up: bool = False
    """Cap the warm-up by rank too (:meth:`_Greedy._ranked_warm_up`)."""
    alternate: bool = False
    """After a B a ready forward goes first, after a forward a ready B (1F1B's steady state
    keeps the first stages feeding the pipeline); else every B before any forward."""

    def describe(self) -> str:
        return (f"{'oldest' if self.oldest_backward_first else 'chunk-1'} B first, W slack "
                f"{self.w_slack:g}, F slack {self.f_slack:g}, warm-up {self.warm_up:g}"
                f"{', ranked warm-up' if self.ranked_warm_up else ''}"
                f"{', F/B alternate' if self.alternate else ''}")


POLICIES = tuple(
    Policy(oldest, w, f, warm, ranked, alternate)
    for alternate in (False, True)
    for ranked in (False, True)
    for warm in (1.0, 0.75)
    for oldest in (False, True)
    for w in (0.0, 1.0)
    for f in (0.0, 1.0)
)
"""The policies the searches try (each is one greedy run)."""


@dataclass(frozen=True)
class GreedyResult:
    orders: tuple[tuple[Action, ...], ...]
    makespan: float
    """The greedy's own timing (an upper bound of the simulator's for these orders)."""


class _Rank:
    __slots__ = ("index", "stages", "memory", "next_f", "next_b", "pending_w", "out", "done",
                 "backward_started", "durations", "last")

    def __init__(self, index: int, stages: tuple, durations: list):
        self.index = index
        self.stages = stages
        self.memory = 0.0
        self.next_f = [0] * len(stages)
        self.next_b = [0] * len(stages)
        self.pending_w: deque = deque()
        self.out: list = []
        self.done = 0
        self.backward_started = False
        self.durations = durations
        self.last = F


class _Greedy:
    """One greedy run (see the module doc)."""

    def __init__(self, problem: Problem, policy: Policy):
        placement, m, costs, memory = (problem.placement, problem.microbatches, problem.costs,
                                       problem.memory)
        self.placement, self.m, self.cap, self.policy = placement, m, problem.cap, policy
        self.comm = costs.comm
        self.delta = memory.deltas
        stages = placement.num_stages
        self.stages = stages
        self.rank_of = [placement.rank_of(s) for s in range(stages)]
        self.chunk_of = [placement.locate(s)[1] for s in range(stages)]
        share = placement.chunks
        durations = pass_durations(placement, costs)
        self.ranks = [_Rank(r, tuple(placement.stage_of(r, c) for c in range(share)), durations[r])
                      for r in range(placement.ranks)]
        index = self.index = PassIndex.of(placement, m)
        self.first_id = {kind: [index.first_id(kind, s) for s in range(stages)]
                         for kind in (F, B, W)}
        """[kind][stage]: the id of microbatch 0's pass; microbatch k's is k more."""
        self.loop = EventLoop(placement.ranks, index.durations(durations), index.key,
                              _remote_wakes(index, costs.comm))
        self.ended = self.loop.finished
        """End by id, -1.0 while not started (known once a pass starts)."""
        self.free_at = self.loop.free_at
        self.total = 3 * share * m

    # -- readiness ---------------------------------------------------------------------------
    def _arrival(self, producer_stage: int, mb: int, kind: PassKind, consumer_rank: int,
                 now: float) -> float:
        """When the result of ``kind`` at (producer_stage, mb) reaches ``consumer_rank``: known
        once the producer started, else a lower bound."""
        producer = self.rank_of[producer_stage]
        hop = self.comm if producer != consumer_rank else 0.0
        return self._end_bound(producer_stage, mb, kind, now, _DEPTH) + hop

    def _end_bound(self, stage: int, mb: int, kind: PassKind, now: float, depth: int) -> float:
        """The end of pass ``kind`` (F or B) of ``mb`` at ``stage``: known once it started,
        else bounded below by its rank becoming free and, ``depth`` hops up the chain, its own
        dependency arriving."""
        end = self.ended[self.first_id[kind][stage] + mb]
        if end >= 0.0:
            return end
        rank = self.rank_of[stage]
        state = self.ranks[rank]
        start = max(now, self.free_at[rank])
        if depth > 0:
            if kind is F and stage > 0:
                dep_stage, dep_kind = stage - 1, F
            elif kind is B and stage < self.stages - 1:
                dep_stage, dep_kind = stage + 1, B
            else:
                dep_stage, dep_kind = stage, F
            if (dep_stage, dep_kind) != (stage, kind):
                hop = self.comm if self.rank_of[dep_stage] != rank else 0.0
                start = max(start, self._end_bound(dep_stage, mb, dep_kind, now, depth - 1) + hop)
        return start + state.durations[self.chunk_of[stage]][kind]

    def _known(self, producer_stage: int, mb: int, kind: PassKind) -> bool:
        return self.ended[self.first_id[kind][producer_stage] + mb] >= 0.0

    def _forward(self, state: _Rank, chunk: int, now: float):
        """(ready time, known) of the rank's next forward of ``chunk``, or None."""
        k = state.next_f[chunk]
        if k >= self.m:
            return None
        stage = state.stages[chunk]
        if stage == 0:
            return 0.0, True
        return self._arrival(stage - 1, k, F, state.index, now), self._known(stage - 1, k, F)

    def _backward(self, state: _Rank, chunk: int, now: float):
        k = state.next_b[chunk]
        if k >= state.next_f[chunk]:
            return None
        stage = state.stages[chunk]
        if stage == self.stages - 1:
            return self.ended[self.first_id[F][stage] + k], True
        return self._arrival(stage + 1, k, B, state.index, now), self._known(stage + 1, k, B)

    def _fits(self, state: _Rank, chunk: int) -> bool:
        limit = self.cap
        if chunk == 0 and not state.backward_started:
            limit = max(self.delta[F], self.cap * self.policy.warm_up)
            if self.policy.ranked_warm_up:
                limit = min(limit, self.delta[F] * self._ranked_warm_up(state.index))
        owed = (chunk == 0 and len(state.stages) == 2
                and state.next_f[0] > state.next_f[1])
        return state.memory + self.delta[F] * (1 + owed) <= limit + _EPS

    def _ranked_warm_up(self, rank: int) -> int:
        """Chunk-0 forwards before the first B that keep later ranks behind earlier ones: p - r
        on one chunk (1F1B's warm-up), and on the V the limit less two per rank nearer its
        turn, room for the chunk-1 forwards that come back (the reference's V-ZB rule)."""
        p = len(self.ranks)
        if self.placement.chunks == 1:
            return p - rank
        return max(1, int(self.cap / self.delta[F]) - 2 * (rank + 1))

    # -- choice --------------------------------------------------------------------------------
    def _candidates(self, state: _Rank, now: float) -> list:
        """(priority, kind, chunk, ready) in priority order; W last."""
        found = []
        chunks = range(len(state.stages))
        backs = [(c, self._backward(state, c, now)) for c in chunks]
        backs = [(c, r) for c, r in backs if r is not None]
        if self.policy.oldest_backward_first:
            backs.sort(key=lambda cr: (state.next_b[cr[0]], -cr[0]))
        else:
            backs.sort(key=lambda cr: -cr[0])
        backwards = [(B, c, ready) for c, (ready, _) in backs]
        forwards = []
        for c in sorted(chunks, reverse=True):
            ready = self._forward(state, c, now)
            if ready is not None:
                forwards.append((F, c, ready[0]))
        if self.policy.alternate and state.last is B:
            found = forwards + backwards
        else:
            found = backwards + forwards
        if state.pending_w:
            found.append((W, state.pending_w[0][0], now))
        return found

    def _choose(self, state: _Rank, now: float):
        """The pass to start at ``now``, or None to wait."""
        found = self._candidates(state, now)
        for i, (kind, chunk, ready) in enumerate(found):
            if ready > now + _EPS:
                continue
            if kind is F and not self._fits(state, chunk):
                if state.pending_w:  # memory, not readiness, keeps it out: free some
                    return W, state.pending_w[0][0]
                continue
            duration = state.durations[chunk][kind]
            slack = {F: self.policy.f_slack, W: self.policy.w_slack}.get(kind, 0.0) * duration
            urgent = [r for k, _, r in found[:i] if k is not W]
            if (kind is W or kind is not found[0][0]) and urgent and \
                    min(urgent) < now + duration - slack - _EPS:
                continue  # it would delay a more urgent pass too much
            return kind, chunk
        return None

    # -- run -------------------------------------------------------------------------------------
    def _step(self, rank: int, now: float) -> int | None:
        """The greedy's policy (model/event_loop.py): the id of the pass rank ``rank`` starts
        at ``now``, its counts updated, or None (asleep until something it might start becomes
        ready)."""
        state = self.ranks[rank]
        if state.done == self.total:
            return None
        choice = self._choose(state, now)
        if choice is None:
            self._sleep(state, now)
            return None
        kind, chunk = choice
        stage = state.stages[chunk]
        if kind is W:
            _, k = state.pending_w.popleft()
        elif kind is F:
            k = state.next_f[chunk]
            state.next_f[chunk] += 1
        else:
            k = state.next_b[chunk]
            state.next_b[chunk] += 1
            state.backward_started = True
            state.pending_w.append((chunk, k))
        if kind is not W:
            state.last = kind
        state.memory += self.delta[kind]
        a = self.first_id[kind][stage] + k
        state.out.append(a)
        state.done += 1
        return a

    def run(self) -> GreedyResult:
        self.loop.run(self._step)
        stuck = [r.index for r in self.ranks if r.done < self.total]
        if stuck:
            raise ScheduleError(f"greedy schedule: memory limit {self.cap:g} chunk-activations "
                                f"leaves ranks {stuck} waiting")
        return GreedyResult(self.index.decode([r.out for r in self.ranks]), self.loop.makespan())

    def _sleep(self, state: _Rank, now: float) -> None:
        """Wait until something this rank might start becomes ready (arrivals not yet known
        wake it when their producer is scheduled)."""
        times = [ready for _, _, ready in self._candidates(state, now) if ready > now + _EPS]
        if times:
            self.loop.wake_at(min(times), state.index)


@functools.lru_cache(maxsize=8)
def _remote_wakes(index: PassIndex, comm: float) -> list[tuple]:
    """Per completion id, the (rank, hop) of the F and B passes on other ranks that wait for
    it: whom a pass's end wakes (its own rank is woken by its end)."""
    wakes = index.wakes(comm, frozenset({F, B}))
    return [tuple(w for w in woken if w[0] != rank) for woken, rank in zip(wakes, index.rank)]


def greedy_schedule(problem: Problem, policy: Policy = Policy()) -> GreedyResult:
    """Orders built in simulated time within the problem's cap per rank (module doc).
    Raises ScheduleError when the limit leaves ranks waiting on each other."""
    cap, chunks = problem.cap, problem.chunks
    if cap < problem.memory.forward * chunks - _EPS:
        raise ScheduleError(f"greedy schedule: a memory limit of {cap:g} chunk-activations "
                            f"cannot hold one microbatch on a rank ({chunks})")
    return _Greedy(problem, policy).run()
