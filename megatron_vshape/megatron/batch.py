"""The batch and forward step of Megatron-LM's loop under a V (``scripts/pretrain_gpt_vshape.py``).

Under a V, pipeline rank 0 holds both ends of the model (embedding and LM head), so it needs
the tokens *and* the labels of every microbatch; the other ranks read no data, except the
documents' boundaries of packed sequences (--sft), which every stage's attention needs.

Context parallelism: every context-parallel rank reads the whole microbatch (its data loader
is that of its data-parallel rank, as in megatron) and keeps its slice with megatron-core's own
function, as pretrain_gpt's get_batch does (:func:`on_this_cp_rank`): the load-balanced split
(chunks r and 2cp-1-r of 2cp), per document for packed sequences (0.19-era training code only:
core_v0.16.1's get_batch cannot split packs, features.py refuses --sft with CP there).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

__all__ = ["VBatch", "VForwardStep", "is_v_dataset_rank", "packed_seq_params", "on_this_cp_rank"]


def is_v_dataset_rank(packed: bool = False) -> bool:
    """Under a V only pipeline rank 0 (both ends of the model) reads data, on TP rank 0; with
    packed sequences (``--sft``) every pipeline rank does, for the documents' boundaries
    (every stage's attention needs them), as Megatron-LM's 0.19-era pretrain_gpt does. Every
    context-parallel rank reads (the whole microbatch, then keeps its slice), as in megatron."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and \
        (packed or ps.get_pipeline_model_parallel_rank() == 0)


def packed_seq_params(cu_seqlens, max_seqlen, cu_seqlens_padded=None, seq_length=None):
    """megatron's PackedSeqParams ("thd") of one microbatch's pack, as pretrain_gpt builds them
    from the data's ``cu_seqlens`` and ``max_seqlen``: 1-D offsets of the documents (a pack is
    one sample, ``--micro-batch-size 1``), the padded offsets where the data has them."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = _one_pack(cu_seqlens)
    if cu_seqlens_padded is not None:
        cu_seqlens_padded = _one_pack(cu_seqlens_padded)
    offsets = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    longest = int(max_seqlen.reshape(-1)[0].item())
    fields = dict(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                  cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                  max_seqlen_q=longest, max_seqlen_kv=longest)
    if seq_length is not None and "tokens_per_sample" in \
            {f.name for f in dataclasses.fields(PackedSeqParams)}:  # megatron-core >= 0.19
        fields["tokens_per_sample"] = seq_length
    return PackedSeqParams(**fields)


@dataclass(frozen=True)
class VBatch:
    """One microbatch, read on TP rank 0 and broadcast over the tensor-parallel group (as
    Megatron-LM's get_batch_on_this_tp_rank does): tokens, labels, loss mask and positions on
    pipeline rank 0 (both ends of the V), this context-parallel rank's slice of them
    (:func:`on_this_cp_rank`); with ``packed`` (``--sft``) the pack's document boundaries on
    every pipeline rank, since every stage's attention must keep the documents apart (without
    them they would attend to each other, silently)."""

    seq_length: int
    micro_batch_size: int
    attention_mask: bool = False
    """Whether the data loader makes attention masks (--create-attention-mask-in-dataloader)."""
    packed: bool = False
    """Packed sequences (--sft): the data has cu_seqlens and max_seqlen per microbatch."""

    _KEYS = (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
             ("position_ids", torch.int64))

    def __call__(self, data_iterator):
        """(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params): the
        tensors on pipeline rank 0 (Nones elsewhere), the packed parameters where ``packed``."""
        from megatron.core import parallel_state as ps

        first = ps.get_pipeline_model_parallel_rank() == 0
        if not (first or self.packed):
            return None, None, None, None, None, None
        data = next(data_iterator) if ps.get_tensor_model_parallel_rank() == 0 else None
        batch = self._tensors(data) if first else {}
        if self.packed:
            batch.update(self._offsets(data))
            batch = _flattened(batch)
        if first:
            batch = on_this_cp_rank(batch)
        packed = packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"],
                                   batch["cu_seqlens_padded"], self.seq_length) \
            if self.packed else None
        return (batch.get("tokens"), batch.get("labels"), batch.get("loss_mask"),
                batch.get("attention_mask"), batch.get("position_ids"), packed)

    def _tensors(self, data) -> dict:
        """Rank 0's tensors of the microbatch, the same on every TP rank."""
        shape = (self.micro_batch_size, self.seq_length)
        keys = list(self._KEYS) + ([("attention_mask", torch.bool)] if self.attention_mask else [])
        if data is not None:
            batch = {k: data[k].to(_device(), non_blocking=True) for k, _ in keys}
        else:
            batch = {k: torch.empty(shape if k != "attention_mask" else
                                    (shape[0], 1, shape[1], shape[1]), dtype=dtype,
                                    device=_device())
                     for k, dtype in keys}
        for key, _ in keys:
            _tp_broadcast(batch[key])
        return batch

    def _offsets(self, data) -> dict:
        """The pack's offsets as the data loader has them ([1, n] int32: one pack per
        microbatch; the padded ones or None) and its longest document, the same on every TP
        rank (offsets of any length)."""
        source = data is not None
        cu_seqlens = _tp_broadcast_offsets(data["cu_seqlens"] if source else None, source)
        padded = _tp_broadcast_offsets(data.get("cu_seqlens_padded") if source else None, source)
        longest = (data["max_seqlen"].to(_device()).reshape(1).to(torch.int32) if source else
                   torch.empty(1, dtype=torch.int32, device=_device()))
        _tp_broadcast(longest)
        return {"cu_seqlens": cu_seqlens.reshape(1, -1),
                "cu_seqlens_padded": None if padded is None else padded.reshape(1, -1),
                "max_seqlen": longest}


def _flattened(batch: dict) -> dict:
    """megatron-core >= 0.19's flatten_batch_for_packed_sequences (utils.py:2565; the 0.19-era
    pretrain_gpt.py:150 calls it on every batch): one pack's offsets without the data
    loader's trailing copies of the pack length, which 0.19's SFTDataset adds so that packs
    stack (sft_dataset.py:184-191); the batch as it is where megatron-core has no such
    function (0.16, whose SFTDataset adds none)."""
    from megatron.core import utils

    flatten = getattr(utils, "flatten_batch_for_packed_sequences", None)
    return batch if flatten is None else flatten(batch)


def on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's slice of pipeline rank 0's batch, by megatron-core's own
    function, called as Megatron-LM's get_batch calls it: core_v0.16.1's
    ``get_batch_on_this_cp_rank(batch)`` (pretrain_gpt.py:89, megatron-core 0.16.1
    utils.py:1994-2038); the 0.19 era's ``get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
    cp_group=...)`` (pretrain_gpt.py:167-173; megatron-core 0.19.2 utils.py:2612-2666: per
    sequence, or per document through Transformer Engine's thd_get_partitioned_indices where
    the batch has ``cu_seqlens``). The offsets and longest document stay whole (every rank's
    attention takes the whole pack's). Nothing changes with one context-parallel rank."""
    import inspect

    from megatron.core import parallel_state as ps
    from megatron.core import utils

    if ps.get_context_parallel_world_size() == 1:
        return batch
    split = utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(split).parameters:  # megatron-core >= 0.19
        return split(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
    if batch.get("cu_seqlens") is not None:
        raise ValueError("packed sequences (--sft) with --context-parallel-size > 1 need "
                         "megatron-core >= 0.19: core_v0.16.1's get_batch cannot split a pack "
                         "over context-parallel ranks (features.py says why)")
    return split(batch)


def _one_pack(offsets):
    """A pack's document offsets as 1-D (the data loader stacks them per microbatch)."""
    if offsets.dim() > 1 and offsets.shape[0] != 1:
        raise ValueError(f"packed sequences (--sft) hold one pack per microbatch: use "
                         f"--micro-batch-size 1 (got {offsets.shape[0]})")
    return offsets.reshape(-1)


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def _tp_broadcast(tensor) -> None:
    """Broadcast from TP rank 0 over the tensor-parallel group (nothing to do without TP)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(tensor, ps.get_tensor_model_parallel_src_rank(),
                                    group=ps.get_tensor_model_parallel_group())


def _tp_broadcast_offsets(offsets, source: bool):
    """Document offsets of TP rank 0 (``source``; None there: the data has none) as 1-D int32
    on every TP rank, None where absent: the length goes first, since the number of documents
    varies per pack."""
    if offsets is not None:
        offsets = _one_pack(offsets).to(_device(), torch.int32)
    length = torch.tensor([0 if offsets is None else offsets.numel()], device=_device())
    _tp_broadcast(length)
    if not source:
        offsets = torch.empty(int(length.item()), dtype=torch.int32, device=_device())
    if length.item() == 0:
        return None
    _tp_broadcast(offsets)
    return offsets


class VForwardStep:
    """Megatron-LM's forward_step for the V (pretrain_gpt.forward_step with the V's batch):
    ``loss_func(loss_mask, output_tensor[, model=])`` is pretrain_gpt's loss function."""

    def __init__(self, batch: VBatch, loss_func: Callable, timers: Callable | None = None):
        self.batch = batch
        self.loss_func = loss_func
        self.timers = timers
        self._takes_model = "model" in inspect.signature(loss_func).parameters

    def __call__(self, data_iterator, model):
        if self.timers is not None:
            self.timers("batch-generator", log_level=2).start()
        tokens, labels, loss_mask, attention_mask, position_ids, packed = \
            self.batch(data_iterator)
        if self.timers is not None:
            self.timers("batch-generator").stop()
        output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                       packed_seq_params=packed)
        loss = partial(self.loss_func, loss_mask, model=model) if self._takes_model else \
            partial(self.loss_func, loss_mask)
        return output, loss
