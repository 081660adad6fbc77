"""transformer_engine.pytorch.attention: DotProductAttention (TE v2.11
attention/__init__.py). ``_SplitAlongDim``, ``apply_rotary_pos_emb`` and the ``rope`` module
are absent, so megatron takes its own split and RoPE (megatron-core 0.16.1
extensions/transformer_engine.py:2289-2294, 2335-2390 catch the ImportError)."""
from .dot_product_attention import DotProductAttention  # noqa: F401
