"""Squeeze and reorder in slots, pass by pass (paper, section 4, steps 3-4, as its code does it).

``compose`` squeezes a repeated block as a whole and rebuilds the cool-down; the paper's own
generator instead walks every pass in slot order and moves it to the earliest free slot after
its dependencies, as long as the rank's peak memory (counted in slots) does not grow. It does so
twice, and the result is a different warm-up: a rank's chunk-1 W can run right after its B,
before the next forward arrives, where ``compose`` leaves the slot empty. Neither order wins
everywhere (p = 4, m = 8, F = B = W: 0.094 bubble here against 0.111; elsewhere ``compose``'s
cool-down wins), so the adaptive search and the memory levels time both, and the local search
(search/local.py) starts from the faster.

The walk, for a V block (types ``F0 F1 B1 B0 W``: chunk-0 forward, chunk-1 forward, chunk-1
backward, chunk-0 backward, weight pass):

    1. repeat the block every ``interval`` slots; W passes take free slots first in first out
    2. walk all passes in slot order (ties: rank, then type); before rank 0's first B0 (the
       warm-up) and after rank 0's last F0 (the cool-down) each pass moves to the earliest free
       slot after its dependencies that keeps the rank's peak, else it stays
    3. drop the W passes; walk again, moving cool-down passes only, W passes now implicit (each
       free slot retires one pending W)
    4. place W passes per chunk, first in first out, chunk 1's first, into the free slots

All moves are in unit slots, so the order is cost-independent (the simulator times it).
"""
from __future__ import annotations

import functools
from collections import deque

from ..model.actions import Action, PassKind, ScheduleError
from ..model.placement import Layout, Placement
from .blocks import BuildingBlock

__all__ = ["slot_reorder"]

F, B, W = PassKind.F, PassKind.B, PassKind.W
F0, F1, B1, B0, WT = range(5)
"""Pass types in the walk's tie order; ``WT`` is a weight pass of either chunk."""
_KIND_CHUNK = {F0: (F, 0), F1: (F, 1), B1: (B, 1), B0: (B, 0)}
_DELTA = (1, 1, 0, 0, -1)
"""Memory per type in chunk-activations (F holds its chunk, W frees it)."""
_WARM_UP, _STEADY, _COOL_DOWN = range(3)


@functools.lru_cache(maxsize=16, typed=True)
def slot_reorder(block: BuildingBlock, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per-rank orders of ``block`` repeated ``microbatches`` times, squeezed and reordered by
    the pass-by-pass walk of the module doc. Cached per (block, microbatches), like
    :func:`.compose.compose`: the walk is in slots, so costs and memory model do not enter."""
    if block.layout is not Layout.V or not block.split_backward:
        raise ScheduleError(f"block {block.name}: the slot reorder needs a V block with W passes")
    slots = [_repeated(block, rank, microbatches) for rank in range(block.ranks)]
    for rank_slots in slots:
        rank_slots[WT] = _weights(rank_slots)[0]
    _walk(slots, explicit_weights=True)
    slots = _squeeze(slots)
    for rank_slots in slots:
        rank_slots[WT] = []
    _walk(slots, explicit_weights=False)
    for rank_slots in slots:
        rank_slots[WT] = _weights(rank_slots)[0]
    slots = _squeeze(slots)
    placement = Placement(block.ranks, Layout.V)
    return tuple(_order(placement, rank, rank_slots) for rank, rank_slots in enumerate(slots))


def _repeated(block: BuildingBlock, rank: int, m: int) -> list[list[int]]:
    """Slots of each type on ``rank``, microbatch k at index k."""
    by_kind = {kind_chunk: slot for kind_chunk, slot in block.slots[rank]}
    out = [[by_kind[_KIND_CHUNK[t]] + block.interval * k for k in range(m)]
           for t in (F0, F1, B1, B0)]
    return out + [[]]


def _weights(rank_slots: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """W slots, first in first out into the free slots after the B passes: (all W slots in B
    order, per chunk [chunk 0's, chunk 1's] with chunk 1's taking a free slot first)."""
    taken = {}
    for t in (F0, F1, B1, B0):
        for slot in rank_slots[t]:
            taken[slot] = t
    pending = {0: deque(), 1: deque()}
    anonymous, per_chunk = [], [[], []]
    owed = 0
    slot = 0
    last = max(taken)
    while slot <= last or owed:
        t = taken.get(slot)
        if t in (B1, B0):
            owed += 1
            pending[_KIND_CHUNK[t][1]].append(slot)
        elif t is None and owed:
            owed -= 1
            anonymous.append(slot)
            chunk = 1 if pending[1] else 0
            pending[chunk].popleft()
            per_chunk[chunk].append(slot)
        slot += 1
    return anonymous, per_chunk


def _walk(slots: list[list[list[int]]], explicit_weights: bool) -> None:
    """One pass of step 2 (``explicit_weights``) or step 3 over all ranks, in place."""
    types = (F0, F1, B1, B0, WT) if explicit_weights else (F0, F1, B1, B0)
    cap = max(_peak(rank_slots, explicit_weights) for rank_slots in slots)
    events = sorted((slot, rank, t, k) for rank, rank_slots in enumerate(slots)
                    for t in types for k, slot in enumerate(rank_slots[t]))
    occupied = [set() for _ in slots]
    last_f0 = len(slots[0][F0]) - 1
    phase = _WARM_UP
    for slot, rank, t, k in events:
        if phase == _WARM_UP and t == B0 and rank == 0:
            phase = _STEADY
        movable = phase == _COOL_DOWN or (phase == _WARM_UP and explicit_weights)
        if phase == _STEADY and t == F0 and k == last_f0:
            phase = _COOL_DOWN
        if movable:
            _move_earlier(slots, rank, t, k, occupied[rank], cap, explicit_weights)
        occupied[rank].add(slots[rank][t][k])


def _move_earlier(slots, rank: int, t: int, k: int, occupied: set, cap: int,
                  explicit_weights: bool) -> None:
    """Move pass (t, k) of ``rank`` to the earliest free slot after its dependencies that keeps
    the rank's peak at most ``cap``; leave it where it is when none does."""
    rank_slots = slots[rank]
    home = rank_slots[t][k]
    # with W passes explicit, moving a pass that adds nothing earlier cannot raise the peak
    unchecked = explicit_weights and _DELTA[t] <= 0
    for candidate in range(_earliest(slots, rank, t, k), home):
        if candidate in occupied:
            continue
        rank_slots[t][k] = candidate
        if unchecked or _peak(rank_slots, explicit_weights) <= cap:
            return
    rank_slots[t][k] = home


def _earliest(slots, rank: int, t: int, k: int) -> int:
    """One slot after the latest dependency of pass (t, k) on ``rank``."""
    deps = [slots[r][dt][dk] for r, dt, dk in _dependencies(len(slots), rank, t, k)]
    if t == WT:
        own = slots[rank]
        deps.append(sorted(own[B1] + own[B0])[k])
    return max(deps, default=-1) + 1


def _dependencies(p: int, rank: int, t: int, k: int):
    """(rank, type, microbatch) of the passes that pass (t, k) on ``rank`` follows: the same
    type's previous microbatch, the microbatch's previous type on the rank (F1 after F0, B1
    after F1, B0 after B1), and the neighbour rank along the V (a W's B is the caller's)."""
    if k:
        yield rank, t, k - 1
    if t == WT:
        return
    if t != F0:
        yield rank, t - 1, k
    if t in (F0, B1) and rank > 0:
        yield rank - 1, t, k
    if t in (F1, B0) and rank < p - 1:
        yield rank + 1, t, k


def _squeeze(slots: list[list[list[int]]]) -> list[list[list[int]]]:
    """Every pass as early as its dependencies and its rank's previous pass allow, each rank's
    order kept (unit passes, no hop): the walk leaves gaps that the next step must not see."""
    events = sorted((slot, rank, t, k) for rank, rank_slots in enumerate(slots)
                    for t, slots_of_type in enumerate(rank_slots)
                    for k, slot in enumerate(slots_of_type))
    out = [[[0] * len(slots_of_type) for slots_of_type in rank_slots] for rank_slots in slots]
    free = [0] * len(slots)
    for _, rank, t, k in events:
        start = free[rank]
        for r, dt, dk in _dependencies(len(slots), rank, t, k):
            start = max(start, out[r][dt][dk] + 1)
        out[rank][t][k] = start
        free[rank] = start + 1
    return out


def _peak(rank_slots: list[list[int]], explicit_weights: bool) -> int:
    """The rank's peak memory in chunk-activations; without explicit W passes every free slot
    retires one pending W (as step 4 will place them)."""
    last = max(slots_of_type[-1] for slots_of_type in rank_slots if slots_of_type)
    delta_at = [None] * (last + 1)  # this runs for every tried move: lists, not dicts
    for t, slots_of_type in enumerate(rank_slots):
        delta = _DELTA[t]
        for slot in slots_of_type:
            delta_at[slot] = delta
    level = peak = owed = 0
    for delta in delta_at:
        if delta is None:
            if owed and not explicit_weights:
                owed -= 1
                level -= 1
        elif delta:
            level += delta
            if level > peak:
                peak = level
        else:  # a B: its W is owed
            owed += 1
    return peak


def _order(placement: Placement, rank: int, rank_slots: list[list[int]]) -> tuple[Action, ...]:
    """The rank's passes sorted by slot, W passes placed by step 4."""
    timed = []
    for t in (F0, F1, B1, B0):
        kind, chunk = _KIND_CHUNK[t]
        stage = placement.stage_of(rank, chunk)
        timed.extend((slot, Action(kind, stage, k)) for k, slot in enumerate(rank_slots[t]))
    for chunk, w_slots in enumerate(_weights(rank_slots)[1]):
        stage = placement.stage_of(rank, chunk)
        timed.extend((slot, Action(W, stage, k)) for k, slot in enumerate(w_slots))
    timed.sort(key=lambda sa: sa[0])
    return tuple(action for _, action in timed)
