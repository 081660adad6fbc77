"""The one event loop of the list schedulers that lay orders out in simulated time.

The timed replay (rewrite/replay.py), the W deferral (rewrite/weight_deferral.py) and the greedy
(construct/greedy.py) advance ranks the same way: a rank free at ``now`` starts the pass its
policy picks among those that are ready (dependency ended, plus a hop across ranks) and fit its
memory, or waits; the pass's end wakes its rank, and one hop later the ranks that wait for it.
Written three times, each copy kept its own heap, clocks and end times. Here it is once: the
loop owns the wake heap, the clocks (``free_at``, ``first``), the end of every pass
(``finished``, by completion id: model/indexed.py) and the wakes; a scheduler gives only its
policy, ``pick(rank, now)``, which returns the pass id the rank starts now (its own facts, such
as memory and output, already updated) or None to wait.

Each scheduler's results depend on the order it sees events in (a tie decides which pass a
rank gets), so the loop has both orders they use, as an option:

    one at a time   (batch None) heap entries (time, rank) popped one by one, ties by rank; a
                    rank busy past now + ``busy`` is skipped (its own end is queued), and an end
                    wakes every waiter it is given (the deferral, the greedy)
    batched         (batch = a tolerance) every entry due within ``batch`` of the earliest is one
                    event, its ranks run once each in rank order; a rank busy past now is queued
                    again at its end (that entry may have been in the batch), and a waiter busy
                    past an arrival is not woken by it (the replay)

A policy may also queue a wake of its own (``wake_at``: the greedy sleeps until a pass it
bounded becomes ready). Not on this loop: the critical-path cool-down (Giffler and Thompson's
rule picks the pass that can end first over every rank, not what a free rank starts now) and
the V-ZB wave (rounds rank by rank, no events); docs/design.md.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

__all__ = ["EventLoop"]


class EventLoop:
    """Ranks advanced in simulated time by a policy (module doc), over pass ids with
    ``duration`` and ``key`` (the completion id a pass's end is known by); ``wakes[key]`` is
    the (rank, hop) of every pass that waits for that completion (PassIndex.wakes)."""

    def __init__(self, ranks: int, duration: Sequence[float], key: Sequence[int],
                 wakes: Sequence[tuple], batch: float | None = None, busy: float = 1e-9):
        self.duration, self.key, self.wakes = duration, key, wakes
        self.batch, self.busy = batch, busy
        self.free_at = [0.0] * ranks
        """When each rank's last pass ends."""
        self.first: list[float | None] = [None] * ranks
        """When each rank's first pass started (None: none yet)."""
        self.finished = [-1.0] * len(duration)
        """End by completion id, -1.0 while not started (an end is known once it starts)."""
        self._heap = [(0.0, r) for r in range(ranks)]

    def wake_at(self, time: float, rank: int) -> None:
        """Asks ``rank``'s policy again at ``time``."""
        heapq.heappush(self._heap, (time, rank))

    def run(self, pick: Callable[[int, float], int | None]) -> None:
        """Runs until no rank is woken again (the caller checks what is left)."""
        if self.batch is None:
            self._one_at_a_time(pick)
        else:
            self._batched(pick, self.batch)

    def makespan(self) -> float:
        """The first start to the last end, over the ranks that ran a pass."""
        ran = [r for r, start in enumerate(self.first) if start is not None]
        return (max((self.free_at[r] for r in ran), default=0.0)
                - min((self.first[r] for r in ran), default=0.0))

    def _one_at_a_time(self, pick) -> None:
        heap, free_at, first, finished = self._heap, self.free_at, self.first, self.finished
        duration, key, wakes, busy = self.duration, self.key, self.wakes, self.busy
        pop, push = heapq.heappop, heapq.heappush
        while heap:  # the searches' hot loop: one policy call per event
            now, rank = pop(heap)
            if free_at[rank] > now + busy:
                continue  # its own end is queued
            a = pick(rank, now)
            if a is None:
                continue
            end = free_at[rank] = now + duration[a]
            if first[rank] is None:
                first[rank] = now
            k = key[a]
            finished[k] = end
            push(heap, (end, rank))
            for woken, hop in wakes[k]:
                push(heap, (end + hop, woken))

    def _batched(self, pick, tolerance: float) -> None:
        heap, free_at, first, finished = self._heap, self.free_at, self.first, self.finished
        duration, key, wakes, busy = self.duration, self.key, self.wakes, self.busy
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            now = heap[0][0]
            limit = now + tolerance
            due = {pop(heap)[1]}
            while heap and heap[0][0] <= limit:
                due.add(pop(heap)[1])
            for rank in sorted(due) if len(due) > 1 else due:
                if free_at[rank] > now + busy:
                    push(heap, (free_at[rank], rank))  # its end may have been in this batch
                    continue
                a = pick(rank, now)
                if a is None:
                    continue
                end = free_at[rank] = now + duration[a]
                if first[rank] is None:
                    first[rank] = now
                k = key[a]
                finished[k] = end
                push(heap, (end, rank))
                for woken, hop in wakes[k]:
                    if free_at[woken] < end + hop:  # else its own end wakes it
                        push(heap, (end + hop, woken))

