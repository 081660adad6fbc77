"""One world of gloo processes that trains the same model under several schedules in turn.

Shared by ``vshape demo`` (:mod:`.demo`) and ``vshape gpu-check`` (:mod:`.gpu_check`): both
spawn one world (spawning and importing megatron cost seconds) and run the schedules one after
the other in it, so megatron's groups are set up once per chunk layout, and every step runs
without garbage-collection pauses.
"""
from __future__ import annotations

import contextlib
import gc
import threading

from ..schedule.model.placement import Layout
from ..schedule.names import schedule_info

__all__ = ["two_chunks", "model_parallel", "placed_chunks", "no_gc_pauses",
           "forward_progress"]


def two_chunks(schedule: str) -> bool:
    """Whether ``schedule`` places two chunks per rank as a V (schedule/names.py)."""
    return schedule_info(schedule).layout is Layout.V


def model_parallel(ranks: int, v_layout: bool, current: bool | None) -> bool:
    """Initialize megatron's groups for the chunk layout (V: the embedding group joins rank 0's
    two chunks) unless they are up already; returns the layout now set up. Once per layout,
    not per run: megatron's destroy_model_parallel forgets its groups without destroying them,
    and every gloo group keeps a thread that wakes every 10 ms: dozens per run slowed the later
    runs' steps down."""
    import megatron.core.models.gpt  # noqa: F401  (before the shims rebind megatron's RNG)
    from megatron.core import parallel_state as ps

    from ..megatron.model import v_embedding_ranks

    if current == v_layout:
        return v_layout
    if current is not None:
        ps.destroy_model_parallel()
    kwargs = {"get_embedding_ranks": v_embedding_ranks} if v_layout else {}
    ps.initialize_model_parallel(pipeline_model_parallel_size=ranks, **kwargs)
    return v_layout


def placed_chunks(provider, config, schedule: str, ranks: int, stage_layers=None) -> list:
    """This rank's model chunks under ``schedule``'s placement (a V's two, with
    ``stage_layers`` per V stage, None for the even split; or megatron's one per rank), seeded
    alike for every schedule; zb-1p's weight gradients deferred to W (the V chunks defer theirs
    as they are built). The weights are the provider's: callers give every schedule the same
    ones (tiny_gpt.init_by_name)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..runtime.wgrad import WeightGradStore
    from ..megatron.model import build_v_chunks
    from ..megatron.wgrad import defer_weight_grads

    model_parallel_cuda_manual_seed(123)
    if two_chunks(schedule):
        return build_v_chunks(provider, config, ps.get_pipeline_model_parallel_group(),
                              stage_layers=stage_layers)
    if stage_layers is not None:
        raise ValueError(f"stage_layers place a V's stages; {schedule} runs one chunk per rank")
    rank = ps.get_pipeline_model_parallel_rank()
    chunk = provider(config=config, pre_process=rank == 0, post_process=rank == ranks - 1)
    if schedule_info(schedule).splits_w:
        defer_weight_grads(chunk, WeightGradStore())
    return [chunk]


@contextlib.contextmanager
def no_gc_pauses():
    """No garbage collection inside the step: a full collection pauses one process for tens of
    milliseconds and stalls the whole pipeline (Megatron-LM's --manual-gc exists for the same
    reason; runtime/toy_run.py does the same), so collect before the step instead."""
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


@contextlib.contextmanager
def forward_progress(done, on_done, count: int):
    """While the world runs, call ``on_done(name)`` for each schedule name rank 0 puts on the
    ``done`` queue (at most ``count``), in a thread of the calling process (progress bars)."""
    watcher = threading.Thread(target=_report, args=(done, on_done, count), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.put(None)
        watcher.join(timeout=5)


def _report(done, on_done, count: int) -> None:
    for _ in range(count):
        name = done.get()
        if name is None:
            return
        if on_done is not None:
            on_done(name)
