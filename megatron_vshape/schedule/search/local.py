"""Local search over per-rank orders, with the simulator's timing as the objective.

Every builder fixes its orders by a rule (a block repeated, a greedy's priorities); none of
them looks at the result and asks which single pass, placed elsewhere, would shorten it. This
does, starting from any valid order:

    gaps       time the orders; wherever a rank sits idle before a pass, that pass waits for
               a dependency (or for the memory a later W frees); the gaps on the critical
               path (from the last pass back, each pass's binding predecessor) come first
    moves      fill the gap with a later pass of the same rank that is ready sooner, or move
               the awaited pass earlier on its own rank (within ``window`` positions)
    accept     the first move that keeps every rank within the problem's limit (its ``cap``
               in chunk-activations: model/problem.py), does not deadlock (most moves at
               V-Min's memory would: checked before they are timed, ``LocalSearch.deadlocks``),
               and improves (makespan, sum of the ranks' finish times, sum of all ends): the
               two tie-breakers let it cross the plateaus

A move never reorders two forwards (or two backwards) of one stage, so microbatches stay in
order per stage and the result lowers to matching sends and receives. The work is bounded by
``budget`` passes timed (not wall time), so results are deterministic.

:func:`improve_repeated` also *repeats* a move: makes it in every period of q microbatches at
once (the pass q, 2q, ... microbatches away goes before the pass as far from the one it was
put before). A steady state is the same few passes again and again; a single move changes one
period of it, which rarely shortens the makespan (another period still binds), so the single
moves stop on a plateau that a move made in every period crosses. At the H100 costs (2, 2.78,
0.7, hop 0.05) and V-Min's memory, p = 4: m = 16 from 1.219 to 1.196 x 1F1B (a whole-schedule
CP-SAT run, ours as its hint, finds 1.172 in 90 s), m = 32 from 1.296 to 1.253 x.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from ..model.actions import Action, PassKind, ScheduleError
from ..model.indexed import Dataflow, PassIndex, gather
from ..model.problem import Problem
from ..model.simulate import pass_durations
from .settings import SETTINGS, Settings

__all__ = ["Improved", "improve", "improve_repeated", "LocalSearch"]

_EPS = 1e-9
W = PassKind.W
_KINDS = (PassKind.F, PassKind.B, PassKind.W, PassKind.BW)


@dataclass(frozen=True)
class Improved:
    orders: tuple[tuple[Action, ...], ...]
    makespan: float
    moves: int
    """How many moves were accepted."""


class LocalSearch:
    """One local search (module doc): the current orders (as pass ids, indexed.py), their
    timing and the move loop. A move re-times only what starts at or after the first pass it
    touches, and the budget counts the passes re-timed (plus ``overhead`` per move)."""

    def __init__(self, problem: Problem, orders, settings: Settings = SETTINGS):
        self.cap, self.window = problem.cap, settings.move_window
        self.probe = settings.deadlock_probe
        placement, costs = problem.placement, problem.costs
        index = self.index = PassIndex.of(placement, problem.microbatches)
        self.flow = Dataflow(index, index.durations(pass_durations(placement, costs)),
                             costs.comm)
        deltas = problem.memory.deltas
        self.delta = [deltas[a.kind] for a in index.actions]
        stages = placement.num_stages
        self.group = [-1 if a.kind is W else _KINDS.index(a.kind) * stages + a.stage
                      for a in index.actions]  # passes of one kind and stage; W passes none
        self.orders = index.encode(orders)
        self._locate()
        self.overhead = settings.move_cost + sum(map(len, self.orders)) // 8
        """What a move costs besides the passes it re-times, in passes: building it, and
        copying and summing the schedule's lists (about an eighth of timing all of it)."""
        self.timed = 0
        self.critical_first = True
        self.score, self.timing = self._evaluate(self.orders, None)

    def _locate(self) -> None:
        """``where``: completion id -> (rank, position) of the pass that completes it."""
        key = self.index.key
        self.where = {key[a]: (r, k) for r, order in enumerate(self.orders)
                      for k, a in enumerate(order)}

    # -- objective ---------------------------------------------------------------------------
    def _evaluate(self, orders, cut):
        """(score, timing), or (None, None) when the orders deadlock; with ``cut``, only what
        starts at or after it in the current timing is timed again."""
        timing = self.flow.time(orders) if cut is None else \
            self.flow.retime(orders, self.timing, cut)
        self.timed += timing.timed + self.overhead
        if timing.stuck is not None:
            return None, None
        starts, ends = timing.starts, timing.ends
        used = [r for r in range(len(orders)) if orders[r]]
        first = min(starts[r][0] for r in used)
        finish = [ends[r][-1] for r in used]
        score = (round(max(finish) - first, 9), round(sum(finish), 9),
                 round(sum(sum(e) for e in ends), 9))
        return score, timing

    def _fits(self, order: list) -> bool:
        if not order:
            return True
        return max(itertools.accumulate(gather(self.delta, order))) <= self.cap + _EPS

    # -- moves -------------------------------------------------------------------------------
    def moves(self):
        """(rank, from, to) moves of one pass earlier on its rank: the gaps on the critical
        path first (only they can shorten the makespan), each group biggest first."""
        critical = self._critical_path() if self.critical_first else set()
        gaps = []
        for r, order in enumerate(self.orders):
            starts, ends = self.timing.starts[r], self.timing.ends[r]
            for i in range(1, len(order)):
                idle = starts[i] - ends[i - 1]
                if idle > _EPS:
                    gaps.append(((r, i) not in critical, -idle, r, i))
        gaps.sort()
        dep = self.index.dep
        for _, _, r, i in gaps:
            order = self.orders[r]
            for j in range(i + 1, min(len(order), i + 1 + self.window)):
                yield r, j, i  # fill the gap with a later pass
            waited = dep[order[i]]
            if waited < 0:
                continue
            q, k = self.where[waited]
            for to in range(k - 1, max(-1, k - 1 - self.window), -1):
                yield q, k, to  # the awaited pass earlier on its rank

    def _critical_path(self) -> set:
        """(rank, position) of the passes on the critical path: back from the last pass to
        end, each pass's binding predecessor (its dependency when that ended, plus the hop,
        exactly at its start, else the pass before it on its rank)."""
        index, timing, delay, where = self.index, self.timing, self.flow.delay, self.where
        r = max((q for q in range(len(self.orders)) if self.orders[q]),
                key=lambda q: timing.ends[q][-1])
        i = len(self.orders[r]) - 1
        path = set()
        while True:
            path.add((r, i))
            action, start = self.orders[r][i], timing.starts[r][i]
            d = index.dep[action]
            if d >= 0 and timing.done[d] + delay[action] == start:
                r, i = where[d]
            elif i > 0 and timing.ends[r][i - 1] == start:
                i -= 1
            else:
                return path

    def blocked(self, order: list, i: int, j: int) -> bool:
        """Whether the pass at j may not move to i < j: past its own dependency, or past a
        pass of its kind and stage (W passes may)."""
        mover = order[j]
        waits, group, key, groups = self.index.dep[mover], self.group[mover], self.index.key, \
            self.group
        for other in order[i:j]:  # a loop, not any(): the repeated moves call this per period
            if key[other] == waits or (group >= 0 and groups[other] == group):
                return True
        return False

    def _moved(self, r: int, j: int, i: int):
        """Rank r's order with the pass at j moved to i < j, or None when not allowed, when it
        would deadlock (``deadlocks``) or when it does not fit the cap."""
        new = self._spliced(r, j, i)
        return new if new is not None and self._fits(new) else None

    def _spliced(self, r: int, j: int, i: int):
        """Rank r's order with the pass at j moved to i < j, or None when the move is not
        allowed (``blocked``) or surely deadlocks (``deadlocks``); the cap is not checked."""
        order = self.orders[r]
        if self.blocked(order, i, j) or self.deadlocks(r, i, j):
            return None
        return order[:i] + [order[j]] + order[i:j] + order[j + 1:]

    def deadlocks(self, r: int, i: int, j: int) -> bool:
        """Whether moving rank r's pass at j to i < j surely deadlocks, found without timing
        the orders (a timing finds it only after re-laying everything from i: 65 us a move
        at p = 16, m = 16, where nine of ten moves of v-min's searches deadlock).

        The orders deadlock exactly when the moved pass's dependency descends from the pass
        at i (the only new cycle: moved pass -> pass at i ~> its dependency -> moved pass;
        every other new edge shortcuts an old path). A descendant of the pass at i starts at
        or after its end, so the walk back from the dependency (each pass's dependency and
        the pass before it on its rank) stops at passes that start earlier, and finds the
        cycle when it reaches rank r at position i or later. It gives up (False: leaves the
        move to the timing) after ``deadlock_probe`` passes (settings.py). Each pass it visits is charged to the
        budget like a pass timed, and a deadlock found also a move's fixed cost
        (``overhead``), as when the timing found it: the budget buys about the moves it
        bought before (over 384 named builds and searches, p 4-16, four cost ratios, both
        memory models: 372 the same, 7 faster, 5 slower, in 19% less time), where charging
        only the passes visited let the search go further but left 34 faster and 9 slower
        in 10% less time (both: the same two 2-3% slower, at p = 8, m = 16 below V-Min's
        memory, costs 1,1.2,0.8,0.1, where a different polish won)."""
        waits = self.index.dep[self.orders[r][j]]
        if waits < 0:
            return False
        starts, end = self.timing.starts, self.timing.ends[r][i]
        q, k = self.where[waits]
        if self.timing.ends[q][k] <= end:  # ended before the pass at i did: not below it
            return False
        dep, where, orders = self.index.dep, self.where, self.orders
        stack, seen, visited = [(q, k)], {(q, k)}, 0
        while stack and visited < self.probe:
            q, k = stack.pop()
            visited += 1
            before = dep[orders[q][k]]
            for node in ((q, k - 1) if k else None, where[before] if before >= 0 else None):
                if node is None or node in seen:
                    continue
                if node[0] == r and node[1] >= i:
                    self.timed += visited + self.overhead
                    return True
                if starts[node[0]][node[1]] >= end:
                    seen.add(node)
                    stack.append(node)
        self.timed += visited
        return False

    def repeated(self, r: int, j: int, i: int, period: int):
        """(order, first position changed) of rank r with the move of the pass at j to i made
        in every period of ``period`` microbatches (module doc), nearest periods first, or
        None when the move itself is not allowed or is made only once (a single move).

        Nor when the move made once surely deadlocks (``deadlocks``): its cycle runs through
        passes that start after the gap, which the copies of the move further away rarely
        reorder. In v-min's repeated descents (p = 4, m = 32 and p = 8, m = 16, costs H100 and
        2,2.4,1.6,0.1) 3,088 repeated moves were timed whose single move surely deadlocked,
        and every one deadlocked; skipping them, v-min at p = 4 (m 4-32) and p = 8 (m 8-16), 9
        cost sets, both memory models (108 builds) got the same makespans, and p = 8, m = 16 at
        the H100 costs spent 0.165 s on repeated moves instead of 0.218 s."""
        new = self._spliced(r, j, i)  # the move itself first
        if new is None:
            return None
        order = self.orders[r]
        actions, m = self.index.actions, self.index.microbatches
        mover, anchor = order[j], order[i]
        low = -min(actions[mover].microbatch, actions[anchor].microbatch)
        high = m - 1 - max(actions[mover].microbatch, actions[anchor].microbatch)
        first, made = i, 1
        where = dict(zip(new, range(len(new))))  # kept up to date through the splices
        shifts = (shift for shift in range(-(-low // period) * period, high + 1, period) if shift)
        for shift in sorted(shifts, key=abs):  # then the nearest periods first
            # ids are laid out microbatch last: + shift is that many microbatches on
            at, to = where.get(mover + shift), where.get(anchor + shift)
            if at is None or to is None:  # that microbatch's pass is fused (BW) or split
                continue
            if at <= to or self.blocked(new, to, at):
                continue
            new[to:at + 1] = [new[at]] + new[to:at]
            for k in range(to, at + 1):
                where[new[k]] = k
            first, made = min(first, to), made + 1
        return (new, first) if made > 1 and self._fits(new) else None

    def descend(self, budget: int, period: int = 0) -> int:
        """Accept improving moves (made in every period of ``period`` microbatches, or single
        when 0) until none is left or ``budget`` passes were timed."""
        accepted = 0
        while self.timed < budget:
            for r, j, i in self.moves():
                if self.timed >= budget:
                    return accepted
                moved = self.repeated(r, j, i, period) if period else \
                    self._single(r, j, i)
                if self._adopt(r, moved, lambda score: score < self.score):
                    accepted += 1
                    break
            else:
                return accepted
        return accepted

    def _single(self, r: int, j: int, i: int):
        new = self._moved(r, j, i)
        return None if new is None else (new, i)

    def _adopt(self, r: int, moved, accept) -> bool:
        """Takes rank r's ``moved`` (order, first position changed) when ``accept``s its score."""
        if moved is None:
            return False
        new, first = moved
        trial = list(self.orders)
        trial[r] = new
        score, timing = self._evaluate(trial, self.timing.starts[r][first])
        if score is None or not accept(score):
            return False
        self.orders, self.score, self.timing = trial, score, timing
        key, where = self.index.key, self.where
        for k in range(first, len(new)):
            where[key[new[k]]] = (r, k)
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
            done += self._adopt(r, self._single(r, j, i), lambda score: True)

    def run(self, budget: int, kicks: int, critical_first: bool = True) -> int:
        """Descend (the critical path's gaps first, or not); then, while the budget lasts,
        kick and descend again from the best found (iterated local search; the generator is
        seeded, so runs repeat)."""
        rng = random.Random(0)
        self.critical_first = critical_first
        accepted = self.descend(budget)
        self.critical_first = False  # after a kick, gaps anywhere: across the plateaus
        best = (self.score, self.orders, self.timing)
        while self.timed < budget:
            before = self.timed
            self.kick(rng, kicks)
            accepted += self.descend(budget)
            if self.timed == before:
                break  # no legal move left to try: nothing more to find
            if self.score < best[0]:
                best = (self.score, self.orders, self.timing)
            else:
                self.score, self.orders, self.timing = best
                self._locate()
        return accepted


def improve(problem: Problem, orders, budget: int, settings: Settings = SETTINGS) -> Improved:
    """Orders at least as fast as ``orders`` (module doc), every rank within the problem's
    limit (the input orders must be within it too), from ``budget`` passes timed; moves,
    kicks and what a move costs are ``settings``' (settings.py)."""
    search = _started(problem, orders, settings)
    scarce = budget < settings.many_timings * sum(map(len, search.orders))
    moves = search.run(budget, settings.kicks, critical_first=scarce)
    score = search.score
    return Improved(search.index.decode(search.orders), score[0], moves)


def improve_repeated(problem: Problem, orders, budget: int,
                     settings: Settings = SETTINGS) -> Improved:
    """Orders at least as fast as ``orders``, from rounds of: per period of ``settings``'
    ``repeated_periods``, a descent with moves repeated in every period (module doc), then
    :func:`improve` with ``repeated_polish`` passes (settings.py); until
    a round after the first gains nothing or ``budget`` passes are spent (each polish counted
    in full). The first round always gets a second: its polish ends on other orders of the
    same makespan at worst, from which the next finds more (V-Min at p = 4, H100 costs:
    127.19 -> 126.22 at m = 16, 247.64 -> 243.54 at m = 32).

    The polish matters as much as the repeated moves: at p = 4, m = 32 (V-Min's memory, H100
    costs) one repeated move (rank 0's ``b k, f k+3`` to ``f k+3, b k`` in every period)
    leaves the makespan as it is, and the polish from there takes it from 1.296 to 1.253 x
    1F1B, where the same 1,000,000 passes of :func:`improve` alone reach 1.292 (3,000,000:
    1.279). Periods 1-4 instead of 1 reached the same there and at p = 4, m = 16, in more
    time."""
    search = _started(problem, orders, settings)
    best = Improved(search.index.decode(search.orders), search.score[0], 0)
    polish = min(settings.repeated_polish, budget)  # a small schedule's budget is small (improvements.capped)
    spent = moves = rounds = 0
    while spent < budget:
        start = best.makespan
        for period in settings.repeated_periods:
            search = LocalSearch(problem, best.orders, settings)
            search.critical_first = False
            moves += search.descend(budget - spent, period)
            spent += search.timed + polish
            polished = improve(problem, search.index.decode(search.orders), polish, settings)
            moves += polished.moves
            if polished.makespan <= best.makespan:
                best = Improved(polished.orders, polished.makespan, moves)
        rounds += 1
        if rounds > 1 and best.makespan >= start - _EPS:
            break
    return best


def _started(problem: Problem, orders, settings: Settings) -> LocalSearch:
    """A search from ``orders``, which must run and fit the problem's limit."""
    search = LocalSearch(problem, orders, settings)
    if search.score is None:
        raise ScheduleError("local search: the starting orders deadlock")
    if any(not search._fits(o) for o in search.orders):
        raise ScheduleError(f"local search: the starting orders exceed {problem.cap:g} "
                            "chunk-activations")
    return search
