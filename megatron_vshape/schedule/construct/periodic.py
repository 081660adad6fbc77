"""Cost-aware V blocks with continuous offsets (the paper's future work, section "known weakness").

The fixed blocks place passes in unit slots, so with F, B and W of different lengths their
6-slot steady state takes 6 x max(pass) per microbatch. Here the block is built in real time
for the given costs by modulo scheduling: every rank repeats its passes with one period T (at
least its compute per microbatch, F + B + W), and microbatch 0's passes are placed, in
dependency order along the V, at the earliest time that

    follows their dependencies (one hop of ``comm`` across ranks; the V's turn is local), and
    does not overlap, modulo T, a pass already placed on the same rank;

each W right after its B, or into the next free gap. A longer period lowers the memory (fewer
microbatches in flight per lifespan) at the cost of a slower steady state.

Repeating the block every T and sorting each rank's passes by start time gives the order; the
simulator then squeezes it. Memory is whatever the order holds (checked by the caller): the
block reads the problem's placement and costs, not its limit.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.actions import Action, PassKind, ScheduleError
from ..model.placement import Layout, Placement
from ..model.problem import Problem

__all__ = ["PeriodicBlock", "periodic_block", "periodic_orders"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
_EPS = 1e-9


@dataclass(frozen=True)
class PeriodicBlock:
    """The pass start times per rank of ``patterns`` microbatches (``periodic_block``'s: one),
    repeated every ``period``: repeat k runs microbatches k x patterns + offset. A block of
    several lets their patterns differ, a steady state that alternates them (the machine proof
    in tests/schedule/test_search_bound.py, case 6, builds one)."""

    ranks: int
    period: float
    starts: tuple[tuple[tuple[float, PassKind, int, int], ...], ...]
    """Per rank: (start time, kind, chunk, offset) of each pass of the block's microbatches."""
    patterns: int = 1


class _Reservations:
    """Busy intervals of one rank, modulo the period."""

    def __init__(self, period: float):
        self.period = period
        self.busy: list[tuple[float, float]] = []

    def _clashes(self, start: float, length: float) -> float | None:
        """The end (in the frame of ``start``) of the first clash, or None when free."""
        s = start % self.period
        for b_start, b_len in self.busy:
            for shift in (-self.period, 0.0, self.period):
                lo = b_start + shift
                if lo < s + length - _EPS and s < lo + b_len - _EPS:
                    return start + (lo + b_len - s)
        return None

    def place(self, earliest: float, length: float) -> float:
        start = earliest
        for _ in range(4 * len(self.busy) + 4):
            clash = self._clashes(start, length)
            if clash is None:
                self.busy.append((start % self.period, length))
                return start
            start = clash
        raise ScheduleError(f"no room for a pass of length {length:g} in period {self.period:g}")


def periodic_block(problem: Problem, period_scale: float) -> PeriodicBlock:
    """Build the block for the problem's costs (a V placement); the period is ``period_scale``
    x the slowest rank's work."""
    if problem.placement.layout is not Layout.V:
        raise ScheduleError("the continuous-offset block is defined for the V layout")
    p, costs = problem.ranks, problem.costs
    times = costs.pass_times(problem.placement)  # [rank][chunk]
    f = [[t.forward for t in chunks] for chunks in times]
    b = [[t.backward for t in chunks] for chunks in times]
    w = [[t.weight for t in chunks] for chunks in times]
    period = period_scale * max(sum(t.forward + t.backward + t.weight for t in chunks)
                                for chunks in times)
    table = [_Reservations(period) for _ in range(p)]
    starts: list[list[tuple[float, PassKind, int, int]]] = [[] for _ in range(p)]
    hop = costs.comm

    def put(rank, kind, chunk, earliest, length):
        start = table[rank].place(earliest, length)
        starts[rank].append((start, kind, chunk, 0))
        return start + length

    ready = 0.0
    for r in range(p):  # chunk 0 forward, down the V
        ready = put(r, F, 0, ready, f[r][0]) + hop
    ready -= hop
    for r in reversed(range(p)):  # chunk 1 forward, back up
        ready = put(r, F, 1, ready, f[r][1]) + hop
    ready -= hop
    b1_end = []
    for r in range(p):  # chunk 1 input gradient, down again (the loss is on rank 0)
        end = put(r, B, 1, ready, b[r][1])
        b1_end.append(end)
        ready = end + hop
    ready -= hop
    for r in reversed(range(p)):  # chunk 0 input gradient, back up
        end = put(r, B, 0, ready, b[r][0])
        put(r, W, 1, b1_end[r], w[r][1])
        put(r, W, 0, end, w[r][0])
        ready = end + hop
    frozen = tuple(tuple(sorted(s, key=lambda x: x[0])) for s in starts)
    return PeriodicBlock(ranks=p, period=period, starts=frozen)


def periodic_orders(block: PeriodicBlock, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Repeat ``block`` every period and order each rank's passes by start time."""
    placement = Placement(block.ranks, Layout.V)
    step = block.patterns
    orders = []
    for rank, passes in enumerate(block.starts):
        stage = (placement.stage_of(rank, 0), placement.stage_of(rank, 1))
        timed = [
            (start + k * block.period, order, Action(kind, stage[chunk], k * step + offset))
            for order, (start, kind, chunk, offset) in enumerate(passes)
            for k in range((microbatches - offset + step - 1) // step)
        ]
        timed.sort(key=lambda x: (round(x[0], 9), x[1]))
        orders.append(tuple(a for _, _, a in timed))
    return tuple(orders)
