"""A lower bound on any schedule's makespan from its memory limit (Little's law).

On every rank, each microbatch's activation of a chunk is held from the start of its F until
the end of its B (the part B frees) or of its W (the rest), and between those the microbatch
must travel the rest of the pipeline and back: the F passes of every later stage, the B
passes of every later stage, one hop per rank crossing, then the rank's own B (and W). Summed
over the microbatches that lifetime is the time integral of the rank's memory, which is at
most ``limit x makespan``. So no order at all, however clever, finishes sooner than

    makespan >= microbatches x (the rank's lifetime per microbatch) / limit,   on every rank.

Where this exceeds what a rival reaches (1F1B at large m), the limit makes the rival's bubble
unreachable: tests/test_search.py uses it to show which unbalanced-cost targets of issue 3 no
schedule can meet. The search does not need it; it is here so such claims are computed, not
argued by hand.
"""
from __future__ import annotations

from ..model.costs import Costs, MemoryModel
from ..model.placement import Placement

__all__ = ["lifetime_per_microbatch", "makespan_floor"]


def lifetime_per_microbatch(placement: Placement, costs: Costs, rank: int,
                            memory: MemoryModel = MemoryModel()) -> float:
    """The least time integral of ``rank``'s memory one microbatch causes (memory-model units
    x time): for each chunk, the shortest path from its F's start to its B's and W's ends."""
    stages, chunks = placement.num_stages, placement.chunks
    owner = [placement.rank_of(s) for s in range(stages)]
    f = [costs.forward[owner[s]] / chunks for s in range(stages)]
    b = [costs.backward[owner[s]] / chunks for s in range(stages)]
    freed_by_b, freed_by_w = -memory.backward, -memory.weight
    total = 0.0
    for chunk in range(chunks):
        stage = placement.stage_of(rank, chunk)
        hops = sum(owner[s] != owner[s + 1] for s in range(stage, stages - 1))
        to_b_end = sum(f[stage:]) + sum(b[stage:]) + 2 * hops * costs.comm
        to_w_end = to_b_end + costs.weight[rank] / chunks
        total += freed_by_b * to_b_end + freed_by_w * to_w_end
    return total


def makespan_floor(placement: Placement, microbatches: int, costs: Costs, limit: float,
                   memory: MemoryModel = MemoryModel()) -> float:
    """No schedule of ``microbatches`` whose peak stays within ``limit`` units (as
    :func:`.simulate.peak_memory` counts them) finishes sooner than this; also at least the
    busiest rank's compute."""
    chunks = placement.chunks
    level = limit * chunks  # peak_memory divides the running level by the chunks
    work = max(microbatches * (costs.forward[r] + costs.backward[r] + costs.weight[r])
               for r in range(placement.ranks))
    by_memory = max(microbatches * lifetime_per_microbatch(placement, costs, r, memory) / level
                    for r in range(placement.ranks))
    return max(work, by_memory)
