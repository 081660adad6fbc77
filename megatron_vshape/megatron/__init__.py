"""megatron-core glue: V-shape layer placement, the pass compute, the forward-backward function.

Needs ``pip install -e ".[megatron]"`` (megatron-core 0.16).
"""
