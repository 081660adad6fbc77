"""LayerNorm and RMSNorm: TE v2.11's norm modules (module/layernorm.py, module/rmsnorm.py over
ops/basic/layer_norm.py, ops/basic/rmsnorm.py) and the norm math LayerNormLinear shares.

    LayerNorm  y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta
    RMSNorm    y = x / sqrt(E[x^2] + eps) * gamma
    zero_centered_gamma: gamma is stored minus one (initialised to 0) and applied as 1 + gamma
    (ops/basic/layer_norm.py:157-161, :273).

Parameters ``weight`` (and ``bias`` for LayerNorm), initialised to 1 (0 when zero-centred) and
0 (layer_norm.py:140-161); the legacy ``sequence_parallel`` flag becomes an attribute of each
parameter (module/layernorm.py:133-136), which megatron's finalize_model_grads sums over the
tensor-parallel group. Megatron's TENorm builds them with the deprecated ``hidden_size`` and
``params_dtype`` names (module/layernorm.py:82-104 accepts them).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["LayerNorm", "RMSNorm", "apply_normalization"]


def apply_normalization(x, weight, bias, eps: float, zero_centered_gamma: bool,
                        normalization: str) -> torch.Tensor:
    """The forward of either norm over x's last dimension (module doc)."""
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), gamma, eps)
    raise ValueError(f"Unsupported normalization type {normalization!r}")


class _Norm(torch.nn.Module):
    """What LayerNorm and RMSNorm share (module doc)."""

    normalization = ""
    has_bias = True

    def __init__(self, normalized_shape=None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, device=None, dtype=None, sm_margin=0):
        super().__init__()
        if (normalized_shape is None) == (hidden_size is None):  # layernorm.py:82-100
            raise RuntimeError("give exactly one of `normalized_shape` and `hidden_size`")
        shape = normalized_shape if normalized_shape is not None else hidden_size
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = params_dtype if params_dtype is not None else \
            (dtype if dtype is not None else torch.get_default_dtype())
        device = "cpu" if device is None or str(device).startswith("cuda") else device
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if self.has_bias:
            self.bias = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if str(device) != "meta":
            self.reset_parameters()

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        if defer_init:
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.has_bias:
                self.bias.zero_()
        if self.sequence_parallel is not None:  # layernorm.py:133-136
            for param in self.parameters():
                param.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return apply_normalization(inp, self.weight, self.bias if self.has_bias else None,
                                   self.eps, self.zero_centered_gamma, self.normalization)

    def get_extra_state(self) -> torch.Tensor:
        """ops/op.py:528-602: no quantization state, an empty byte tensor."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """ops/op.py:604-...: an empty state sets nothing."""
        if state is not None and state.numel() != 0:
            raise NotImplementedError("the CPU stand-in of Transformer Engine does not imitate "
                                      "quantized norm state")


class LayerNorm(_Norm):
    """module/layernorm.py:18-140."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """module/rmsnorm.py (no bias)."""

    normalization = "RMSNorm"
    has_bias = False
