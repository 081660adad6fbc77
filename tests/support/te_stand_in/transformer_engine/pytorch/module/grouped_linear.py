"""GroupedLinear: one GEMM per group of rows (MoE experts), TE v2.11 module/grouped_linear.py.

The input's rows are split by ``m_splits`` (expert i gets the next ``m_splits[i]`` rows,
grouped_linear.py:146-152) and each split meets its own ``weight{i}`` / ``bias{i}``
(:667-698); the outputs are concatenated in the same order (:191-208, :303). No tensor-parallel
communication happens inside: ``tp_size`` and ``parallel_mode`` only shape the weights, the MoE
dispatcher communicates (the class doc, :583-586), and a bias with TP > 1 is refused (:650-654).

Backward (:305-525): dgrad through every expert's weight; the weight gradients (and the bias
gradients, which the GEMM computes when the bias went through it) are written into
preallocated outputs -- ``main_grad`` with fuse_wgrad_accumulation, else fresh buffers
(:419-425) -- now, or with delay_wgrad_compute later: the GEMM, its inputs and those outputs are
put into the WeightGradStore (:466-468). Without fusion the buffers themselves are what
backward returns to autograd (:480-507), uninitialised when the GEMM was delayed; backward_dw
then *replaces* each ``weight{i}.grad`` with its buffer (:861-863). The bias gradients:
returned by backward when computed now, left to backward_dw when delayed (:514-516), which sets
a ``bias{i}.grad`` only where it is None (:864-867) -- from the GEMM's bias gradients, empty
tensors when the bias did not go through the GEMM (return_bias; cpp_extensions/gemm.py:247-250).
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch

from ..distributed import set_tensor_model_parallel_attributes
from . import _gemm
from ._common import WeightGradStore
from .base import (TransformerEngineBaseModule, cast_if_needed, divide, get_default_init_method,
                   init_method_constant, refuse)
from .linear import _set_tp

__all__ = ["GroupedLinear"]


def _grouped_wgrad(inputmats, grad_outputs, outs, *, use_bias: bool, fuse: bool,
                   accumulate: bool):
    """cpp_extensions/gemm.py:214-330 general_grouped_gemm with grad=True, layout "NT": each
    expert's ``dy^T x`` into ``outs[i]`` (added when ``accumulate``); ``(outs, bias grads,
    None)``, the bias grads empty tensors unless ``use_bias`` (gemm.py:246-250)."""
    biases = []
    for x, dy, out in zip(inputmats, grad_outputs, outs):
        _, db = _gemm.wgrad(x, dy, with_bias_grad=use_bias, out=out,
                            accumulate=accumulate and fuse)
        biases.append(db if use_bias else torch.empty(0, dtype=dy.dtype, device=dy.device))
    return outs, biases, None


class _GroupedLinear(torch.autograd.Function):
    """grouped_linear.py:59-525."""

    @staticmethod
    def forward(ctx, inp, args: dict, *weights_and_biases):
        n = len(args["m_splits"])
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        if inp.size(-1) != weights[0].size(-1):  # :145-150
            raise ValueError(f"Input tensor (shape={tuple(inp.size())}) is not compatible with "
                             f"weight tensor (shape={tuple(weights[0].size())})")
        module = args["module"]
        inp_view = inp.reshape(-1, weights[0].size(-1))
        inputmats = torch.split(module._quantized_input(inp_view), args["m_splits"])  # :152
        weights_fp8 = [module._quantized_weight(w, f"weight{i}", args["is_first_microbatch"])
                       for i, w in enumerate(weights)]
        outs = [_gemm.fprop(x, w, b if args["use_bias"] else None)
                for x, w, b in zip(inputmats, weights_fp8, biases)]
        out = torch.cat(outs) if outs else inp_view.new_empty((0, weights[0].size(0)))
        ctx.save_for_backward(*(inputmats if weights[0].requires_grad else [None] * n),
                              *weights_fp8)
        ctx.weights = weights  # the Parameters: main_grad and megatron's flags live on them
        ctx.args, ctx.num_gemms, ctx.inp_shape = args, n, inp.shape
        ctx.requires_dgrad = inp.requires_grad
        ctx.weights_requires_grad = weights[0].requires_grad
        return out.view(-1, *inp.shape[1:-1], out.shape[-1])  # :303

    @staticmethod
    def backward(ctx, grad_output):
        n, args = ctx.num_gemms, ctx.args
        saved = ctx.saved_tensors
        inputmats, weights_fp8 = saved[:n], saved[n:]
        grad_outputs = torch.split(grad_output.contiguous().view(-1, grad_output.shape[-1]),
                                   args["m_splits"])  # :365-371
        dgrad = None
        if ctx.requires_dgrad:  # :379-409
            dgrad = torch.cat([_gemm.dgrad(dy, w) for dy, w in zip(grad_outputs, weights_fp8)])
        wgrads, grad_biases = [None] * n, [None] * n
        if ctx.weights_requires_grad:
            wgrads, grad_biases = _weight_grads(ctx, inputmats, grad_outputs)
        if not args["use_bias"] or args["wgrad_store"].delay_wgrad_compute():  # :511-516
            grad_biases = [None] * n
        return (dgrad.view(ctx.inp_shape) if dgrad is not None else None, None,
                *wgrads, *grad_biases)


def _weight_grads(ctx, inputmats, grad_outputs):
    """grouped_linear.py:410-507: the GEMM now or put into the store; what autograd gets."""
    args, weights = ctx.args, ctx.weights
    fuse = args["fuse_wgrad_accumulation"]
    first = args["is_first_microbatch"]
    accumulate = fuse and not first if first is not None else fuse  # :372-377
    if getattr(weights[0], "overwrite_main_grad", False):
        accumulate = False
    outs = [w.main_grad for w in weights] if fuse else \
        [torch.empty(w.size(), dtype=w.dtype, device=w.device) for w in weights]  # :419-425
    gemm = functools.partial(_grouped_wgrad, use_bias=args["use_bias"], fuse=fuse,
                             accumulate=accumulate)
    grad_biases = [None] * len(weights)
    if args["wgrad_store"].delay_wgrad_compute():
        args["wgrad_store"].put([list(inputmats), list(grad_outputs), outs], gemm)  # :466-468
    else:
        _, grad_biases, _ = gemm(inputmats, grad_outputs, outs)
    return [_for_autograd(w, g, fuse) for w, g in zip(weights, outs)], grad_biases


def _for_autograd(weight, wgrad, fuse: bool):
    """grouped_linear.py:480-502 handle_custom_ddp_from_mcore."""
    if fuse and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    if fuse:
        return None
    return wgrad


class GroupedLinear(TransformerEngineBaseModule):
    """grouped_linear.py:528-873 (Userbuffers, FP8 and debug not imitated)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name: Optional[str] = None, init_method=None, bias: bool = True,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, device="cuda",
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__()
        assert not ub_overlap_rs and not ub_overlap_ag, \
            "GroupedLinear doesn't support Userbuffer overlap."  # :626-628
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias  # :621
        self.ub_overlap_rs, self.ub_overlap_ag, self.ub_name = ub_overlap_rs, ub_overlap_ag, ub_name
        self.save_original_input, self.name = save_original_input, name
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)  # :633
        _set_tp(self, tp_group, tp_size)
        if self.tp_size > 1 and bias:  # :650-654
            raise ValueError("GroupedLinear doesn't support bias when TP > 1. "
                             "Because the TP communication is handled outside of this module.")
        assert parallel_mode in (None, "column", "row"), \
            f"parallel_mode {parallel_mode} not supported"
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":  # :661-664
            self.out_features = divide(self.out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self._register(init_method, get_rng_state_tracker, params_dtype, device)
        self.reset_parameters(defer_init=device == "meta")
        if self.wgrad_store.delay_wgrad_compute():  # :707-711
            for name_, param in self.named_parameters():
                if any(name_ in (f"weight{i}", f"bias{i}") for i in range(num_gemms)):
                    param.skip_backward_post_hook = True

    @property
    def weight_names(self) -> List[str]:
        return [f"weight{i}" for i in range(self.num_gemms)]

    def _register(self, init_method, get_rng_state_tracker, params_dtype, device) -> None:
        """grouped_linear.py:667-698: weight{i} with the init method under the RNG tracker,
        bias{i} zeros; without biases, empty tensor attributes."""
        for i in range(self.num_gemms):
            self.register_parameter(
                f"weight{i}",
                torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               device=device, dtype=params_dtype)),
                init_fn=init_method or get_default_init_method(),
                get_rng_state_tracker=get_rng_state_tracker)
            if self.use_bias:
                self.register_parameter(
                    f"bias{i}",
                    torch.nn.Parameter(torch.empty(self.out_features, device=device,
                                                   dtype=params_dtype)),
                    init_fn=init_method_constant(0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=params_dtype, device=device))

    def reset_parameters(self, defer_init=False):
        """grouped_linear.py:726-750: as Linear's attributes, per expert."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        for i in range(self.num_gemms):
            set_tensor_model_parallel_attributes(getattr(self, f"weight{i}"), True,
                                                 1 if self.parallel_mode == "row" else 0, 1)
            if self.use_bias:
                bias = getattr(self, f"bias{i}")
                if self.parallel_mode == "row":
                    bias.sequence_parallel = self.sequence_parallel
                elif self.parallel_mode == "column":
                    set_tensor_model_parallel_attributes(bias, True, 0, 1)

    def forward(self, inp: torch.Tensor, m_splits: List[int],
                is_first_microbatch: Optional[bool] = None):
        """grouped_linear.py:752-847: ``out`` or ``(out, [bias{i}])`` with return_bias."""
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        with self.prepare_forward(inp, num_gemms=self.num_gemms) as inp:
            if self.fp8:
                refuse("FP8 in GroupedLinear (per-expert quantizers, grouped_linear.py:96-190)")
            weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
            args = {"module": self, "m_splits": list(m_splits), "use_bias": self.apply_bias,
                    "is_first_microbatch": is_first_microbatch, "wgrad_store": self.wgrad_store,
                    "fuse_wgrad_accumulation": self.fuse_wgrad_accumulation}
            out = _GroupedLinear.apply(inp, args, *weights, *biases)
        if self.return_bias:
            return out, [cast_if_needed(b, self.activation_dtype) for b in biases]
        return out

    def backward_dw(self) -> None:
        """grouped_linear.py:849-872: run the oldest queued grouped GEMM; each weight{i}.grad
        replaced by its buffer (without fusion), each bias{i}.grad set where None, then the
        hooks."""
        if not self.need_backward_dw():
            return
        (_, grad_biases, _), tensor_list = self.wgrad_store.pop()
        wgrads = tensor_list[2]
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        if not self.fuse_wgrad_accumulation:
            for weight, wgrad in zip(weights, wgrads):
                weight.grad = wgrad.to(weight.dtype)
        if self.use_bias:
            for bias, grad in zip(biases, grad_biases):
                if bias.grad is None:
                    bias.grad = grad.to(bias.dtype)
        del grad_biases, wgrads, tensor_list
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()
