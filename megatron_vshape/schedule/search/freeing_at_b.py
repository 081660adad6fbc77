"""What a memory model that frees memory at B adds to the default model's answer.

Under a model whose B frees part of a chunk (``--memory-model 1,-0.75,-0.25``: what an H100
keeps for W) every order within a limit under the default model (B frees nothing) is within
it too, so the default model's fastest order is a candidate, and the search is never slower
for a model that frees more (:func:`freeing_nothing_at_b`). What the freed memory buys on top:

    deferred   the candidate's W passes moved to where its rank would wait (weight_deferral.py), now
               that a waiting W keeps only what B left (a quarter of a chunk, not all of it)
    polished   then the local search under the model, whose moves see the lower levels

both within the candidate's peak under the default model (not the limit: a large limit is not
filled for a sliver of time, as in adaptive.py's deferral). Measured at V-Min's, V-Half's and
1F1B's memory over p 4-16, m 4p-8p and costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1
(54 points): from the default model's answer these two reach the full search under the model
at 50 points and beat it at 6 (v-min, H100 costs, p = 8, m = 32: 238.5 against 239.6).

The search under the model itself runs only where nothing fits when B frees nothing. It used
to run as well up to 2,048 passes (p = 8, m = 32), for its wins; over the named V schedules at
p 4-16, m = p to 64 within those passes (81 builds, the three cost ratios above) it was faster
at 5, by 0.04-0.95% (v-zb at costs 2,2,2,0.1, p = 8, m = 16: 105.1 against 106.1), slower at
2 (by 0.09%), and it took 40% of those builds' time: at the H100 costs it put 16 of the 33
named V schedules with m <= 64 over a 0.5 s budget, where without it 5 are.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

from ..rewrite.weight_deferral import defer_weight_passes
from ..model.actions import ScheduleError
from ..model.costs import MemoryModel
from ..model.problem import Problem
from ..model.provenance import Step, step
from .local import improve
from .settings import SETTINGS, Settings

__all__ = ["freeing_nothing_at_b", "refined_under"]


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


def refined_under(problem: Problem, orders, budget: int,
                  settings: Settings = SETTINGS) -> list[tuple[Step, tuple]]:
    """(what was done, orders) for ``orders`` with their W passes deferred under the problem's
    memory model within its limit (the caller's: the candidate's peak where B frees nothing),
    and that polished with ``budget`` passes (local.py, under ``settings``); an empty list when
    the deferral does not apply (fused BW passes)."""
    try:
        deferred = defer_weight_passes(problem, orders)
    except ScheduleError:
        return []
    polished = improve(problem, deferred, budget, settings).orders
    return [(step("W deferred under the model"), deferred),
            (step("W deferred and polished under the model"), polished)]
