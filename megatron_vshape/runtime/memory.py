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
from typing import Iterable

import torch

__all__ = ["ActivationTracker"]


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
