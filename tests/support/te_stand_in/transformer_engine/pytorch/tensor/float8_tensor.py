"""Per-tensor FP8 quantization on the CPU: TE v2.11's two per-tensor quantizers
(tensor/float8_tensor.py) and the tensors they make, with torch's own float8 dtypes.

What a cast computes, as TE's kernel does (common/cast/fp8/quantize_fp8.cuh:157-181, 217-229;
the same in common/util/vectorized_pointwise.h:186-224):

    amax       max |x| over the input, taken before scaling (:175), folded into the
               quantizer's amax with a max (``atomicMaxFloat``, :223) -- so several casts
               between two scale updates record the largest; ``fmaxf`` skips NaN elements
    data       ``x * scale`` in fp32, converted to the FP8 type (:181 ``static_cast<OType>``,
               OType ``__nv_fp8_e4m3`` / ``__nv_fp8_e5m2``, common/common.h:430-431), whose
               float constructor rounds to nearest-even and saturates to the largest finite
               value (CUDA's cuda_fp8.hpp, ``__NV_SATFINITE``); torch's CPU conversion rounds
               alike and saturates E4M3, but takes E5M2 beyond its range to infinity, so the
               stand-in clamps first
    scale_inv  ``1 / scale`` (:228-229 ``reciprocal``)

Delayed scaling (:class:`Float8Quantizer`, float8_tensor.py:37-109) casts with the scale its
recipe state holds and records the amax for the next update (quantization.py). Current scaling
(:class:`Float8CurrentScalingQuantizer`, float8_tensor.py:217-325) takes the amax of this very
tensor -- reduced with MAX over ``amax_reduction_group`` when ``with_amax_reduction``
(csrc/quantizer.cpp:497-535) -- and its scale from it (common/recipe/recipe_common.cuh:14-49:
``fp8_max / amax``, the amax floored at ``amax_epsilon``, 1 for a zero, infinite or NaN amax,
the largest fp32 where the quotient overflows, the mantissa cleared for power-of-2 scales).

The stand-in keeps the FP8 values and ``scale_inv`` (:class:`Float8TensorStorage`) and its GEMMs
dequantize them to fp32 before an fp32 matmul (module/_gemm.py): it imitates the quantization,
not the FP8 tensor cores' accumulation. Row-wise and column-wise (transposed) copies, which TE
keeps for the different GEMM layouts, hold the same values, so one copy serves both.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import QuantizedTensorStorage

__all__ = ["Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer",
           "Float8TensorStorage", "FP8_MAX", "cast_to_fp8", "compute_scale_from_amax",
           "prepare_for_saving", "restore_from_saved"]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
"""The largest finite values (common/recipe/delayed_scaling.cu:32-41 fp8_dtype_max)."""
_FP32_MAX = torch.finfo(torch.float32).max


def _amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32 as the kernel's ``fmaxf`` reduction from 0 computes it (NaNs skipped)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    magnitude = tensor.detach().float().abs()
    return torch.where(torch.isnan(magnitude), 0.0, magnitude).max()


def cast_to_fp8(tensor: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in fp32, saturated to the FP8 type's largest finite value, rounded to
    nearest-even (module doc)."""
    limit = FP8_MAX[fp8_dtype]
    scaled = tensor.detach().float() * scale.reshape(()).float()
    return scaled.clamp(-limit, limit).to(fp8_dtype)


def compute_scale_from_amax(amax: torch.Tensor, fp8_max: float, force_pow_2_scales: bool = False,
                            epsilon: float = 0.0) -> torch.Tensor:
    """common/recipe/recipe_common.cuh:14-49, with ``value_for_inf`` the largest fp32
    (common/recipe/current_scaling.cu:201-202)."""
    amax = amax.float().reshape(())
    amax = torch.where(amax < epsilon, torch.tensor(epsilon, dtype=torch.float32), amax)
    if bool(torch.isinf(amax) | torch.isnan(amax) | (amax == 0)):
        return torch.ones((), dtype=torch.float32)
    scale = torch.tensor(fp8_max, dtype=torch.float32) / amax
    if bool(torch.isinf(scale)):
        scale = torch.tensor(_FP32_MAX, dtype=torch.float32)
    if force_pow_2_scales:  # keep sign and exponent bits (:39-46)
        bits = scale.reshape(1).view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32)
        scale = bits.view(torch.float32).reshape(())
    return scale


class Float8TensorStorage(QuantizedTensorStorage):
    """What a per-tensor FP8 cast makes (TE's Float8TensorStorage, tensor/storage/
    float8_tensor_storage.py): the FP8 values, ``scale_inv``, and the high-precision dtype it
    dequantizes to. Not a torch.Tensor (TE's storage classes are not either)."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        self._data, self._scale_inv, self.dtype = data, scale_inv, dtype

    @property
    def shape(self) -> torch.Size:
        return self._data.shape

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``data * scale_inv`` in fp32, then ``dtype`` (the tensor's own by default)."""
        out = self._data.float() * self._scale_inv.reshape(()).float()
        return out.to(dtype or self.dtype)

    def view_rows(self) -> "Float8TensorStorage":
        """The same values as a matrix over the last dimension."""
        return Float8TensorStorage(self._data.reshape(-1, self._data.shape[-1]),
                                   self._scale_inv, self.dtype)


def prepare_for_saving(*items) -> tuple:
    """quantized_tensor.py:124-143: tensors for ``save_for_backward`` (an FP8 tensor's values
    and scale_inv in its place) and the FP8 tensors' descriptions (None for a plain one)."""
    tensors, objects = [], []
    for item in items:
        if isinstance(item, Float8TensorStorage):
            tensors += [item._data, item._scale_inv]
            objects.append(item.dtype)
        else:
            tensors.append(item)
            objects.append(None)
    return tensors, objects


def restore_from_saved(objects, saved) -> list:
    """quantized_tensor.py:146-165: the items again, FP8 tensors rebuilt from their saved
    values (not the live object: a weight workspace cast again later keeps this one's)."""
    items, saved = [], list(saved)
    for dtype in objects:
        if dtype is None:
            items.append(saved.pop(0))
        else:
            data, scale_inv = saved.pop(0), saved.pop(0)
            items.append(Float8TensorStorage(data, scale_inv, dtype))
    return items


class Quantizer:
    """The part of TE's Quantizer base (quantized_tensor.py) the linears use: the usages they
    set (no numerical effect here, module doc) and calling the quantizer to cast."""

    def __init__(self, rowwise: bool = True, columnwise: bool = True):
        self.rowwise_usage, self.columnwise_usage, self.internal = rowwise, columnwise, False

    def set_usage(self, *, rowwise: Optional[bool] = None,
                  columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def __call__(self, tensor: torch.Tensor) -> Float8TensorStorage:
        return self.quantize(tensor)

    def quantize(self, tensor: torch.Tensor, dtype: Optional[torch.dtype] = None):
        data, scale_inv = self._cast(tensor)
        return Float8TensorStorage(data, scale_inv, dtype or tensor.dtype)

    def update_quantized(self, src: torch.Tensor, dst: Float8TensorStorage) -> Float8TensorStorage:
        """Cast ``src`` again into ``dst``, in place (float8_tensor.py:83-105, 299-321)."""
        dst._data, dst._scale_inv = self._cast(src)
        return dst

    def _cast(self, tensor: torch.Tensor):
        raise NotImplementedError


class Float8Quantizer(Quantizer):
    """Delayed scaling (float8_tensor.py:37-109): cast with ``scale``, record the amax into
    ``amax`` (a view of the recipe state's amax history, quantization.py:1089-1096)."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, *,
                 rowwise: bool = True, columnwise: bool = True):
        super().__init__(rowwise, columnwise)
        self.scale, self.amax, self.dtype = scale, amax, fp8_dtype

    def _cast(self, tensor):
        with torch.no_grad():
            self.amax.copy_(torch.maximum(self.amax, _amax(tensor)))
            scale = self.scale.detach().clone()
        return cast_to_fp8(tensor, scale, self.dtype), 1.0 / scale


class Float8CurrentScalingQuantizer(Quantizer):
    """Current (tensorwise) scaling (float8_tensor.py:217-325; csrc/quantizer.cpp:497-535)."""

    def __init__(self, fp8_dtype: torch.dtype, device=None, *, rowwise: bool = True,
                 columnwise: bool = True, with_amax_reduction: bool = False,
                 amax_reduction_group=None, force_pow_2_scales: bool = False,
                 amax_epsilon: float = 0.0):
        super().__init__(rowwise, columnwise)
        self.dtype = fp8_dtype
        self.with_amax_reduction, self.amax_reduction_group = with_amax_reduction, \
            amax_reduction_group
        self.force_pow_2_scales, self.amax_epsilon = force_pow_2_scales, amax_epsilon
        self.scale = torch.ones(1, dtype=torch.float32)
        self.amax = torch.zeros(1, dtype=torch.float32)

    def _cast(self, tensor):
        amax = _amax(tensor).reshape(1)
        if self.with_amax_reduction and torch.distributed.is_initialized():  # quantizer.cpp:523-527
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                         group=self.amax_reduction_group)
        self.amax.copy_(amax)
        self.scale.copy_(compute_scale_from_amax(amax, FP8_MAX[self.dtype],
                                                 self.force_pow_2_scales, self.amax_epsilon))
        scale = self.scale.clone()
        return cast_to_fp8(tensor, scale, self.dtype), 1.0 / scale
