"""A V order's warm-up and cool-down re-laid in the shapes the paper code's adaptive search
gives them.

A repeated block's warm-up and cool-down inherit the steady state's spacing, so a rank that
could already run chunk 1's F, B and W back to back, or pass a gradient on at once, waits in
the block's slots. The adaptive search of the paper's code (sail-sg/zero-bubble-pipeline-
parallelism, ``v_auto_schedule.py``: facts read there, nothing copied) re-lays both ends.

Warm-up (:func:`reshape_warm_up`): each rank's passes before its first chunk-0 B, for rank i of
p and a peak of P chunk-activations::

    2 (p - 1 - i)  chunk-0 F             fill the time until chunk 1 comes back
    i + 1       x  (chunk-0 F, chunk-1 F)
    until done  :  chunk-1 B, its W, then a forward (chunk 1's while one is left)

with at most P - min(i + 1, P // 2) chunk-0 and min(i + 1, P // 2) chunk-1 forwards in the first
two parts, P the problem's limit in whole chunk-activations (model/problem.py's ``full``; a
caller that lays out to another peak passes ``problem.with_cap(peak)``). Only the order of the
prefix changes: the same passes (each stage's in their microbatch order) come before the rank's
first chunk-0 B, and everything after it stays.

Cool-down (:func:`reshape_cool_down`): each rank's last few B passes laid so that both
gradients' walks are tight, in unit slots (:func:`_cool_down_slots`), W passes refilled after.

Both only reorder a rank's own passes, so the result lowers like its input; the caller checks
the peak (the shapes can raise it) and times it (they can deadlock across ranks).

Measured (costs 2,2,2, hop 0.1, p = 8 at 4 units; bubble, the reference's search in brackets):
m = 16 0.254 -> 0.242 (0.243) with the warm-up; m = 64 0.124 -> 0.117 (0.115) with both.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

from collections import deque

from ..model.actions import Action, PassKind, ScheduleError
from ..model.costs import Costs
from ..model.placement import Layout, Placement
from ..model.problem import Problem
from ..model.simulate import pass_durations, time_orders

__all__ = ["reshape_warm_up", "reshape_cool_down", "unit_slots"]

F, B, W = PassKind.F, PassKind.B, PassKind.W


def reshape_warm_up(problem: Problem, orders) -> tuple[tuple[Action, ...], ...]:
    """``orders`` with every rank's passes before its first chunk-0 B re-laid (module doc);
    the problem's limit in whole chunk-activations (``full``) sets how many forwards the first
    two parts take."""
    placement, peak = problem.placement, problem.full
    if placement.layout is not Layout.V:
        raise ScheduleError("the warm-up shape is defined for the V layout")
    return tuple(_reshape_rank(placement, rank, tuple(order), peak)
                 for rank, order in enumerate(orders))


def _reshape_rank(placement: Placement, rank: int, order: tuple, peak: int) -> tuple:
    p = placement.ranks
    down, up = placement.stage_of(rank, 0), placement.stage_of(rank, 1)
    cut = next((k for k, a in enumerate(order) if a.kind is B and a.stage == down), len(order))
    queues = {key: deque() for key in ((F, down), (F, up), (B, up), (W, up))}
    for action in order[:cut]:
        queue = queues.get((action.kind, action.stage))
        if queue is None:  # a chunk-0 W before chunk-0's first B cannot be: keep the order
            return order
        queue.append(action)
    f0, f1, b1, w1 = (queues[key] for key in ((F, down), (F, up), (B, up), (W, up)))
    first_f1 = min(rank + 1, peak // 2)
    first_f0 = peak - first_f1
    prefix: list[Action] = []
    done: set[tuple] = set()  # (kind, stage, microbatch) already in the prefix

    def take(queue: deque) -> bool:
        """Append the queue's head if its local predecessor is in (a chunk-1 F needs this
        rank's chunk-0 F of its microbatch, a chunk-1 B its chunk-1 F, a W its B)."""
        if not queue:
            return False
        head = queue[0]
        need = _local_predecessor(head, down, up)
        if need is not None and need not in done:
            return False
        prefix.append(queue.popleft())
        done.add((head.kind, head.stage, head.microbatch))
        return True

    counts = {"f0": 0, "f1": 0}
    for _ in range(2 * (p - 1 - rank)):
        if counts["f0"] < first_f0 and take(f0):
            counts["f0"] += 1
    for _ in range(rank + 1):
        if counts["f0"] < first_f0 and take(f0):
            counts["f0"] += 1
        if counts["f1"] < first_f1 and take(f1):
            counts["f1"] += 1
    while f0 or f1 or b1 or w1:
        moved = take(b1)
        moved = take(w1) or moved
        moved = (take(f1) or take(f0)) or moved
        if not moved:  # nothing can go next in this shape: keep the rank's own order
            return order
    return tuple(prefix) + order[cut:]


def _local_predecessor(action: Action, down: int, up: int) -> tuple | None:
    """The pass on the same rank that must come first, as (kind, stage, microbatch)."""
    if action.kind is F and action.stage == up:
        return (F, down, action.microbatch)
    if action.kind is B:
        return (F, up, action.microbatch)
    if action.kind is W:
        return (B, action.stage, action.microbatch)
    return None


def reshape_cool_down(problem: Problem, orders) -> tuple[tuple[Action, ...], ...]:
    """``orders`` with their tails re-laid in the cool-down shape of the paper code's adaptive
    search (module doc of :func:`_cool_down_slots`), or ``orders`` unchanged when the shape's
    slots are taken; the peak laid out to is the problem's ``full``, as for
    :func:`reshape_warm_up`."""
    placement, peak = problem.placement, problem.full
    if placement.layout is not Layout.V:
        raise ScheduleError("the cool-down shape is defined for the V layout")
    microbatches = problem.microbatches
    slots = unit_slots(placement, microbatches, orders)
    last_f1 = max(slot for a, slot in zip(orders[0], slots[0])
                  if a.kind is F and a.stage == placement.stage_of(0, 1))
    out = []
    for rank, (order, rank_slots) in enumerate(zip(orders, slots)):
        laid = _cool_down_slots(placement, rank, list(zip(rank_slots, order)), peak,
                                microbatches, last_f1)
        if laid is None:
            return tuple(tuple(o) for o in orders)
        out.append(laid)
    return tuple(out)


def unit_slots(placement: Placement, microbatches: int, orders) -> list[list[int]]:
    """Each pass's slot when every pass takes one slot and hops are free: the order squeezed
    as the paper's code squeezes it (its slots are this timing's start times)."""
    unit = Costs.build(placement.ranks, placement.chunks, placement.chunks, placement.chunks)
    starts, _ = time_orders(placement, microbatches, [tuple(o) for o in orders],
                            pass_durations(placement, unit), 0.0)
    return [[round(t) for t in rank] for rank in starts]


def _cool_down_slots(placement: Placement, rank: int, timed: list, peak: int, m: int,
                     last_f1: int) -> tuple | None:
    """One rank's order with its cool-down re-laid, in slots (``timed``: (slot, action)).

    As the paper code does it, for rank i of p, peak P, and s the slot of rank 0's last
    chunk-1 F:

        pull      the rank's last min((P + 1) // 2, m) chunk-0 B and last min(i + 1, P - that,
                  m) chunk-1 B, and W passes from the end until there are at least as many of
                  each chunk as pulled B and at least P in all
        lay       the k-th last chunk-0 B at slot s - i + 2p - 2k, the k-th last chunk-1 B at
                  s + 1 + i - 2k: both gradients' walks are then tight, one slot a hop
        refill    W passes into the free slots after the rank's last remaining W, chunk 1's
                  first while one is owed, the rest at the end; each W takes its chunk's
                  oldest B without one

    None when a laid B's slot is taken by a pass that stayed.
    """
    p = placement.ranks
    down, up = placement.stage_of(rank, 0), placement.stage_of(rank, 1)
    chunk_of = {down: 0, up: 1}
    pull_b0 = min((peak + 1) // 2, m)
    pull_b1 = min(rank + 1, peak - pull_b0, m)
    pulled = {0: [], 1: []}
    kept = list(timed)
    for index in range(len(kept) - 1, -1, -1):
        slot, action = kept[index]
        if action.kind is B:
            chunk = chunk_of[action.stage]
            if len(pulled[chunk]) < (pull_b1 if chunk else pull_b0):
                pulled[chunk].append(action)
                kept[index] = None
    owed = {0: len(pulled[0]), 1: len(pulled[1])}
    dropped = {0: 0, 1: 0}
    for index in range(len(kept) - 1, -1, -1):
        if dropped[1] >= owed[1] and dropped[0] >= owed[0] and sum(dropped.values()) >= peak:
            break
        if kept[index] is not None and kept[index][1].kind is W:
            dropped[chunk_of[kept[index][1].stage]] += 1
            kept[index] = None
    kept = [entry for entry in kept if entry is not None]
    taken = {slot for slot, _ in kept}
    laid = []
    for chunk, stage, first in ((0, down, last_f1 - rank + 2 * p), (1, up, last_f1 + 1 + rank)):
        for k, action in enumerate(sorted(pulled[chunk], key=lambda a: -a.microbatch)):
            slot = first - 2 * k
            if slot in taken:
                return None
            taken.add(slot)
            laid.append((slot, action))
    busy = sorted(kept + laid, key=lambda entry: entry[0])
    return _refill_weights(busy, dropped, chunk_of, down, up)


def _refill_weights(busy: list, dropped: dict, chunk_of: dict, down: int, up: int) -> tuple:
    """The rank's order with ``dropped`` W passes back in the free slots after its last W."""
    last_w = max((slot for slot, a in busy if a.kind is W), default=-1)
    by_slot = dict(busy)
    end = max(by_slot, default=-1)
    kinds: list = []  # (kind, chunk) or an Action that stays as it is
    owed = {0: 0, 1: 0}  # B seen without their W, by chunk (W relabelled below)
    to_place = dict(dropped)
    for slot in range(end + 1):
        action = by_slot.get(slot)
        if action is not None:
            kinds.append(action)
            if action.kind is B:
                owed[chunk_of[action.stage]] += 1
            elif action.kind is W:
                owed[chunk_of[action.stage]] -= 1
        elif slot > last_w:
            for chunk in (1, 0):
                if owed[chunk] > 0 and to_place[chunk] > 0:
                    kinds.append((W, chunk))
                    owed[chunk] -= 1
                    to_place[chunk] -= 1
                    break
    kinds.extend((W, 1) for _ in range(to_place[1]))
    kinds.extend((W, 0) for _ in range(to_place[0]))
    return _relabel_weights(kinds, chunk_of, {0: down, 1: up})


def _relabel_weights(kinds: list, chunk_of: dict, stage_of: dict) -> tuple:
    """Give every W, in order, its chunk's oldest B that has no W yet. A W that keeps its
    microbatch stays the same action (most do: only the tail moves; p = 16, m = 64: 8,192 new
    actions per search otherwise)."""
    pending = {0: deque(), 1: deque()}
    out = []
    for entry in kinds:
        if isinstance(entry, Action) and entry.kind is not W:
            if entry.kind is B:
                pending[chunk_of[entry.stage]].append(entry.microbatch)
            out.append(entry)
            continue
        chunk = chunk_of[entry.stage] if isinstance(entry, Action) else entry[1]
        if not pending[chunk]:
            raise ScheduleError(f"cool-down shape: a chunk-{chunk} W before its B")
        microbatch = pending[chunk].popleft()
        same = isinstance(entry, Action) and entry.microbatch == microbatch
        out.append(entry if same else Action(W, stage_of[chunk], microbatch))
    return tuple(out)
