"""Activation memory, measured: the bytes kept for backward, live, per rank.

The paper's memory model (section 3) counts what a forward keeps until its backward. We measure
exactly that, by storage: every tensor autograd saves during a forward (a saved-tensors pack
hook) and every tensor a deferred weight gradient keeps for W (the W store registers them) is
tracked; parameters are not activations and are skipped. A storage counts once however many
tensors view it, from the first time it is kept until the last keeper lets go.

Tracking holds no reference that keeps a tensor alive: the tracker hands out a detached alias
and counts it down with ``weakref.finalize`` when that alias dies.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Iterable

import torch

from ..schedule.model.actions import PassKind

__all__ = ["ActivationTracker", "backward_leftover"]


class ActivationTracker:
    """Live and peak bytes of activations kept for backward on this rank."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._skip = {p.untyped_storage().data_ptr() for p in parameters}
        self._keepers: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return an alias of ``tensor`` whose lifetime is counted (parameters pass through)."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or storage.nbytes() == 0:
            return tensor
        alias = tensor.detach()
        if key not in self._keepers:
            self._keepers[key] = 0
            self._bytes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._keepers[key] += 1
        weakref.finalize(alias, self._release, key)
        return alias

    def _release(self, key: int) -> None:
        self._keepers[key] -= 1
        if self._keepers[key] == 0:
            del self._keepers[key]
            self.live -= self._bytes.pop(key)

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current live bytes."""
        self.peak = self.live

    def saved_tensors_hooks(self):
        """Context manager: track what autograd saves for backward inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.track, _unpack)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def backward_leftover(pass_bytes, placement) -> dict[int, float]:
    """Per chunk, the share of a forward's kept bytes that its B leaves for W.

    ``pass_bytes`` is a step's (action, change of tracked bytes) of its F and B passes
    (:attr:`.interpreter.StepResult.pass_bytes`). For every microbatch whose F and B both ran,
    F adds ``f`` bytes and B changes them by ``b`` (negative: what it frees), so ``f + b`` is
    still held for W; summed over the microbatches of a chunk, ``(f + b) / f`` is the chunk's
    leftover, the ``-memory.weight`` of the schedule's memory model (an H100 run of
    megatron-core layers left 8-25%). Chunks with nothing measured are absent.
    """
    forward: dict = {}
    backward: dict = {}
    for action, delta in pass_bytes:
        kept = forward if action.kind is PassKind.F else backward
        kept[(action.stage, action.microbatch)] = delta
    added, left = defaultdict(float), defaultdict(float)
    for key, f in forward.items():
        if key in backward and f > 0:
            chunk = placement.locate(key[0])[1]
            added[chunk] += f
            left[chunk] += f + backward[key]
    return {chunk: min(1.0, max(0.0, left[chunk] / added[chunk])) for chunk in sorted(added)}
