"""transformer_engine.pytorch.fp8: TE v2.11's deprecated re-export of quantization.py
(fp8.py:25-68), where megatron-core imports FP8GlobalStateManager, fp8_autocast and
fp8_model_init from (0.16.1 extensions/transformer_engine.py:63, 0.19.2 :71)."""
from ..common.recipe import (  # noqa: F401  (fp8.py:25-34)
    CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
    MXFP8BlockScaling, NVFP4BlockScaling, Recipe)
from .quantization import (  # noqa: F401  (fp8.py:40-68)
    FP8GlobalStateManager, check_recipe_support, fp8_autocast, fp8_model_init,
    get_default_fp8_recipe)
