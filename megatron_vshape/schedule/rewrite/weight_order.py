"""Each stage's W passes in the order of its B passes, at the same places.

Transformer Engine keeps a layer's delayed weight-gradient GEMMs in a first-in first-out queue
(``delay_wgrad_compute``; its ``backward_dw`` runs the oldest), so a rank must run a stage's W
passes in the order of that stage's B passes. The builders do; the local search that polishes
an order may swap two W passes of one stage (V-ZB at p = 4, m = 8 under measured costs put
W4 before W3 on rank 0).

The rewrite keeps every pass where it is and gives the k-th W of a stage the microbatch of the
k-th B of that stage on its rank::

    before   B0 B1 B2 W0 W2 W1        after   B0 B1 B2 W0 W1 W2

It is always valid: in the source, the first k W passes of a stage belong to k microbatches
whose B passes all ran before the k-th W, so at least k B passes precede it, and the k-th of
them is the one it now takes. A W depends on nothing but its own B and no pass depends on a W,
all microbatches of a stage cost the same and free the same memory, so times, memory peaks,
sends and receives are unchanged.
"""
from __future__ import annotations

import collections

from ..model.actions import PassKind
from ..model.provenance import step
from ..model.schedule import Schedule

__all__ = ["weights_in_backward_order"]


def weights_in_backward_order(schedule: Schedule) -> Schedule:
    """``schedule`` with each stage's W passes relabelled into its B order (module doc); the
    schedule itself when they already are."""
    orders = [_relabelled(actions) for actions in schedule.rank_actions]
    if all(new == tuple(old) for new, old in zip(orders, schedule.rank_actions)):
        return schedule
    return schedule.with_actions(orders,
                                 provenance=schedule.provenance.followed_by(step("W in B order")))


def _relabelled(actions) -> tuple:
    backward = collections.defaultdict(collections.deque)
    for action in actions:
        if action.kind is PassKind.B:
            backward[action.stage].append(action.microbatch)
    return tuple(action._replace(microbatch=backward[action.stage].popleft())
                 if action.kind is PassKind.W else action for action in actions)
