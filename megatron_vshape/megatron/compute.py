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
from .te_wgrad import fold_te_bias_grads, te_backward_dw, te_wgrad_modules
from .wgrad import store_of
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
                fold_te_bias_grads(self._te[c])
                self.stores[c].defer(functools.partial(te_backward_dw, self._te[c]))

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
