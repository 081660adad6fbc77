"""DotProductAttention: TE v2.11 attention/dot_product_attention/dot_product_attention.py, the
math of its unfused backend (backends.py:206-567 UnfusedDotProductAttention: BMM1, softmax with
the mask, dropout, BMM2) in plain torch.

Layouts (dot_product_attention.py:799-1000 forward's docstring): "sbhd" [s, b, h, d], "bshd"
[b, s, h, d], "thd" [t, h, d] (packed documents, offsets ``cu_seqlens_*``); the output has the
heads flattened: [s, b, h*d], [b, s, h*d], [t, h*d] (backends.py:539-566). Grouped-query
attention: ``num_gqa_groups`` key/value heads, each shared by ``num_attention_heads /
num_gqa_groups`` query heads (:356-361); heads per rank are divided by ``tp_size``.

Masks (``attn_mask_type``, :327-352): "causal" / "padding_causal" (a query attends to keys at
or before its position; in "thd" within its own document), "no_mask" / "padding" (every key;
in "thd" of its own document), "arbitrary" (``attention_mask`` True = masked out). Megatron
asks "thd" for padding_causal / padding (megatron-core 0.16.1 extensions/transformer_engine.py
:1397-1404). A document's tokens between its length (``cu_seqlens``) and its padded length
(``cu_seqlens_*_padded``) attend nothing and produce zeros.

Positions, not indices, decide the causal mask (:func:`_Tokens`). Context parallelism
(``cp_group`` of more than one rank, every ``cp_comm_type``) is the result of TE's
context_parallel.py (see that module here): this rank's queries -- chunks r and 2cp-1-r of 2cp
of the sequence, or of each document for "thd" -- attend to the keys and values of the whole
sequence, gathered over the CP group, each token with its global position and document.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _comm
from . import context_parallel as cp

__all__ = ["DotProductAttention"]

_CAUSAL = {"causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right"}
_FULL = {"no_mask", "padding"}


def _not_imitated(what: str):
    return NotImplementedError(f"the CPU stand-in of Transformer Engine does not imitate {what}")


@dataclass(frozen=True)
class _Tokens:
    """Where each token of one sequence (or pack) is: its position, its document (0 without
    packing) and whether it is a real token (padding inside a padded pack is not)."""

    position: torch.Tensor
    document: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def plain(positions: torch.Tensor) -> "_Tokens":
        zeros = torch.zeros_like(positions)
        return _Tokens(positions, zeros, torch.ones_like(positions, dtype=torch.bool))

    @staticmethod
    def packed(tokens: int, cu_seqlens: torch.Tensor,
               cu_seqlens_padded: Optional[torch.Tensor]) -> "_Tokens":
        """A pack of documents: document i starts at ``cu_seqlens_padded[i]`` (``cu_seqlens[i]``
        without padding) and has ``cu_seqlens[i+1] - cu_seqlens[i]`` real tokens."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
        starts = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)
        starts = starts.to(torch.int64)
        index = torch.arange(tokens)
        document = torch.bucketize(index, starts[1:], right=True).clamp(max=len(lengths) - 1)
        position = index - starts[document]
        return _Tokens(position, document, position < lengths[document])


def _take(tokens: _Tokens, index: torch.Tensor) -> _Tokens:
    """The tokens at ``index`` (a context-parallel rank's, or the gathered ones)."""
    return _Tokens(tokens.position[index], tokens.document[index], tokens.valid[index])


def _mask(q: _Tokens, k: _Tokens, mask_type: str) -> torch.Tensor:
    """[sq, sk] True where query i may attend key j."""
    allowed = (q.document[:, None] == k.document[None, :]) & q.valid[:, None] & k.valid[None, :]
    if mask_type in _CAUSAL:
        allowed = allowed & (k.position[None, :] <= q.position[:, None])
    return allowed


class DotProductAttention(torch.nn.Module):
    """dot_product_attention.py:318-527 (constructor) and :799-1574 (forward), unfused.

    TE's is a TransformerEngineBaseModule whose empty ``_extra_state`` a load-state-dict hook
    drops from the missing keys (:503-513); the stand-in keeps no extra state at all, which
    loads alike."""

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker=None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False) -> None:
        super().__init__()
        if softmax_type != "vanilla" or return_max_logit:
            raise _not_imitated(f"softmax_type={softmax_type!r} / return_max_logit")
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type.replace(",", "_")  # :348-351
        if self.attn_mask_type == "causal_padding":
            self.attn_mask_type = "padding_causal"
        _check_window(window_size)
        self.tp_size = tp_size if tp_group is None else _comm.world_size(tp_group)  # :353-359
        self.tp_group = tp_group
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.hidden_size_per_attention_head_k = \
            kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.hidden_size_per_attention_head_v = \
            kv_channels if isinstance(kv_channels, int) else kv_channels[1]
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        assert num_attention_heads % self.num_gqa_groups == 0, \
            "The number of attention heads must be divisible by the number of GQA groups!"
        self.get_rng_state_tracker = get_rng_state_tracker
        # :376-382: dropout runs on the tracker's forked state, except under sequence parallel
        self._dropout_rng = None if sequence_parallel or get_rng_state_tracker is None \
            else get_rng_state_tracker
        self.softmax_scale = softmax_scale if softmax_scale is not None else \
            1.0 / math.sqrt(self.hidden_size_per_attention_head_k)  # :384-387
        self.attention_type, self.attention_dropout = attention_type, attention_dropout
        self.softmax_type = softmax_type
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        """:529-580: the context-parallel group (a list of [a2a, p2p] groups for "a2a+p2p"),
        its ranks, stream and communication type; hierarchical a2a+p2p over two groups of
        more than one rank each is refused here (context_parallel.resolve_group)."""
        if isinstance(cp_group, (list, tuple)) and cp_comm_type == "a2a+p2p" and \
                all(_comm.world_size(g) > 1 for g in cp_group):
            raise _not_imitated("hierarchical context parallelism (cp_comm_type a2a+p2p over "
                                "two groups of more than one rank each)")
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                qkv_format: Optional[str] = None, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type: Optional[str] = None, window_size=None,
                checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                pad_between_seqs: Optional[bool] = None, fp8_output: Optional[bool] = False,
                num_splits: Optional[int] = 1) -> torch.Tensor:
        """:799-1574: attention of the queries over the keys; ``checkpoint_core_attention`` (a
        recomputation, the same values) and ``num_splits`` (FlashAttention-3 only) change
        nothing here."""
        fmt = qkv_format or self.qkv_format
        mask_type = (attn_mask_type or self.attn_mask_type).replace(",", "_")
        _check_window(window_size)
        if alibi_slopes is not None or inference_params is not None or \
                core_attention_bias_type not in ("no_bias", "post_scale_bias"):
            raise _not_imitated("ALiBi, inference KV caches or pre-scale attention bias")
        if mask_type not in _CAUSAL | _FULL | {"arbitrary"}:
            raise ValueError(f"attn_mask_type {mask_type!r} not supported")
        bias = core_attention_bias if core_attention_bias_type == "post_scale_bias" else None
        if cp.group_size(self.cp_group) > 1:
            return self._context_parallel(query_layer, key_layer, value_layer, fmt, mask_type,
                                          cu_seqlens_q, cu_seqlens_q_padded, bias, window_size)
        if fmt == "thd":
            q_tokens = _Tokens.packed(query_layer.shape[0], cu_seqlens_q, cu_seqlens_q_padded)
            k_tokens = _Tokens.packed(key_layer.shape[0], cu_seqlens_kv, cu_seqlens_kv_padded)
            out = self._attend(query_layer.unsqueeze(0), key_layer.unsqueeze(0),
                               value_layer.unsqueeze(0), q_tokens, k_tokens, mask_type, None,
                               bias)
            return out.squeeze(0).reshape(query_layer.shape[0], -1)
        if fmt not in ("sbhd", "bshd"):
            raise ValueError(f"qkv_format {fmt!r} not supported")
        to_bshd = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
        q, k, v = (to_bshd(t) for t in (query_layer, key_layer, value_layer))
        q_tokens = _Tokens.plain(torch.arange(q.shape[1]))
        k_tokens = _Tokens.plain(torch.arange(k.shape[1]))
        if mask_type.endswith("bottom_right"):
            q_tokens = _Tokens.plain(torch.arange(q.shape[1]) + k.shape[1] - q.shape[1])
        arbitrary = attention_mask if mask_type == "arbitrary" else None
        out = self._attend(q, k, v, q_tokens, k_tokens, mask_type, arbitrary, bias)
        out = to_bshd(out)  # back to the input's layout
        return out.reshape(*out.shape[:2], -1)

    def _context_parallel(self, query, key, value, fmt: str, mask_type: str, cu_seqlens,
                          cu_seqlens_padded, bias, window_size) -> torch.Tensor:
        """context_parallel.py:3890-4110 (attn_forward_func_with_cp), its result: this rank's
        queries over the whole sequence's keys and values (module doc of context_parallel).
        "thd" takes ``cu_seqlens`` as the padded offsets where none are given, as TE's flash
        and fused backends pass them (backends.py:878-879, :1834-1837)."""
        group, comm = cp.resolve_group(self.cp_group, self.cp_comm_type, fmt, bias is not None)
        size, rank = _comm.world_size(group), torch.distributed.get_rank(group)
        cp.check(comm, fmt, mask_type, query, key, value, size, bias is not None, window_size)
        if mask_type == "arbitrary" or mask_type.endswith("bottom_right"):
            # no CP backend takes them: bottom-right masks utils.py:768-773, :795-800; an
            # arbitrary mask unfused only (:843-853), which refuses CP (:756-760)
            raise ValueError(f"attn_mask_type {mask_type!r} is not supported with context "
                             "parallelism")
        if fmt not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"qkv_format {fmt!r} not supported")
        seq_dim = 1 if fmt == "bshd" else 0
        local = query.shape[seq_dim]
        if fmt == "thd":
            padded = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
            whole = _Tokens.packed(local * size, cu_seqlens, padded)
        else:
            padded, whole = None, _Tokens.plain(torch.arange(local * size))
        mine = cp.local_indices(fmt, local, size, rank, padded)
        every = torch.cat([cp.local_indices(fmt, local, size, r, padded) for r in range(size)])
        k, v = (cp.gather_sequence(t, seq_dim, group) for t in (key, value))
        if fmt == "thd":
            out = self._attend(query.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                               _take(whole, mine), _take(whole, every), mask_type, None, None)
            return out.squeeze(0).reshape(local, -1)
        to_bshd = (lambda t: t.transpose(0, 1)) if fmt == "sbhd" else (lambda t: t)
        out = to_bshd(self._attend(to_bshd(query), to_bshd(k), to_bshd(v), _take(whole, mine),
                                   _take(whole, every), mask_type, None, None))
        return out.reshape(*out.shape[:2], -1)

    def _attend(self, q, k, v, q_tokens: _Tokens, k_tokens: _Tokens, mask_type: str,
                arbitrary, bias) -> torch.Tensor:
        """[b, sq, h, d] attention (backends.py:368-539): scaled scores, masked softmax,
        dropout, weighted values; queries that may attend nothing give zeros."""
        groups = q.shape[2] // k.shape[2]
        if groups > 1:  # grouped-query attention
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.softmax_scale
        if bias is not None:
            scores = scores + bias
        allowed = _mask(q_tokens, k_tokens, mask_type)[None, None]
        if arbitrary is not None:
            allowed = allowed & ~arbitrary.to(torch.bool)
        scores = scores.masked_fill(~allowed, float("-inf"))
        anything = allowed.any(dim=-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(~anything, 0.0), dim=-1) * anything
        if self.training and self.attention_dropout > 0:
            with self._dropout_context():
                probs = torch.nn.functional.dropout(probs, p=self.attention_dropout)
        return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)

    def _dropout_context(self):
        if self._dropout_rng is None:
            return contextlib.nullcontext()
        return self._dropout_rng().fork()


def _check_window(window_size) -> None:
    """Sliding windows (utils.py:2031-2071) are not imitated: only the unbounded defaults."""
    if window_size is not None and tuple(window_size) not in ((-1, 0), (-1, -1)):
        raise _not_imitated(f"sliding-window attention (window_size={window_size})")
