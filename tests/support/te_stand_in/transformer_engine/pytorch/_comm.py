"""Tensor-parallel collectives along the first (sequence) dimension, as TE v2.11's linears
call them (pytorch/distributed.py). Plain functions, no autograd: the modules' own autograd
Functions call them in forward and backward, as TE's do.

Each returns ``(tensor, None)`` like TE's (whose second value is the async handle); the stand-in
always waits, so there is never a handle.
"""
from __future__ import annotations

import torch

from .tensor.float8_tensor import Float8TensorStorage

__all__ = ["world_size", "gather_along_first_dim", "reduce_scatter_along_first_dim", "allreduce"]


def world_size(group) -> int:
    """distributed.py:158-163 get_distributed_world_size: 1 without torch.distributed."""
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def gather_along_first_dim(inp, group):
    """distributed.py:1586-1740: all-gather, concatenated along dim 0 (rank order); the input
    itself with one rank. An FP8 tensor is gathered as its FP8 bytes with this rank's
    ``scale_inv``, TE assuming the scales equal across ranks (:910-985 ``_all_gather_fp8``,
    :976-977)."""
    size = world_size(group)
    if size == 1:
        return inp, None
    if isinstance(inp, Float8TensorStorage):
        data = gather_along_first_dim(inp._data.view(torch.uint8), group)[0]  # gloo: no fp8
        return Float8TensorStorage(data.view(inp.fp8_dtype), inp._scale_inv, inp.dtype), None
    out = torch.empty((inp.shape[0] * size, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    torch.distributed.all_gather_into_tensor(out, inp.contiguous(), group=group)
    return out, None


def reduce_scatter_along_first_dim(inp: torch.Tensor, group):
    """distributed.py:887-907: sum over the group, this rank's slice of dim 0 (which must
    divide by the group size); the input itself with one rank."""
    size = world_size(group)
    if size == 1:
        return inp, None
    assert inp.shape[0] % size == 0, \
        "First dimension of the tensor should be divisible by tensor parallel size"
    out = torch.empty((inp.shape[0] // size, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    torch.distributed.reduce_scatter_tensor(out, inp.contiguous(), group=group)
    return out, None


def allreduce(inp: torch.Tensor, group):
    """distributed.py:1884-1898: in-place sum over the group; the input itself with one rank."""
    if world_size(group) == 1:
        return inp, None
    torch.distributed.all_reduce(inp, group=group)
    return inp, None
