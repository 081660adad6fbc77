"""One ``[vshape]`` line per training iteration on every rank: memory peaks and waiting time.

``vshape trial`` (experiments/trial.py) and ``vshape collect`` compare schedules by what each rank
did in each iteration, and Megatron-LM logs neither per rank: its memory report comes from a few
ranks once, its timers from the last rank. With ``VSHAPE_STEP_LOG=1`` in the environment of a
run of scripts/pretrain_gpt_vshape.py, :func:`install_step_log` wraps Megatron-LM's
``train_step`` (megatron.training.training, looked up there by train()) and megatron's
``forward_step`` / ``backward_step`` (megatron.core.pipeline_parallel.schedules, looked up by its
schedules and by the plugin's compute.py at each call), and every rank prints after each
iteration::

    [vshape] iteration=5 rank=2 pp_rank=2 start=1764310000.123 end=1764310000.301 step_s=0.2
    busy_s=0.15 wait_s=0.028 F_s=0.05 B_s=0.06 W_s=0.04 BW_s=0 peak_allocated=...
    peak_reserved=... activation_peak=... grad_norm=1.2345678 loss=6.1234567

(one line). ``start``: wall clock when train_step began; ``end``: when this rank's last pass of
the iteration ended; ``busy_s`` the time inside its passes (F, B, W, or megatron's fused BW);
``wait_s`` = end - start - busy_s, the time the rank spent outside its passes before its last one
ended: waiting for messages, and the messaging itself. With every rank's line the trial computes
each rank's measured bubble as the simulator defines it (1 - busy / the pipeline's makespan,
makespan = latest end - earliest start; wall clocks, so across nodes as exact as their clock
sync). ``peak_allocated`` / ``peak_reserved``: the CUDA allocator's peaks over the iteration
(the peak statistics are reset at each train_step; none on the CPU). ``activation_peak``: on
the CPU, the peak bytes kept for backward (runtime/memory.py's tracker, with what the W stores
keep), the quantity the simulator's memory model counts. The plugin's own profiling iterations
(``--pipeline-replan-after``) track with a tracker of their own, so their activation_peak reads
low: keep them in the trial's warm-up. ``loss`` (the rank that logs it) and ``grad_norm`` at full
precision (Megatron-LM prints 6 digits). Under the plugin's schedules each rank also logs, when
its schedule is built or re-planned, its compute passes in order (``[vshape] order pp_rank=...
actions=0F0,0F1,...``), so the trial simulates exactly the order that ran.

On a GPU, pass times need the device synchronized at each pass's end (host clocks run ahead of
the kernels): with the step log on, megatron's passes synchronize, and so do the plugin's
(VShapeForwardBackward.synchronize). That slows steps a little: a trial's tokens/s are of runs
with the step log on, all schedules alike.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch

__all__ = ["STEP_LOG", "install_step_log", "IterationMeter"]

STEP_LOG = "VSHAPE_STEP_LOG"
"""Set to 1 in the environment of a training run to log one line per iteration per rank."""

log = logging.getLogger(__name__)


@dataclass
class IterationMeter:
    """What one rank did in the current iteration (reset at each train_step)."""

    start: float = 0.0
    end: float = 0.0
    seconds: dict = field(default_factory=lambda: {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0})
    passes: int = 0
    in_step: bool = False
    logged_order: object = None
    """The plugin schedule whose order this rank logged last."""

    def reset(self) -> None:
        self.start, self.end, self.passes, self.in_step = time.time(), 0.0, 0, True
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def add(self, kind: str, begin: float, end: float) -> None:
        """One pass of ``kind`` from ``begin`` to ``end`` (wall clock), inside train_step
        (evaluation's forward passes are not the step's)."""
        if self.in_step:
            self._count(kind, begin, end)

    def _count(self, kind: str, begin: float, end: float) -> None:
        self.seconds[kind] += end - begin
        self.passes += 1
        self.end = max(self.end, end)

    def add_timeline(self, started_perf: float, timeline) -> None:
        """The plugin runtime's passes (StepResult.timeline, offsets from ``started_perf``),
        instead of the ones the forward_step wrapper counted (the runtime's F calls it too)."""
        offset = time.time() - time.perf_counter() + started_perf
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.passes, self.end = 0, 0.0
        for action, begin, end in timeline:
            self._count(action.kind.value, offset + begin, offset + end)


def install_step_log() -> None:
    """Wrap train_step, forward_step and backward_step (idempotent) when $VSHAPE_STEP_LOG is
    set; lines go to stdout on every rank."""
    if not os.environ.get(STEP_LOG):
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    if getattr(training.train_step, "vshape_step_log", False):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    meter = IterationMeter()
    schedules.forward_step = _timed_pass(schedules.forward_step, "F", meter)
    schedules.backward_step = _timed_pass(schedules.backward_step, "BW", meter)
    training.train_step = _logged_train_step(training.train_step, training, meter)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_pass(function, kind: str, meter: IterationMeter):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        begin = time.time()
        result = function(*args, **kwargs)
        _synchronize()
        meter.add(kind, begin, time.time())
        return result
    return timed


def _plugin_runner(training):
    """The plugin's forward-backward function when the run's schedule is one of the plugin's
    (the installed getter's ``ours``), else None (megatron's own schedule)."""
    from .install import ForwardBackwardGetter

    getter = training.get_forward_backward_func
    return getter.ours if isinstance(getter, ForwardBackwardGetter) else None


def _logged_train_step(train_step, training, meter: IterationMeter):
    from megatron.training import get_args

    @functools.wraps(train_step)
    def logged(*args, **kwargs):
        ours = _plugin_runner(training)
        if ours is not None and torch.cuda.is_available():
            ours.synchronize = True
        before = None if ours is None else ours.last_step
        model = args[2] if len(args) > 2 else kwargs["model"]
        tracker = None if torch.cuda.is_available() else _tracker(model)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        meter.reset()
        with _tracking(tracker, model):
            result = train_step(*args, **kwargs)
        meter.in_step = False
        if ours is not None and ours.last_step is not None and ours.last_step is not before:
            meter.add_timeline(ours.last_step.started, ours.last_step.timeline)
            if ours.last_schedule is not meter.logged_order:
                _emit_order(ours.last_schedule)
                meter.logged_order = ours.last_schedule
        _emit(get_args().curr_iteration + 1, meter, tracker, result)
        return result

    logged.vshape_step_log = True
    return logged


def _tracker(model):
    from ..runtime.memory import ActivationTracker

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return ActivationTracker([p for c in chunks for p in c.parameters()])


@contextlib.contextmanager
def _tracking(tracker, model):
    """Track what autograd saves, and what the chunks' W stores keep, inside."""
    if tracker is None:
        yield
        return
    from .wgrad import store_of

    chunks = model if isinstance(model, (list, tuple)) else [model]
    stores = [store_of(c) for c in chunks]
    before = [s.tracker for s in stores]
    for store in stores:
        store.tracker = tracker
    try:
        with tracker.saved_tensors_hooks():
            yield
    finally:
        for store, previous in zip(stores, before):
            store.tracker = previous


def _emit_order(schedule) -> None:
    """This rank's compute passes in the order the plugin runs them (the canonical action
    strings, ``3F7``), logged when the schedule changes: the trial simulates exactly this order
    with the measured pass times. megatron's own schedules log none (their order is fixed:
    the registry's 1f1b)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_pipeline_model_parallel_rank()
    log.info("[vshape] order pp_rank=%d ranks=%d microbatches=%d layout=%s schedule=%s "
             "actions=%s", rank, schedule.ranks, schedule.microbatches,
             schedule.placement.layout.value, schedule.name,
             ",".join(map(str, schedule.compute_actions(rank))))


def _emit(iteration: int, meter: IterationMeter, tracker, result) -> None:
    from megatron.core import parallel_state

    busy = sum(meter.seconds.values())
    end = meter.end or time.time()
    fields = {"iteration": iteration, "rank": torch.distributed.get_rank(),
              "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
              "start": f"{meter.start:.6f}", "end": f"{end:.6f}",
              "step_s": f"{time.time() - meter.start:.6f}", "busy_s": f"{busy:.6f}",
              "wait_s": f"{max(0.0, end - meter.start - busy):.6f}", "passes": meter.passes,
              **{f"{k}_s": f"{v:.6f}" for k, v in meter.seconds.items()}}
    if torch.cuda.is_available():
        fields["peak_allocated"] = torch.cuda.max_memory_allocated()
        fields["peak_reserved"] = torch.cuda.max_memory_reserved()
    if tracker is not None:
        fields["activation_peak"] = tracker.peak
    grad_norm = result[5] if len(result) > 5 else None
    if grad_norm is not None:
        fields["grad_norm"] = repr(float(grad_norm))
    losses = result[0] or {}
    if "lm loss" in losses:
        fields["loss"] = repr(float(losses["lm loss"]))
    log.info("[vshape] %s", " ".join(f"{k}={v}" for k, v in fields.items()))
