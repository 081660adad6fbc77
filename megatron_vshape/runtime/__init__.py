"""Torch runtime: execute one rank's schedule over torch.distributed.

Point-to-point per stream (:mod:`.streams`, :mod:`.p2p`), the pass interpreter
(:mod:`.interpreter`), deferred weight gradients (:mod:`.wgrad`), measured activation memory
(:mod:`.memory`). Written for gloo on CPU and NCCL on GPUs alike.
"""
from .interpreter import PipelineRunner, RunnerConfig, StepResult
from .memory import ActivationTracker, backward_leftover
from .p2p import P2PError, TensorSpec
from .stages import ModuleStages, StageCompute
from .streams import StreamGroups
from .wgrad import DeferredLinear, WeightGradStore, defer_linear_weight_grads

__all__ = [
    "PipelineRunner", "RunnerConfig", "StepResult", "ActivationTracker", "backward_leftover",
    "P2PError",
    "TensorSpec", "ModuleStages", "StageCompute", "StreamGroups", "DeferredLinear",
    "WeightGradStore", "defer_linear_weight_grads",
]
