"""Context-parallel attention: the result of TE v2.11's
attention/dot_product_attention/context_parallel.py (attn_forward_func_with_cp, :3890-4110),
computed in plain torch.

What TE computes, whatever the communication: each context-parallel rank holds a slice of
every sequence (megatron's load-balanced split: of 2 x cp chunks, rank r holds chunks r and
2cp-1-r, of the whole sequence for "sbhd"/"bshd", of each document for "thd"), and its queries
attend to the keys and values of the *whole* sequence, causal by global position, with the
gradients of the keys and values summed back to the ranks that hold them. TE's four
``cp_comm_type`` s move the data differently -- "p2p" passes key/value blocks around a ring
(AttnFuncWithCPAndKVP2P, :1232), "all_gather" gathers them (AttnFuncWithCPAndKVAllGather,
:2759), "a2a" swaps the sequence split for a head split (AttnFuncWithCPAndQKVOA2A, :3268),
"a2a+p2p" nests the two over two groups -- and give the same attention. The stand-in imitates
the result, not the communication: for every type it all-gathers the keys and values over the
CP group (:class:`_GatherSequence`) and runs the stand-in's one attention over them with each
token's global position and document; the backward all-reduces the keys' and values'
gradients and keeps this rank's part. Each type keeps TE's own refusals (:func:`check`).

Not imitated: hierarchical "a2a+p2p" over two groups of more than one rank each (the order of
the ranks of the nested ring is TE's own; with one of the two of size 1 TE falls back to the
other, :3996-4001, and so does the stand-in), attention bias, sliding windows and FP8 under
context parallelism. TE's context-parallel backends (flash, fused) run fp16/bf16 only and its
unfused one refuses context parallelism (utils.py:756-760); the stand-in computes in the
inputs' dtype (fp32 in the CPU runs, float64 in the unit tests).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _comm

__all__ = ["COMM_TYPES", "resolve_group", "check", "local_indices", "gather_sequence"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""context_parallel.py:4076-4108: the types TE dispatches; any other is a ValueError."""


def _te_assert(condition: bool, message: str) -> None:
    """TE's ``assert`` (an AssertionError with its message), kept under ``python -O``."""
    if not condition:
        raise AssertionError(message)


def group_size(cp_group) -> int:
    """dot_product_attention.py:1207-1214: the group's size, the product over a list."""
    if cp_group is None:
        return 1
    if isinstance(cp_group, (list, tuple)):
        size = 1
        for group in cp_group:
            size *= _comm.world_size(group)
        return size
    return _comm.world_size(cp_group)


def resolve_group(cp_group, cp_comm_type: str, qkv_format: str, has_bias: bool):
    """(group, type) the attention runs with: "a2a+p2p" takes [a2a group, p2p group] and
    becomes "p2p" or "a2a" when the other group has one rank (context_parallel.py:3986-4005);
    the stand-in refuses it over two groups of more than one rank each (module doc)."""
    if cp_comm_type != "a2a+p2p":
        _te_assert(not isinstance(cp_group, (list, tuple)),
                   f"cp_group must be ProcessGroup type for {cp_comm_type=}!")
        return cp_group, cp_comm_type
    _te_assert(isinstance(cp_group, (list, tuple)) and len(cp_group) == 2,
               "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!")
    _te_assert(qkv_format != "thd",
               f"{qkv_format} format is not supported with hierarchical CP implementation yet!")
    _te_assert(not has_bias, "post_scale_bias bias type is not supported with hierarchical CP "
                             "implementation yet!")
    if _comm.world_size(cp_group[0]) == 1:
        return cp_group[1], "p2p"
    if _comm.world_size(cp_group[1]) == 1:
        return cp_group[0], "a2a"
    raise NotImplementedError(
        "the CPU stand-in of Transformer Engine does not imitate hierarchical context "
        "parallelism (cp_comm_type a2a+p2p over two groups of more than one rank each)")


def check(comm: str, qkv_format: str, mask_type: str, q, k, v, cp_size: int,
          has_bias: bool, window_size) -> None:
    """TE's refusals for context parallelism that apply to the stand-in's arguments:
    attn_forward_func_with_cp's (context_parallel.py:4008-4047; its "cu_seqlens_padded can not
    be None" never fires from DotProductAttention, whose flash and fused backends pass
    cu_seqlens where the padded offsets are None, backends.py:878-879, :1834-1837) and each
    communication's (all_gather :2802-2806 and :2842, a2a :3316-3320 and :3365-3367; the even local
    length of p2p :1432-1434, all_gather :2846-2848 and a2a :3377-3379)."""
    if comm not in COMM_TYPES:
        raise ValueError(f"Unsupported communication type: {comm}!")  # :4108
    _te_assert(qkv_format in ("bshd", "sbhd", "thd"),
               f"Context parallelism does not support {qkv_format=}!")
    if has_bias:  # TE: FusedAttention only, without padding (:4015-4018)
        raise NotImplementedError("the CPU stand-in of Transformer Engine does not imitate "
                                  "attention bias under context parallelism")
    if window_size is not None and tuple(window_size) not in ((-1, 0), (-1, -1)):
        _te_assert(comm in ("a2a", "all_gather"), "Context parallelism does not support "
                   "sliding window attention with {cp_comm_type=}!")  # TE's text, unformatted
    _te_assert(k.shape[-1] == v.shape[-1] or comm in ("p2p", "a2a+p2p"),
               "Context parallelism does not support MLA with {cp_comm_type=}!")
    padding = "padding" in mask_type
    seq_dim = 0 if qkv_format in ("sbhd", "thd") else 1
    if comm == "all_gather":
        _te_assert(not padding, f"{mask_type} mask type is not supported!")
        _te_assert(qkv_format != "thd", f"{qkv_format} format is not supported!")
    if comm == "a2a":
        _te_assert(not padding or qkv_format == "thd",
                   f"{mask_type} mask type is not supported for BSHD and SBHD!")
        _te_assert(q.shape[-2] % cp_size == 0 and k.shape[-2] % cp_size == 0,
                   "The number of attention heads needs to be divisible by CP size!")
    if comm in ("all_gather", "a2a"):
        _te_assert(q.shape[-1] % 8 == 0,
                   "Hidden size per attention head should be multiple of 8!")
    _te_assert(qkv_format == "thd" or (q.shape[seq_dim] % 2 == 0 and k.shape[seq_dim] % 2 == 0),
               "Sequence length per GPU needs to be divisible by 2!")


def local_indices(qkv_format: str, local_tokens: int, cp_size: int, cp_rank: int,
                  cu_seqlens_padded: Optional[torch.Tensor]) -> torch.Tensor:
    """Where rank ``cp_rank``'s ``local_tokens`` sit in the whole sequence (or pack): for
    "sbhd"/"bshd" chunks r and 2cp-1-r of the sequence (the order TE expects its inputs in,
    context_parallel.py:3933-3953, megatron's get_batch_on_this_cp_rank); for "thd" the same
    per document of the padded offsets (:3954-3977), the indices
    transformer_engine_torch.thd_get_partitioned_indices gives megatron's batch."""
    if qkv_format == "thd":
        import transformer_engine_torch as tex

        return tex.thd_get_partitioned_indices(cu_seqlens_padded.to(torch.int32),
                                               local_tokens * cp_size, cp_size,
                                               cp_rank).to(torch.int64)
    chunk = local_tokens // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` in rank order; backward: the gradients of the whole sequence
    summed over the group, this rank's slice (each rank's queries reach every key)."""

    @staticmethod
    def forward(ctx, tensor, dim: int, group):
        ctx.dim, ctx.group = dim, group
        ctx.rank, ctx.length = torch.distributed.get_rank(group), tensor.shape[dim]
        parts = [torch.empty_like(tensor) for _ in range(_comm.world_size(group))]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.length, ctx.length), None, None


def gather_sequence(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` (rank order), gradients to owners."""
    return _GatherSequence.apply(tensor, dim, group)
