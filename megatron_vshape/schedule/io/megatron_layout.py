"""Megatron's ``--pipeline-model-parallel-layout`` string, written in one place.

Megatron-core's grammar (megatron/core/transformer/pipeline_parallel_layer_layout.py,
``parse_str_to_list``): stages separated by ``|``, ``E`` the embedding, ``t`` a transformer
layer, ``m`` a multi-token-prediction layer, ``L`` the loss (final layernorm, LM head, cross
entropy), ``x*n`` n copies of x. The stages are listed in global stage order: for interleaved
1F1B megatron puts stage s on rank s mod p; for a V the plugin reads them in V order (stage s
on rank s for s < p, on rank 2p-1-s after)::

    V, p = 4, 14 layers, counts 2 2 2 2 2 2 2 0   ->   Et*2|t*2|t*2|t*2|t*2|t*2|t*2|L
    1F1B, p = 4, 30 layers, counts 8 8 8 6        ->   Et*8|t*8|t*8|t*6L

The planner prints it (plan/launch_flags.py); the V's reader (megatron/stage_layout.py, which
parses with megatron-core's own parser) writes a layout back in it for its messages and log.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["StageContents", "layout_string", "layout_of_counts"]

StageContents = tuple[int, bool, bool, int]
"""One stage: (transformer layers, holds the embedding, holds the loss, MTP layers)."""


def _layers(n: int) -> str:
    return "t" * n if n < 2 else f"t*{n}"


def layout_string(stages: Sequence[StageContents]) -> str:
    """The layout string of ``stages`` in global stage order."""
    if not stages or any(layers < 0 or mtp < 0 for layers, _, _, mtp in stages):
        raise ValueError(f"a layout needs one or more stages of >= 0 layers, got {list(stages)}")
    return "|".join("E" * embedding + _layers(layers) + "m" * mtp + "L" * loss
                    for layers, embedding, loss, mtp in stages)


def layout_of_counts(counts: Sequence[int]) -> str:
    """The layout string of ``counts`` layers per global stage, the embedding on the first
    stage and the loss on the last."""
    last = len(counts) - 1
    return layout_string([(n, s == 0, s == last, 0) for s, n in enumerate(counts)])
