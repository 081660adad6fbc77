"""TransformerEngineBaseModule: what TE v2.11's linears share (module/base.py:601-1613).

Parameters registered with their init function and RNG tracker and initialised under it
(register_parameter :1197-1208, reset_parameters :1210-1318); the tensor-parallel group
(:946-958); the activation dtype (:925-944); FP8 metadata from the global state (:971-1026);
the forward preparation (:1028-1079); the checkpoint's extra state (:806-923); and the delayed
weight gradients: ``register_wgrad_accumulation_and_reduce_hooks`` (:1463-1471) and
``backward_dw`` (:1482-1501).

Where TE v2.11 would quantize (FP8) the stand-in has two hooks that return their tensor
unchanged, so that FP8 can be added in one place: :meth:`_quantized_input` and
:meth:`_quantized_weight`, the latter keyed as TE's weight-cast cache is (linear.py:267-277:
``cache_name`` "weight" unless ``is_first_microbatch`` is None, refreshed when
``is_first_microbatch`` is None or True).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..quantization import FP8GlobalStateManager

__all__ = ["TransformerEngineBaseModule", "get_default_init_method", "init_method_constant",
           "cast_if_needed", "divide"]


def get_default_init_method() -> Callable:
    """utils.py:80-82: normal(0, 0.023)."""
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=0.023)


def init_method_constant(value: float) -> Callable:
    """utils.py:85-101."""
    return lambda tensor: torch.nn.init.constant_(tensor, value)


def cast_if_needed(tensor: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """utils.py:424-431: the tensor itself when it has the dtype already."""
    if tensor is None or dtype is None or tensor.dtype == dtype:
        return tensor
    with torch.enable_grad():
        return tensor.to(dtype=dtype)


def divide(numerator: int, denominator: int) -> int:
    """utils.py:153-157."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


@dataclass
class _ParameterInitMeta:
    """_common.py:173-186: how to (re)initialise one parameter."""

    init_fn: Optional[Callable] = None
    get_rng_state_tracker: Optional[Callable] = None
    fp8_meta_index: Optional[int] = None

    def __post_init__(self):
        if self.init_fn is None:
            self.init_fn = get_default_init_method()


_NOT_IMITATED = "the CPU stand-in of Transformer Engine does not imitate {}"


def refuse(what: str) -> None:
    """Stop where TE would do something the stand-in does not imitate."""
    raise NotImplementedError(_NOT_IMITATED.format(what))


class TransformerEngineBaseModule(torch.nn.Module):
    """base.py:601-1613 (the parts module doc lists)."""

    def __init__(self) -> None:
        super().__init__()
        # base.py:603-628 (no CUDA assertion: :605 asserts torch.cuda.is_available())
        self.name = None
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        self.param_init_meta = {}
        self.primary_weights_in_fp8 = FP8GlobalStateManager.with_fp8_parameters()
        if self.primary_weights_in_fp8:
            refuse("FP8 parameters (quantized_model_init / fp8_model_init)")
        self.activation_dtype = None
        self.wgrad_accumulation_and_reduce_hooks = []
        self.wgrad_store = None

    # -- parameters -------------------------------------------------------------------------
    def register_parameter(self, name, param, **kwargs):
        """base.py:1197-1208: register, and remember how to initialise it."""
        super().register_parameter(name, param)
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """base.py:1210-1239: each parameter's init function, under its RNG tracker's fork
        (the module's ``rng_tracker_name`` if it has one, else the tracker's default)."""
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            meta = self.param_init_meta[name]
            with torch.no_grad():
                if meta.get_rng_state_tracker is None:
                    meta.init_fn(param)
                else:
                    tracker = meta.get_rng_state_tracker()
                    fork = tracker.fork(self.rng_tracker_name) \
                        if getattr(self, "rng_tracker_name", None) else tracker.fork()
                    with fork:
                        meta.init_fn(param)

    def _get_weight_tensors(self) -> list:
        """linear.py / layernorm_linear.py ``_get_weight_tensors``: the weights by name."""
        return [getattr(self, name) for name in self.weight_names]

    # -- forward preparation ----------------------------------------------------------------
    def set_tensor_parallel_group(self, tp_group) -> None:
        """base.py:946-958."""
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        """base.py:925-944: the input's dtype, which every parameter must share outside
        autocast (torch autocast is not imitated)."""
        if self.activation_dtype == inp.dtype:
            return
        for name, param in self.named_parameters():
            assert inp.dtype == param.dtype, (
                "Data types for parameters must match when outside of autocasted region. "
                f" Found input dtype: {inp.dtype} and {name!r} dtype: {param.dtype}")
        self.activation_dtype = inp.dtype

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """base.py:971-1026: FP8 on or off from the global state, recorded for checkpoints."""
        self.fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        self.fp8_meta["fp8_checkpoint"] = self.fp8 or self.fp8_calibration
        if self.fp8_parameters or self.fp8 or self.fp8_calibration:
            refuse("FP8 execution or calibration")
        self.fp8_initialized = False

    @contextlib.contextmanager
    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1,
                        allow_non_contiguous: bool = False):
        """base.py:1028-1079: checks, dtype, FP8 metadata; a contiguous input (:1074-1075)."""
        if self.tp_size > 1:
            assert getattr(self, "tp_group_initialized", False), "TP group not initialized."
        self.set_activation_dtype(inp)
        self.init_fp8_metadata(num_gemms=num_gemms)
        if not allow_non_contiguous and not inp.is_contiguous():
            inp = inp.contiguous()
        yield inp

    def _quantized_input(self, inp: torch.Tensor) -> torch.Tensor:
        """Where TE quantizes the GEMM input (linear.py:173-241); FP8 off: the input cast to the
        activation dtype (linear.py:205, 239)."""
        return cast_if_needed(inp, self.activation_dtype)

    def _quantized_weight(self, weight: torch.Tensor, cache_name: str,
                          is_first_microbatch: Optional[bool]) -> torch.Tensor:
        """Where TE casts the weight for the GEMM (linear.py:250-281), with FP8 into a workspace
        cached under ``cache_name`` (None when ``is_first_microbatch`` is None) and refreshed
        when ``is_first_microbatch`` is None or True; FP8 off: the weight cast to the
        activation dtype (linear.py:280-281)."""
        return cast_if_needed(weight, self.activation_dtype)

    # -- checkpoints ------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """base.py:806-865: without FP8 state, an empty byte tensor (:839-841)."""
        if self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration:
            refuse("FP8 checkpoint state")
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """base.py:867-923: None or an empty tensor means no FP8 state (:871-878)."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        refuse("loading FP8 checkpoint state")

    # -- delayed weight gradients -----------------------------------------------------------
    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """base.py:1463-1471: called, in order, at the end of every backward_dw."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        """base.py:1473-1480."""
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        """base.py:1482-1501: run the oldest queued weight-gradient GEMM; without
        fuse_wgrad_accumulation its result *replaces* ``weight.grad`` (:1491-1493); the bias
        gradient goes to ``bias.grad`` only if that is None (:1494-1497); then the hooks.

        As in TE, a bias added outside the GEMM (row-parallel, or ``return_bias``) gets no
        gradient from the GEMM (None): if its ``.grad`` is None here, ``bgrad.to`` fails as
        TE's does."""
        if not self.need_backward_dw():
            return
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            weights = self._get_weight_tensors()
            assert len(weights) == 1, "parameters_split is not imitated"
            weights[0].grad = wgrad.to(weights[0].dtype)
        if self.use_bias:
            bias = getattr(self, self.bias_names[0])
            if bias.grad is None:
                bias.grad = bgrad.to(bias.dtype)
        del wgrad, bgrad
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()
