"""megatron-core glue: V-shape layer placement, the pass compute, the forward-backward function.

Needs megatron-core 0.16.x or 0.19.x (``pip install -e ".[megatron]"``; versions.py is the one
place that says which, and :func:`megatron_vshape.install` checks it).
"""
