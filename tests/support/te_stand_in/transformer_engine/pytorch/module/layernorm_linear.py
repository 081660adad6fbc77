"""LayerNormLinear: a norm, then a column- (or row-) parallel linear, as TE v2.11's
module/layernorm_linear.py computes it.

TE fuses them in one autograd Function (layernorm_linear.py:86-1000); the stand-in composes the
norm (layernorm.py, autograd) with :class:`.linear._Linear`, which gives the same
communication and the same backward split:

    forward   the norm on the local (sequence-parallel) input (:222); column +
              sequence_parallel: the norm's output is all-gathered for the GEMM (:151, :275)
    backward  dgrad GEMM and its column-parallel reduction (:760-770), then the norm's
              backward with its weight gradients, in B (:968-992); the linear's wgrad is put
              into the WeightGradStore with delay_wgrad_compute (:914)
    FP8       the norm's output is the GEMM input, cast by the input quantizer; TE casts it in
              the norm kernel (:209-234 ``with_quantized_norm``) from the norm's fp32 result,
              the same values with fp32 activations (with bf16 ones the stand-in casts the
              bf16-rounded output)

Parameters: ``layer_norm_weight`` (and ``layer_norm_bias`` unless RMSNorm), marked
``sequence_parallel`` (:1440-1444); ``weight``, ``bias`` as Linear's (:1445-1460).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._common import WeightGradStore
from .base import (TransformerEngineBaseModule, cast_if_needed, divide, init_method_constant,
                   refuse)
from .layernorm import apply_normalization
from .linear import (_Linear, _args, _register_weight_and_bias, _set_linear_parallel_attributes,
                     _set_tp, _skip_backward_post_hooks, customize_current_scaling_quantizers)

__all__ = ["LayerNormLinear"]


class LayerNormLinear(TransformerEngineBaseModule):
    """layernorm_linear.py:1060-1620 (parameters_split, returning the norm's output,
    Userbuffers and FP8 outputs not imitated). Not a Linear (as in TE: megatron tells them
    apart with isinstance)."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm",
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device="cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 name: Optional[str] = None) -> None:
        super().__init__()
        if parameters_split is not None or return_layernorm_output:
            refuse("LayerNormLinear(parameters_split=... / return_layernorm_output=True)")
        if any((ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_wgrad, ub_bulk_dgrad)):
            refuse("Userbuffers (tensor-parallel communication overlap, --tp-comm-overlap)")
        if symmetric_ar_type is not None:
            refuse("symmetric-memory all-reduce (symmetric_ar_type)")
        assert normalization in ("LayerNorm", "RMSNorm"), "Unsupported normalization type!"
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation, self.normalization = fuse_wgrad_accumulation, normalization
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias  # :1176
        self.return_layernorm_output = False
        self.zero_centered_gamma, self.eps = zero_centered_gamma, eps
        self.symmetric_ar_type, self.name, self.ub_name = symmetric_ar_type, name, ub_name
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, None
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, ub_bulk_wgrad)  # :1184
        _set_tp(self, tp_group, tp_size)
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":  # :1201-1204
            self.out_features = divide(self.out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel  # :1209
        self._register_norm(params_dtype, device)
        self.weight_names, self.bias_names = ["weight"], ["bias"]
        _register_weight_and_bias(self, init_method, get_rng_state_tracker, params_dtype, device)
        self.reset_parameters(defer_init=device == "meta")
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias  # :1390-1393
        if self.wgrad_store.delay_wgrad_compute():  # :1403-1406
            _skip_backward_post_hooks(self)

    def _register_norm(self, params_dtype, device) -> None:
        """layernorm_linear.py:1256-1274: gamma initialised to 1 (0 zero-centred), beta to 0."""
        shape = (self.in_features,)
        self.register_parameter(
            "layer_norm_weight",
            torch.nn.Parameter(torch.empty(shape, device=device, dtype=params_dtype)),
            init_fn=init_method_constant(float(not self.zero_centered_gamma)))
        if self.normalization != "RMSNorm":
            self.register_parameter(
                "layer_norm_bias",
                torch.nn.Parameter(torch.empty(shape, device=device, dtype=params_dtype)),
                init_fn=init_method_constant(0.0))
        else:
            self.layer_norm_bias = None

    def reset_parameters(self, defer_init=False):
        """layernorm_linear.py:1436-1460: the norm's parameters are marked sequence_parallel,
        the linear's as Linear's."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.normalization != "RMSNorm":
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        _set_linear_parallel_attributes(self)

    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """layernorm_linear.py:1408-1418: the recipe state, then the current-scaling
        quantizers customized."""
        super().set_meta_tensor(fwd, recipe)
        customize_current_scaling_quantizers(self, fwd, recipe)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        """layernorm_linear.py:1500-1610."""
        if fp8_output or fp8_grad:
            refuse("LayerNormLinear(fp8_output / fp8_grad): FP8 outputs and input gradients")
        is_grad_enabled = torch.is_grad_enabled()
        with self.prepare_forward(inp) as inp:
            ln_out = apply_normalization(inp, self.layer_norm_weight, self.layer_norm_bias,
                                         self.eps, self.zero_centered_gamma, self.normalization)
            bias = self.bias
            out = _Linear.apply(self.weight, ln_out,
                                bias if self.apply_bias and not self.gemm_bias_unfused_add
                                else None, _args(self, is_first_microbatch, is_grad_enabled))
        if self.gemm_bias_unfused_add:
            out = out + cast_if_needed(bias, self.activation_dtype)
        if self.return_bias:
            return out, cast_if_needed(bias, self.activation_dtype)
        return out
