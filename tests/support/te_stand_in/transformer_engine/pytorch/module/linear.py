"""Linear: TE v2.11's tensor-parallel linear layer (module/linear.py), on CPU.

parallel_mode (linear.py:1127-1135): "column" splits the output features over ``tp_group``,
"row" the input features, None none. Communication, exactly where TE does it:

    forward   column + sequence_parallel: all-gather the input along dim 0 (:145-147, :213)
              row, TP > 1: reduce-scatter the output with sequence_parallel, else all-reduce
              (:354-363); a row-parallel bias is added after that (:1300-1302, :1475-1476)
    backward  row + sequence_parallel: all-gather the output gradient (base.py:1111-1127)
              column + sequence_parallel: all-gather the saved input again for wgrad (:668)
              column, TP > 1: reduce-scatter (sequence_parallel) or all-reduce dgrad (:744-754)

delay_wgrad_compute (:1115): backward computes dgrad only and puts the weight-gradient GEMM
(with the bias gradient when the bias went through the GEMM) into the module's
WeightGradStore (:888-899); ``backward_dw`` (base.py) runs it. fuse_wgrad_accumulation: the
GEMM writes into ``weight.main_grad`` -- overwriting it for the first microbatch
(``is_first_microbatch`` True), adding otherwise (:832-838) -- and backward hands autograd a
dummy gradient with megatron's ``grad_added_to_main_grad`` set (:945-964).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _comm
from ..distributed import set_tensor_model_parallel_attributes
from ..quantization import FP8GlobalStateManager
from ..tensor.float8_tensor import prepare_for_saving, restore_from_saved
from . import _gemm
from ._common import WeightGradStore
from .base import (TransformerEngineBaseModule, cast_if_needed, divide, get_default_init_method,
                   init_method_constant, refuse)

__all__ = ["Linear"]

_PARALLEL_MODES = (None, "column", "row")
"""constants.py GemmParallelModes."""


@dataclass(frozen=True)
class _LinearArgs:
    """The non-tensor arguments of one call (linear.py:98-131's tuple, the ones imitated)."""

    module: "TransformerEngineBaseModule"
    is_first_microbatch: Optional[bool]
    wgrad_store: WeightGradStore
    fuse_wgrad_accumulation: bool
    tp_group: object
    tp_size: int
    sequence_parallel: bool
    parallel_mode: Optional[str]
    fp8: bool = False
    activation_dtype: Optional[torch.dtype] = None
    is_grad_enabled: bool = True
    input_quantizer: object = None
    weight_quantizer: object = None
    grad_output_quantizer: object = None


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """base.py:79-92 get_dummy_wgrad: a placeholder gradient of the weight's shape that
    megatron's DDP ignores (``grad_added_to_main_grad``); TE's is uninitialised memory, zeroed
    with ``zero_out_wgrad`` -- zeros here."""
    return torch.zeros(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)


def assert_dim_for_fp8_exec(*tensors) -> None:
    """utils.py:439-447: FP8 GEMMs need the leading dimensions' product divisible by 8 and the
    last dimension by 16."""
    for tensor in tensors:
        assert math.prod(tensor.shape[:-1]) % 8 == 0 and tensor.shape[-1] % 16 == 0, (
            "FP8 execution requires the product of all dimensions except the last to be "
            "divisible by 8 and the last dimension to be divisible by 16, but got tensor with "
            f"dims={list(tensor.size())}")


class _Linear(torch.autograd.Function):
    """linear.py:83-982: GEMM and tensor-parallel communication, with TE's backward split.

    Under FP8 (linear.py:176-281, 574-823): the input is cast by the input quantizer before any
    all-gather (the FP8 bytes are gathered), the weight comes from the module's workspace
    (base.py), a bias in the GEMM is rounded to bf16 when the activations are fp32 (cuBLAS
    takes no fp32 bias with FP8, :286-291); backward casts the output gradient with the grad
    output quantizer -- the bias gradient summed from the unquantized gradient first
    (base.py:1174-1195 ``bgrad_quantize``; :1129-1161 with the all-gather) -- and dgrad and the
    weight-gradient GEMM use the quantized tensors, the latter without the bias (:861), so a
    delayed GEMM (backward_dw) returns no bias gradient and B returns it instead. The first FP8
    module of an autocast region reduces and updates the backward scaling state at the end of
    its backward (:478-485, 968-972)."""

    @staticmethod
    def forward(ctx, weight, inp, bias, args: _LinearArgs):
        assert inp.shape[-1] == weight.shape[1], "GEMM not possible"  # :139-140
        module = args.module
        if args.fp8:
            assert_dim_for_fp8_exec(inp, weight)  # :176-178
        inputmat = module._quantized_input(inp, args.input_quantizer)
        gather_input = args.parallel_mode == "column" and args.sequence_parallel
        inputmat_total = _comm.gather_along_first_dim(inputmat, args.tp_group)[0] \
            if gather_input else inputmat
        weightmat = module._quantized_weight(weight, "weight", args.is_first_microbatch,
                                             args.weight_quantizer)
        gemm_bias = bias
        if args.fp8 and bias is not None and args.activation_dtype == torch.float32:
            gemm_bias = cast_if_needed(bias, torch.bfloat16)  # :286-291
        out = _gemm.fprop(inputmat_total, weightmat, gemm_bias, out_dtype=args.activation_dtype)
        if args.parallel_mode == "row" and args.tp_size > 1:
            out = (_comm.reduce_scatter_along_first_dim if args.sequence_parallel
                   else _comm.allreduce)(out, args.tp_group)[0]
        # :379-439: what backward needs (the input before any all-gather)
        tensors, ctx.tensor_objects = prepare_for_saving(
            inputmat if weight.requires_grad else None, weightmat, bias)
        ctx.save_for_backward(*tensors)
        ctx.weight = weight  # the Parameter: main_grad and megatron's flags live on it
        ctx.args = args
        ctx.backward_input_needs_gather = weight.requires_grad and gather_input  # :381-383
        ctx.use_bias = bias is not None
        ctx.inp_shape = inp.shape
        ctx.requires_dgrad = inp.requires_grad
        ctx.requires_wgrad = weight.requires_grad
        ctx.reduce_and_update_bwd_fp8_tensors = False
        if args.is_grad_enabled and args.fp8 and any(
                t is not None and t.requires_grad for t in (inp, weight, bias)):  # :478-485
            ctx.reduce_and_update_bwd_fp8_tensors = FP8GlobalStateManager.is_first_fp8_module()
        return out

    @staticmethod
    def backward(ctx, grad_output):
        inputmat, weightmat, bias = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        ctx.tensor_objects = None
        args, weight = ctx.args, ctx.weight
        grad_output, grad_bias = _grad_output_preprocess(ctx, grad_output)
        dgrad = _dgrad(grad_output, weightmat, args) if ctx.requires_dgrad else None
        wgrad = None
        if ctx.requires_wgrad:
            total = _comm.gather_along_first_dim(inputmat, args.tp_group)[0] \
                if ctx.backward_input_needs_gather else inputmat
            gemm = _wgrad_gemm(weight, bias if not args.fp8 else None, args)  # :861
            if args.wgrad_store.delay_wgrad_compute():  # :888-899
                args.wgrad_store.put([total, grad_output], gemm)
            else:  # :900-907
                wgrad, gemm_bias_grad = gemm(total, grad_output)
                if grad_bias is None:
                    grad_bias = gemm_bias_grad
            wgrad = _wgrad_for_autograd(weight, wgrad, args.fuse_wgrad_accumulation)
        if not ctx.use_bias:
            grad_bias = None
        if ctx.reduce_and_update_bwd_fp8_tensors:  # :968-972
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return (wgrad, dgrad.view(ctx.inp_shape) if dgrad is not None else None, grad_bias,
                None)


def _grad_output_preprocess(ctx, grad_output):
    """base.py:1098-1195: the output gradient as rows, all-gathered for a row-parallel linear
    with sequence parallel (:1113-1119, 1131-1161); under FP8 cast by the grad output quantizer
    (its FP8 bytes gathered), with the bias gradient summed from the unquantized gradient
    (:1129-1134, 1174-1195). ``(grad_output, grad_bias or None)``."""
    args = ctx.args
    grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
    gather = args.parallel_mode == "row" and args.sequence_parallel
    if not args.fp8:
        if gather:
            grad_output = _comm.gather_along_first_dim(grad_output, args.tp_group)[0]
        return grad_output, None
    grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
    grad_output = args.grad_output_quantizer(grad_output)
    if gather:
        grad_output = _comm.gather_along_first_dim(grad_output, args.tp_group)[0]
    return grad_output, grad_bias


def _dgrad(grad_output, weightmat, args: _LinearArgs) -> torch.Tensor:
    """linear.py:722-757: dgrad GEMM, then the column-parallel reduction."""
    dgrad = _gemm.dgrad(grad_output, weightmat, out_dtype=args.activation_dtype)
    if args.parallel_mode == "column" and args.tp_size > 1:
        dgrad = (_comm.reduce_scatter_along_first_dim if args.sequence_parallel
                 else _comm.allreduce)(dgrad, args.tp_group)[0]
    return dgrad


def _wgrad_gemm(weight, bias, args: _LinearArgs):
    """linear.py:832-885: the wgrad GEMM as a closure over its settings (TE's ``wgrad_gemm``),
    into main_grad with fuse_wgrad_accumulation, accumulating except on the first microbatch
    (or always when is_first_microbatch is None), overwriting with ``overwrite_main_grad``;
    the bias gradient with it only when ``bias`` is given (not under FP8)."""
    fuse = args.fuse_wgrad_accumulation
    if args.is_first_microbatch is not None:
        accumulate = fuse and not args.is_first_microbatch
    else:
        accumulate = fuse
    if getattr(weight, "overwrite_main_grad", False):
        accumulate = False

    def wgrad_gemm(x, dy):
        return _gemm.wgrad(x, dy, with_bias_grad=bias is not None,
                           out=weight.main_grad if fuse else None, accumulate=accumulate,
                           out_dtype=args.activation_dtype)
    return wgrad_gemm


def _wgrad_for_autograd(weight, wgrad, fuse: bool):
    """linear.py:945-966: what backward returns for the weight: a dummy with megatron's
    ``grad_added_to_main_grad`` set under fusion, None under fusion without it, else the
    gradient computed now (None when delayed)."""
    if fuse and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return _dummy_wgrad(weight)
    if fuse:
        return None
    return wgrad


class Linear(TransformerEngineBaseModule):
    """linear.py:984-1480 (parameters_split, Userbuffers, FP8 outputs and debug not
    imitated)."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker=None, rng_tracker_name: Optional[str] = None,
                 init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None,
                 parallel_mode: Optional[str] = None, parameters_split=None,
                 device="cuda", ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 save_original_input: bool = False, name: Optional[str] = None) -> None:
        super().__init__()
        if parameters_split is not None:
            refuse("Linear(parameters_split=...)")
        if any((ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad)):
            refuse("Userbuffers (tensor-parallel communication overlap, --tp-comm-overlap)")
        if symmetric_ar_type is not None:
            refuse("symmetric-memory all-reduce (symmetric_ar_type)")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias  # :1108
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.symmetric_ar_type, self.save_original_input = symmetric_ar_type, save_original_input
        self.name, self.ub_name = name, ub_name
        self.wgrad_store = WeightGradStore(delay_wgrad_compute, ub_bulk_wgrad)  # :1115
        _set_tp(self, tp_group, tp_size)
        self.parallel_mode = parallel_mode
        assert parallel_mode in _PARALLEL_MODES, f"parallel_mode {parallel_mode} not supported"
        if parallel_mode == "column":  # :1132-1135
            self.out_features = divide(self.out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel  # :1138
        self.weight_names, self.bias_names = ["weight"], ["bias"]  # :1207-1213
        _register_weight_and_bias(self, init_method, get_rng_state_tracker, params_dtype, device)
        self.reset_parameters(defer_init=device == "meta")
        # :1298-1302: a row-parallel bias is added after the reduction, not in the GEMM
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias
        if self.wgrad_store.delay_wgrad_compute():  # :1305-1309
            _skip_backward_post_hooks(self)

    def reset_parameters(self, defer_init=False):
        """linear.py:1324-1345: initialise, then megatron's tensor-parallel attributes."""
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            _set_linear_parallel_attributes(self)

    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """linear.py:1311-1323: the recipe state, then the current-scaling quantizers
        customized."""
        super().set_meta_tensor(fwd, recipe)
        customize_current_scaling_quantizers(self, fwd, recipe)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        """linear.py:1347-1480: ``out`` or ``(out, bias)`` with return_bias."""
        if fp8_output or fp8_grad:
            refuse("Linear(fp8_output / fp8_grad): FP8 outputs and input gradients")
        is_grad_enabled = torch.is_grad_enabled()  # :1375
        with self.prepare_forward(inp) as inp:
            weight, bias = self.weight, self.bias
            out = _Linear.apply(weight, inp,
                                bias if self.apply_bias and not self.gemm_bias_unfused_add
                                else None, _args(self, is_first_microbatch, is_grad_enabled))
        if self.gemm_bias_unfused_add:
            out = out + cast_if_needed(bias, self.activation_dtype)
        if self.return_bias:
            return out, cast_if_needed(bias, self.activation_dtype)
        return out


def _args(module, is_first_microbatch, is_grad_enabled: bool = True) -> _LinearArgs:
    """The call's arguments (linear.py:1433-1467), the quantizers of :func:`_quantizers`."""
    input_q, weight_q, grad_output_q = _quantizers(module, is_grad_enabled)
    return _LinearArgs(module, is_first_microbatch, module.wgrad_store,
                       module.fuse_wgrad_accumulation, module.tp_group, module.tp_size,
                       module.sequence_parallel, module.parallel_mode, module.fp8,
                       module.activation_dtype, is_grad_enabled, input_q, weight_q,
                       grad_output_q)


_INPUT, _WEIGHT, _GRAD_OUTPUT = 0, 1, 0
"""csrc/common.h:73-95: FP8FwdTensors GEMM1_INPUT, GEMM1_WEIGHT; FP8BwdTensors GRAD_OUTPUT1."""


def _quantizers(module, is_grad_enabled: bool) -> tuple:
    """linear.py:1482-1506 (layernorm_linear.py:1613-1640) ``_get_quantizers``: (input,
    weight, grad output) quantizers under FP8, the last only with grad enabled; Nones without
    FP8 (no FP8 output or grad input: fp8_output / fp8_grad are not imitated)."""
    if not module.fp8:
        return None, None, None
    forward, backward = module.quantizers["scaling_fwd"], module.quantizers["scaling_bwd"]
    return (forward[_INPUT], forward[_WEIGHT],
            backward[_GRAD_OUTPUT] if is_grad_enabled else None)


def customize_current_scaling_quantizers(module, fwd: bool, recipe) -> None:
    """linear.py:1311-1318, 1595-1640 (layernorm_linear.py:1408-1418, 1718-1763): with
    Float8CurrentScaling, the recipe's QParams on the input, weight and grad output quantizers,
    and the amax reduced over the tensor-parallel group where a gather needs one scale: the
    input of a column-parallel linear, the output gradient of a row-parallel one, with
    sequence parallel."""
    if not recipe.float8_current_scaling():
        return
    if fwd:
        quantizers = module.quantizers["scaling_fwd"]
        for index, params in ((_INPUT, recipe.fp8_quant_fwd_inp),
                              (_WEIGHT, recipe.fp8_quant_fwd_weight)):
            quantizers[index].force_pow_2_scales = params.power_2_scale
            quantizers[index].amax_epsilon = params.amax_epsilon
        reduce_over_tp = module.sequence_parallel and module.parallel_mode == "column"
        index = _INPUT
    else:
        quantizers = module.quantizers["scaling_bwd"]
        params = recipe.fp8_quant_bwd_grad
        quantizers[_GRAD_OUTPUT].force_pow_2_scales = params.power_2_scale
        quantizers[_GRAD_OUTPUT].amax_epsilon = params.amax_epsilon
        reduce_over_tp = module.sequence_parallel and module.parallel_mode == "row"
        index = _GRAD_OUTPUT
    if reduce_over_tp:
        quantizers[index].with_amax_reduction = True
        quantizers[index].amax_reduction_group = module.tp_group


def _set_tp(module, tp_group, tp_size: int) -> None:
    """linear.py:1117-1124: the group's size when given, else ``tp_size`` (then the group
    must be set later unless it is 1)."""
    if tp_group is None:
        module.tp_size = tp_size
        if tp_size == 1:
            module.set_tensor_parallel_group(tp_group)
    else:
        module.tp_size = _comm.world_size(tp_group)
        module.set_tensor_parallel_group(tp_group)


def _register_weight_and_bias(module, init_method, get_rng_state_tracker, params_dtype,
                              device) -> None:
    """linear.py:1253-1293: the weight with the init method under the RNG tracker, the bias
    zero-initialised; without a bias, an empty tensor attribute (:1290-1292)."""
    shape = (module.out_features, module.in_features)
    module.register_parameter(
        "weight", torch.nn.Parameter(torch.empty(shape, device=device, dtype=params_dtype)),
        init_fn=init_method or get_default_init_method(),
        get_rng_state_tracker=get_rng_state_tracker)
    if module.use_bias:
        module.register_parameter(
            "bias", torch.nn.Parameter(torch.empty(module.out_features, device=device,
                                                   dtype=params_dtype)),
            init_fn=init_method_constant(0.0))
    else:
        module.bias = torch.Tensor().to(dtype=params_dtype, device=device)


def _set_linear_parallel_attributes(module) -> None:
    """linear.py:1328-1345: weights are tensor-parallel along dim 1 (row) or 0 (whatever the
    mode, None included); a row-parallel bias is marked sequence_parallel, a column-parallel
    one tensor-parallel along dim 0."""
    for name in module.weight_names:
        set_tensor_model_parallel_attributes(getattr(module, name), True,
                                             1 if module.parallel_mode == "row" else 0, 1)
    if module.use_bias:
        for name in module.bias_names:
            bias = getattr(module, name)
            if module.parallel_mode == "row":
                bias.sequence_parallel = module.sequence_parallel
            elif module.parallel_mode == "column":
                set_tensor_model_parallel_attributes(bias, True, 0, 1)


def _skip_backward_post_hooks(module) -> None:
    """linear.py:1305-1309 (layernorm_linear.py:1403-1406): with delay_wgrad_compute the
    weights and biases are marked ``skip_backward_post_hook``, so megatron's DDP registers its
    gradient hook through register_wgrad_accumulation_and_reduce_hooks (backward_dw calls it)
    instead of on autograd's accumulator."""
    for name, param in module.named_parameters():
        if name in module.weight_names or name in module.bias_names:
            param.skip_backward_post_hook = True
