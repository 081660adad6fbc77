"""What a rank computes for each pass: the interface the interpreter calls, and a generic one.

The interpreter (:mod:`.interpreter`) owns ordering, buffers and communication; a
:class:`StageCompute` owns the model. :class:`ModuleStages` runs plain ``nn.Module`` stages
with autograd; the megatron glue provides its own (megatron's forward_step and loss function).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from .backward import run_backward
from .wgrad import WeightGradStore

__all__ = ["StageCompute", "ModuleStages"]


class StageCompute(Protocol):
    """The passes of one rank's stages."""

    def forward(self, stage: int, microbatch: int, input_tensor: torch.Tensor | None,
                data: Any) -> torch.Tensor:
        """F: the stage's output; on the last stage the (unscaled) scalar loss.

        ``input_tensor`` is None on stage 0, which reads ``data`` (the microbatch's item).
        """

    def backward_input(self, stage: int, microbatch: int, output: torch.Tensor,
                       output_grad: torch.Tensor | None) -> None:
        """B: gradients into the stage input's ``.grad``; weight gradients deferred to W."""

    def backward_weight(self, stage: int, microbatch: int) -> None:
        """W: the deferred weight gradients of (stage, microbatch)."""

    def pending_weight_work(self) -> dict[int, list[int]]:
        """Stage -> microbatches whose W has not run (empty after a step)."""


class ModuleStages:
    """Stages that are ``nn.Module`` s, each with its own :class:`WeightGradStore`.

    ``modules`` maps this rank's global stages to modules; the last stage's output goes through
    ``loss_fn(output, target)``. Microbatch data items are ``(input, target)`` pairs.
    """

    def __init__(self, modules: Mapping[int, nn.Module], num_stages: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 stores: Mapping[int, WeightGradStore] | None = None):
        self.modules = dict(modules)
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.stores = {s: (stores or {}).get(s) or WeightGradStore() for s in self.modules}

    def forward(self, stage, microbatch, input_tensor, data):
        x = data[0] if stage == 0 else input_tensor
        y = self.modules[stage](x)
        if stage == self.num_stages - 1:
            y = self.loss_fn(y, data[1])
        return y

    def backward_input(self, stage, microbatch, output, output_grad):
        with self.stores[stage].collecting(microbatch):
            run_backward(output, output_grad)

    def backward_weight(self, stage, microbatch):
        self.stores[stage].run(microbatch)

    def pending_weight_work(self):
        return {s: st.pending for s, st in self.stores.items() if st.pending}
