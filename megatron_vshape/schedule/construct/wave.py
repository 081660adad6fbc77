"""V-ZB's cost-aware construction: a forward wave, then rounds of B and F with W in the gaps.

The hand-written ZB-V order (zbv.py) is zero-bubble only when F, B and W take the same time and
hops are free. The paper's code builds V-ZB differently: rank by rank in simulated time, with
the real pass times and hop time, under a memory limit. This module is our construction of that
kind, written after reading that generator (sail-sg/zero-bubble-pipeline-parallelism, zbv.py)
for its rules; at 1F1B's memory it matches its makespans at 67 of 72 points of
scripts/bench/reference_compare.py's grid and beats them at 5 (we pick the variant by makespan):

    wave       every rank runs one chunk-0 F; then from the last rank down, each rank runs its
               chunk-1 F, and before it ranks 0..r run extra chunk-0 forwards while rank r has
               the time (the chunk-1 F has not arrived yet) and the room (2 + 2r forwards
               still to come); then every rank catches up with its predecessor's forwards
    rounds     2m rounds of: one B per rank (chunk 1's when it is behind or chunk 0's input
               has not arrived), then one F per rank (chunk 1's when its input is there)
    W          a rank runs W passes while it would otherwise wait for the next pass's input,
               when the memory limit keeps the next pass out, and, once the wait exceeds
               what the most delayed rank has already lost (bubble balancing), one more
    balancing  the construction is repeated with each rank allowed the bubbles of the previous
               run (a rank that lost less may wait longer), while the worst rank's bubble falls

Variants fill the waits before chunk-1 backwards and before forwards or not; the fastest
variant (its own timing, which the simulator reproduces) is returned. The memory limit is in
chunk-activations under the given memory model, so B's share of the savings counts. Below 1F1B's
memory these rules deadlock (every rank full of chunk-0 activations, none able to run its
chunk-1 forward); then a second set keeps room for the chunk-1 forwards a rank owes and lets
rounds skip what the limit keeps out, which reaches down to one microbatch per chunk in flight.

Not on the list schedulers' event loop (model/event_loop.py): that loop asks a rank free at the
earliest pending time what it starts; this construction has no events. It places passes phase by
phase and, within a round, rank by rank in a fixed order (B from the last rank down for chunk 0,
up for chunk 1, then F in rank order), each at max(its rank's clock, its input's arrival), so
passes are placed out of time order (one placed later, on another rank, may start earlier). Run
in time order the rounds would be another construction, with other orders.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..model.actions import Action, PassKind, ScheduleError
from ..model.indexed import PassIndex
from ..model.placement import Layout, Placement
from ..model.problem import Problem
from ..model.simulate import pass_durations

__all__ = ["wave_schedule", "WaveResult"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
_EPS = 1e-9
_F0, _F1, _B0, _B1 = 0, 1, 2, 3
"""Codes of (kind, chunk) for the per-rank counts and ends (:func:`_code`)."""
_BALANCING_ROUNDS = 64
"""At most this many balancing repeats (each must lower the worst bubble; a guard)."""


_LOCAL = float("-inf")
"""The arrival of a pass's input from its own rank: nothing to wait for."""


def _code(kind: PassKind, chunk: int) -> int:
    """Written out as ``2 * (kind is B) + chunk`` in the hot methods (a call per pass costs
    more than the expression; the wave builds 8 runs of 4,096 passes at p = 16, m = 64)."""
    return 2 * (kind is B) + chunk


@dataclass(frozen=True)
class _Rules:
    """One variant of the construction (module doc)."""

    fill_b: bool
    """Fill the wait before a chunk-1 B with one W beyond what the wait holds (bubble balancing;
    before a chunk-0 B always)."""
    fill_f: bool
    """The same before a forward."""
    keep_room: bool
    """A chunk-0 forward keeps room for the chunk-1 forwards the rank owes (tight limits)."""


@dataclass(frozen=True)
class WaveResult:
    orders: tuple[tuple[Action, ...], ...]
    makespan: float
    """The construction's own timing of the orders."""


class _Run:
    """One construction (module doc) with fixed fill choices and allowed bubbles."""

    def __init__(self, p: int, m: int, durations: list, comm: float, cap: float,
                 delta: dict, rules: "_Rules", allowed: list | None):
        self.p, self.m, self.durations, self.comm, self.cap = p, m, durations, comm, cap
        self.delta, self.rules = delta, rules
        self.allowed = allowed or [0.0] * p
        self.most_allowed = max(self.allowed)
        self.now = [0.0] * p
        self.first = [None] * p
        self.memory = [0.0] * p
        self.bubble = [0.0] * p
        self.count = [[0, 0, 0, 0] for _ in range(p)]  # passes run, by _code(kind, chunk)
        self.end = [[[] for _ in range(p)] for _ in range(4)]  # [code][rank][k]: end time
        self.pending = [deque() for _ in range(p)]
        self.out = [[] for _ in range(p)]
        index = PassIndex.of(Placement(p, Layout.V), m)
        self.actions = index.actions
        # Per code (_code's four, then W of chunk 0 and 1) in lists: each pass looked its id
        # up in a dict keyed by (kind, chunk, rank), its time in a dict per rank.
        kinds = (F, F, B, B, W, W)
        self.ids = [[index.first_id(kind, self._stage(rank, code % 2)) for rank in range(p)]
                    for code, kind in enumerate(kinds)]
        """[code][rank]: the id of microbatch 0's pass; microbatch k's is k more."""
        self.time = [[durations[rank][code % 2][kind] for rank in range(p)]
                     for code, kind in enumerate(kinds)]
        """[code][rank]: how long the pass takes."""
        self.step = [delta[kind] for kind in kinds]
        """[code]: what the pass adds to the rank's activations."""

    # -- the V's dependencies ------------------------------------------------------------------
    def _arrival(self, kind: PassKind, chunk: int, rank: int, k: int):
        """When input for pass k of (kind, chunk) reaches ``rank`` (None: not scheduled yet;
        -inf: local, nothing to wait for): from the rank below for a chunk-0 F or a chunk-1 B
        (they flow to higher ranks), else from the rank above; local past either end."""
        source = rank - 1 if (kind is F) == (chunk == 0) else rank + 1
        if not 0 <= source < self.p:
            return _LOCAL
        ends = self.end[2 * (kind is B) + chunk][source]
        return ends[k] + self.comm if k < len(ends) else None

    def _local_inputs_done(self, kind: PassKind, chunk: int, rank: int, k: int) -> bool:
        """A B follows its own F; at the V's turn (last rank) chunk 1 follows chunk 0."""
        count = self.count[rank]
        if kind is B and count[chunk] <= k:
            return False
        if rank == self.p - 1 and ((kind is F and chunk == 1 and count[_F0] <= k)
                                   or (kind is B and chunk == 0 and count[_B1] <= k)):
            return False
        return True

    def _input_ready(self, kind: PassKind, chunk: int, rank: int) -> bool:
        """Whether the rank's next pass of (kind, chunk) has its inputs scheduled."""
        k = self.count[rank][2 * (kind is B) + chunk]
        return self._arrival(kind, chunk, rank, k) is not None and \
            self._local_inputs_done(kind, chunk, rank, k)

    # -- placing passes ------------------------------------------------------------------------
    def put(self, kind: PassKind, chunk: int, rank: int) -> None:
        code = 2 * (kind is B) + chunk
        k = self.count[rank][code]
        if k >= self.m:
            raise ScheduleError(f"wave: rank {rank} has no {kind.name} of chunk {chunk} left")
        if self.memory[rank] + self.step[code] > self.cap + _EPS:
            raise ScheduleError(f"wave: memory limit {self.cap:g} keeps rank {rank}'s "
                                f"{kind.name} out")
        arrival = self._arrival(kind, chunk, rank, k)
        if arrival is None or not self._local_inputs_done(kind, chunk, rank, k):
            raise ScheduleError(f"wave: rank {rank}'s {kind.name}{chunk} of microbatch {k} "
                                "would run before its input exists")
        start = max(self.now[rank], arrival)
        if self.count[rank][_F0]:
            self.bubble[rank] += start - self.now[rank]
        self._run(rank, code, k, start)
        self.count[rank][code] += 1
        self.end[code][rank].append(self.now[rank])
        if kind is B:
            self.pending[rank].append((chunk, k))

    def put_w(self, rank: int) -> None:
        if not self.pending[rank]:
            raise ScheduleError(f"wave: memory limit {self.cap:g} leaves rank {rank} stuck")
        chunk, k = self.pending[rank].popleft()
        self._run(rank, 4 + chunk, k, self.now[rank])

    def _run(self, rank: int, code: int, k: int, start: float) -> None:
        """Rank ``rank`` runs microbatch k's pass of ``code`` (``ids``) from ``start``."""
        if self.first[rank] is None:
            self.first[rank] = start
        self.now[rank] = start + self.time[code][rank]
        self.memory[rank] += self.step[code]
        self.out[rank].append(self.actions[self.ids[code][rank] + k])

    def _stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * self.p - 1 - rank

    def _worst_bubble(self, rank: int) -> float:
        return max(max(self.bubble), self.most_allowed - self.allowed[rank])

    def _fill(self, kind: PassKind, chunk: int, rank: int, extra: bool) -> None:
        """W passes into the wait before (kind, chunk) on ``rank`` (module doc)."""
        arrival = self._arrival(kind, chunk, rank, self.count[rank][2 * (kind is B) + chunk])
        if arrival is None or arrival == _LOCAL:
            return
        pending, time = self.pending[rank], self.time
        while pending and arrival >= self.now[rank] + time[4 + pending[0][0]][rank]:  # its W's
            self.put_w(rank)
        gap = arrival - self.now[rank]
        if extra and self.pending[rank] and \
                gap > self._worst_bubble(rank) - self.bubble[rank]:
            self.put_w(rank)

    def _remaining(self) -> int:
        return sum(2 * 2 * self.m - sum(count) for count in self.count)

    def _make_room(self, rank: int, kind: PassKind) -> None:
        while self.memory[rank] + self.delta[kind] > self.cap + _EPS:
            self.put_w(rank)

    # -- phases -------------------------------------------------------------------------------
    def build(self) -> "_Run":
        self._wave()
        remaining = self._remaining()
        while remaining:  # 2m rounds unless the limit made some rounds skip a pass
            self._backward_round()
            self._forward_round()
            left = self._remaining()
            if left == remaining:
                raise ScheduleError(f"wave: memory limit {self.cap:g} leaves every rank waiting")
            remaining = left
        for rank in range(self.p):
            while self.pending[rank]:
                self.put_w(rank)
        return self

    def _wave(self) -> None:
        p, m, f = self.p, self.m, self.delta[F]
        for rank in range(p):
            self.put(F, 0, rank)
        for rank in reversed(range(p)):
            if rank < p - 1:
                arrival = self.end[_F1][rank + 1][0] + self.comm
                while (self.memory[rank] + f * (2 + 2 * rank) <= self.cap + _EPS
                       and self.now[rank] + self.time[_F0][rank] <= arrival
                       and self.count[rank][_F0] < m):
                    for earlier in range(rank + 1):
                        self.put(F, 0, earlier)
            self.put(F, 1, rank)
        chunk = 0
        for rank in range(1, p):
            idle = 0
            while self._behind(rank) and idle < 2:
                # chunk 0 flows to higher ranks, chunk 1 back: feed in that direction
                later = range(rank, p) if chunk == 0 else reversed(range(rank, p))
                placed = sum(self._try_forward(chunk, r) for r in later)
                chunk = 1 - chunk
                idle = 0 if placed else idle + 1

    def _try_forward(self, chunk: int, rank: int) -> bool:
        """Run the rank's next forward of ``chunk`` in the warm-up if it exists, its input was
        produced and it fits the limit (a tight limit ends the catching up early)."""
        if self.count[rank][chunk] >= self.m or not self._input_ready(F, chunk, rank) or \
                self.memory[rank] + self._room_for_forward(rank, chunk) > self.cap + _EPS:
            return False
        self.put(F, chunk, rank)
        return True

    def _behind(self, rank: int) -> bool:
        mine, theirs = self.count[rank], self.count[rank - 1]
        total = mine[_F0] + mine[_F1] < theirs[_F0] + theirs[_F1]
        return total or mine[_F1] <= theirs[_F1] < self.m

    def _backward_round(self) -> None:
        for rank in range(self.p):
            self._make_room(rank, B)
        chunk0, chunk1 = [], []
        for rank in range(self.p):
            count = self.count[rank]
            if count[_B0] >= count[_B1]:
                chunk1.append(rank)
            elif rank == self.p - 1 or count[_B1] >= self.m or \
                    count[_B0] < len(self.end[_B0][rank + 1]):
                chunk0.append(rank)
            else:
                chunk1.append(rank)
        for rank, chunk in [(r, 0) for r in reversed(chunk0)] + [(r, 1) for r in chunk1]:
            if self.count[rank][_code(B, chunk)] >= self.m or not self._input_ready(B, chunk, rank):
                continue  # its input is not there yet (a tight limit delayed a forward)
            self._fill(B, chunk, rank, extra=chunk == 0 or self.rules.fill_b)
            self.put(B, chunk, rank)

    def _forward_round(self) -> None:
        for rank in range(self.p):
            chunk = self._next_forward(rank)
            if chunk is None or not self._input_ready(F, chunk, rank):
                continue
            needed = self._room_for_forward(rank, chunk)
            while self.memory[rank] + needed > self.cap + _EPS and self.pending[rank]:
                self.put_w(rank)
            if self.memory[rank] + needed > self.cap + _EPS:
                continue  # the limit keeps it out this round; a B will make room
            self._fill(F, chunk, rank, extra=self.rules.fill_f)
            self.put(F, chunk, rank)

    def _room_for_forward(self, rank: int, chunk: int) -> float:
        """Memory a forward needs: a chunk-0 F also keeps room for the chunk-1 forwards the
        rank owes, or under a tight limit the V deadlocks (no rank can run its chunk-1 F)."""
        count = self.count[rank]
        owed = count[_F0] - count[_F1] if chunk == 0 and self.rules.keep_room else 0
        return self.delta[F] * (1 + owed)

    def _next_forward(self, rank: int):
        count = self.count[rank]
        if count[_F1] >= self.m:
            return None
        if count[_F1] >= count[_F0]:
            return 0
        if rank == self.p - 1 or count[_F1] < len(self.end[_F1][rank + 1]):
            return 1
        if count[_F0] < self.m and (rank == 0 or count[_F0] < len(self.end[_F0][rank - 1])):
            return 0
        return None

    # -- results ------------------------------------------------------------------------------
    @property
    def worst_bubble(self) -> float:
        return max(self.bubble)

    @property
    def makespan(self) -> float:
        return max(self.now) - min(self.first)


def _balanced(p, m, durations, comm, cap, delta, rules) -> _Run:
    """Repeat the construction, each time allowing every rank the previous run's bubbles,
    while the worst bubble falls (module doc)."""
    best = _Run(p, m, durations, comm, cap, delta, rules, None).build()
    for _ in range(_BALANCING_ROUNDS):
        try:
            again = _Run(p, m, durations, comm, cap, delta, rules, best.bubble).build()
        except ScheduleError:
            break
        if again.worst_bubble >= best.worst_bubble:
            break
        best = again
    return best


def wave_schedule(problem: Problem) -> WaveResult:
    """The fastest variant of the construction (module doc) within the problem's cap per
    rank; its placement must be the V. Raises ScheduleError when no variant fits."""
    placement, microbatches, costs, memory, cap = (problem.placement, problem.microbatches,
                                                   problem.costs, problem.memory, problem.cap)
    if placement.layout is not Layout.V:
        raise ScheduleError(f"wave: the construction is the V's, not {placement.layout.value}'s")
    ranks = placement.ranks
    durations = pass_durations(placement, costs)
    delta = memory.deltas
    runs, errors = [], []
    for keep_room in (False, True):  # keeping room costs V-ZB's memory dearly: only if needed
        for fill_b in (True, False):
            for fill_f in (True, False):
                try:
                    runs.append(_balanced(ranks, microbatches, durations, costs.comm, cap,
                                          delta, _Rules(fill_b, fill_f, keep_room)))
                except ScheduleError as err:
                    errors.append(str(err))
        if runs:
            break
    if not runs:
        raise ScheduleError(f"wave: no variant fits {cap:g} chunk-activations: {errors[0]}")
    best = min(runs, key=lambda run: run.makespan)
    return WaveResult(tuple(tuple(order) for order in best.out), best.makespan)
