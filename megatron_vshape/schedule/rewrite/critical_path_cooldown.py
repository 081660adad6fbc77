"""Cool-down re-scheduled in time, critical path first (an active schedule).

From each rank's last chunk-0 forward on (cooldown_reorder.py's tail) a rank has left its up-leg
forwards, its backwards and its W passes, and the makespan is the last microbatches' walk back to
rank 0. An order that runs a ready down-leg backward B(r, k) makes an up-leg pass that arrives a
moment later wait its whole length; but the up-leg pass heads the longer walk (after B(2p-1-r, k)
come 2p-1-r backwards, after B(r, k) only r). Neither the blocks' orders, nor cooldown_reorder.py's
first-ready rule, nor the local search (the gain needs every rank to change at once) see that. This
re-schedules every rank's tail by Giffler and Thompson's rule: take the pass, of any rank, that can
end first; among the passes of its rank that could start before that end, run the one with the
longest path to the end of the schedule (its bottom level: real durations and hops); a forward only
when it fits ``cap``. So a rank waits for a critical pass rather than start one that would delay it.
Where the tails start is a choice (``LINES``): after each rank's own last chunk-0 forward, or at one
time on every rank, so that the later ranks' last forwards move too; over 108 named builds (p 4-16,
m 4p-8p, three cost ratios, both memory models) the first is faster than the order it starts from at
20, by up to 0.6%, and the other two than that at 17 (14 of them new), by up to 0.75%.

At the H100 costs (2, 2.78, 0.7, hop 0.05) v-min at p = 16, m = 64 goes from 615.36 to 612.75, which
CP-SAT proves the fastest cool-down over the last 60 time units after the same warm-up and steady
state (scripts/bench/cooldown_gap.py), and v-half at p = 16, m = 128 from 805.57 to 802.09 (801.99
under ``1,-0.75,-0.25``), both from the middle line. Where the tail's W passes and forwards compete
for memory (v-zb, small p) the rule loses to the order it starts from: it is the search's last step
(search/critical_path_step.py), kept only where faster. One line costs 6-13 ms at p = 16, m = 64
(v-min, v-zb), where one timing takes 1.5 ms.

Not on the list schedulers' event loop (model/event_loop.py), which asks a rank free at the
earliest pending time which pass it starts then. This rule looks at every rank at once, takes
the pass that can end first, and starts a pass on that rank at the time that pass's choice
allows, possibly before the last pass placed on another rank (an active schedule, not a
non-delay one), so its events are not in time order. On the loop the rule becomes the non-delay
one (a free rank runs, of its passes ready then, the one with the longest path to the end):
tried over scripts/bench/search_digest.py's 320 cases, 39 answers were slower (by up to 1.4%:
v-min at p = 16, m = 16, costs 1,1.39,0.35,0.05, 102.965 -> 104.095), none faster.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import bisect

from ..model.actions import Action, PassKind, ScheduleError
from ..model.indexed import Dataflow, PassIndex
from ..model.problem import Problem
from ..model.simulate import pass_durations
from ..construct.cooldown_reorder import last_chunk0_forward

__all__ = ["LINES", "critical_tail", "critical_tails", "bottom_levels"]

LINES = ("own", "first", "middle")
"""Where the tails may start (``critical_tail``): each of them wins somewhere."""

F, B, W = PassKind.F, PassKind.B, PassKind.W
_EPS = 1e-9
_NEVER = float("inf")


def bottom_levels(index: PassIndex, durations: list[float], delays: list[float]) -> list[float]:
    """Per pass id, the longest path from its start to the end of the schedule: its duration,
    then the longest of what waits for it (plus the hop to it). F, B and W passes only (a fused
    BW completes as its B, which this does not model)."""
    stages, m = index.placement.num_stages, index.microbatches
    level = [0.0] * len(index.actions)
    for stage in range(stages):  # W passes wait for nothing after them
        first = index.first_id(W, stage)
        for w in range(first, first + m):
            level[w] = durations[w]
    for stage in range(stages):  # B(s) heads B(s-1) and W(s): stages upward
        first, weight = index.first_id(B, stage), index.first_id(W, stage)
        below = index.first_id(B, stage - 1) if stage else None
        for k in range(m):
            b = first + k
            after = level[weight + k] + delays[weight + k]
            if below is not None:
                after = max(after, level[below + k] + delays[below + k])
            level[b] = durations[b] + after
    for stage in reversed(range(stages)):  # F(s) heads F(s+1), the last F its B
        first = index.first_id(F, stage)
        then = index.first_id(F, stage + 1) if stage + 1 < stages else index.first_id(B, stage)
        for k in range(m):
            level[first + k] = durations[first + k] + level[then + k] + delays[then + k]
    return level


class _TailFacts:
    """What every line's re-scheduling reads and none changes: the orders as ids, per-id
    durations, hops, memory steps and bottom levels, and the orders' own timing (computed once
    for the three lines)."""

    def __init__(self, problem: Problem, orders):
        placement, costs, memory = problem.placement, problem.costs, problem.memory
        index = self.index = PassIndex.for_orders(placement, orders)
        self.ids = index.encode(orders)
        self.duration = index.durations(pass_durations(placement, costs))
        self.delay = index.delays(costs.comm)
        self.level = bottom_levels(index, self.duration, self.delay)
        self.step = index.steps(memory)
        self.cap = problem.cap + _EPS
        self.flow = Dataflow(index, self.duration, costs.comm)
        self.timing = self.flow.time(self.ids)
        self.span = placement.num_stages * index.microbatches
        """Ids are laid out kind, stage, microbatch: + span is the next kind (F -> B -> W) of
        the same stage and microbatch, + microbatches the next stage."""


class _Tail:
    """One line's re-scheduling (module doc): per rank its clock, level and what it can run
    next, per pass its end once run. A rank's F and B passes of one stage run in microbatch
    order, so of each (kind, stage) only the first left can be next, and of its W passes those
    whose B has ended: a rank's options are those few, not its whole tail."""

    def __init__(self, facts: _TailFacts, line: str):
        self.facts, index, timing = facts, facts.index, facts.timing
        self.end = timing.done[:]
        self.out, self.clock, self.memory, self.queues, self.weights = [], [], [], [], []
        self.position, self.rank_of, self.left = {}, {}, []
        for r, (order, cut) in enumerate(zip(facts.ids, _cuts(index, facts.ids, timing, line))):
            tail = order[cut:]
            self.out.append(order[:cut])
            self.clock.append(timing.ends[r][cut - 1] if cut else 0.0)
            self.memory.append(sum(facts.step[a] for a in order[:cut]))
            self.left.append(len(tail))
            queues: dict = {}
            for position, a in enumerate(tail):
                self.end[a] = -1.0
                self.position[a], self.rank_of[a] = position, r
                if index.kind[a] is not W:
                    queues.setdefault((index.kind[a], index.actions[a].stage), []).append(a)
            self.queues.append([queue[::-1] for queue in queues.values()])  # next one last
        for r, order in enumerate(facts.ids):  # W passes whose B ran before the tail
            self.weights.append([a for a in order[len(self.out[r]):]
                                 if index.kind[a] is W and self.end[a - facts.span] >= 0.0])
        dep = index.dep
        self.exact = not any(dep[a] >= 0 and self.end[dep[a]] < 0.0
                             for kept in self.out for a in kept)
        """Whether every kept pass waits only for kept passes: then their old times hold and
        the new orders run. The own line cuts the ranks at different times, so a kept pass can
        wait for one another rank re-schedules, taken here as ended at its old time."""

    def options(self, r: int) -> list[tuple[float, int, int]]:
        """(earliest start, position in the tail, id) of what rank r can run next: the first
        F or B left of each of its stages once its dependency has ended (a forward only when
        it fits), and its W passes whose B has ended."""
        facts = self.facts
        found, dep, end, delay, clock = [], facts.index.dep, self.end, facts.delay, self.clock[r]
        for queue in self.queues[r]:
            if not queue:
                continue
            a = queue[-1]
            d = dep[a]
            if d >= 0 and end[d] < 0.0 or self.memory[r] + facts.step[a] > facts.cap:
                continue
            ready = end[d] + delay[a] if d >= 0 else 0.0
            found.append((ready if ready > clock else clock, self.position[a], a))
        for w in self.weights[r]:
            ready = end[dep[w]] + delay[w]
            found.append((ready if ready > clock else clock, self.position[w], w))
        return found

    def next_passes(self, r: int) -> list[int]:
        """What rank r waits to run: the first F or B left of each stage, its W passes."""
        return [queue[-1] for queue in self.queues[r] if queue] + self.weights[r]

    def run(self, r: int, start: float, a: int) -> list[int]:
        """Runs ``a`` on rank r from ``start``; returns the ranks whose options changed."""
        facts = self.facts
        if facts.index.kind[a] is W:
            self.weights[r].remove(a)
        else:
            next(q for q in self.queues[r] if q and q[-1] == a).pop()
        self.out[r].append(a)
        self.clock[r] = self.end[a] = start + facts.duration[a]
        self.memory[r] += facts.step[a]
        self.left[r] -= 1
        touched = {r}
        for waiter in _waiters(facts, a):
            q = self.rank_of.get(waiter)
            if q is not None and self.end[waiter] < 0.0:
                touched.add(q)
                if facts.index.kind[waiter] is W:
                    self.weights[q].append(waiter)
        return sorted(touched)

    def schedule(self) -> list[list[int]]:
        """The orders, every tail re-scheduled (module doc); ScheduleError when stuck."""
        facts = self.facts
        options = {r: _soonest(facts, self.options(r)) for r in range(len(self.out))
                   if self.left[r]}
        while options:
            # the pass that can end first (ties: the lower rank), then its rank's conflict set
            end, r = min((soonest, r) for r, (soonest, _) in options.items())
            if end == _NEVER:
                stuck = [facts.index.actions[a] for q in options for a in self.next_passes(q)]
                raise ScheduleError(f"critical tail: no rank can run its next pass: {stuck[:4]}")
            conflict = [o for o in options[r][1] if o[0] < end - _EPS]
            start, _, a = max(conflict, key=lambda o: (facts.level[o[2]], -o[1]))
            for q in self.run(r, start, a):
                if self.left[q]:
                    options[q] = _soonest(facts, self.options(q))
                else:
                    options.pop(q, None)
        if not self.exact and facts.flow.time(self.out).stuck is not None:
            raise ScheduleError("critical tail: the re-scheduled orders deadlock (a kept pass "
                                "waits for one that another rank's tail moved)")
        return self.out


def critical_tails(problem: Problem, orders, lines=LINES) -> dict:
    """{line: ``critical_tail``'s orders from it} for each of ``lines``, sharing what the lines
    read; a line whose tails cannot run (a forward that never fits, or orders that deadlock:
    ``_Tail.exact``) is left out. The own line's did at p = 16, m = 32 and 18 units, costs
    2,2.4,1.6,0.1 (the V-ZB wave), and the search raised DeadlockError there; its cuts keep a
    pass that waits for another rank's tail in about 6% of searches (3 of 48), and only those
    orders are timed for it."""
    _check(orders, lines)
    facts = _TailFacts(problem, orders)
    out = {}
    for line in lines:
        try:
            out[line] = facts.index.decode(_Tail(facts, line).schedule())
        except ScheduleError:
            continue
    return out


def critical_tail(problem: Problem, orders, line: str = "own") -> tuple[tuple[Action, ...], ...]:
    """``orders`` with every rank's tail re-scheduled (module doc), each rank within the
    problem's cap. Where the tails start (``LINES``): ``own``, after each rank's last
    chunk-0 forward; ``first``, at the time the first rank runs its last one, the same time
    on every rank (so the later ranks' last chunk-0 forwards are re-scheduled too); ``middle``,
    halfway between that and the last rank's. Raises ScheduleError for fused BW passes, an
    unknown line, and when the tails cannot run (a forward that never fits, or orders that
    deadlock: ``critical_tails``)."""
    _check(orders, (line,))
    facts = _TailFacts(problem, orders)
    return facts.index.decode(_Tail(facts, line).schedule())


def _check(orders, lines) -> None:
    unknown = [line for line in lines if line not in LINES]
    if unknown:
        raise ScheduleError(f"critical tail: line {unknown[0]!r} is not one of "
                            f"{', '.join(LINES)}")
    if any(a.kind is PassKind.BW for order in orders for a in order):
        raise ScheduleError("fused BW passes: no bottom levels for them")


def _soonest(facts: _TailFacts, found: list) -> tuple[float, list]:
    """(the earliest end of ``found``'s passes, ``found``): kept per rank, so each step looks
    at one number per rank."""
    duration = facts.duration
    return min((s + duration[a] for s, _, a in found), default=_NEVER), found


def _waiters(facts: _TailFacts, a: int) -> tuple[int, ...]:
    """The ids whose dependency is ``a`` (deps.py's rule read backwards, by the id layout)."""
    kind, m, span = facts.index.kind[a], facts.index.microbatches, facts.span
    stage = (a % span) // m
    if kind is F:  # the next stage's F; the last stage's F heads its own B
        return (a + m,) if stage + 1 < facts.index.placement.num_stages else (a + span,)
    if kind is B:  # its W, and the B of the stage before
        return (a + span, a - m) if stage else (a + span,)
    return ()


def _cuts(index: PassIndex, ids: list[list[int]], timing, line: str) -> list[int]:
    """Per rank, the position where its tail starts (``critical_tail``'s ``line``)."""
    own = [last_chunk0_forward(index, r, order) + 1 for r, order in enumerate(ids)]
    if line == "own":
        return own
    last = [timing.starts[r][k - 1] for r, k in enumerate(own) if k]  # last chunk-0 forwards
    at = min(last) if line == "first" else (min(last) + max(last)) / 2
    return [bisect.bisect_right(starts, at) for starts in timing.starts]  # starts ascend
