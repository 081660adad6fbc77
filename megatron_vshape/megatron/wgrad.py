"""Weight-gradient deferral for megatron-core's local-spec linears (Column/RowParallelLinear).

Both layers call ``LinearWithGradAccumulationAndAsyncCommunication.apply``, looked up as a
module global of ``megatron.core.tensor_parallel.layers`` at call time. :func:`patch_linear`
puts a subclass there whose backward, for a weight that a chunk registered with its
:class:`..runtime.wgrad.WeightGradStore`, splits the pass (paper, section 2)::

    B:  dY in the input's dtype (megatron-core 0.20, whose forward may output another)
        dX = dY W  (+ tensor-parallel all-reduce, or reduce-scatter with sequence parallel)
        db = sum(dY)
    W:  dW = dY^T X  (X re-gathered over tensor-parallel ranks with sequence parallel)
        into main_grad (gradient-accumulation fusion) or grad, then the DDP hooks

Weights without a store take megatron's own path, so models that do not run a V schedule are
unaffected. DDP: with ``DistributedDataParallelConfig(delay_wgrad_compute=True)``, DDP asks
each module for ``register_wgrad_accumulation_and_reduce_hooks`` for weights marked
``skip_backward_post_hook``; :func:`defer_weight_grads` provides both, so
``overlap_grad_reduce`` starts a bucket's reduction when W (not B) completes it.
"""
from __future__ import annotations

import functools

import torch

from ..runtime.wgrad import WeightGradStore, accumulate_grad
from .te_wgrad import mark_te_delayed_parameters

__all__ = ["patch_linear", "unpatch_linear", "defer_weight_grads", "store_of"]

_STORE = "vshape_wgrad_store"
_HOOKS = "vshape_wgrad_hooks"


def _layers():
    from megatron.core.tensor_parallel import layers

    return layers


def _deferrable_function():
    """Build the subclass once per process (it must subclass megatron's own Function)."""
    layers = _layers()
    base = getattr(layers.LinearWithGradAccumulationAndAsyncCommunication, "vshape_base",
                   layers.LinearWithGradAccumulationAndAsyncCommunication)

    class DeferrableLinear(base):
        """megatron's linear Function; B/W split for weights registered with a store."""

        vshape_base = base

        @staticmethod
        def forward(ctx, input_, weight, *rest):
            # The Parameter itself: saved tensors may come back as other Python objects.
            ctx.vshape_weight = weight
            # backward returns one gradient per forward input: 9 in megatron-core 0.16,
            # 10 in 0.19 (gtp_remat_size), 11 in 0.20 (output_dtype), counted here rather
            # than per version
            ctx.vshape_inputs = 2 + len(rest)
            return base.forward(ctx, input_, weight, *rest)

        @staticmethod
        @layers.custom_bwd
        def backward(ctx, grad_output):
            weight = ctx.vshape_weight
            if not _deferrable(ctx, weight):
                return base.backward(ctx, grad_output)
            input_, _ = ctx.saved_tensors
            grad_output = _as_megatron_casts(ctx, grad_output)
            grad_input = _input_grad(ctx, grad_output, weight)
            grad_bias = (grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
                         if ctx.use_bias else None)
            getattr(weight, _STORE).defer(
                functools.partial(_weight_grad, weight, ctx.sequence_parallel,
                                  ctx.gradient_accumulation_fusion, ctx.tp_group),
                input_, grad_output)
            return (grad_input, None, grad_bias) + (None,) * (ctx.vshape_inputs - 3)

    return DeferrableLinear


def _deferrable(ctx, weight) -> bool:
    """Whether B may leave this weight's gradient to W: a store registered it, megatron keeps
    no grad_output buffer for it, and the weight is whole on this rank (megatron-core 0.19's
    GTP re-materialisation, ``gtp_remat_size > 1``, shards it: megatron's own path then)."""
    return (getattr(weight, _STORE, None) is not None and ctx.grad_output_buffer is None
            and getattr(ctx, "gtp_remat_size", 1) <= 1)


def _as_megatron_casts(ctx, grad_output):
    """dY in the dtype megatron's backward computes with. From megatron-core 0.20 the forward
    may output another dtype than its input (``output_dtype``, e.g. fp32 logits of a bf16
    GEMM), and the backward first casts dY to the input's dtype (``ctx.input_dtype``), so both
    gradients come out in it; earlier releases save no ``input_dtype`` and use dY as it is."""
    return grad_output.to(getattr(ctx, "input_dtype", grad_output.dtype))


def _input_grad(ctx, grad_output, weight):
    """B's input gradient with megatron's tensor-parallel reduction."""
    layers = _layers()
    grad_input = grad_output.matmul(weight)
    if ctx.sequence_parallel:
        shape = list(grad_input.shape)
        shape[0] //= ctx.tp_group.size()
        out = torch.empty(shape, dtype=grad_input.dtype, device=grad_input.device)
        layers.dist_reduce_scatter_func(out, grad_input.contiguous(), group=ctx.tp_group)
        return out
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    return grad_input


def _weight_grad(weight, sequence_parallel, fusion, tp_group, input_, grad_output):
    """W: the weight gradient, accumulated where megatron keeps it, then DDP's hooks.

    W records no autograd graph: the saved input still requires grad, and gloo's all-gather
    refuses to write a tensor that requires grad into views of its output."""
    with torch.no_grad():
        _accumulate_weight_grad(weight, sequence_parallel, fusion, tp_group, input_.detach(),
                                grad_output.detach())
    for hook in getattr(weight, _HOOKS, ()):
        hook()


def _accumulate_weight_grad(weight, sequence_parallel, fusion, tp_group, input_, grad_output):
    layers = _layers()
    total = input_
    if sequence_parallel:
        shape = list(input_.shape)
        shape[0] *= tp_group.size()
        total = torch.empty(shape, dtype=input_.dtype, device=input_.device)
        layers.dist_all_gather_func(total, input_.contiguous(), group=tp_group)
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = total.reshape(-1, total.shape[-1])
    if fusion and hasattr(weight, "main_grad"):
        kernel = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
        if kernel is not None and weight.main_grad.is_cuda and weight.main_grad.dtype == torch.float32:
            kernel.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
        else:
            weight.main_grad.add_(dy.t().matmul(x).to(weight.main_grad.dtype))
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
    else:
        accumulate_grad(weight, dy.t().matmul(x))


def patch_linear() -> None:
    """Install the deferrable Function in megatron's layers module (idempotent)."""
    layers = _layers()
    if not hasattr(layers.LinearWithGradAccumulationAndAsyncCommunication, "vshape_base"):
        layers.LinearWithGradAccumulationAndAsyncCommunication = _deferrable_function()


def unpatch_linear() -> None:
    layers = _layers()
    current = layers.LinearWithGradAccumulationAndAsyncCommunication
    layers.LinearWithGradAccumulationAndAsyncCommunication = getattr(current, "vshape_base", current)


def defer_weight_grads(chunk: torch.nn.Module, store: WeightGradStore,
                       mark_for_ddp: bool = False, output_layer: bool = False) -> int:
    """Route the weight gradients of ``chunk``'s parallel linears through ``store``.

    Call before wrapping the chunk in DDP; with ``mark_for_ddp`` (DDP built with
    delay_wgrad_compute=True) the weights skip DDP's per-parameter hook and W calls the hooks
    DDP registers through the module. The LM head (``output_layer``) is left out by default:
    its W would keep the logits' gradient (vocabulary-sized, the largest activation on rank
    0) alive from B to W, for little bubble gain. Returns how many weights were registered.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    patch_linear()
    head = getattr(chunk, "output_layer", None)
    count = 0
    for module in chunk.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or weight is None:
            continue
        if module is head and not output_layer:
            continue
        setattr(weight, _STORE, store)
        setattr(weight, _HOOKS, [])
        if mark_for_ddp:
            weight.skip_backward_post_hook = True
            module.register_wgrad_accumulation_and_reduce_hooks = getattr(weight, _HOOKS).append
        count += 1
    if mark_for_ddp:
        mark_te_delayed_parameters(chunk)
    return count


def store_of(chunk: torch.nn.Module) -> WeightGradStore:
    """The store :func:`defer_weight_grads` gave ``chunk`` (a fresh, unused one if none)."""
    for param in chunk.parameters():
        store = getattr(param, _STORE, None)
        if store is not None:
            return store
    return WeightGradStore()
