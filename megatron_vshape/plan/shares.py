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
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedule.model.placement import Placement, stage_layer_counts
from .model import ModelConfig

__all__ = ["ChunkShare", "stage_layer_counts", "rank_shares", "whole_model_share"]


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


def rank_shares(model: ModelConfig, placement: Placement) -> tuple[tuple[ChunkShare, ...], ...]:
    """Per rank, its chunks' shares in chunk order (chunk 0 first)."""
    stages = placement.num_stages
    try:
        counts = stage_layer_counts(model.num_layers, stages)
    except ValueError as err:
        raise ValueError(f"model {model.name!r}: {err} (--pp)") from None
    by_rank: list[list[ChunkShare | None]] = [[None] * placement.chunks
                                              for _ in range(placement.ranks)]
    for stage in range(stages):
        rank, chunk = placement.locate(stage)
        by_rank[rank][chunk] = ChunkShare(stage, counts[stage], stage == 0, stage == stages - 1)
    return tuple(tuple(chunks) for chunks in by_rank)


def whole_model_share(model: ModelConfig) -> tuple[tuple[ChunkShare, ...], ...]:
    """No pipeline: one rank, one chunk, everything."""
    return ((ChunkShare(0, model.num_layers, True, True),),)
