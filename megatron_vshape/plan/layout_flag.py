"""A layout as megatron's ``--pipeline-model-parallel-layout`` string.

Megatron-core's grammar (megatron/core/transformer/pipeline_parallel_layer_layout.py,
``parse_str_to_list``): stages separated by ``|``, ``E`` the embedding, ``t`` a transformer
layer, ``L`` the loss (final layernorm, LM head, cross entropy), ``x*n`` n copies of x. The
stages are listed in global stage order: for interleaved 1F1B megatron puts stage s on rank
s mod p; for a V the plugin reads them in V order (stage s on rank s for s < p, on rank
2p-1-s after)::

    V, p = 4, 14 layers, counts 2 2 2 2 2 2 2 0   ->   Et*2|t*2|t*2|t*2|t*2|t*2|t*2|L
    1F1B, p = 4, 30 layers, counts 8 8 8 6        ->   Et*8|t*8|t*8|t*6L

The V's reader is megatron/stage_layout.py (megatron-core's own parser and the V's rules).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["layout_flag"]


def _layers(n: int) -> str:
    return "t" * n if n < 2 else f"t*{n}"


def layout_flag(counts: Sequence[int]) -> str:
    """The layout string of ``counts`` layers per global stage (embedding on the first, loss
    on the last)."""
    if len(counts) < 1 or any(n < 0 for n in counts):
        raise ValueError(f"layer counts must be >= 0 per stage, got {list(counts)}")
    parts = [_layers(n) for n in counts]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "L"
    return "|".join(parts)
