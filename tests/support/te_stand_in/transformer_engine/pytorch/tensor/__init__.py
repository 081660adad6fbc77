"""transformer_engine.pytorch.tensor: QuantizedTensor, the base class of TE 2.x's FP8 tensors
(TE v2.11 quantized_tensor.py, re-exported by tensor/__init__.py). megatron-core's fp8_utils
imports it when TE >= 2.0 (0.16.1 fp8_utils.py:42-49) and asks ``isinstance`` of parameters;
the stand-in has no FP8 parameters, so nothing is one. Its FP8 casts make
float8_tensor.Float8TensorStorage, a QuantizedTensorStorage as TE's internal FP8 tensors are."""
import torch


class QuantizedTensor(torch.Tensor):
    """Never instantiated by the stand-in."""


class QuantizedTensorStorage:
    """The base of the stand-in's Float8TensorStorage (TE v2.11 quantized_tensor.py:29-121)."""
