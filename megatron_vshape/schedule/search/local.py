"""Local search over per-rank orders, with the simulator's timing as the objective.

Every builder fixes its orders by a rule (a block repeated, a greedy's priorities); none of
them looks at the result and asks which single pass, placed elsewhere, would shorten it. This
does, starting from any valid order:

    gaps       time the orders; wherever a rank sits idle before a pass, that pass waits for
               a dependency (or for the memory a later W frees)
    moves      fill the gap with a later pass of the same rank that is ready sooner, or move
               the awaited pass earlier on its own rank (within ``window`` positions)
    accept     the first move that keeps every rank within ``cap`` chunk-activations, does not
               deadlock, and improves (makespan, sum of the ranks' finish times, sum of all
               ends): the two tie-breakers let it cross the makespan's plateaus

A move never reorders two forwards (or two backwards) of one stage, so microbatches stay in
order per stage and the result lowers to matching sends and receives. The work is bounded by
``budget`` passes timed (not wall time), so results are deterministic.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..model.actions import Action, PassKind, ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.deps import hop_table
from ..model.placement import Placement
from ..model.simulate import pass_durations, time_orders

__all__ = ["Improved", "improve"]

_EPS = 1e-9
F, B, W = PassKind.F, PassKind.B, PassKind.W


@dataclass(frozen=True)
class Improved:
    orders: tuple[tuple[Action, ...], ...]
    makespan: float
    moves: int
    """How many moves were accepted."""


class _Search:
    """One local search (module doc): the current orders, their timing and the move loop."""

    def __init__(self, placement: Placement, m: int, orders, costs: Costs, cap: float,
                 memory: MemoryModel, window: int):
        self.placement, self.m, self.cap, self.window = placement, m, cap, window
        self.durations = pass_durations(placement, costs)
        self.comm = costs.comm
        self.delta = memory.deltas
        self.table = hop_table(placement, m)
        self.rank_of = [placement.rank_of(s) for s in range(placement.num_stages)]
        self.orders = [list(o) for o in orders]
        self.passes = sum(len(o) for o in self.orders)
        self.timed = 0
        self.score, self.starts, self.ends = self._evaluate(self.orders)

    # -- objective ---------------------------------------------------------------------------
    def _evaluate(self, orders):
        """(score, starts, ends), or None when the orders deadlock."""
        self.timed += self.passes
        try:
            starts, ends = time_orders(self.placement, self.m, orders, self.durations, self.comm)
        except ScheduleError:
            return None, None, None
        used = [r for r in range(len(orders)) if orders[r]]
        first = min(starts[r][0] for r in used)
        finish = [ends[r][-1] for r in used]
        score = (round(max(finish) - first, 9), round(sum(finish), 9),
                 round(sum(sum(e) for e in ends), 9))
        return score, starts, ends

    def _fits(self, order: list) -> bool:
        level = 0.0
        for action in order:
            level += self.delta[action.kind]
            if level > self.cap + _EPS:
                return False
        return True

    # -- moves -------------------------------------------------------------------------------
    def _can_pass(self, mover: Action, other: Action) -> bool:
        """Whether ``mover`` may be placed before ``other`` (which precedes it now)."""
        if self.table[mover][1] == self.table[other][0]:
            return False  # its own dependency, on this rank
        return not (mover.kind is other.kind and mover.stage == other.stage
                    and mover.kind is not W)

    def _moves(self):
        """(rank, from, to) moves of one pass earlier on its rank, biggest gaps first."""
        gaps = []
        for r, order in enumerate(self.orders):
            for i in range(1, len(order)):
                idle = self.starts[r][i] - self.ends[r][i - 1]
                if idle > _EPS:
                    gaps.append((-idle, r, i))
        gaps.sort()
        for _, r, i in gaps:
            order = self.orders[r]
            for j in range(i + 1, min(len(order), i + 1 + self.window)):
                yield r, j, i  # fill the gap with a later pass
            waited = self.table[order[i]][1]
            if waited is None:
                continue
            q = self.rank_of[waited.stage]
            k = self._position(q, waited)
            for to in range(k - 1, max(-1, k - 1 - self.window), -1):
                yield q, k, to  # the awaited pass earlier on its rank

    def _position(self, rank: int, key: Action) -> int:
        order = self.orders[rank]
        for index, action in enumerate(order):
            if self.table[action][0] == key:
                return index
        raise ScheduleError(f"local search: {key} is not on rank {rank}")

    def _moved(self, r: int, j: int, i: int):
        """Rank r's order with the pass at j moved to i < j, or None when not allowed."""
        order = self.orders[r]
        mover = order[j]
        if any(not self._can_pass(mover, other) for other in order[i:j]):
            return None
        new = order[:i] + [mover] + order[i:j] + order[j + 1:]
        return new if self._fits(new) else None

    def descend(self, budget: int) -> int:
        """Accept improving moves until none is left or ``budget`` passes were timed."""
        accepted = 0
        while self.timed < budget:
            for r, j, i in self._moves():
                if self.timed >= budget:
                    return accepted
                if self._try(r, j, i, lambda score: score < self.score):
                    accepted += 1
                    break
            else:
                return accepted
        return accepted

    def _try(self, r: int, j: int, i: int, accept) -> bool:
        new = self._moved(r, j, i)
        if new is None:
            return False
        trial = list(self.orders)
        trial[r] = new
        score, starts, ends = self._evaluate(trial)
        if score is None or not accept(score):
            return False
        self.orders, self.score, self.starts, self.ends = trial, score, starts, ends
        return True

    def kick(self, rng: random.Random, moves: int) -> None:
        """``moves`` random legal moves, better or not: out of the current local optimum."""
        done = tries = 0
        while done < moves and tries < 20 * moves:
            tries += 1
            r = rng.randrange(len(self.orders))
            if len(self.orders[r]) < 2:
                continue
            j = rng.randrange(1, len(self.orders[r]))
            i = max(0, j - rng.randint(1, self.window))
            done += self._try(r, j, i, lambda score: True)

    def run(self, budget: int, kicks: int) -> int:
        """Descend; then, while the budget lasts, kick and descend again from the best found
        (iterated local search; the generator is seeded, so runs repeat)."""
        rng = random.Random(0)
        accepted = self.descend(budget)
        best = (self.score, self.orders, self.starts, self.ends)
        while self.timed < budget:
            self.kick(rng, kicks)
            accepted += self.descend(budget)
            if self.score < best[0]:
                best = (self.score, self.orders, self.starts, self.ends)
            else:
                self.score, self.orders, self.starts, self.ends = best
        return accepted


def improve(placement: Placement, microbatches: int, orders, costs: Costs, cap: float,
            memory: MemoryModel = MemoryModel(), budget: int = 200_000,
            window: int = 6, kicks: int = 3) -> Improved:
    """Orders at least as fast as ``orders`` (module doc), every rank within ``cap``
    chunk-activations (the input orders must be within it too)."""
    search = _Search(placement, microbatches, orders, costs, cap, memory, window)
    if search.score is None:
        raise ScheduleError("local search: the starting orders deadlock")
    if any(not search._fits(o) for o in search.orders):
        raise ScheduleError(f"local search: the starting orders exceed {cap:g} chunk-activations")
    moves = search.run(budget, kicks)
    return Improved(tuple(tuple(o) for o in search.orders), search.score[0], moves)
