"""megatron-vshape: memory-controllable V-shape pipeline schedules for megatron-core.

Method: "Pipeline Parallelism with Controllable Memory" (Qi et al., arXiv 2405.15362).
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
