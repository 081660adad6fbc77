"""Which layers, and which ends of the model, each rank's chunks hold.

A schedule's :class:`~megatron_vshape.schedule.Placement` says which rank and chunk run each
global stage; this module says what a stage contains. Stage 0 holds the embedding and the last
stage the final layernorm, LM head and loss. Layers are spread evenly over the stages; when
the count does not divide, the ends give up layers first, one at a time, moving inwards
(stage 0, stage S-1, stage 1, stage S-2, ...)::

    V, p = 4, 14 layers       stage   0  1  2  3  4  5  6  7
                              layers  1  2  2  2  2  2  2  1   rank 0 holds stages 0 and 7
    1F1B, p = 4, 30 layers    stage   0  1  2  3
                              layers  7  8  8  7               ranks 0 and 3 hold the ends

The counts come from ``schedule.placement.stage_layer_counts``, the rule the plugin builds the
V with (the paper's advice L = k p - 2); for a single chunk per rank megatron-core expresses it with
``num_layers_in_first/last_pipeline_stage`` (or ``pipeline_model_parallel_layout`` when more
than the two end stages are short).

A planner may choose another layout (:mod:`.layout_search`): any whole-layer count per stage,
given as the global stages' shares in stage order (:func:`stages_from_counts`), which
:func:`shares_by_rank` places on the ranks. Every stage holds a layer but an end stage, which
may hold only the embedding or only the LM head and loss (megatron's layout ``E|t*4|...|L``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedule.model.placement import Placement, stage_layer_counts
from .model import ModelConfig

__all__ = ["ChunkShare", "StageShares", "stage_layer_counts", "rank_shares", "even_stages",
           "stages_from_counts", "shares_by_rank", "whole_model_share"]


@dataclass(frozen=True)
class ChunkShare:
    """What one model chunk (one global stage) holds."""

    stage: int
    """Global stage (0 .. S-1)."""
    layers: int
    """Transformer layers."""
    embedding: bool
    """Word and position embeddings (stage 0)."""
    head: bool
    """Final layernorm, LM head and loss (stage S-1)."""


StageShares = tuple  # tuple[ChunkShare, ...], one per global stage in stage order
"""A layout: what each global stage holds, stage 0 first."""


def stages_from_counts(counts) -> StageShares:
    """The shares of stages holding ``counts[s]`` layers, the embedding on stage 0 and the LM
    head on the last. Raises ValueError for a stage left empty (an end stage may hold no
    layer: it still holds the embedding or the head)."""
    last = len(counts) - 1
    for stage, n in enumerate(counts):
        if not isinstance(n, int) or n < 0 or (n == 0 and 0 < stage < last):
            raise ValueError(f"stage {stage} would hold {n!r} layers: every stage but the two "
                             f"ends (embedding, LM head) needs at least one; counts {list(counts)}")
    return tuple(ChunkShare(s, n, s == 0, s == last) for s, n in enumerate(counts))


def even_stages(model: ModelConfig, placement: Placement) -> StageShares:
    """The plugin's default layout (module docstring): equal counts, the ends short first."""
    try:
        counts = stage_layer_counts(model.num_layers, placement.num_stages)
    except ValueError as err:
        raise ValueError(f"model {model.name!r}: {err} (--pp)") from None
    return stages_from_counts(counts)


def shares_by_rank(stages: StageShares, placement: Placement
                   ) -> tuple[tuple[ChunkShare, ...], ...]:
    """Per rank, its chunks' shares in chunk order (chunk 0 first), as ``placement`` puts the
    global stages on the ranks."""
    if len(stages) != placement.num_stages:
        raise ValueError(f"a layout of {len(stages)} stages for {placement.num_stages} "
                         f"(PP {placement.ranks} x {placement.chunks} chunks)")
    by_rank: list[list[ChunkShare | None]] = [[None] * placement.chunks
                                              for _ in range(placement.ranks)]
    for share in stages:
        rank, chunk = placement.locate(share.stage)
        by_rank[rank][chunk] = share
    return tuple(tuple(chunks) for chunks in by_rank)


def rank_shares(model: ModelConfig, placement: Placement) -> tuple[tuple[ChunkShare, ...], ...]:
    """Per rank, its chunks' shares in chunk order (chunk 0 first), for the even layout."""
    return shares_by_rank(even_stages(model, placement), placement)


def whole_model_share(model: ModelConfig) -> tuple[tuple[ChunkShare, ...], ...]:
    """No pipeline: one rank, one chunk, everything."""
    return ((ChunkShare(0, model.num_layers, True, True),),)
