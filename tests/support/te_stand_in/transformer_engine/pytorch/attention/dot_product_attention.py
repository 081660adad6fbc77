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

Positions, not indices, decide the causal mask (:func:`_Tokens`): so that context parallelism
can be added by gathering key/value and giving each token its global position (megatron's
load-balanced split gives CP rank r the chunks r and 2cp-1-r of 2cp, :func:`cp_positions`).
Context parallelism itself (``cp_group`` of size > 1) is not imitated: it is refused.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _comm

__all__ = ["DotProductAttention", "cp_positions"]

_CAUSAL = {"causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right"}
_FULL = {"no_mask", "padding"}


def _not_imitated(what: str):
    return NotImplementedError(f"the CPU stand-in of Transformer Engine does not imitate {what}")


def cp_positions(seq_len: int, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Global positions of one CP rank's tokens when a sequence of ``seq_len`` is split into
    2 x cp_size chunks and rank r holds chunks r and 2cp-1-r (megatron's load-balanced split,
    which TE's context-parallel attention expects); every position with cp_size 1."""
    if cp_size == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


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
        """:529-580: where context parallelism would be configured (refused beyond one rank)."""
        if cp_group is not None and not isinstance(cp_group, list) and \
                _comm.world_size(cp_group) > 1:
            raise _not_imitated("context parallelism (cp_group of more than one rank)")
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
