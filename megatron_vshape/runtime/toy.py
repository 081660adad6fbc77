"""Toy models and their single-process reference: what the runtime tests and benchmark train.

A model is a list of layers cut into equal stages: with L layers and S global stages, stage s
holds layers [s L/S, (s+1) L/S). So 1F1B (S = p) and the V schedules (S = 2p) train the same
model, and a single process running the layers in order is the reference.

- ``mlp``: blocks of ``Linear(h, h)`` then GELU. (GELU saves its input, not its output, so no
  storage is saved by two layers and a stage's memory is exactly the sum of its layers'.)
- ``transformer``: pre-norm blocks, two-head self-attention and a GELU MLP with residuals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..schedule.model.placement import Placement
from .memory import ActivationTracker
from .stages import ModuleStages
from .wgrad import WeightGradStore, defer_linear_weight_grads

__all__ = ["ToyModel", "build_layers", "make_batch", "pipeline_stages", "reference_step",
           "loss_fn", "MODEL_KINDS"]

MODEL_KINDS = ("mlp", "transformer")


@dataclass(frozen=True)
class ToyModel:
    """Shape of a toy model and its data."""

    kind: str = "mlp"
    layers: int = 16
    hidden: int = 16
    micro_batch_size: int = 4
    seq_length: int = 8
    """Tokens per sample (transformer only)."""
    dtype: torch.dtype = torch.float64
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"toy model kind must be one of {', '.join(MODEL_KINDS)}, got "
                             f"{self.kind!r}")
        if self.layers < 1 or self.hidden < 2 or self.hidden % 2:
            raise ValueError(f"toy model needs layers >= 1 and an even hidden >= 2, got "
                             f"layers={self.layers}, hidden={self.hidden}")

    def sample_shape(self) -> tuple:
        """Shape of one microbatch's activations between stages."""
        if self.kind == "mlp":
            return (self.micro_batch_size, self.hidden)
        return (self.micro_batch_size, self.seq_length, self.hidden)


class MLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x):
        return F.gelu(self.linear(x))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention (two heads) and MLP, each with a residual connection."""

    def __init__(self, hidden: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.softmax(q.matmul(k.transpose(-1, -2)) / math.sqrt(h // self.heads), -1)
        attn = scores.matmul(v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def build_layers(model: ToyModel) -> nn.ModuleList:
    """The model's layers, initialised from ``model.seed`` (identical in every process)."""
    block = MLPBlock if model.kind == "mlp" else TransformerBlock
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model.seed)
        return nn.ModuleList(block(model.hidden) for _ in range(model.layers)).to(model.dtype)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Regress the sum of the output features onto a scalar target per token.

    The sum saves nothing for backward, so the loss adds almost no activation memory and the
    measured memory is the stages' (an LM head's logits, by contrast, would dominate rank 0).
    """
    return F.mse_loss(output.sum(-1), target)


def make_batch(model: ToyModel, microbatches: int, step: int) -> list[tuple]:
    """``(input, target)`` per microbatch, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(model.seed * 1000 + step)
    shape = model.sample_shape()
    return [(torch.randn(shape, generator=gen, dtype=model.dtype),
             torch.randn(shape[:-1], generator=gen, dtype=model.dtype))
            for _ in range(microbatches)]


def stage_layers(layers: nn.ModuleList, num_stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage``'s slice of the layers (they must divide evenly)."""
    if len(layers) % num_stages:
        raise ValueError(f"{len(layers)} layers do not split evenly into {num_stages} stages; "
                         f"use a multiple of {num_stages}")
    per = len(layers) // num_stages
    return nn.Sequential(*layers[stage * per:(stage + 1) * per])


def pipeline_stages(layers: nn.ModuleList, placement: Placement, rank: int,
                    tracker: ActivationTracker | None = None, defer: bool = True
                    ) -> ModuleStages:
    """This rank's stages of ``layers`` (modified in place: their ``nn.Linear`` s defer W)."""
    modules, stores = {}, {}
    for chunk in range(placement.chunks):
        stage = placement.stage_of(rank, chunk)
        modules[stage] = stage_layers(layers, placement.num_stages, stage)
        stores[stage] = WeightGradStore(tracker)
        if defer:
            defer_linear_weight_grads(modules[stage], stores[stage])
    return ModuleStages(modules, placement.num_stages, loss_fn, stores)


def reference_step(layers: nn.ModuleList, batch: list[tuple]) -> list[torch.Tensor]:
    """One single-process step: every microbatch through all layers, ``loss / m`` backward.

    Returns the unscaled losses; gradients accumulate in the layers' ``.grad``.
    """
    losses = []
    for x, target in batch:
        loss = loss_fn(nn.Sequential(*layers)(x), target)
        (loss / len(batch)).backward()
        losses.append(loss.detach())
    return losses


def split_memory(model: ToyModel) -> tuple[int, int]:
    """(bytes one layer's forward keeps for backward, bytes still kept after its B for W).

    Their ratio is what the simulator's ``MemoryModel`` calls the W share: B frees the rest.
    """
    layer = build_layers(ToyModel(**{**model.__dict__, "layers": 1}))
    tracker = ActivationTracker(layer.parameters())
    store = WeightGradStore(tracker)
    defer_linear_weight_grads(layer, store)
    x = make_batch(model, 1, 0)[0][0].requires_grad_()
    with tracker.saved_tensors_hooks():
        y = layer[0](x)
    after_forward = tracker.live
    with store.collecting(0):
        y.backward(torch.ones_like(y))
    del y
    return after_forward, tracker.live
