"""The recipe classes megatron builds (TE v2.11 transformer_engine/common/recipe/__init__.py).

Fields and defaults as TE v2.11 declares them; pytorch/quantization.py runs the two per-tensor
recipes (DelayedScaling, Float8CurrentScaling) and refuses the others. TE declares the recipes
as pydantic dataclasses (:11 ``from pydantic.dataclasses import dataclass``), whose
constructors ignore keyword arguments they do not declare (pydantic v2's default
``extra="ignore"``): megatron-core 0.16.1's TEDelayedScaling passes
``override_linear_precision``, ``params_dtype`` and ``device``
(extensions/transformer_engine.py:2191-2225), which TE v2.11's DelayedScaling does not declare.
:func:`_ignoring_extra` keeps that behaviour for these plain dataclasses.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from enum import Enum
from typing import Callable, NamedTuple, Optional

__all__ = ["Format", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling",
           "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]


class _FormatHelper(NamedTuple):
    """recipe/__init__.py:14-20: the largest fp8 values of forward and backward tensors."""

    max_fwd: float
    max_bwd: float


class Format(Enum):
    """recipe/__init__.py:23-44."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclasses.dataclass(frozen=True)
class MMParams:
    """recipe/__init__.py:47-58."""

    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    """recipe/__init__.py:61-74."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


def _ignoring_extra(cls):
    """A dataclass whose constructor drops undeclared keyword arguments (module doc)."""
    cls = dataclasses.dataclass(cls)
    declared = {f.name for f in dataclasses.fields(cls)}
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **{k: v for k, v in kwargs.items() if k in declared})

    cls.__init__ = __init__
    return cls


class Recipe:
    """recipe/__init__.py:86-117: which kind of recipe this is."""

    def nvfp4(self):
        return isinstance(self, NVFP4BlockScaling)

    def mxfp8(self):
        return isinstance(self, MXFP8BlockScaling)

    def delayed(self):
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self):
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self):
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self):
        return isinstance(self, Float8BlockScaling)

    def custom(self):
        return isinstance(self, CustomRecipe)


@_ignoring_extra
class DelayedScaling(Recipe):
    """recipe/__init__.py:120-209; :208-209 refuses pure E5M2."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: object = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."

    def __repr__(self) -> str:
        """:211-220 (FP8GlobalStateManager keys its buffers by this string)."""
        return (f"recipe_type={self.__class__.__name__}, margin={self.margin}, "
                f"format={str(self.fp8_format).split('.')[1]}, "
                f"amax_history_len={self.amax_history_len}, reduce_amax={self.reduce_amax}, "
                f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}")


_POWER_2 = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"


@_ignoring_extra
class Float8CurrentScaling(Recipe):
    """recipe/__init__.py:223-261. The three QParams are class attributes, not fields (:237-239:
    no annotation), built from the environment's default of ``use_power_2_scales``."""

    use_power_2_scales: bool = _POWER_2
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp = QParams(power_2_scale=_POWER_2, amax_epsilon=0.0)
    fp8_quant_fwd_weight = QParams(power_2_scale=_POWER_2, amax_epsilon=0.0)
    fp8_quant_bwd_grad = QParams(power_2_scale=_POWER_2, amax_epsilon=0.0)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."

    def __repr__(self) -> str:
        """:249-261."""
        return (f"recipe_type={self.__class__.__name__}, "
                f"format={str(self.fp8_format).split('.')[1]}, "
                f"fp8_quant_fwd_inp={self.fp8_quant_fwd_inp}, "
                f"fp8_quant_fwd_weight={self.fp8_quant_fwd_weight}, "
                f"fp8_quant_bwd_grad={self.fp8_quant_bwd_grad}, "
                f"fp8_gemm_fprop={self.fp8_gemm_fprop}, fp8_gemm_dgrad={self.fp8_gemm_dgrad}, "
                f"fp8_gemm_wgrad={self.fp8_gemm_wgrad}, fp8_dpa={self.fp8_dpa}, "
                f"fp8_mha={self.fp8_mha}")


@_ignoring_extra
class MXFP8BlockScaling(Recipe):
    """recipe/__init__.py:264-295."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignoring_extra
class Float8BlockScaling(Recipe):
    """recipe/__init__.py:305-366."""

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignoring_extra
class NVFP4BlockScaling(Recipe):
    """recipe/__init__.py:386-445."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignoring_extra
class CustomRecipe(Recipe):
    """recipe/__init__.py:483-513."""

    qfactory: Optional[Callable] = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
