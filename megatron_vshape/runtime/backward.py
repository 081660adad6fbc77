"""Backward through a stage whose output was deallocated after sending.

A stage's output is sent to the next stage and then only its autograd node is needed, not its
values. Like megatron's ``deallocate_output_tensor``, we replace the output's data by a
one-element tensor right after the send is posted (the transport holds its own alias until the
send completes), and run the backward through the autograd engine directly, because
``torch.autograd.backward`` would reject the gradient's shape against the shrunken output.
"""
from __future__ import annotations

import torch

__all__ = ["deallocate", "run_backward"]


def deallocate(output: torch.Tensor) -> None:
    """Free ``output``'s values, keeping its autograd node (it must not be a view)."""
    if output._base is not None:
        raise ValueError("cannot deallocate a view: its base keeps the storage alive anyway")
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def run_backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backpropagate ``grad`` (None for a scalar loss) from ``output`` into leaves' ``.grad``."""
    if grad is None:
        if output.numel() != 1:
            raise ValueError(f"backward from a non-scalar output {tuple(output.shape)} needs a grad")
        grad = torch.ones_like(output, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
