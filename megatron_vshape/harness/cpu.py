"""CPU shims so megatron-core (0.16, 0.19) runs on gloo processes: the one place they live.

For the tests and the CPU demo (``vshape demo``) only; never imported on GPU clusters.
megatron-core assumes CUDA in a few places (see ../shared/reference/megatron-core.md); each
patch below names the assumption it removes. Call :func:`prepare_cpu_imports` before the
first megatron import and :func:`install_cpu_shims` once per process, before building
models. They patch torch and megatron process-wide, which is why only spawned worker
processes (and the demo's parent, for the imports) call them.
"""
import contextlib
import importlib
import importlib.util
import sys
import types
from functools import partial

import torch

__all__ = ["prepare_cpu_imports", "install_cpu_shims", "install_triton_stand_in",
           "install_typing_override", "allow_sequence_parallel_norms", "SequenceParallelLayerNorm"]

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
              "empty_like", "randn", "rand")


def _cpu_device(device):
    text = str(device) if device is not None else None
    if text is not None and (text.startswith("cuda") or text.isdigit()):
        return "cpu"
    return device


def _wrap_factory(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)
    wrapper.__wrapped_cpu_shim__ = fn
    return wrapper


class _CpuStream:
    """Stands in for the current CUDA stream: every wait returns at once (CPU work is
    synchronous)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuRngTracker:
    """Stands in for megatron's CUDA RNG tracker: names are tracked (each with its seed as a
    tensor, the shape of state Megatron-LM's checkpoints save and restore), forks change nothing
    (the tests use no dropout, so which generator would be forked does not matter)."""

    def __init__(self):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def is_initialized(self):
        return True

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = torch.tensor([seed], dtype=torch.int64)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield


_INDUCTOR_PROBES = ("torch._dynamo", "torch._inductor.runtime.hints",
                    "torch._inductor.runtime.triton_compat", "functorch.compile",
                    "torch._dynamo.repro.after_dynamo", "torch._inductor.compile_fx")
"""torch modules that look for triton once, when first imported: imported while none exists."""


class _TritonPlaceholder:
    """Any attribute of the stand-in ``triton.language`` (``tl.constexpr``, ``tl.float32``...):
    enough for a module body or a signature to evaluate; never a kernel that runs."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _TritonPlaceholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        return _TritonPlaceholder(f"{self._name}()")

    def __getitem__(self, item):
        return self

    def __repr__(self) -> str:
        return f"<triton stand-in {self._name}>"


def _language_attribute(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _TritonPlaceholder(f"triton.language.{item}")


def install_triton_stand_in() -> None:
    """Let megatron-core >= 0.17 import on CPU-only torch (idempotent; before megatron imports).

    megatron-core 0.19 imports ``triton`` at module level (transformer/moe/ops/paged_stash.py,
    fusions/fused_indices_converter.py reads ``triton.__version__``, inference modules); CPU
    torch ships no triton. A stand-in module whose ``jit``/``autotune``/``heuristics`` are
    identity decorators lets those modules load; their kernels are GPU paths the CPU never
    takes. torch's inductor probes for triton when first imported, so its probing modules are
    imported first, while no triton exists. Nothing happens where a real triton is importable.
    """
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    for name in _INDUCTOR_PROBES:
        importlib.import_module(name)
    triton = types.ModuleType("triton")
    triton.__file__, triton.__version__ = "<megatron-vshape CPU stand-in>", "3.4.0"
    triton.jit = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
    triton.autotune = triton.heuristics = lambda *args, **kwargs: (lambda f: f)
    triton.Config = _TritonPlaceholder("triton.Config")
    triton.cdiv = lambda a, b: -(-a // b)
    language = types.ModuleType("triton.language")
    language.__getattr__ = _language_attribute
    triton.language = language
    sys.modules["triton"], sys.modules["triton.language"] = triton, language


def install_typing_override() -> None:
    """``typing.override`` (Python 3.12) on 3.11, as the identity decorator (idempotent).

    megatron-core 0.19 and the Megatron-LM training code of its era decorate methods with it
    (``from typing import override``); PEP 698's decorator only sets ``__override__``, so the
    stand-in (typing_extensions' definition, without the dependency) changes no behaviour.
    """
    import typing

    if hasattr(typing, "override"):
        return

    def override(method):
        try:
            method.__override__ = True
        except (AttributeError, TypeError):
            pass
        return method

    typing.override = override


def prepare_cpu_imports() -> None:
    """What a CPU process needs before its first megatron import (idempotent): the triton
    stand-in (megatron-core >= 0.17) and ``typing.override`` on Python 3.11. Call it first
    thing in the demo's and the tests' spawned workers; a no-op where neither is missing."""
    install_typing_override()
    install_triton_stand_in()


def install_cpu_shims() -> None:
    """Patch the CUDA assumptions (idempotent)."""
    if getattr(torch, "_vshape_cpu_shims", False):
        return
    torch._vshape_cpu_shims = True
    # 1. current_device: buffers allocated "on the current device" go to the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # 2. synchronize (batched p2p) is a no-op.
    torch.cuda.synchronize = lambda *a, **k: None
    # 4. device="cuda" literals (token counters, causal masks) become CPU tensors.
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    # 5. Tensor.cuda (tied embeddings with PP > 1) stays on the CPU.
    torch.Tensor.cuda = lambda self, *a, **k: self
    # 7. the current CUDA stream: megatron-core 0.19's bucket groups wait on it for CUDA-graph
    #    weight-gradient events before reducing (distributed/param_and_grad_buffer.py:632,
    #    start_grad_sync); on the CPU nothing runs asynchronously, so there is nothing to wait.
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()
    # 3. the CUDA RNG tracker (attention always forks it).
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _CpuRngTracker()
    mrandom.get_cuda_rng_tracker = lambda *a, **k: tracker
    mrandom.model_parallel_cuda_manual_seed = partial(_cpu_manual_seed, tracker)
    _rebind(mrandom, "get_cuda_rng_tracker")
    _rebind(mrandom, "model_parallel_cuda_manual_seed")
    # 6. activation recomputation (CheckpointFunction) saves and restores the CUDA generator's
    #    state around the replayed forward; on the CPU torch's own generator, which
    #    _set_all_rng_states restores itself, is the only one.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _cpu_manual_seed(tracker, seed, *args, **kwargs):
    """model_parallel_cuda_manual_seed on the CPU: the torch seed, and the tracker's names
    (megatron seeds the data-parallel and tensor-parallel generators from ``seed``)."""
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm, accepted under sequence parallel.

    megatron's torch norm (WrappedTorchNorm) refuses sequence parallel; the norms that accept
    it (apex's FusedLayerNorm, TE's) are GPU builds. This one computes the same thing and, as
    FusedLayerNorm does, marks its parameters ``sequence_parallel`` so finalize_model_grads
    sums their gradients over the tensor-parallel ranks (each rank saw part of the sequence).
    """

    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                 zero_centered_gamma=False, normalization="LayerNorm"):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def allow_sequence_parallel_norms() -> None:
    """Build layer specs and blocks with :class:`SequenceParallelLayerNorm` (idempotent; call
    before building specs). Both schedules of a comparison must use it."""
    from megatron.core.models import backends
    from megatron.core.transformer import transformer_block

    backends.LNImpl = SequenceParallelLayerNorm
    transformer_block.LayerNormImpl = SequenceParallelLayerNorm


def _rebind(module, name):
    """Modules that did ``from ...random import name`` hold the original: rebind them too."""
    import sys

    value = getattr(module, name)
    for mod in list(sys.modules.values()):
        if mod is not None and getattr(mod, "__name__", "").startswith("megatron") and \
                hasattr(mod, name) and mod is not module:
            setattr(mod, name, value)
