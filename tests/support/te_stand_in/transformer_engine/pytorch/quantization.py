"""FP8 state and scaling: FP8GlobalStateManager, the recipe states, the autocast / model-init
contexts (TE v2.11 pytorch/quantization.py).

What runs: per-tensor FP8 with the DelayedScaling and Float8CurrentScaling recipes (megatron's
``--fp8-recipe delayed`` and ``tensorwise``), quantized on the CPU with torch's float8 dtypes
(tensor/float8_tensor.py). The stand-in answers as a Hopper GPU for those two
(``check_fp8_support``, quantization.py:48-58) and refuses the block-scaled recipes (MXFP8,
Float8BlockScaling, NVFP4) and custom recipes with the reason that it does not imitate them,
where TE asserts the device's support (:90-100, called at :845-846, and :587-598).

Delayed scaling, as TE v2.11 does it:

    state      per module and direction, ``scale`` (ones) and ``amax_history``
               (``amax_history_len`` x quantizers, zeros) (:1049-1096); the forward holds 3
               quantizers per GEMM (input, weight, output), the backward 2 (grad output, grad
               input) (module/base.py:729-741)
    buffers    each module registers its amax history's first row, history and scale once,
               under a key of direction, recipe and group (:359-411, from
               module/base.py:1066-1067 prepare_forward)
    reduction  at the exit of the outermost autocast with grad enabled, the forward keys
               (:600-610); in the backward of the first FP8 module of an autocast region, the
               backward keys (module/linear.py:478-485, 968-972): each key's amaxes are
               concatenated and all-reduced with MAX over the autocast's group when the recipe
               reduces and the group has more than one rank (:496-521)
    update     TE's fused kernel (:530-538; common/recipe/delayed_scaling.cu:162-253), per
               quantizer: the amax is the reduced one when not zero, else the quantizer's own;
               a zero amax leaves the history as it is, otherwise the history rolls (the new
               amax last, the first row zeroed); the amax for the scale is that amax
               ("most_recent") or the largest in the rolled history ("max"); the scale is
               ``fp8_max x 2^-margin / amax`` for a finite positive amax, else unchanged, the
               largest fp32 where it overflows (:296-309 ``scaled_max``). The unfused Python
               update (``NVTE_UNFUSED_FP8_UPDATE``, callable algorithms, :524-548) rolls a zero
               amax too; callable algorithms are refused.

Format (:127-158): E4M3 everywhere, or HYBRID: E4M3 forward, E5M2 backward (grad output).
Not imitated (refused where used): FP8 calibration, FP8 parameters (``quantized_model_init``),
activation recomputation in FP8 (:612-668), CUDA graphs, FP8 attention (``fp8_dpa``/``fp8_mha``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..common.recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling,
                             Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
                             Recipe)
from .tensor.float8_tensor import FP8_MAX, Float8CurrentScalingQuantizer, Float8Quantizer

__all__ = ["FP8GlobalStateManager", "autocast", "fp8_autocast", "quantized_model_init",
           "fp8_model_init", "check_recipe_support", "get_default_fp8_recipe",
           "get_default_recipe", "is_fp8_available", "is_mxfp8_available",
           "is_fp8_block_scaling_available", "is_nvfp4_available", "get_fp8_torch_dtype",
           "get_fp8_max", "RecipeState", "DelayedScalingRecipeState",
           "Float8CurrentScalingRecipeState"]

_NOT_IMITATED = ("the CPU stand-in of Transformer Engine imitates per-tensor FP8 scaling only "
                 "(DelayedScaling, Float8CurrentScaling); it runs no {} GEMMs")


def check_fp8_support():
    """quantization.py:48-58: (supported, reason); the stand-in quantizes per-tensor FP8 on
    the CPU, as a compute capability 9.0 device would."""
    return True, ""


def check_mxfp8_support():
    """:61-68."""
    return False, _NOT_IMITATED.format("MXFP8")


def check_nvfp4_support():
    """:71-76."""
    return False, _NOT_IMITATED.format("NVFP4")


def check_fp8_block_scaling_support():
    """:79-87."""
    return False, _NOT_IMITATED.format("FP8 block-scaled")


def _available(check):
    def available(return_reason: bool = False):
        return check() if return_reason else check()[0]
    return available


is_fp8_available = _available(check_fp8_support)  # :161-177
is_mxfp8_available = _available(check_mxfp8_support)  # :180-195
is_fp8_block_scaling_available = _available(check_fp8_block_scaling_support)  # :198-213
is_nvfp4_available = _available(check_nvfp4_support)  # :216-231


def check_recipe_support(recipe: Optional[Recipe]) -> None:
    """quantization.py:90-100; a custom recipe (megatron's --fp8-recipe custom) is refused
    too: the stand-in builds no quantizers from a factory."""
    supported, reason = True, ""
    if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        supported, reason = check_fp8_support()
    elif isinstance(recipe, Float8BlockScaling):
        supported, reason = check_fp8_block_scaling_support()
    elif isinstance(recipe, MXFP8BlockScaling):
        supported, reason = check_mxfp8_support()
    elif isinstance(recipe, (NVFP4BlockScaling, CustomRecipe)):
        supported, reason = False, _NOT_IMITATED.format(type(recipe).__name__)
    assert supported, reason
    if recipe is not None and (getattr(recipe, "fp8_dpa", False)
                               or getattr(recipe, "fp8_mha", False)):
        raise NotImplementedError("the CPU stand-in of Transformer Engine runs attention in high "
                                  "precision only (recipe fp8_dpa / fp8_mha)")


def get_default_fp8_recipe() -> Recipe:
    """quantization.py:103-110: DelayedScaling below compute capability 10/12."""
    return DelayedScaling()


get_default_recipe = get_default_fp8_recipe


def get_fp8_torch_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    """quantization.py:127-133: E4M3 for E4M3 and for HYBRID's forward tensors, else E5M2."""
    if fp8_recipe.fp8_format == Format.E4M3 or (
            fp8_recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def get_fp8_max(fp8_recipe: Recipe, fprop_tensor: bool = True) -> float:
    """quantization.py:152-158."""
    return FP8_MAX[get_fp8_torch_dtype(fp8_recipe, fprop_tensor)]


class RecipeState:
    """quantization.py:977-1036: the state of one recipe for one module and direction."""

    @staticmethod
    def create(recipe: Recipe, *, mode: str, num_quantizers: int = 1, device=None):
        """:988-1036 (the two per-tensor recipes; check_recipe_support refused the others)."""
        if recipe.delayed():
            return DelayedScalingRecipeState(recipe, mode=mode, num_quantizers=num_quantizers)
        if recipe.float8_current_scaling():
            return Float8CurrentScalingRecipeState(recipe, mode=mode,
                                                   num_quantizers=num_quantizers)
        raise ValueError(_NOT_IMITATED.format(type(recipe).__name__))


class DelayedScalingRecipeState(RecipeState):
    """quantization.py:1049-1096: scales (ones) and amax history (zeros); its quantizers cast
    with ``scale[i]`` and record into ``amax_history[0][i]``."""

    def __init__(self, recipe: DelayedScaling, *, mode: str, num_quantizers: int = 1):
        self.recipe, self.mode, self.num_quantizers = recipe, mode, num_quantizers
        self.dtype = get_fp8_torch_dtype(recipe, mode == "forward")
        self.scale = torch.ones(num_quantizers, dtype=torch.float32)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers,
                                        dtype=torch.float32)

    def make_quantizers(self) -> list:
        return [Float8Quantizer(self.scale[i:i + 1], self.amax_history[0][i:i + 1], self.dtype)
                for i in range(self.num_quantizers)]


class Float8CurrentScalingRecipeState(RecipeState):
    """quantization.py:1099-1137: no state; quantizers with the recipe's power-of-2 choice."""

    def __init__(self, recipe: Float8CurrentScaling, *, mode: str, num_quantizers: int = 1):
        self.recipe, self.mode, self.num_quantizers = recipe, mode, num_quantizers
        self.dtype = get_fp8_torch_dtype(recipe, mode == "forward")

    def make_quantizers(self) -> list:
        return [Float8CurrentScalingQuantizer(self.dtype,
                                              force_pow_2_scales=self.recipe.use_power_2_scales)
                for _ in range(self.num_quantizers)]


def _fused_amax_and_scale_update(amax: torch.Tensor, history: torch.Tensor, scale: torch.Tensor,
                                 algo: str, scaled_max: float) -> None:
    """common/recipe/delayed_scaling.cu:174-252 for one module's quantizers, in place:
    ``amax`` the (reduced) amaxes, ``history`` (length x quantizers), ``scale``."""
    last = torch.where(amax != 0, amax, history[0])
    moving = last != 0
    values = torch.cat([history[1:], last[None]])  # a_i: the history rolled, the amax last
    largest = torch.where(torch.isnan(values), 0.0, values).amax(dim=0)  # fmaxf from 0
    rolled = values.clone()
    rolled[0] = 0
    history.copy_(torch.where(moving[None], rolled, history))
    chosen = last if algo == "most_recent" else torch.where(moving, largest, 0.0)
    new = torch.where(torch.isfinite(chosen) & (chosen > 0),
                      torch.tensor(scaled_max, dtype=torch.float32) / chosen, scale)
    scale.copy_(torch.where(torch.isinf(new), torch.finfo(torch.float32).max, new))


class FP8GlobalStateManager:
    """quantization.py:234-670: the global FP8 state, the delayed-scaling buffers and their
    reduction and update (module doc).

    Class-level state, as TE keeps it (quantization.py:239-262): it is process-global in TE."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE = None
    FP8_DISTRIBUTED_GROUP = None
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    IS_FIRST_FP8_MODULE = False
    FP8_GRAPH_CAPTURING = False
    AUTOCAST_DEPTH = 0
    global_amax_buffer: dict = {}
    global_amax_history_buffer: dict = {}
    global_scale_buffer: dict = {}
    autocast_arguments: dict = {}
    skip_fp8_weight_update_tensor = None

    @classmethod
    def reset(cls) -> None:
        """quantization.py:264-287."""
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.FP8_PARAMETERS = False
        cls.HIGH_PRECISION_INIT_VAL = cls.IS_FIRST_FP8_MODULE = cls.FP8_GRAPH_CAPTURING = False
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = cls.skip_fp8_weight_update_tensor = None
        cls.AUTOCAST_DEPTH = 0
        cls.global_amax_buffer, cls.global_amax_history_buffer = {}, {}
        cls.global_scale_buffer, cls.autocast_arguments = {}, {}

    @classmethod
    def is_fp8_available(cls):
        """quantization.py:300-303."""
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls):
        return check_mxfp8_support()  # :305-308

    @classmethod
    def is_fp8_block_scaling_available(cls):
        return check_fp8_block_scaling_support()  # :310-313

    @classmethod
    def is_nvfp4_available(cls):
        return check_nvfp4_support()  # :315-318

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        return "scaling_fwd" if forward else "scaling_bwd"  # :320-325

    @staticmethod
    def get_fwd_bwd_key(forward: bool = True) -> str:
        return "forward" if forward else "backward"  # :327-330

    @classmethod
    def get_buffer_info(cls) -> str:
        return "buffer_index_and_autocast_key"  # :332-338

    @classmethod
    def get_unique_autocast_key(cls, recipe=None, group=None) -> str:
        """:550-560: recipe and group identify an autocast."""
        return f"{str(recipe)}:{hash(group)}"

    @classmethod
    def get_key_in_buffer(cls, forward: bool, fp8_recipe: Recipe, fp8_group) -> str:
        """:340-350."""
        autocast_key = cls.get_unique_autocast_key(fp8_recipe, fp8_group)
        return f"{cls.get_fwd_bwd_key(forward)}_{autocast_key}"

    @classmethod
    def split_key_in_buffer(cls, key: str) -> tuple:
        """:352-357."""
        forward, autocast_key = key.split("_", 1)
        return forward == "forward", autocast_key

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """:359-411: delayed scaling only; once per module, its forward and backward amax row,
        history and scale appended under their keys, the positions kept in ``fp8_meta``."""
        if not fp8_meta["recipe"].delayed():
            return
        index_in_buffer = cls.get_buffer_info()
        if index_in_buffer in fp8_meta:
            return
        fp8_meta[index_in_buffer] = []
        for forward in (True, False):
            meta_key = cls.get_meta_tensor_key(forward=forward)
            if meta_key not in fp8_meta:
                continue
            key = cls.get_key_in_buffer(forward, fp8_meta["recipe"], fp8_meta["fp8_group"])
            state = fp8_meta[meta_key]
            cls.global_amax_buffer.setdefault(key, []).append(state.amax_history[0])
            cls.global_amax_history_buffer.setdefault(key, []).append(state.amax_history)
            cls.global_scale_buffer.setdefault(key, []).append(state.scale)
            fp8_meta[index_in_buffer].append(len(cls.global_amax_buffer[key]) - 1)
            fp8_meta[index_in_buffer].append(key)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED  # :413-416

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION  # :418-421

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS  # :423-426

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL  # :428-431

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.FP8_GRAPH_CAPTURING  # :433-436 (no CUDA stream to capture on the CPU)

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """:438-445: True once per autocast region."""
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """:447-452."""
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.FP8_DISTRIBUTED_GROUP  # :454-457

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return cls.skip_fp8_weight_update_tensor  # :295-298

    @classmethod
    def get_autocast_state(cls) -> tuple:
        """:459-469."""
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        """:471-483."""
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING) = state

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """:496-548: for each buffer key of this direction, the amaxes concatenated, reduced
        with MAX over the autocast's group, and every module's history and scale updated by
        the fused kernel's rule (module doc)."""
        for buffer_key, amax_buffer in cls.global_amax_buffer.items():
            fwd_update, autocast_key = cls.split_key_in_buffer(buffer_key)
            if fwd_update != forward or len(amax_buffer) == 0:
                continue
            recipe, group = cls.autocast_arguments[autocast_key]
            if callable(recipe.amax_compute_algo) or callable(recipe.scaling_factor_compute_algo):
                raise NotImplementedError("the CPU stand-in of Transformer Engine does not "
                                          "imitate callable amax / scaling-factor algorithms")
            contiguous_amax = torch.cat(amax_buffer)
            if recipe.reduce_amax and torch.distributed.is_initialized() \
                    and torch.distributed.get_world_size(group=group) > 1:
                torch.distributed.all_reduce(contiguous_amax, op=torch.distributed.ReduceOp.MAX,
                                             group=group)  # :485-494
            scaled_max = get_fp8_max(recipe, forward) * 2.0 ** -recipe.margin
            offset = 0
            with torch.no_grad():
                for history, scale in zip(cls.global_amax_history_buffer[buffer_key],
                                          cls.global_scale_buffer[buffer_key]):
                    count = scale.numel()
                    _fused_amax_and_scale_update(contiguous_amax[offset:offset + count],
                                                 history, scale, recipe.amax_compute_algo,
                                                 scaled_max)
                    offset += count

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None,
                       _graph=False) -> None:
        """:562-598: set the region's state, remember its recipe and group by key; the first
        module of an outermost region is 'first'; an enabled region asserts FP8 support."""
        fp8_recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        cls.autocast_arguments[cls.get_unique_autocast_key(fp8_recipe, fp8_group)] = \
            (fp8_recipe, fp8_group)
        cls.FP8_ENABLED, cls.FP8_CALIBRATION = enabled, calibrating
        cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP = fp8_recipe, fp8_group
        cls.FP8_GRAPH_CAPTURING = _graph
        if cls.AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.AUTOCAST_DEPTH += 1
        if enabled:
            supported, reason = cls.is_fp8_available()
            assert supported, reason
            check_recipe_support(fp8_recipe)

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        """:600-610: leaving the outermost enabled region with grad enabled reduces and
        updates the forward buffers (delayed scaling; empty for the other recipes)."""
        cls.AUTOCAST_DEPTH -= 1
        if enabled and cls.AUTOCAST_DEPTH == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False):
    """quantization.py:800-862: check the recipe when enabled, save the state, enter, and
    restore the saved state on exit."""
    if enabled:
        check_recipe_support(recipe)
    state = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled=enabled, calibrating=calibrating,
                                         fp8_recipe=recipe, fp8_group=amax_reduction_group,
                                         _graph=_graph)
    try:
        yield
    finally:
        FP8GlobalStateManager.set_autocast_state(state)
        FP8GlobalStateManager.autocast_exit(enabled, _graph=_graph)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None, _graph: bool = False):
    """quantization.py:766-797: the deprecated name of :func:`autocast`."""
    with autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe,
                  amax_reduction_group=fp8_group, _graph=_graph):
        yield


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """quantization.py:703-763: modules built inside keep quantized weights only (the state;
    the stand-in refuses to build such a module: it has no FP8 parameters, module/base.py)."""
    saved = (FP8GlobalStateManager.FP8_PARAMETERS, FP8GlobalStateManager.FP8_RECIPE,
             FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL)
    FP8GlobalStateManager.FP8_PARAMETERS = enabled
    FP8GlobalStateManager.FP8_RECIPE = get_default_fp8_recipe() if recipe is None else recipe
    FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL = preserve_high_precision_init_val
    try:
        yield
    finally:
        (FP8GlobalStateManager.FP8_PARAMETERS, FP8GlobalStateManager.FP8_RECIPE,
         FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL) = saved


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """quantization.py:672-700: the deprecated name of :func:`quantized_model_init`."""
    with quantized_model_init(enabled=enabled, recipe=recipe,
                              preserve_high_precision_init_val=preserve_high_precision_init_val):
        yield
