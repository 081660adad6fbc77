"""FP8 state: FP8GlobalStateManager and the autocast / model-init contexts (TE v2.11
pytorch/quantization.py), the state only.

The stand-in runs no FP8 GEMM. It answers as TE v2.11 answers on a device without FP8
support: ``is_fp8_available()`` is False with the reason (quantization.py:48-58, 161-178), and
``autocast(enabled=True)`` asserts that the recipe is supported (:90-100 ``check_recipe_support``,
called at :839-840), so an FP8 run stops at its first autocast instead of computing something
else. ``autocast(enabled=False)`` and the state getters work as in TE: that is the path
megatron's TE wrappers take with FP8 off (megatron-core 0.16.1
extensions/transformer_engine.py:206-215 ``fp8_autocast(enabled=False)``).

Where FP8 will go: the modules ask :class:`FP8GlobalStateManager` in
``TransformerEngineBaseModule.init_fp8_metadata`` (module/base.py) as TE does (base.py:971-1026),
and the linears call ``_quantized_weight`` / ``_quantized_input`` hooks (module/base.py) where TE
quantizes (linear.py:173-241, 250-281); with FP8 off those hooks return the tensors unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from ..common.recipe import DelayedScaling, Recipe

__all__ = ["FP8GlobalStateManager", "autocast", "fp8_autocast", "quantized_model_init",
           "fp8_model_init", "check_recipe_support", "get_default_fp8_recipe",
           "get_default_recipe", "is_fp8_available", "is_mxfp8_available",
           "is_fp8_block_scaling_available", "is_nvfp4_available"]

_NO_FP8 = ("the CPU stand-in of Transformer Engine runs no FP8/FP4 GEMMs (TE v2.11 "
           "quantization.py:48-58 requires compute capability 8.9 or higher)")


def check_fp8_support():
    """quantization.py:48-58: (supported, reason); the CPU has no FP8 tensor cores."""
    return False, _NO_FP8


def is_fp8_available(return_reason: bool = False):
    """quantization.py:161-178."""
    return (False, _NO_FP8) if return_reason else False


is_mxfp8_available = is_fp8_block_scaling_available = is_nvfp4_available = is_fp8_available


def check_recipe_support(recipe: Optional[Recipe]) -> None:
    """quantization.py:90-100: asserts that the device supports the recipe (none here)."""
    supported, reason = check_fp8_support()
    assert supported, reason


def get_default_fp8_recipe() -> Recipe:
    """quantization.py:103-110: DelayedScaling below compute capability 10/12."""
    return DelayedScaling()


get_default_recipe = get_default_fp8_recipe


class FP8GlobalStateManager:
    """quantization.py:234-670, the state megatron reads and the autocast entry/exit.

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
    skip_fp8_weight_update_tensor = None

    @classmethod
    def reset(cls) -> None:
        """quantization.py:264-287."""
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.FP8_PARAMETERS = False
        cls.HIGH_PRECISION_INIT_VAL = cls.IS_FIRST_FP8_MODULE = cls.FP8_GRAPH_CAPTURING = False
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = cls.skip_fp8_weight_update_tensor = None
        cls.AUTOCAST_DEPTH = 0

    @classmethod
    def is_fp8_available(cls):
        """quantization.py:300-304."""
        return check_fp8_support()

    is_mxfp8_available = is_fp8_block_scaling_available = is_nvfp4_available = is_fp8_available

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED  # quantization.py:414-416

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION  # :419-421

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS  # :424-426

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL  # :429-431

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.FP8_GRAPH_CAPTURING  # :434-436 (no CUDA stream to capture on the CPU)

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """:439-445: True once per autocast region."""
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """:448-452."""
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.FP8_DISTRIBUTED_GROUP  # :455-457

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        return cls.skip_fp8_weight_update_tensor  # :296-298

    @classmethod
    def get_autocast_state(cls) -> tuple:
        """:460-469."""
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        """:472-483."""
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING) = state

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None,
                       _graph=False) -> None:
        """:563-598: set the region's state; the first module of an outermost region is
        'first'; an enabled region asserts FP8 support (none on the CPU)."""
        cls.FP8_ENABLED, cls.FP8_CALIBRATION = enabled, calibrating
        cls.FP8_RECIPE = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        cls.FP8_DISTRIBUTED_GROUP, cls.FP8_GRAPH_CAPTURING = fp8_group, _graph
        if cls.AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.AUTOCAST_DEPTH += 1
        if enabled:
            supported, reason = cls.is_fp8_available()
            assert supported, reason

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        """:601-610 (the amax reduction at the outermost exit has no FP8 tensors to reduce)."""
        cls.AUTOCAST_DEPTH -= 1


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
    a module built with it asks for FP8 metadata, which the CPU refuses)."""
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
