"""The hand-written ZB-V order (Qi et al., "Zero Bubble Pipeline Parallelism", section 6).

A candidate order for the V-ZB block (see ``BlockFamily.reorders``): the block repeated and
list-scheduled keeps one idle slot on rank 0 where steady state turns into cool-down, while this
order defers the up-leg W passes into the cool-down, where they fill the gradient's trip back
along the V. Per rank i of p, as (pass, chunk) patterns; each (pass, chunk) takes the next
microbatch in order::

    warm-up    (2(p-i)-1) x F0,  i x (F1, F0),  (p-i) x (F1, B1, W1)
    steady     F0 B0 W0 F1 B1 W1 while forwards remain
    cool-down  i x (B0, B1),  (p-i) x (B0, W0),  then every pending W1, then every pending W0

The pattern needs 2p-1 microbatches; with fewer it is built for 2p-1 and the passes of the
missing microbatches are dropped (that keeps every dependency of the remaining ones).
The same order ships in torch.distributed.pipelining as ScheduleZBVZeroBubble.
"""
from __future__ import annotations

from collections import Counter

from ..model.actions import Action, PassKind
from ..model.placement import Layout, Placement

__all__ = ["zbv_order"]

F, B, W = PassKind.F, PassKind.B, PassKind.W


def _rank_pattern(p: int, i: int, m: int) -> list[tuple[PassKind, int]]:
    """(kind, chunk) tokens of rank i; ``m`` is already at least 2p - 1."""
    tokens = [(F, 0)] * (2 * (p - i) - 1) + [(F, 1), (F, 0)] * i + [(F, 1), (B, 1), (W, 1)] * (p - i)
    count = Counter(tokens)
    while count[F, 1] < count[F, 0] or count[F, 0] < m:
        step = ([(F, 0)] if count[F, 0] < m else []) + [(B, 0), (W, 0), (F, 1), (B, 1), (W, 1)]
        tokens += step
        count.update(step)
    cool = [(B, 0), (B, 1)] * i + [(B, 0), (W, 0)] * (p - i)
    tokens += cool
    count.update(cool)
    return tokens + [(W, 1)] * (m - count[W, 1]) + [(W, 0)] * (m - count[W, 0])


def zbv_order(ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per-rank orders of the ZB-V schedule for ``microbatches`` microbatches."""
    placement = Placement(ranks, Layout.V)
    padded = max(microbatches, 2 * ranks - 1)
    orders = []
    for rank in range(ranks):
        stages = (placement.stage_of(rank, 0), placement.stage_of(rank, 1))
        counters: Counter = Counter()
        order = []
        for token in _rank_pattern(ranks, rank, padded):
            microbatch = counters[token]
            counters[token] += 1
            if microbatch < microbatches:
                order.append(Action(token[0], stages[token[1]], microbatch))
        orders.append(tuple(order))
    return tuple(orders)
