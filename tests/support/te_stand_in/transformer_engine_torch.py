"""transformer_engine_torch: TE v2.11's compiled PyTorch extension (``tex``), the one function of
it that megatron-core calls on the paths the tests run.

megatron-core imports it as ``tex`` where Transformer Engine is installed (0.16.1 and 0.19.2
core/utils.py: ``import transformer_engine_torch as tex``, None without it) and splits a pack of
documents ("thd") over the context-parallel ranks with :func:`thd_get_partitioned_indices`
(0.16.1 core/utils.py:2070 get_thd_batch_on_this_cp_rank; 0.19.2 core/utils.py:2441
_get_batch_on_this_cp_rank_per_document_balancing). Nothing else of the extension is imitated:
a missing name raises AttributeError, as an older TE would.
"""
from __future__ import annotations

import torch

__all__ = ["thd_get_partitioned_indices"]


def thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
    """The indices, into a pack of ``total_tokens``, of the tokens context-parallel ``rank`` of
    ``world_size`` holds: each document (offsets ``cu_seqlens``, every length a multiple of
    2 x world_size) cut into 2 x world_size chunks, of which the rank takes chunk ``rank`` and
    chunk 2 x world_size - 1 - rank, document after document (int32, total_tokens / world_size).

    TE v2.11 pytorch/csrc/extensions/attention.cpp:785-803 (the checks, an int32 output of
    total_tokens / world_size) and transformer_engine/common/fused_attn/context_parallel.cu
    :83-104 (thd_partition_indices_kernel: local offsets cu_seqlens / world_size, the document
    by a binary search over them, :66-77, that never goes past the last document, the first
    half of a document's local tokens from chunk ``rank`` and the second from chunk
    2 x world_size - 1 - rank). Not TE's code: the same arithmetic, vectorised. pybind refuses
    anything but a tensor and ints with TypeError (pybind.cpp:378), as here.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or not all(
            isinstance(x, int) and not isinstance(x, bool)
            for x in (total_tokens, world_size, rank)):
        raise TypeError("thd_get_partitioned_indices(): incompatible function arguments. The "
                        "following argument types are supported: (cu_seqlens: torch.Tensor, "
                        "total_tokens: int, world_size: int, rank: int) -> torch.Tensor; "
                        f"invoked with: {type(cu_seqlens).__name__}, "
                        f"{type(total_tokens).__name__}, {type(world_size).__name__}, "
                        f"{type(rank).__name__}")
    _check(cu_seqlens.dtype == torch.int32, "cu_seqlens.scalar_type() == at::ScalarType::Int")
    _check(cu_seqlens.dim() == 1, "cu_seqlens.dim() == 1")
    _check(cu_seqlens.size(0) >= 2, "cu_seqlens.size(0) >= 2")
    _check(0 <= rank < world_size, "rank >= 0 && rank < world_size")
    _check(world_size > 0, "world_size > 0")
    _check(total_tokens > 0 and total_tokens % (world_size * 2) == 0,
           "total_tokens > 0 && total_tokens % (world_size * 2) == 0")
    offsets = cu_seqlens.to(torch.int64)
    if bool((offsets % (2 * world_size)).any()):  # context_parallel.cu:88-91, a device assert
        raise RuntimeError("device-side assert triggered: seqlen % (world_size * 2) == 0 "
                           f"(cu_seqlens {offsets.tolist()}, world_size {world_size})")
    local = offsets // world_size
    token = torch.arange(total_tokens // world_size, device=cu_seqlens.device)
    document = torch.searchsorted(local[1:].contiguous(), token, right=True)
    document = document.clamp(max=local.numel() - 2)  # the search stops at the last document
    half = (local[document + 1] - local[document]) // 2
    index = token - local[document]
    chunk = torch.where(index < half, torch.full_like(index, rank),
                        torch.full_like(index, 2 * world_size - 2 - rank))
    return (index + local[document] * world_size + half * chunk).to(torch.int32)


def _check(condition: bool, what: str) -> None:
    """NVTE_CHECK: a RuntimeError naming the failed condition."""
    if not condition:
        raise RuntimeError(f"Assertion failed: {what}.")
