"""TransformerEngineBaseModule: what TE v2.11's linears share (module/base.py:601-1613).

Parameters registered with their init function and RNG tracker and initialised under it
(register_parameter :1197-1208, reset_parameters :1210-1318); the tensor-parallel group
(:946-958); the activation dtype (:925-944); FP8 metadata from the global state (:971-1026,
set_meta_tensor :706-741); the forward preparation (:1028-1079); the checkpoint's extra state
with the delayed-scaling state (:806-923); and the delayed weight gradients:
``register_wgrad_accumulation_and_reduce_hooks`` (:1463-1471) and ``backward_dw``
(:1482-1501).

Where TE v2.11 quantizes, the linears call two hooks: :meth:`_quantized_input` (the GEMM
input: cast with the input quantizer under FP8, linear.py:226-240) and
:meth:`_quantized_weight` (the weight workspace, :meth:`get_weight_workspace`,
base.py:1322-1440, called at linear.py:267-277): with ``is_first_microbatch`` None the weight is
cast every time and not cached; True casts it again into the cached workspace; False reuses the
workspace as it is -- cast at the last True (or at the first forward if there was none), so a
weight the optimizer changed since is used stale. FP8 off, both return their tensor cast to the
activation dtype (linear.py:239, 280-281).
"""
from __future__ import annotations

import contextlib
import pickle
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..distributed import is_fp8_activation_recompute_enabled
from ..quantization import FP8GlobalStateManager, RecipeState

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
        self.quantizers = {"scaling_fwd": [], "scaling_bwd": []}
        self._fp8_workspaces = {}
        self.tp_group = None
        self.tp_size = 1
        self.sequence_parallel = False
        self.param_init_meta = {}
        self.primary_weights_in_fp8 = FP8GlobalStateManager.with_fp8_parameters()
        if self.primary_weights_in_fp8:
            refuse("FP8 parameters (quantized_model_init / fp8_model_init: TE's Float8Tensor "
                   "weights)")
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
        """base.py:971-1026: FP8 on or off from the global state, recorded for checkpoints; on
        first use (or a changed recipe) the recipe states and quantizers are made."""
        original = self.fp8_meta.get("recipe")
        self.fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        self.fp8_meta["fp8_checkpoint"] = self.fp8 or self.fp8_calibration
        if self.fp8_calibration:
            refuse("FP8 calibration (autocast(calibrating=True))")
        if not self.fp8:
            self.fp8_initialized = False
            return
        if self.fp8_initialized and FP8GlobalStateManager.get_fp8_recipe() == \
                self.fp8_meta["recipe"]:
            return
        self.fp8_meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
        self.fp8_meta["num_gemms"] = num_gemms
        self.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
        self.fp8_meta["fp8_max_fwd"] = self.fp8_meta["recipe"].fp8_format.value.max_fwd
        self.fp8_meta["fp8_max_bwd"] = self.fp8_meta["recipe"].fp8_format.value.max_bwd
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        self.fp8_initialized = True
        if original is not None and not (isinstance(self.fp8_meta["recipe"], type(original))
                                         or isinstance(original, type(self.fp8_meta["recipe"]))):
            warnings.warn(f"Recipe type changed from {type(original).__name__} to "
                          f"{type(self.fp8_meta['recipe']).__name__}. This may affect model "
                          "behavior.")  # :1014-1025
            self._fp8_workspaces.clear()

    def init_fp8_meta_tensors(self, recipe) -> None:
        """base.py:767-772."""
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fp8_meta_tensors_initialized = True

    def set_meta_tensor(self, fwd: bool, recipe) -> None:
        """base.py:706-741: a recipe state of 3 quantizers per GEMM forward (input, weight,
        output), 2 backward (grad output, grad input), kept when one of the recipe's kind is
        there already (delayed scaling: its history resized to the recipe's length,
        :653-704)."""
        key = "scaling_fwd" if fwd else "scaling_bwd"
        state = self.fp8_meta.get(key)
        if self.fp8_meta_tensors_initialized and state is not None and \
                state.recipe.delayed() == recipe.delayed() and \
                state.recipe.float8_current_scaling() == recipe.float8_current_scaling():
            if recipe.delayed() and state.amax_history.shape[0] != recipe.amax_history_len:
                refuse("changing the amax history length of a module (adjust_amax_history_length)")
            return
        per_gemm = 3 if fwd else 2
        state = RecipeState.create(recipe, mode="forward" if fwd else "backward",
                                   num_quantizers=self.fp8_meta["num_gemms"] * per_gemm)
        self.fp8_meta[key] = state
        self.quantizers[key] = state.make_quantizers()

    @contextlib.contextmanager
    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1,
                        allow_non_contiguous: bool = False):
        """base.py:1028-1079: checks, dtype, FP8 metadata; a contiguous input (:1074-1075)."""
        if self.tp_size > 1:
            assert getattr(self, "tp_group_initialized", False), "TP group not initialized."
        self.set_activation_dtype(inp)
        self.init_fp8_metadata(num_gemms=num_gemms)
        if self.fp8 and is_fp8_activation_recompute_enabled():
            refuse("FP8 modules under activation recomputation (TE's checkpoint in FP8: the "
                   "scaling state stashed for the recomputation, base.py:1044-1079)")
        if self.fp8 and self.fp8_meta["recipe"].delayed():  # :1058-1067
            if self.sequence_parallel:
                assert self.fp8_meta["recipe"].reduce_amax, (
                    "Amax reduction across tensor parallel group is "
                    "necessary when using sequence parallelism with FP8.")
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
        if not allow_non_contiguous and not inp.is_contiguous():
            inp = inp.contiguous()
        yield inp

    def _quantized_input(self, inp: torch.Tensor, quantizer=None):
        """The GEMM input (linear.py:226-240): cast by ``quantizer`` under FP8, else to the
        activation dtype."""
        if not self.fp8:
            return cast_if_needed(inp, self.activation_dtype)
        if quantizer is None:
            raise ValueError("Missing quantizer for input tensor")  # linear.py:231-232
        return quantizer(inp)

    def _quantized_weight(self, weight: torch.Tensor, cache_name: str,
                          is_first_microbatch: Optional[bool], quantizer=None):
        """The weight for the GEMM (linear.py:252-281): under FP8 the workspace of
        :meth:`get_weight_workspace`, cached under ``cache_name`` unless ``is_first_microbatch``
        is None, cast again when it is None or True; else the weight in the activation dtype."""
        if not self.fp8:
            return cast_if_needed(weight, self.activation_dtype)
        return self.get_weight_workspace(
            tensor=weight, quantizer=quantizer,
            cache_name=None if is_first_microbatch is None else cache_name,
            update_workspace=is_first_microbatch is None or is_first_microbatch,
            workspace_dtype=self.activation_dtype)

    def get_weight_workspace(self, *, tensor=None, quantizer=None, cache_name=None,
                             update_workspace: bool = True, workspace_dtype=None):
        """base.py:1322-1440: the cached workspace when there is one (else cast and, with a
        ``cache_name``, cache it, :1408-1428), cast again into it when ``update_workspace``
        (:1430-1440)."""
        out = self._fp8_workspaces.get(cache_name) if cache_name is not None else None
        if out is None:
            if tensor is None or quantizer is None:
                raise ValueError("tensor and quantizer kwargs must be provided to construct FP8 "
                                 "workspace")
            out = quantizer.quantize(tensor, dtype=workspace_dtype)
            if cache_name is not None:
                self._fp8_workspaces[cache_name] = out
            return out
        if update_workspace:
            if tensor is None:
                raise ValueError("tensor kwarg must be provided to update FP8 workspace")
            quantizer.update_quantized(tensor, out)
        return out

    # -- checkpoints ------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """base.py:806-865: an empty byte tensor without FP8 (:839-841); with it the pickled
        recipe, the delayed-scaling scales and amax histories and the plain ``fp8_meta``
        values (:843-864)."""
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        state = {"recipe": self.fp8_meta["recipe"]}
        if state["recipe"].delayed():
            for suffix, key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
                state[f"scale_{suffix}"] = self.fp8_meta[key].scale.clone()
                state[f"amax_history_{suffix}"] = self.fp8_meta[key].amax_history.clone()
        state["extra_fp8_variables"] = {
            k: v for k, v in self.fp8_meta.items()
            if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str,
                                                                      tuple, list))}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """base.py:867-923: None or an empty tensor means no FP8 state (:871-878); else the
        recipe states are made (:905-906) and the delayed-scaling tensors copied in."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        if not isinstance(state, torch.Tensor):
            raise RuntimeError("Unsupported checkpoint format.")
        state = pickle.loads(state.detach().cpu().numpy().tobytes())
        if state is None:
            return
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        if self.fp8_meta["recipe"].delayed():
            with torch.no_grad():
                for suffix, key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
                    self.fp8_meta[key].scale.copy_(state[f"scale_{suffix}"])
                    self.fp8_meta[key].amax_history.copy_(state[f"amax_history_{suffix}"])

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
