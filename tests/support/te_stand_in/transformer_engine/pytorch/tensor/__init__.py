"""transformer_engine.pytorch.tensor: QuantizedTensor, the base class of TE 2.x's FP8 tensors
(TE v2.11 quantized_tensor.py, re-exported by tensor/__init__.py). megatron-core's fp8_utils
imports it when TE >= 2.0 (0.16.1 fp8_utils.py:42-49) and asks ``isinstance``; the stand-in
makes no quantized tensors, so nothing is one."""
import torch


class QuantizedTensor(torch.Tensor):
    """Never instantiated by the stand-in."""


class QuantizedTensorStorage:
    """Never instantiated by the stand-in."""
