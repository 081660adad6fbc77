"""The linears' three GEMMs in plain torch (TE v2.11 calls cuBLAS through
pytorch/cpp_extensions/gemm.py ``general_gemm``).

Shapes as TE's layouts give them (gemm.py:92-211): fprop ``y = x W^T (+ b)``, dgrad
``dx = dy W``, wgrad ``dW = dy^T x`` with the bias gradient ``db = sum(dy)`` computed with it
when the bias took part in fprop (the GEMM epilogue, gemm.cpp:178-183: a ``bias`` with
``grad=True`` makes the GEMM return its gradient; without one it returns None).

FP8 operands (tensor/float8_tensor.py's Float8TensorStorage) are dequantized to fp32
(``data x scale_inv``) and multiplied in fp32, the result cast to ``out_dtype`` (TE's
``out_dtype``: the activation dtype, linear.py:328, 729; the weight gradient's: main_grad's or
the activation dtype, :850-852). cuBLAS multiplies the FP8 values and applies both scale
inverses to the fp32 sums; the stand-in imitates the quantization, not that accumulation.
Without FP8 operands the GEMMs are exactly the plain ones.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..tensor.float8_tensor import Float8TensorStorage

__all__ = ["fprop", "dgrad", "wgrad"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _quantized(*tensors) -> bool:
    return any(isinstance(t, Float8TensorStorage) for t in tensors)


def _fp32(t) -> torch.Tensor:
    return t.dequantize(torch.float32) if isinstance(t, Float8TensorStorage) else t.float()


def fprop(x, weight, bias: Optional[torch.Tensor] = None,
          out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x W^T + b`` over x's last dimension, keeping x's leading dimensions."""
    if _quantized(x, weight):
        out = _rows(_fp32(x)).matmul(_fp32(weight).t())
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype).view(*x.shape[:-1], weight.shape[0])
    out = _rows(x).matmul(weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def dgrad(grad_output, weight, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``dy W`` (rows)."""
    if _quantized(grad_output, weight):
        return _rows(_fp32(grad_output)).matmul(_fp32(weight)).to(out_dtype)
    return _rows(grad_output).matmul(weight)


def wgrad(x, grad_output, with_bias_grad: bool, out: Optional[torch.Tensor] = None,
          accumulate: bool = False, out_dtype: Optional[torch.dtype] = None):
    """``(dy^T x, sum(dy) or None)``; with ``out`` (fuse_wgrad_accumulation's main_grad) the
    weight gradient is written there, added to it when ``accumulate`` (gemm.py:92-119
    ``out``/``accumulate``), and ``out`` is returned."""
    if _quantized(x, grad_output):
        dy, rows = _rows(_fp32(grad_output)), _rows(_fp32(x))
        dw = dy.t().matmul(rows)
        db = dy.sum(dim=0) if with_bias_grad else None
        if out is None:
            dw = dw.to(out_dtype)
    else:
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
