"""What a memory model that frees memory at B adds to the default model's answer.

Under a model whose B frees part of a chunk (``--memory-model 1,-0.75,-0.25``: what an H100
keeps for W) every order within a limit under the default model (B frees nothing) is within
it too, so the default model's fastest order is a candidate, and the search is never slower
for a model that frees more (:func:`freeing_nothing_at_b`). What the freed memory buys on top:

    deferred   the candidate's W passes moved to where its rank would wait (wfill.py), now
               that a waiting W keeps only what B left (a quarter of a chunk, not all of it)
    polished   then the local search under the model, whose moves see the lower levels

both within the candidate's peak under the default model (not the limit: a large limit is not
filled for a sliver of time, as in adaptive.py's deferral). Measured at V-Min's, V-Half's and
1F1B's memory over p 4-16, m 4p-8p and costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1
(54 points): from the default model's answer these two reach the full search under the model
at 50 points and beat it at 6 (v-min, H100 costs, p = 8, m = 32: 238.5 against 239.6); the
full search wins 4 points: three at up to 1,536 passes by 0.2-0.4% (p = 4, m = 16 and 32;
p = 8, m = 32), so it still runs there (``FULL_SEARCH_PASSES``), and one at p = 8, m = 64 by
0.05% (v-zb, costs 2,2,2,0.1: 393.9 against 394.1), where it would take half of the time. The
faster of the answers is the one refined.
"""
from __future__ import annotations

from ..build.wfill import defer_weight_passes
from ..model.actions import ScheduleError
from ..model.costs import Costs, MemoryModel
from ..model.schedule import Schedule
from .local import improve

__all__ = ["FULL_SEARCH_PASSES", "freeing_nothing_at_b", "refined_under"]

FULL_SEARCH_PASSES = 2_048
"""Up to this many passes (p = 8, m = 32 and p = 4, m = 64: 1,536) the model also gets a
search of its own (three of its four wins above are there); beyond it that search doubles the
time of a named schedule (p = 16, m = 64: 1.0 s instead of 0.5 s) for one win of 0.05%. Where
the default model's search ends with moves repeated per microbatch, less (adaptive.py's
``_search_cached``)."""


def freeing_nothing_at_b(memory: MemoryModel) -> MemoryModel | None:
    """The model whose B frees nothing (the default's shape, same forward), when ``memory``'s
    B frees something; else None. A rank's level after any prefix of its order is F count x f
    + B count x b + W count x w with w = -(f + b), and a prefix holds at least as many B as W,
    so a more negative b only lowers it: every order within a limit under this model is within
    it under ``memory``, and its fastest order is a candidate there too (a model that frees
    more at B is then never slower than the default one)."""
    if memory.backward >= 0:
        return None
    return MemoryModel(memory.forward, 0.0, -memory.forward)


def refined_under(schedule: Schedule, costs: Costs, memory: MemoryModel, cap: float,
                  budget: int) -> list[tuple[str, tuple]]:
    """(what was done, orders) for ``schedule`` with its W passes deferred under ``memory``
    within ``cap`` chunk-activations, and that polished under ``memory`` with ``budget``
    passes (local.py); an empty list when the deferral does not apply (fused BW passes)."""
    placement, m = schedule.placement, schedule.microbatches
    try:
        deferred = defer_weight_passes(schedule.rank_actions, placement, costs, cap, memory)
    except ScheduleError:
        return []
    polished = improve(placement, m, deferred, costs, cap, memory, budget).orders
    return [("W deferred under the model", deferred),
            ("W deferred and polished under the model", polished)]
