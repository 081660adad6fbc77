"""How fast a schedule could run: the whole-layer bound and the balanced bound.

For one (point, schedule), with W = F + B + W of one microbatch and m microbatches:

- **bubble**: what the schedule leaves idle even when every stage costs the same: the
  simulated makespan with the model's total work spread evenly over the stages, less
  m x total / p. Near zero for V-ZB, about (p - 1) stage-times for 1F1B.
- **busiest** = m x (the least busiest-rank work any assignment of whole layers allows,
  :func:`.layout_search.whole_layer_work`): a true lower bound on every whole-layer layout's
  makespan under every schedule (the busiest rank must run all its passes).
- **whole-layer bound** = busiest + bubble: what choosing the layout can reach if the
  schedule idles as much as when balanced.
- **balanced bound** = m x total / p + bubble: every rank equally busy, which only splitting
  the LM head's and embedding's work across ranks (vocabulary parallelism) could reach.

The last two are targets, not proofs: an uneven layout's own bubble can be smaller than the
balanced one's, since lighter ranks absorb the warm-up (V-ZB, Llama-3-8B's shape at PP 8:
the chosen layout runs 6.96 s against a whole-layer bound of 7.01 s and busiest 6.85 s).
"""
from __future__ import annotations

from dataclasses import dataclass

from .candidates import GridPoint
from .cost import PassTimes
from .evaluate import Evaluator
from .layout_search import whole_layer_work

__all__ = ["PipelineBounds", "pipeline_bounds"]


@dataclass(frozen=True)
class PipelineBounds:
    """Seconds per iteration (pipeline only, no data-parallel communication)."""

    bubble: float
    busiest: float
    whole_layer: float
    balanced: float


def pipeline_bounds(evaluator: Evaluator, point: GridPoint, name: str,
                    recompute: str = "none") -> PipelineBounds:
    """The bounds of the module docstring for ``name`` at ``point``."""
    schedule = evaluator.schedule(name, point.pp, point.microbatches)
    if isinstance(schedule, Exception):
        raise schedule
    placement = schedule.placement
    times = evaluator.times(point.tp, point.micro_batch_size, recompute, point.ep)
    model = evaluator.model
    total = [model.num_layers * getattr(times.layer, k) + getattr(times.embedding, k)
             + getattr(times.head, k) for k in ("forward", "backward", "weight")]
    stages = placement.num_stages
    uniform = (PassTimes(*(t / stages for t in total)),) * stages
    makespan, _ = evaluator.simulate_stages(name, schedule, uniform, evaluator.hop(point))
    per_rank = sum(total) / point.pp
    bubble = max(0.0, makespan - point.microbatches * per_rank)
    busiest = whole_layer_work(placement, model.num_layers, times)
    return PipelineBounds(bubble, point.microbatches * busiest,
                          point.microbatches * busiest + bubble,
                          point.microbatches * per_rank + bubble)
