"""Lower bounds on any schedule's makespan: compute, the memory limit (Little's law), and the
pipeline's fill and drain (:func:`fill_and_drain_floor`).

On every rank, each microbatch's activation of a chunk is held from the start of its F until
the end of its B (the part B frees) or of its W (the rest), and between those the microbatch
must travel the rest of the pipeline and back: the F passes of every later stage, the B
passes of every later stage, one hop per rank crossing, then the rank's own B (and W). Summed
over the microbatches that lifetime is the time integral of the rank's memory, which is at
most ``limit x makespan``. So no order at all, however clever, finishes sooner than

    makespan >= microbatches x (the rank's lifetime per microbatch) / limit,   on every rank.

Where this exceeds what a rival reaches (1F1B at large m), the limit makes the rival's bubble
unreachable: tests/schedule/test_search.py uses it to show which unbalanced-cost bubble targets no
schedule can meet. The search does not need it; it is here so such claims are computed, not
argued by hand.
"""
from __future__ import annotations

from ..model.costs import Costs, MemoryModel
from ..model.placement import Placement

__all__ = ["lifetime_per_microbatch", "makespan_floor", "fill_and_drain_floor"]


def lifetime_per_microbatch(placement: Placement, costs: Costs, rank: int,
                            memory: MemoryModel = MemoryModel()) -> float:
    """The least time integral of ``rank``'s memory one microbatch causes (memory-model units
    x time): for each chunk, the shortest path from its F's start to its B's and W's ends."""
    stages, chunks = placement.num_stages, placement.chunks
    owner = [placement.rank_of(s) for s in range(stages)]
    times = costs.stage_times(placement)
    f = [t.forward for t in times]
    b = [t.backward for t in times]
    freed_by_b, freed_by_w = -memory.backward, -memory.weight
    total = 0.0
    for chunk in range(chunks):
        stage = placement.stage_of(rank, chunk)
        hops = sum(owner[s] != owner[s + 1] for s in range(stage, stages - 1))
        to_b_end = sum(f[stage:]) + sum(b[stage:]) + 2 * hops * costs.comm
        to_w_end = to_b_end + times[stage].weight
        total += freed_by_b * to_b_end + freed_by_w * to_w_end
    return total


def makespan_floor(placement: Placement, microbatches: int, costs: Costs, limit: float,
                   memory: MemoryModel = MemoryModel()) -> float:
    """No schedule of ``microbatches`` whose peak stays within ``limit`` units (as
    :func:`.simulate.peak_memory` counts them) finishes sooner than this; also at least the
    busiest rank's compute."""
    chunks = placement.chunks
    level = limit * chunks  # peak_memory divides the running level by the chunks
    work = max(microbatches * _compute(chunks) for chunks in costs.pass_times(placement))
    by_memory = max(microbatches * lifetime_per_microbatch(placement, costs, r, memory) / level
                    for r in range(placement.ranks))
    return max(work, by_memory, fill_and_drain_floor(placement, microbatches, costs, limit, memory))


def fill_and_drain_floor(placement: Placement, microbatches: int, costs: Costs, limit: float,
                         memory: MemoryModel = MemoryModel()) -> float:
    """The pipeline's fill and drain, which no order hides completely.

    Rank r can start nothing before the first microbatch's forwards reach one of its stages
    (``start``). Until the first gradient comes back to one of its stages (``first_b``: every
    forward of the pipeline, then the backwards down to that stage) it can run forwards only,
    and each holds its activation, so at most the limit's worth of them (``warm``: the rest
    of that time it waits). After its last B it runs only W passes, while the gradient still
    walks down to stage 0 (``drain``: the B passes of the stages below, one hop per rank
    crossing); W passes deferred past that B fill the drain, but each one holds its
    activation's leftover (``-memory.weight``), so at most ``limit`` worth of them wait. The
    three waits are apart in time, hence, on every rank::

        makespan >= start + warm + the rank's compute + max(0, drain - deferrable W time)
    """
    chunks, stages = placement.chunks, placement.num_stages
    owner = [placement.rank_of(s) for s in range(stages)]
    times = costs.stage_times(placement)
    f = [t.forward for t in times]
    b = [t.backward for t in times]
    per_chunk = costs.pass_times(placement)

    def hops(first: int, last: int) -> int:
        return sum(owner[s] != owner[s + 1] for s in range(first, last))

    held = -memory.weight
    waiting = chunks * microbatches if held <= 0 else \
        min(chunks * microbatches, int(limit * chunks / held + 1e-9))
    forwards = min(chunks * microbatches, int(limit * chunks / memory.forward + 1e-9))
    loss = sum(f) + hops(0, stages - 1) * costs.comm  # the first microbatch reaches the loss
    floor = 0.0
    for rank in range(placement.ranks):
        own = [placement.stage_of(rank, c) for c in range(chunks)]
        start = min(sum(f[:s]) + hops(0, s) * costs.comm for s in own)
        first_b = min(loss + sum(b[s + 1:]) + hops(s, stages - 1) * costs.comm for s in own)
        mine = per_chunk[rank]  # the longest of its chunks' passes: what fills a wait most
        warm = max(0.0, first_b - start - forwards * max(t.forward for t in mine))
        drain = min(sum(b[:s]) + hops(0, s) * costs.comm for s in own)
        compute = microbatches * _compute(mine)
        deferrable = waiting * max(t.weight for t in mine)
        floor = max(floor, start + warm + compute + max(0.0, drain - deferrable))
    return floor


def _compute(chunks) -> float:
    """One microbatch's F, B and W over a rank's chunks (``pass_times``' row): the rank's
    whole share, as the per-rank costs give it."""
    if len(set(chunks)) == 1:  # the share split evenly: the rank's own sum, bit for bit
        t = chunks[0]
        return len(chunks) * t.forward + len(chunks) * t.backward + len(chunks) * t.weight
    return sum(t.forward + t.backward + t.weight for t in chunks)
