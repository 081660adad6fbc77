"""The demo's heavy-head case: a V with the even stage layout and with a balanced one.

Under a V rank 0 holds both ends, stage 0 (embedding) and stage 2p-1 (final norm, LM head and
loss); with today's vocabularies the head costs about as much as a few transformer layers
(Llama-3-8B: 2 h V = 1.05 GFLOP a token against a layer's 0.56, so about 2 layers), and the
even split (schedule.placement.stage_layer_counts) leaves rank 0 the slowest::

    p = 4, 8 layers, head = 2 layers     rank     0      1   2   3
      even      stages 1 1 1 1 1 1 1 1   load   1+1+2    2   2   2     (layers, head in)
      balanced  stages 1 1 1 2 1 1 1 0   load   1+0+2    2   2   3

Here the head is *emulated*: the demo's tiny GPT has a small vocabulary, so each stage's pass
sleeps for its layers' emulated time, and stage 2p-1 for ``head_layers`` layers more
(:func:`emulated_stage_costs`, per stage through ``Costs.for_stages``; the runtime's emulated
sleep is per chunk, runtime/interpreter.py). :func:`balanced_stage_layers` is the demo's
simple balance by rank load; the model itself is the same under both layouts, so losses and
gradients still equal megatron's own 1F1B.
"""
from __future__ import annotations

from ..schedule.model.costs import Costs
from ..schedule.model.placement import Layout, Placement, stage_layer_counts
from ..schedule.names import V_ZB

__all__ = ["LAYOUT_SCHEDULE", "balanced_stage_layers", "emulated_stage_costs",
           "stage_layouts"]

LAYOUT_SCHEDULE = V_ZB
"""The schedule the two layouts run: the V built for throughput, where a slow rank shows."""


def balanced_stage_layers(num_layers: int, ranks: int, head_layers: float) -> tuple[int, ...]:
    """Layers per V stage (2p, stage order) that minimise the most loaded rank's layers,
    counting the head as ``head_layers`` layers on rank 0 (ties: the fewest layers moved);
    the even split where that is already as good.
    Every rank but 0 keeps at least one layer per stage; rank 0 keeps at least one layer, on
    stage 0, its layers split with the extra one on stage 0 (stage 2p-1 holds the head); the
    others split their share evenly, the extra one on the down-leg stage."""
    if num_layers < 2 * ranks:
        raise ValueError(f"num_layers={num_layers} cannot give the V's 2 x {ranks} stages a "
                         f"layer each; use num_layers >= {2 * ranks}")
    others = ranks - 1

    def load(first: int) -> float:
        return max(first + head_layers, -(-(num_layers - first) // others))

    even = stage_layer_counts(num_layers, 2 * ranks)
    first = min(range(1, num_layers - 2 * others + 1), key=lambda n: (load(n), -n))
    if load(first) >= load(even[0] + even[-1]):
        return even
    rest = num_layers - first
    shares = [first] + [rest // others + (r > others - rest % others) for r in range(1, ranks)]
    placement = Placement(ranks, Layout.V)
    layers = [0] * (2 * ranks)
    for rank, share in enumerate(shares):
        layers[placement.stage_of(rank, 0)] = share - share // 2
        layers[placement.stage_of(rank, 1)] = share // 2
    return tuple(layers)


def stage_layouts(num_layers: int, ranks: int, head_layers: float) -> dict[str, tuple[int, ...]]:
    """``{"even": layers, "balanced": layers}``; only ``even`` where balancing moves nothing."""
    even = stage_layer_counts(num_layers, 2 * ranks)
    balanced = balanced_stage_layers(num_layers, ranks, head_layers)
    return {"even": even} if balanced == even else {"even": even, "balanced": balanced}


def emulated_stage_costs(stage_layers, layer_costs, head_layers: float) -> Costs:
    """Per-stage emulated costs: stage s's F, B, W are ``stage_layers[s]`` times one layer's
    (``layer_costs``: F, B, W seconds), stage 2p-1's ``head_layers`` layers more (the LM head
    and loss as so many layers' F, B and W alike)."""
    ranks = len(stage_layers) // 2
    weights = [float(n) for n in stage_layers]
    weights[-1] += head_layers
    return Costs.for_stages(Placement(ranks, Layout.V),
                            *([w * cost for w in weights] for cost in layer_costs))
