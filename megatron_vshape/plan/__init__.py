"""Planning before training: model configurations, memory and throughput predictions.

Pure Python (standard library and PyYAML); builds on :mod:`megatron_vshape.schedule`.
"""
from .model import ModelConfig, load_model_config

__all__ = ["ModelConfig", "load_model_config"]
