"""transformer_engine.pytorch.distributed: what megatron uses of it (TE v2.11
pytorch/distributed.py) -- the tensor-parallel parameter attributes, the RNG states tracker
(megatron's TECudaRNGStatesTracker subclasses it, --te-rng-tracker) and activation
checkpointing (megatron's te_checkpoint, full recompute with the TE spec). The collectives the
linears use live in ``_comm.py``.

The CPU has one generator, torch's default one: the tracker keeps named states of it where TE
keeps named CUDA generator states (distributed.py:776-884).
"""
from __future__ import annotations

import contextlib

import torch

from .quantization import FP8GlobalStateManager

__all__ = ["set_tensor_model_parallel_attributes", "CudaRNGStatesTracker", "checkpoint",
           "activation_recompute_forward", "is_fp8_activation_recompute_enabled",
           "in_fp8_activation_recompute_phase", "get_all_rng_states"]

_MODEL_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")
"""distributed.py:57-61."""


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """distributed.py:145-155: megatron's tensor-parallel attributes, set once."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTES:
        assert not hasattr(tensor, attribute)
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


_FP8_RECOMPUTE = {"enabled": False, "phase": False}
"""distributed.py:64-66: whether an FP8 recomputation is under way, and in which phase."""
_ALL_ACTIVE_RNG_STATES: dict = {}
"""distributed.py:69-80: the states of the last tracker that added one."""


def get_all_rng_states() -> dict:
    return _ALL_ACTIVE_RNG_STATES  # distributed.py:72-74


class activation_recompute_forward(contextlib.ContextDecorator):  # noqa: N801 (TE's name)
    """distributed.py:228-263: megatron's CheckpointFunction enters it around the first
    forward and the recomputation (megatron-core 0.16.1 tensor_parallel/random.py:592, :684)
    when FP8 is on; it records the phase and the first-FP8-module flag of the first forward
    for the recomputation."""

    _is_first_fp8_module: list = []

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        self.activation_recompute, self.recompute_phase = activation_recompute, recompute_phase

    def __enter__(self):
        from .quantization import FP8GlobalStateManager

        _FP8_RECOMPUTE["enabled"] = self.activation_recompute and \
            FP8GlobalStateManager.is_fp8_enabled()
        _FP8_RECOMPUTE["phase"] = self.recompute_phase
        if self.activation_recompute and not self.recompute_phase:
            self._is_first_fp8_module.append(FP8GlobalStateManager.IS_FIRST_FP8_MODULE)
        if self.activation_recompute and self.recompute_phase:
            FP8GlobalStateManager.IS_FIRST_FP8_MODULE = self._is_first_fp8_module.pop(0)
        return self

    def __exit__(self, *exc):
        _FP8_RECOMPUTE["enabled"] = _FP8_RECOMPUTE["phase"] = False
        return False


def is_fp8_activation_recompute_enabled() -> bool:
    return _FP8_RECOMPUTE["enabled"]  # distributed.py:266-268


def in_fp8_activation_recompute_phase() -> bool:
    return _FP8_RECOMPUTE["phase"]  # distributed.py:271-273


class CudaRNGStatesTracker:
    """distributed.py:776-884: named generator states; ``fork(name)`` runs its block on that
    state and keeps where it left off. Here the CPU generator's states."""

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)  # :810-818

    def set_states(self, states):
        self.states_ = states  # :820-830

    def add(self, name: str, seed: int) -> None:
        """:832-862: a seed and a name are used once each."""
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)
        _ALL_ACTIVE_RNG_STATES.clear()  # :862 set_all_rng_states(self.states_)
        _ALL_ACTIVE_RNG_STATES.update(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """:864-884."""
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


_FP8_ACTIVATION_RECOMPUTE_ENABLED = False
"""distributed.py:65, 228-268: set while a checkpointed function runs (its first forward and
its recomputation) inside an FP8 autocast. TE then stashes each FP8 module's scaling state at
the first forward and recomputes with it (quantization.py:612-668); the stand-in does not
imitate that, and its FP8 modules refuse to run while this is set (module/base.py)."""


def is_fp8_activation_recompute_enabled() -> bool:
    """distributed.py:266-268."""
    return _FP8_ACTIVATION_RECOMPUTE_ENABLED


def _marking_fp8_recompute(function):
    """``function`` with :data:`_FP8_ACTIVATION_RECOMPUTE_ENABLED` set around it, as TE's
    activation_recompute_forward sets it (:244-263)."""
    def marked(*args, **kwargs):
        global _FP8_ACTIVATION_RECOMPUTE_ENABLED
        _FP8_ACTIVATION_RECOMPUTE_ENABLED = FP8GlobalStateManager.is_fp8_enabled()
        try:
            return function(*args, **kwargs)
        finally:
            _FP8_ACTIVATION_RECOMPUTE_ENABLED = False
    return marked


def _tracker_states(get_rng_state_tracker):
    if get_rng_state_tracker is None:
        return None
    return {name: state.clone() if isinstance(state, torch.Tensor) else state
            for name, state in get_rng_state_tracker().get_states().items()}


def checkpoint(function, *args, **kwargs):
    """distributed.py:623-735: recompute ``function`` in backward instead of keeping its
    activations, with the generator states it ran with (TE's _CheckpointFunction restores the
    CPU, CUDA and tracker states, :317-456).

    Keyword arguments as TE reads them (:666-669): ``distribute_saved_activations`` (refused
    here: it shards the first input over ``tp_group``), ``get_rng_state_tracker``, ``tp_group``,
    ``use_reentrant``. Built on ``torch.utils.checkpoint`` (TE's own non-reentrant path,
    :696-735), with the tracker's states put back for the recomputation.
    """
    use_reentrant = kwargs.pop("use_reentrant", True)
    distribute = kwargs.pop("distribute_saved_activations", False)
    kwargs.pop("tp_group", None)
    get_rng_state_tracker = kwargs.pop("get_rng_state_tracker", None)
    if distribute:
        raise NotImplementedError("the CPU stand-in of Transformer Engine does not imitate "
                                  "checkpoint(distribute_saved_activations=True)")
    saved = _tracker_states(get_rng_state_tracker)

    @contextlib.contextmanager
    def recomputing():
        if saved is None:
            yield
            return
        tracker = get_rng_state_tracker()
        current = tracker.get_states()
        tracker.set_states(dict(saved))
        try:
            yield
        finally:
            tracker.set_states(current)

    del use_reentrant  # both of TE's modes recompute the same values; torch's non-reentrant one
    return torch.utils.checkpoint.checkpoint(
        _marking_fp8_recompute(function), *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (contextlib.nullcontext(), recomputing()), **kwargs)
