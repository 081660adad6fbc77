"""Planning before training: model configurations, memory and throughput predictions.

Pure Python (standard library and PyYAML); builds on :mod:`megatron_vshape.schedule`.
``vshape plan`` (:func:`plan`) ranks every (DP, TP, PP, micro batch, schedule) that fits the GPUs
by predicted throughput: memory from :mod:`.memory`, time from :mod:`.cost` (or a measured
profile, :mod:`.profile_file`) through the schedule simulator.
"""
from .candidates import SearchSpace
from .model import ModelConfig, load_model_config
from .planner import PlanResult, plan
from .profile_file import load_profile
from .settings import ClusterConfig, TrainingConfig

__all__ = ["ModelConfig", "load_model_config", "SearchSpace", "PlanResult", "plan",
           "load_profile", "ClusterConfig", "TrainingConfig"]
