"""Context parallelism (megatron ``--context-parallel-size``, Transformer Engine's ring
attention with ``--cp-comm-type p2p``): what it changes, as the planner counts it.

With CP ranks c, each rank holds s / c tokens of every sample, in two chunks of s / (2c)
taken from both ends of the sequence (chunks i and 2c-1-i on rank i), so every rank does the
same share of the causal attention::

    c = 2, s split in 4:   tokens  [0 1 | 2 3]      rank 0: chunks 0 and 3
                                                    rank 1: chunks 1 and 2

- every per-token cost (the linears, the elementwise work, the head, the embedding, the
  activations kept, the pipeline hop) is that of s / c tokens;
- the attention core does 1 / c of the causal work for s queries over s keys;
- the key and value blocks go round the ring: c - 1 steps, each sending this rank's
  s / c tokens of K and V (2 x groups x head width / TP wide) in F, and in B the same
  forward again plus their gradients (twice the bytes). TE overlaps each step's send with the
  previous block's attention; what the transfer takes beyond the attention's time is exposed
  (:func:`ring_kernel`);
- parameters are not split; the gradient reduction and the distributed optimizer's shards
  run over DP x CP ranks (megatron's data-parallel group with context parallelism).
"""
from __future__ import annotations

from .kernels import GpuSpec, Kernel

__all__ = ["ring_bytes", "ring_kernel"]


def ring_bytes(cp: int, rank_tokens: int, kv_width: int, element_bytes: int,
               backward: bool) -> float:
    """Bytes one rank sends around the CP ring for one attention pass of one microbatch
    (``rank_tokens`` = s b / c, ``kv_width`` = key + value features on this TP rank)."""
    if cp == 1:
        return 0.0
    block = rank_tokens * kv_width * element_bytes
    return (cp - 1) * block * (2 if backward else 1)


def ring_kernel(name: str, moved: float, gbps: float, attention_seconds: float,
                gpu: GpuSpec) -> list[Kernel]:
    """The ring's exposed time: its transfer beyond the attention it overlaps, plus one
    kernel's fixed cost per pass (none without CP)."""
    if not moved:
        return []
    exposed = max(0.0, moved / (gbps * 1e9) - attention_seconds)
    return [Kernel(name, 0.0, moved, exposed + gpu.kernel_overhead_us * 1e-6, "memory")]
