"""Passes as integers, for the loops that time orders many times (simulator, local search).

Timing an order of :class:`Action` values costs four dictionary operations per pass, each
hashing a three-field tuple, and the local search times orders of thousands of passes tens of
thousands of times. Here every compute action of one (placement, microbatches) shape gets an
integer id once, with flat lists of what the timing loop reads per pass::

    dep[id]        the id of the one pass it waits for (deps.py), -1 when none
    remote[id]     whether that dependency crosses ranks (one hop of comm)
    key[id]        the id others wait for when it ends (a fused BW completes its B)

:class:`Dataflow` times per-rank orders of ids by dataflow, as the simulator always has (each
rank runs its order, a pass starts when the rank is free and its dependency has ended, plus a
hop across ranks), and re-times them after a change: a pass that starts before the first pass
an edit touched keeps its times (by induction over start times: its rank's previous pass and
its dependency both ended before it, so before the edit), so only the rest is timed again.
Each pass's times come from the same operations on the same inputs either way, so they are
bit-identical to a full timing.
"""
from __future__ import annotations

import bisect
import functools
import operator
from dataclasses import dataclass

from .actions import Action, PassKind
from .costs import MemoryModel
from .deps import hop_table, wake_table
from .placement import Placement

__all__ = ["PassIndex", "Dataflow", "Timing", "gather"]

_KINDS = (PassKind.F, PassKind.B, PassKind.W, PassKind.BW)
_MICROBATCH = operator.itemgetter(2)  # Action's field


@dataclass(frozen=True, eq=False)
class PassIndex:
    """Integer ids of every compute action of a shape, and the per-id facts the loops read."""

    placement: Placement
    microbatches: int
    actions: tuple[Action, ...]
    """id -> action."""
    ids: dict
    """action -> id."""
    dep: tuple[int, ...]
    remote: tuple[bool, ...]
    key: tuple[int, ...]
    rank: tuple[int, ...]
    """The rank that runs the pass."""
    chunk: tuple[int, ...]
    """Which of its rank's chunks the pass's stage is."""
    kind: tuple[PassKind, ...]
    slot: tuple[int, ...]
    """(rank x chunks + chunk) x 4 + the kind's place in (F, B, W, BW): where its duration
    is looked up."""

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def of(placement: Placement, microbatches: int) -> "PassIndex":
        """The index of a shape, built once and shared read-only."""
        table = hop_table(placement, microbatches)
        actions = tuple(Action(kind, stage, mb) for kind in _KINDS
                        for stage in range(placement.num_stages) for mb in range(microbatches))
        ids = {action: i for i, action in enumerate(actions)}
        dep, remote, key = [], [], []
        for action in actions:
            completes, waits_for, crosses = table[action]
            dep.append(-1 if waits_for is None else ids[waits_for])
            remote.append(crosses)
            key.append(ids[completes])
        located = [placement.locate(a.stage) for a in actions]
        rank = tuple(r for r, _ in located)
        kind = tuple(a.kind for a in actions)
        chunk = tuple(c for _, c in located)
        slot = tuple(4 * (r * placement.chunks + c) + _KINDS.index(k)
                     for r, c, k in zip(rank, chunk, kind))
        return PassIndex(placement, microbatches, actions, ids, tuple(dep), tuple(remote),
                         tuple(key), rank, chunk, kind, slot)

    @staticmethod
    def for_orders(placement: Placement, orders) -> "PassIndex":
        """The index of a shape that covers every microbatch ``orders`` name."""
        last = max((max(map(_MICROBATCH, order)) for order in orders if order), default=0)
        return PassIndex.of(placement, last + 1)

    def first_id(self, kind: PassKind, stage: int) -> int:
        """The id of microbatch 0's pass of ``kind`` on ``stage``; microbatch k's is k more
        (ids are laid out kind by kind, in (F, B, W, BW) order, then stage, then microbatch)."""
        return (_KINDS.index(kind) * self.placement.num_stages + stage) * self.microbatches

    def encode(self, orders) -> list[list[int]]:
        """Per-rank orders of actions as lists of ids."""
        return [gather(self.ids, order) for order in orders]

    def decode(self, orders) -> tuple[tuple[Action, ...], ...]:
        actions = self.actions
        return tuple(tuple(actions[i] for i in order) for order in orders)

    def durations(self, per_chunk: list[list[dict]]) -> list[float]:
        """Per id, its duration from durations per rank, chunk and kind
        (simulate.pass_durations)."""
        flat = [durations[kind] for chunks in per_chunk for durations in chunks
                for kind in _KINDS]
        return gather(flat, self.slot)

    def delays(self, comm: float) -> list[float]:
        """Per id, what its dependency's end is delayed by: one hop when it crosses ranks."""
        return gather((0.0, comm), self.remote)

    def steps(self, memory: MemoryModel) -> list[float]:
        """Per id, what the pass adds to its rank's activations (memory.deltas)."""
        return gather(memory.deltas, self.kind)

    def wakes(self, comm: float, kinds: frozenset) -> list[tuple]:
        """Per completion id, the (rank, hop delay) of every pass of ``kinds`` that waits for
        it (deps.wake_table): whom a finished pass wakes in the list schedulers."""
        return _wakes(self, comm, kinds)


@dataclass
class Timing:
    """Start and end of every pass of per-rank id orders (aligned with the orders), and where
    they deadlock (``stuck``: rank and position, None when every pass ran)."""

    starts: list[list[float]]
    ends: list[list[float]]
    stuck: tuple[int, int] | None
    done: list[float]
    """End time by completion id (-1.0: not run); what :meth:`Dataflow.retime` starts from."""
    timed: int
    """How many passes this timing computed (the rest were kept from an earlier one)."""


class Dataflow:
    """Times id orders under fixed durations and hop (module doc), in full or after a change."""

    def __init__(self, index: PassIndex, durations: list[float], comm: float):
        self.index = index
        self.duration = durations
        self.delay = index.delays(comm)

    def time(self, orders) -> Timing:
        """A full timing of ``orders``."""
        ranks = len(orders)
        return self._run(orders, [0] * ranks, [0.0] * ranks, [-1.0] * len(self.index.actions),
                         [[0.0] * len(order) for order in orders],
                         [[0.0] * len(order) for order in orders])

    def retime(self, orders, kept: Timing, cut: float) -> Timing:
        """The timing of ``orders``, which differ from the orders ``kept`` timed only in passes
        that start at or after ``cut`` there; the passes before it keep their times."""
        key, done = self.index.key, kept.done[:]
        ptr, clock, starts, ends = [], [], [], []
        for order, old_starts, old_ends in zip(orders, kept.starts, kept.ends):
            i = bisect.bisect_left(old_starts, cut)  # starts increase along a rank
            for a in order[i:]:
                done[key[a]] = -1.0
            ptr.append(i)
            clock.append(old_ends[i - 1] if i else 0.0)
            starts.append(old_starts[:i] + [0.0] * (len(order) - i))
            ends.append(old_ends[:i] + [0.0] * (len(order) - i))
        return self._run(orders, ptr, clock, done, starts, ends)

    def _run(self, orders, ptr, clock, done, starts, ends) -> Timing:
        """Advance every rank from ``ptr`` until it blocks, waking the ranks that wait for
        what it ends; ``done`` holds the end of every pass already timed (-1.0: not yet)."""
        dep, delay, duration, key = self.index.dep, self.delay, self.duration, self.index.key
        kept = sum(ptr)
        waiter: list = [None] * len(done)  # ranks blocked on a completion id
        pending = list(range(len(orders)))
        while pending:  # the search's hot loop: list lookups only
            r = pending.pop()
            i, t, mine, start_r, end_r = ptr[r], clock[r], orders[r], starts[r], ends[r]
            count = len(mine)
            while i < count:
                a = mine[i]
                d = dep[a]
                if d >= 0:
                    f = done[d]
                    if f < 0.0:
                        if waiter[d] is None:
                            waiter[d] = [r]
                        else:
                            waiter[d].append(r)
                        break
                    f += delay[a]
                    if f > t:
                        t = f
                start_r[i] = t
                t += duration[a]
                end_r[i] = t
                k = key[a]
                done[k] = t
                if waiter[k] is not None:
                    pending.extend(waiter[k])
                    waiter[k] = None
                i += 1
            ptr[r], clock[r] = i, t
        stuck = next(((r, ptr[r]) for r in range(len(orders)) if ptr[r] < len(orders[r])), None)
        return Timing(starts, ends, stuck, done, sum(ptr) - kept)


@functools.lru_cache(maxsize=8)
def _wakes(index: PassIndex, comm: float, kinds: frozenset) -> list[tuple]:
    table = wake_table(index.placement, comm, index.microbatches, kinds)
    out: list[tuple] = [()] * len(index.actions)
    for key, woken in table.items():
        out[index.ids[key]] = tuple(woken)
    return out


def gather(table, keys) -> list:
    """``[table[k] for k in keys]``, looked up in C (the loops' tables are built per call)."""
    if len(keys) < 2:
        return [table[k] for k in keys]
    return list(operator.itemgetter(*keys)(table))
