"""The passes of one rank's megatron chunks: megatron's own forward_step, our backward.

F calls megatron's ``forward_step`` (the user's forward_step_func, the loss function scaled by
the number of microbatches, the forward data store) with the chunk's vp stage and whether it is
the V's last stage passed explicitly (its fallback asks parallel_state, which assumes the loop
placement). B runs the backward through the engine (outputs are deallocated after sending) with
``config.grad_scale_func`` applied to the loss, and leaves a chunk's ``no_sync`` before that
chunk's last B so DDP reduces its gradients; W runs the chunk's deferred weight gradients. B
and W run under megatron's ``backward-compute`` timer, as its backward_step does.

MoE: megatron's ``forward_step`` also sets the loss scale of the aux losses' backward
(``MoEAuxLossAutoScaler.set_loss_scale``; ``MTPLossAutoScaler``'s too) after every microbatch's
forward, on every stage, as megatron's schedules do. The scale is the same for every
microbatch of a step (``grad_scale_func(1)`` x CP / microbatches, or ``grad_scale_func(1)``
per token), so a B that a V runs after a later microbatch's F scales alike. The MoE layers
record their aux losses in megatron's tracker by global layer number (chunk 1 is built with
the mirrored pipeline group, so its layers carry stage 2p-1-r's numbers) and Megatron-LM
reduces the tracker over the pipeline group: both chunks of a V rank are counted, once.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch

from ..runtime.backward import run_backward
from ..runtime.wgrad import WeightGradStore
from .wgrad import store_of, te_wgrad_modules
from ..schedule.model.actions import PassKind
from ..schedule.model.schedule import Schedule

__all__ = ["MegatronStages"]


class MegatronStages:
    """:class:`..runtime.stages.StageCompute` for a rank's megatron model chunks."""

    def __init__(self, schedule: Schedule, rank: int, chunks: Sequence[torch.nn.Module],
                 forward_step_func: Callable, data_iterators: Sequence[Any], config,
                 cp_group_size: int = 1, collect_non_loss_data: bool = False,
                 first_val_step: bool | None = None, forward_only: bool = False,
                 stores: Sequence[WeightGradStore] | None = None):
        self.schedule, self.rank = schedule, rank
        self.chunks = list(chunks)
        self.forward_step_func = forward_step_func
        self.data_iterators = list(data_iterators)
        self.config = config
        self.cp_group_size = cp_group_size
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step if forward_only else None
        self.stores = list(stores) if stores is not None else [store_of(c) for c in chunks]
        self.forward_data_store: list = []
        self.total_num_tokens = torch.zeros(  # where the loss's token counts live
            [], dtype=torch.int, device=torch.cuda.current_device() if torch.cuda.is_available()
            else "cpu")
        self._chunk_of = {schedule.placement.stage_of(rank, c): c for c in range(len(chunks))}
        self._last_backward = _last_pass_per_chunk(schedule, rank, self._chunk_of,
                                                   (PassKind.B, PassKind.BW))
        self._last_weight = _last_pass_per_chunk(schedule, rank, self._chunk_of,
                                                 (PassKind.W, PassKind.BW))
        self._no_sync = [None] * len(chunks)
        self._grad_sync_launched: set[int] = set()
        self._te = [te_wgrad_modules(c) for c in chunks]
        _check_forwards_in_order(schedule, rank)
        if any(self._te):
            _check_w_follows_b(schedule, rank)

    # -- parameter and grad sync -------------------------------------------------------------
    def start_param_sync(self) -> None:
        """Launch every chunk's parameter all-gather (distributed optimizer with
        overlap_param_gather), as megatron's interleaved schedule does for its first chunks;
        each chunk's forward pre-hook waits for its own."""
        funcs = self.config.param_sync_func
        if funcs is None:
            return
        for c, chunk in enumerate(self.chunks):
            (funcs[c] if isinstance(funcs, (list, tuple)) else funcs)(chunk.parameters())

    @contextlib.contextmanager
    def tracking(self, tracker):
        """Count what the W stores keep in ``tracker`` too, inside (None: change nothing)."""
        if tracker is None:
            yield
            return
        before = [store.tracker for store in self.stores]
        for store in self.stores:
            store.tracker = tracker
        try:
            yield
        finally:
            for store, previous in zip(self.stores, before):
                store.tracker = previous

    def disable_grad_sync(self) -> None:
        """Enter every chunk's no_sync (start of the step)."""
        funcs = self.config.no_sync_func
        for c in range(len(self.chunks)):
            func = funcs[c] if isinstance(funcs, (list, tuple)) else funcs
            if func is not None and self._no_sync[c] is None:
                self._no_sync[c] = func()
                self._no_sync[c].__enter__()

    def enable_grad_sync(self, chunk: int) -> None:
        if self._no_sync[chunk] is not None:
            self._no_sync[chunk].__exit__(None, None, None)
            self._no_sync[chunk] = None

    def launch_grad_sync(self, chunk: int) -> None:
        """Leave the chunk's no_sync and, once, call ``config.grad_sync_func`` for it.

        Two ways to start the data-parallel reduction, as megatron's schedules have them:
        without grad_sync_func, no_sync is left before the chunk's last B and DDP's hooks launch
        each bucket when W completes it; with it (Megatron-LM's align_grad_reduce), the chunk
        stays in no_sync and the whole chunk is launched right after its last W.
        """
        if chunk in self._grad_sync_launched:
            return
        self._grad_sync_launched.add(chunk)
        self.enable_grad_sync(chunk)
        funcs = self.config.grad_sync_func
        if funcs is not None:
            (funcs[chunk] if isinstance(funcs, (list, tuple)) else funcs)(
                self.chunks[chunk].parameters())

    # -- passes ------------------------------------------------------------------------------
    def forward(self, stage, microbatch, input_tensor, data):
        from megatron.core.pipeline_parallel.schedules import forward_step

        c = self._chunk_of[stage]
        output, num_tokens = forward_step(
            self.forward_step_func, self.data_iterators[c], self.chunks[c],
            self.schedule.microbatches, input_tensor, self.forward_data_store, self.config,
            self.cp_group_size, collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=microbatch == 0 and self.first_val_step is not False,  # megatron's
            # check_first_val_step: in evaluation, first_val_step decides; in training, mb 0
            current_microbatch=microbatch, vp_stage=c,
            is_last_stage=stage == self.schedule.num_stages - 1)
        self.total_num_tokens += num_tokens
        return output

    def backward_input(self, stage, microbatch, output, output_grad):
        c = self._chunk_of[stage]
        if self.config.grad_sync_func is None and self._last_backward[c] == microbatch:
            self.launch_grad_sync(c)
        if output_grad is None and self.config.grad_scale_func is not None:
            output = self.config.grad_scale_func(output)
        if not output.requires_grad:
            return
        with self._timer(), self.stores[c].collecting(microbatch):
            run_backward(output, output_grad)
            if self._te[c]:  # TE queues the weight GEMMs itself, first in first out
                _fold_te_bias_grads(self._te[c])
                self.stores[c].defer(functools.partial(_te_backward_dw, self._te[c]))

    def backward_weight(self, stage, microbatch):
        c = self._chunk_of[stage]
        with self._timer():
            self.stores[c].run(microbatch)
        if self.config.grad_sync_func is not None and self._last_weight[c] == microbatch:
            self.launch_grad_sync(c)

    def _timer(self):
        timers = self.config.timers
        if timers is None:
            return contextlib.nullcontext()
        return _running(timers("backward-compute", log_level=2))

    def pending_weight_work(self):
        return {c: s.pending for c, s in enumerate(self.stores) if s.pending}


@contextlib.contextmanager
def _running(timer):
    timer.start()
    try:
        yield
    finally:
        timer.stop()


def _last_pass_per_chunk(schedule: Schedule, rank: int, chunk_of: dict, kinds) -> dict[int, int]:
    """Chunk -> microbatch of its last pass of ``kinds`` in this rank's order."""
    last = {}
    for action in schedule.compute_actions(rank):
        if action.kind in kinds:
            last[chunk_of[action.stage]] = action.microbatch
    return last


def _te_backward_dw(modules) -> None:
    for module in modules:
        _grads_for_te_hooks(module)
        module.backward_dw()


def _check_forwards_in_order(schedule: Schedule, rank: int) -> None:
    """Every stage's F passes come in microbatch order on this rank: its chunk's data
    iterator hands out microbatches in order (each F calls next() on it), and megatron's
    ``is_first_microbatch`` (F of microbatch 0) must be the chunk's first forward of the step,
    where Transformer Engine recasts its cached FP8 weights after an optimizer step."""
    done: dict[int, int] = {}
    for action in schedule.compute_actions(rank):
        if action.kind is PassKind.F:
            expected = done.get(action.stage, -1) + 1
            if action.microbatch != expected:
                raise ValueError(f"schedule {schedule.name!r} runs {action} on rank {rank} "
                                 f"before stage {action.stage}'s microbatch {expected}: "
                                 "megatron's data iterators and first-microbatch flag need "
                                 "each stage's forwards in microbatch order")
            done[action.stage] = action.microbatch


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


def _fold_te_bias_grads(modules) -> None:
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


def _check_w_follows_b(schedule: Schedule, rank: int) -> None:
    """TE keeps each layer's pending weight GEMMs in a first-in first-out queue, so every
    stage's W passes must come in the order of its B passes."""
    b_order, w_order = {}, {}
    for action in schedule.compute_actions(rank):
        if action.kind is PassKind.B:
            b_order.setdefault(action.stage, []).append(action.microbatch)
        elif action.kind is PassKind.W:
            w_order.setdefault(action.stage, []).append(action.microbatch)
    for stage, order in w_order.items():
        if order != b_order.get(stage):
            raise ValueError(f"schedule {schedule.name!r} runs stage {stage}'s W passes in "
                             f"another order than its B passes on rank {rank}; Transformer "
                             "Engine's delayed weight gradients need the same order")
