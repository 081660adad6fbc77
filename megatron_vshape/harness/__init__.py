"""Runs of megatron-core under the schedules outside a user's training: the CPU demo
(``vshape demo``), the one-device check (``vshape gpu-check``), per-layer profiling
(``vshape profile``), and what they share: one process world per pipeline, a tiny GPT, and
megatron-core's CPU shims (the one place they live).

Built on the glue in :mod:`megatron_vshape.megatron`, which needs none of it: a training run
imports only the glue (docs/design.md, "Layers").
"""
