"""The linears' three GEMMs in plain torch (TE v2.11 calls cuBLAS through
pytorch/cpp_extensions/gemm.py ``general_gemm``; same math, no quantization).

Shapes as TE's layouts give them (gemm.py:92-211): fprop ``y = x W^T (+ b)``, dgrad
``dx = dy W``, wgrad ``dW = dy^T x`` with the bias gradient ``db = sum(dy)`` computed with it
when the bias took part in fprop (the GEMM epilogue, gemm.cpp:178-183: a ``bias`` with
``grad=True`` makes the GEMM return its gradient; without one it returns None).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["fprop", "dgrad", "wgrad"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def fprop(x: torch.Tensor, weight: torch.Tensor,
          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + b`` over x's last dimension, keeping x's leading dimensions."""
    out = _rows(x).matmul(weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def dgrad(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dy W`` (rows)."""
    return _rows(grad_output).matmul(weight)


def wgrad(x: torch.Tensor, grad_output: torch.Tensor, with_bias_grad: bool,
          out: Optional[torch.Tensor] = None, accumulate: bool = False):
    """``(dy^T x, sum(dy) or None)``; with ``out`` (fuse_wgrad_accumulation's main_grad) the
    weight gradient is written there, added to it when ``accumulate`` (gemm.py:92-119
    ``out``/``accumulate``), and ``out`` is returned."""
    dy, rows = _rows(grad_output), _rows(x)
    dw = dy.t().matmul(rows)
    db = dy.sum(dim=0) if with_bias_grad else None
    if out is not None:
        with torch.no_grad():
            if accumulate:
                out.add_(dw.to(out.dtype))
            else:
                out.copy_(dw)
        dw = out
    return dw, db
