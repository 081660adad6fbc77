"""FP8 training (megatron ``--fp8-format hybrid`` on Transformer Engine layers): what it
changes in time and in memory, as the planner counts it.

Time: a transformer layer's linear GEMMs (QKV, projection, FC1, FC2: forward, input and
weight gradients) run on FP8 tensor cores at :data:`GEMM_SPEEDUP` x the 16-bit peak (H100 SXM
datasheet: 1979 dense FP8 against 989 bf16 TFLOP/s) with 1-byte operands; each linear's input
(forward) and output gradient (backward) is first cast to FP8, a streaming pass. The attention
core, the embedding and the LM head stay in 16 bits (megatron's output layer is not a TE
module; TE's FP8 attention is off by default).

Memory (Transformer Engine v2.18):

- each linear keeps its input for the weight gradient as the FP8 tensor it multiplied, one
  byte per element, column-wise data only (transformer_engine/pytorch/module/linear.py:572-577
  ``saved_inputmat = inputmat``, the quantized input; layernorm_linear.py:451-469
  ``ln_out_to_save = ln_out`` for the QKV and FC1 inputs, the layernorm's FP8 output). The
  layernorm inputs and the activation function's input stay 16-bit; output gradients kept for
  a deferred W are counted at 16 bits (conservative).
- each linear's weight is cast once per iteration and its FP8 copy kept across microbatches
  (linear.py:1883, the ``weight`` workspace cached when ``is_first_microbatch`` is given), with
  row- and column-wise data on Hopper: :data:`WEIGHT_COPY_BYTES` per linear parameter.
- the delayed-scaling amax history, ``amax_history_len`` = 1024 fp32 values per tensor
  (transformer_engine/common/recipe/__init__.py:255), three tensors per linear: kilobytes,
  counted in :data:`AMAX_BYTES_PER_LINEAR`.
"""
from __future__ import annotations

__all__ = ["GEMM_SPEEDUP", "OPERAND_BYTES", "WEIGHT_COPY_BYTES", "AMAX_BYTES_PER_LINEAR",
           "LINEARS_PER_LAYER"]

GEMM_SPEEDUP = 2.0
"""FP8 dense tensor-core peak over bf16 (H100 SXM: 1979 / 989.4)."""
OPERAND_BYTES = 1
"""Bytes of an FP8 element (E4M3 activations and weights, E5M2 gradients)."""
WEIGHT_COPY_BYTES = 2
"""Bytes per linear parameter of the cached FP8 weight: row-wise and column-wise copies."""
AMAX_BYTES_PER_LINEAR = 3 * 1024 * 4
"""Input, weight and gradient amax histories of one linear, fp32, 1024 long."""
LINEARS_PER_LAYER = 4
"""QKV, projection, FC1, FC2."""
