"""transformer_engine.pytorch: the names megatron-core's TE wrappers use (TE v2.11
pytorch/__init__.py:19-60, the ones imitated; see ../../README.md)."""
from . import distributed, fp8, ops, quantization, router, tensor  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .distributed import CudaRNGStatesTracker, checkpoint  # noqa: F401
from .module import GroupedLinear, LayerNorm, LayerNormLinear, Linear, RMSNorm  # noqa: F401
from .quantization import (  # noqa: F401
    autocast, fp8_autocast, fp8_model_init, get_default_recipe, is_fp8_available,
    is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available,
    quantized_model_init)
