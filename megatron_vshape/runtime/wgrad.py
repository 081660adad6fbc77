"""Weight-gradient deferral: B computes input gradients and queues the W work; W runs it.

The paper (section 2, after zero-bubble pipelining) splits a backward into B, the input
gradient the previous stage waits for, and W, the weight gradient nobody waits for, which the
schedule places later to fill bubbles. For a linear layer ``y = x A^T + b``::

    B:  dx = dy A        db = sum(dy)     (b's gradient is cheap: done in B)
    W:  dA += dy^T x                      (needs only x and dy)

so after B everything but the linear layers' inputs and output gradients can be freed.

A :class:`WeightGradStore` is one chunk's queue (an instance, never module state). Layers call
:meth:`WeightGradStore.defer` from their backward; the interpreter opens
:meth:`WeightGradStore.collecting` around B and calls :meth:`WeightGradStore.run` for W.
Outside ``collecting`` (a plain ``loss.backward()``), deferred work runs at once, so a model
with deferred layers still trains normally. :class:`DeferredLinear` is the generic
``nn.Linear`` version; the megatron glue plugs its own parallel linears in through ``defer``.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .memory import ActivationTracker

__all__ = ["WeightGradStore", "DeferredLinear", "defer_linear_weight_grads", "accumulate_grad"]


class WeightGradStore:
    """Deferred weight-gradient work of one model chunk, queued per microbatch."""

    def __init__(self, tracker: ActivationTracker | None = None):
        self.tracker = tracker
        self._queues: dict[int, list] = defaultdict(list)
        self._current: int | None = None
        self.ran = 0
        """How many deferred items W has run (diagnostics: proves the split happened)."""

    @contextlib.contextmanager
    def collecting(self, microbatch: int):
        """Queue the weight-gradient work of backwards run inside under ``microbatch``."""
        if self._current is not None:
            raise RuntimeError(f"already collecting W work for microbatch {self._current}")
        self._current = microbatch
        try:
            yield self
        finally:
            self._current = None

    def defer(self, fn: Callable[..., None], *kept: torch.Tensor) -> None:
        """Queue ``fn(*kept)`` for W (run it now outside :meth:`collecting`).

        ``kept`` are the tensors W needs (layer inputs, output gradients); they count as live
        activation memory until W has run.
        """
        if self._current is None:
            fn(*kept)
            return
        if self.tracker is not None:
            kept = tuple(self.tracker.track(t) for t in kept)
        self._queues[self._current].append((fn, kept))

    def run(self, microbatch: int) -> int:
        """Run (W) and drop the work queued for ``microbatch``; return how many items ran."""
        work = self._queues.pop(microbatch, [])
        for fn, kept in work:
            fn(*kept)
        self.ran += len(work)
        return len(work)

    @property
    def pending(self) -> list[int]:
        """Microbatches with queued W work (must be empty at the end of a step)."""
        return sorted(self._queues)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad``, creating it on first use (as autograd's accumulator does)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _linear_weight_grad(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    dy2 = dy.reshape(-1, dy.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    accumulate_grad(weight, dy2.t().mm(x2))


class _DeferredLinearFunction(torch.autograd.Function):
    """``F.linear`` whose backward computes dx and db, and defers dA to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        ctx.weight = weight  # the Parameter itself: W accumulates into its .grad
        ctx.store = store
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        if ctx.needs_input_grad[1]:
            ctx.store.defer(lambda x_, dy_: _linear_weight_grad(weight, x_, dy_), x, dy)
        return dx, None, db, None


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient is computed in W (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, store: WeightGradStore,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.wgrad_store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferredLinearFunction.apply(x, self.weight, self.bias, self.wgrad_store)


def defer_linear_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Swap every ``nn.Linear`` inside ``module`` for a :class:`DeferredLinear` that shares its
    parameters (same objects, same names), so optimizers and state dicts are unaffected.

    Returns how many layers were swapped.
    """
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                deferred = DeferredLinear.__new__(DeferredLinear)
                nn.Module.__init__(deferred)
                deferred.in_features, deferred.out_features = child.in_features, child.out_features
                deferred.register_parameter("weight", child.weight)
                deferred.register_parameter("bias", child.bias)
                deferred.wgrad_store = store
                setattr(parent, name, deferred)
                swapped += 1
    return swapped
