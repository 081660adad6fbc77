"""Transformer Engine's own B/W split, as zb-1p and the V schedules run it.

TE linears built with ``delay_wgrad_compute`` (megatron's TE wrappers read the config field:
:func:`with_te_delay_wgrad`) skip their weight GEMMs in the backward and queue them, first in
first out (TE v2.11 module/_common.py:189-262); ``backward_dw`` pops and runs one, then calls
the gradient hooks megatron's DDP registered for the parameters TE marked
``skip_backward_post_hook``. The plugin's B runs the backward (compute.py) and queues one
``backward_dw`` per TE module for W (:func:`te_backward_dw`). What this module adds around
TE's split is what megatron's DDP and a stage running several Bs before their Ws need: the
marks megatron's --use-cpu-initialization drops (:func:`mark_te_delayed_parameters`), a zero
gradient where a W's hook would find none (:func:`_grads_for_te_hooks`), and bias gradients
added in B order (:func:`fold_te_bias_grads`).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

__all__ = ["te_wgrad_modules", "with_te_delay_wgrad", "mark_te_delayed_parameters",
           "te_backward_dw", "fold_te_bias_grads"]

log = logging.getLogger(__name__)


_TE_WRAPPERS = "megatron.core.extensions.transformer_engine"


def te_wgrad_modules(chunk: torch.nn.Module) -> list:
    """The chunk's Transformer Engine linears built with delay_wgrad_compute (GPU): B skips
    their weight GEMMs and W calls their ``backward_dw``. Leaf wrappers only, since attention
    and MLP forward ``backward_dw`` to the same linears."""
    return [m for m in chunk.modules()
            if type(m).__module__ == _TE_WRAPPERS and hasattr(m, "backward_dw")
            and getattr(getattr(m, "config", None), "delay_wgrad_compute", False)]


def with_te_delay_wgrad(config):
    """A copy of ``config`` with delay_wgrad_compute on, for dense models.

    TransformerConfig.__post_init__ accepts delay_wgrad_compute only together with MoE
    overlap_moe_expert_parallel_comm; the TE wrappers read the field when they are built, so
    setting it on a copy after validation enables TE's split for dense layers too. A shallow
    copy (not ``dataclasses.replace``, which keeps only the dataclass fields): a V chunk's
    config carries the V's stage layers as an attribute (layers.with_stage_layers), and
    without it a TE model's chunk 1 got megatron's loop placement of --moe-layer-freq's dense
    and MoE layers (another model than 1f1b's).
    """
    import copy

    delayed = copy.copy(config)
    delayed.delay_wgrad_compute = True
    return delayed


def mark_te_delayed_parameters(chunk: torch.nn.Module) -> int:
    """Mark ``skip_backward_post_hook`` on every weight and bias of the chunk's TE linears
    built with delay_wgrad_compute, as TE marks them when it builds them (TE v2.11
    linear.py:1305-1309, layernorm_linear.py:1403-1406, grouped_linear.py:707-711): DDP then
    registers their gradient hooks through the module, and ``backward_dw`` calls them in W.

    With --use-cpu-initialization megatron replaces the bias of its column- and row-parallel
    TE linears by a new Parameter after TE built them (megatron-core 0.16.1
    extensions/transformer_engine.py:869, 1008, 1109; 0.19.2 :1307, :1466, :1723), which has no
    mark: DDP would hook it on autograd's accumulator, which a bias computed inside TE's
    delayed GEMM never reaches (its gradient arrives in W), and its gradient would never get
    to ``main_grad``. Returns how many parameters were marked (call before DDP wraps the
    chunk)."""
    count = 0
    modules = te_wgrad_modules(chunk)
    for module in modules:
        for name in _te_parameter_names(module):
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.skip_backward_post_hook = True
                count += 1
    if modules:
        log.info("[vshape] W passes call Transformer Engine's backward_dw of %s",
                 ", ".join(f"{name} x{n}" for name, n in
                           sorted(Counter(type(m).__name__ for m in modules).items())))
    return count


def _te_parameter_names(module) -> list:
    """A TE linear's weight and bias names (``weight``/``bias``; GroupedLinear's
    ``weight{i}``/``bias{i}``)."""
    if hasattr(module, "num_gemms"):
        return [f"{kind}{i}" for kind in ("weight", "bias") for i in range(module.num_gemms)]
    return list(getattr(module, "weight_names", ["weight"])) + \
        list(getattr(module, "bias_names", ["bias"]))


def te_backward_dw(modules) -> None:
    """W of one microbatch for a stage's TE modules: each one's oldest queued weight GEMM."""
    for module in modules:
        _grads_for_te_hooks(module)
        module.backward_dw()


def _grads_for_te_hooks(module) -> None:
    """Give a zero ``.grad`` to the parameters of a TE module that its ``backward_dw`` or the
    hooks it calls would read without one.

    TE's backward_dw (TE v2.11 module/base.py:1490-1501, grouped_linear.py:857-872) sets
    ``bias.grad`` from the GEMM's bias gradient where the bias has none, then calls the hooks
    megatron's DDP registered for the parameters TE marked ``skip_backward_post_hook``
    (linear.py:1305-1309): they add ``.grad`` to ``main_grad`` and clear it, asserting that
    it is there under --overlap-grad-reduce (megatron-core 0.16.1
    distributed_data_parallel.py:427-446; 0.19.2 alike). Two kinds of parameter come to a W
    without a gradient:

    - a bias added outside TE's GEMM (row-parallel, or ``return_bias``: megatron's linear_proj
      and fc2 add theirs themselves) gets its gradient from autograd in B, and TE's GEMM gives
      None for it (an empty tensor in GroupedLinear, cpp_extensions/gemm.py:247-250). Under
      FP8 a bias inside the GEMM does too: TE sums its gradient from the unquantized output
      gradient in B (module/base.py:1174-1195) and runs the weight-gradient GEMM without it
      (linear.py:861), so backward_dw has no bias gradient either. When a
      stage runs two Bs before their Ws (zb-1p and the Vs do), the first W's hook takes the sum
      of both and the second W finds none; with --use-cpu-initialization megatron replaces
      that bias after TE built it (0.16.1 extensions/transformer_engine.py:1109) without
      TE's mark, DDP's own hook takes its gradient in B, and every W finds none. TE then casts
      the None: AttributeError (or a shape error for the empty tensor).
    - with fuse_wgrad_accumulation a weight's gradient goes into ``main_grad`` and ``.grad``
      holds B's dummy (linear.py:945-957), which the first W's hook clears: the second W's
      hook asserts under --overlap-grad-reduce.

    A zero gradient there adds nothing (the hook adds zeros, or nothing for a fused weight,
    whose ``grad_added_to_main_grad`` B has set) and every W's hook still runs. Parameters whose
    gradient backward_dw sets itself (unfused weights, biases inside a high-precision GEMM) are
    left alone.
    """
    fused = getattr(module, "fuse_wgrad_accumulation", False)
    for name, param in module.named_parameters(recurse=False):
        if param.grad is not None:
            continue
        if name.startswith("bias"):
            needs = _bias_grad_in_b(module)
        else:
            needs = name.startswith("weight") and fused and \
                getattr(param, "skip_backward_post_hook", False)
        if needs:
            param.grad = torch.zeros_like(param)


def _bias_grad_in_b(module) -> bool:
    """Whether a TE module's biases get their gradients from autograd in B rather than from
    its weight-gradient GEMM in W (:func:`_grads_for_te_hooks` says which)."""
    bias_in_gemm = getattr(module, "apply_bias", False) and \
        not getattr(module, "gemm_bias_unfused_add", False) and not getattr(module, "fp8", False)
    return getattr(module, "use_bias", False) and not bias_in_gemm


def fold_te_bias_grads(modules) -> None:
    """Add the bias gradients B just gave TE's delayed modules to their ``main_grad`` now, as
    megatron's DDP hook would (megatron-core 0.16.1 distributed_data_parallel.py:437-441,
    0.19.2 :490-494), and clear them.

    Such a bias (:func:`_bias_grad_in_b`) is marked ``skip_backward_post_hook``, so DDP adds its
    gradient only when W calls TE's hooks; when a stage runs several Bs before their Ws, autograd
    has summed their gradients in ``.grad`` first: ``main_grad + (g1 + g2)``, where megatron's
    1f1b adds ``(main_grad + g1) + g2``. Under FP8 that last-bit difference can flip a
    quantized value (the bias itself is rounded to bf16 in the FP8 GEMM, TE v2.11
    linear.py:286-291) and grow into different losses. Folded here, every microbatch's
    gradient is added in B order as under 1f1b, and W's hook adds the zero gradient
    :func:`_grads_for_te_hooks` gives it (and counts the bias ready for the reduction). A bias
    without ``main_grad`` (no megatron DDP) keeps its gradient."""
    for module in modules:
        if not _bias_grad_in_b(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            if name.startswith("bias") and param.grad is not None and \
                    getattr(param, "skip_backward_post_hook", False) and \
                    hasattr(param, "main_grad"):
                param.main_grad.add_(param.grad.data)
                param.grad = None
