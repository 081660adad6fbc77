"""The interpreter: run one rank's lowered action list, one handler per pass kind.

It makes no scheduling decisions: the order is the schedule's (validated before anything runs),
and each action is dispatched to its handler::

    F   forward (the stage's input comes from a receive, a local hand-off, or the data)
    B   input-gradient backward; weight gradients queued in the chunk's W store
    W   run the queued weight gradients of (stage, microbatch)
    BW  B then W
    SF / SB   post an asynchronous send of an activation / input gradient
    RF / RB   wait for the receive (posted earlier, see below)

Receives are posted ``recv_lookahead`` compute passes before the pass that consumes them, in
list order, so each stream's receives are posted in the order the validator checked against
the senders. After a send is posted, the stage output's values are freed (its autograd node
stays), as megatron's deallocate_pipeline_outputs does. The last stage's loss is divided by the
number of microbatches before its backward; the unscaled losses are returned on that rank.

At the end of every step the interpreter checks that no buffer, pending receive or W work is
left over: a leak there means a wrong schedule or a wrong handler, never something to carry on.
"""
from __future__ import annotations

import hashlib
from contextlib import nullcontext
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..schedule.model.actions import Action, PassKind, ScheduleError
from ..schedule.model.costs import Costs
from ..schedule.model.lower import lower
from ..schedule.model.schedule import Schedule
from ..schedule.model.simulate import action_durations
from ..schedule.model.validate import validate
from .backward import deallocate
from .memory import ActivationTracker
from .p2p import TensorSpec, Transport
from .stages import StageCompute
from .streams import StreamGroups, route_of

__all__ = ["RunnerConfig", "StepResult", "PipelineRunner", "receive_posting_points"]

_MEASURED = (PassKind.F, PassKind.B)
"""Passes whose change of the tracked bytes a step records (the memory model's F and B)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """How the interpreter runs (never what it runs: that is the schedule)."""

    timeout: float = 300.0
    """Seconds any point-to-point wait may take before failing with rank, step, action, peer."""
    recv_lookahead: int = 1
    """Post a receive this many compute passes before the pass that consumes it (>= 0)."""
    scale_loss: bool = True
    """Divide the last stage's loss by the number of microbatches before its backward."""
    deallocate_outputs: bool = True
    """Free a stage output's values once its send is posted (its autograd node stays)."""
    synchronize: bool = False
    """Synchronize the GPU around every compute pass so the timeline holds kernel times
    (profiling steps only: it removes the overlap of launches with compute)."""
    emulate: Costs | None = None
    """Emulated-cost mode: every compute pass lasts at least its simulated time in seconds (the
    real work runs, then the pass sleeps for the rest, see ``PipelineRunner._emulate``), so p
    processes on a few cores behave like p devices and step times compare with the
    simulator's makespan."""

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"RunnerConfig.timeout must be > 0 seconds, got {self.timeout}")
        if not isinstance(self.recv_lookahead, int) or self.recv_lookahead < 0:
            raise ValueError(f"RunnerConfig.recv_lookahead must be an integer >= 0, got "
                             f"{self.recv_lookahead!r}")


@dataclass
class StepResult:
    """What one step returns on a rank."""

    losses: list
    """Unscaled per-microbatch losses (detached), in microbatch order, on the loss rank; else []."""
    peak_activation_bytes: int
    """Peak bytes kept for backward during the step (0 without a tracker)."""
    seconds: float
    timeline: list = field(default_factory=list)
    """(action, start, end) of every compute pass, seconds from the step's start."""
    started: float = 0.0
    """``time.perf_counter()`` at the step's start (aligns timelines of one machine's ranks)."""
    pass_bytes: list = field(default_factory=list)
    """(action, change of the bytes kept for backward) of every F and B pass, with a tracker:
    what :func:`.memory.backward_leftover` reads the memory model from."""


@dataclass
class _StepState:
    """Per-step buffers; every dict is empty again when the step ends."""

    iteration: int
    batch: Sequence[Any]
    training: bool
    index: int = 0
    inputs: dict = field(default_factory=dict)       # (stage, mb) -> F's input (None on stage 0)
    outputs: dict = field(default_factory=dict)      # (stage, mb) -> F's output (or scaled loss)
    arrived: dict = field(default_factory=dict)      # message -> received / handed-off tensor
    input_grads: dict = field(default_factory=dict)  # (stage, mb) -> B's input gradient to send
    losses: dict = field(default_factory=dict)       # mb -> unscaled loss
    start: float = 0.0
    device_free: float = 0.0                         # emulated-cost mode: see _emulate
    data_ready: float = 0.0
    timeline: list = field(default_factory=list)     # (action, start, end) of compute passes
    pass_bytes: list = field(default_factory=list)   # (action, tracked bytes change): F and B


def receive_posting_points(actions: Sequence[Action], lookahead: int) -> dict[int, list[int]]:
    """Action index -> indices of the receives to post just before running it."""
    computes = [i for i, a in enumerate(actions) if a.kind.is_compute]
    points: dict[int, list[int]] = {}
    k = 0
    for j, action in enumerate(actions):
        while k < len(computes) and computes[k] < j:
            k += 1
        if action.kind.is_recv:
            at = computes[k - lookahead] if k - lookahead >= 0 else 0
            points.setdefault(min(at, j), []).append(j)
    return points


def schedule_digest(schedule: Schedule) -> str:
    """A short fingerprint of every rank's order, to check all ranks run the same schedule."""
    text = "|".join(" ".join(map(str, r)) for r in schedule.rank_actions)
    return hashlib.sha256(f"{schedule.placement}|{text}".encode()).hexdigest()[:16]


class PipelineRunner:
    """Executes a validated schedule on this rank (see the module docstring)."""

    def __init__(self, schedule: Schedule, compute: StageCompute, groups: StreamGroups,
                 spec: TensorSpec, config: RunnerConfig = RunnerConfig(),
                 tracker: ActivationTracker | None = None, check_group=None):
        """Validate ``schedule`` (and, with ``check_group``, that every rank in it has the same
        one) before anything runs. ``tracker`` measures activation memory when given."""
        validate(schedule)
        if groups.placement != schedule.placement:
            raise ScheduleError(f"stream groups were made for {groups.placement}, the schedule "
                                f"uses {schedule.placement}")
        if check_group is not None:
            _check_same_schedule(schedule, check_group)
        self.schedule, self.compute, self.config = schedule, compute, config
        self.rank = groups.rank
        self.transport = Transport(groups, spec, config.timeout)
        self.tracker = tracker
        self.iteration = 0
        self._failed: int | None = None
        self._lists = {mode: lower(s).rank_actions[self.rank]
                       for mode, s in ((True, schedule), (False, schedule.forward_only()))}
        self._posting = {mode: receive_posting_points(acts, config.recv_lookahead)
                         for mode, acts in self._lists.items()}
        self._sleep = (action_durations(schedule, config.emulate)[self.rank]
                       if config.emulate is not None else None)
        self._handlers = {
            PassKind.F: self._forward, PassKind.B: self._backward_input,
            PassKind.W: self._backward_weight, PassKind.BW: self._backward_fused,
            PassKind.SEND_F: self._send_activation, PassKind.SEND_B: self._send_gradient,
            PassKind.RECV_F: self._receive, PassKind.RECV_B: self._receive,
        }

    # -- the step -----------------------------------------------------------------------------
    def step(self, batch: Sequence[Any] | None = None, forward_only: bool = False) -> StepResult:
        """Run one iteration; ``batch`` holds one data item per microbatch (None where unused)."""
        if self._failed is not None:
            raise RuntimeError(f"pipeline rank {self.rank}: iteration {self._failed} failed, so "
                               "receives and buffers are in an unknown state; build a new runner")
        m = self.schedule.microbatches
        batch = [None] * m if batch is None else list(batch)
        if len(batch) != m:
            raise ValueError(f"batch has {len(batch)} microbatches, the schedule {m}")
        state = _StepState(self.iteration, batch, training=not forward_only)
        if self.tracker is not None:
            self.tracker.reset_peak()
        state.start = state.device_free = start = time.perf_counter()
        actions, posting = self._lists[state.training], self._posting[state.training]
        self._failed = self.iteration  # cleared when the step completes
        with torch.set_grad_enabled(state.training):
            for state.index, action in enumerate(actions):
                for j in posting.get(state.index, ()):
                    self.transport.post_recv(route_of(actions[j], self.schedule.placement),
                                             self._where(state, actions[j]))
                self._run(action, state)
            self.transport.finish_sends(self._where(state, None))
        self._check_drained(state)
        self._failed = None
        self.iteration += 1
        losses = [state.losses[k] for k in sorted(state.losses)]
        peak = self.tracker.peak if self.tracker is not None else 0
        return StepResult(losses, peak, time.perf_counter() - start, state.timeline, start,
                          state.pass_bytes)

    def _run(self, action: Action, state: _StepState) -> None:
        sync = self.config.synchronize and action.kind.is_compute and torch.cuda.is_available()
        if sync:
            torch.cuda.synchronize()
        measured = self.tracker is not None and state.training and action.kind in _MEASURED
        live = self.tracker.live if measured else 0
        begin = time.perf_counter()
        with torch.autograd.profiler.record_function(str(action)):
            self._handlers[action.kind](action, state)
        if measured:
            state.pass_bytes.append((action, self.tracker.live - live))
        if not action.kind.is_compute:
            return
        if sync:
            torch.cuda.synchronize()
        end = time.perf_counter()
        if self._sleep is not None:
            begin, end = self._emulate(action, state)
        state.timeline.append((action, begin - state.start, end - state.start))

    def _emulate(self, action: Action, state: _StepState) -> tuple[float, float]:
        """Sleep so the pass lasts its emulated time on an emulated device.

        The device runs passes back to back, each starting when the device is free and its
        input has arrived (a receive that had to block marks the arrival); host work between
        passes (posting sends and receives) overlaps the device's previous pass, as kernel
        launches overlap on a GPU. Sleeping towards an absolute end time also keeps sleep
        overshoot from adding up.
        """
        begin = max(state.device_free, state.data_ready)
        end = begin + self._sleep[self.schedule.placement.locate(action.stage)[1]][action.kind]
        now = time.perf_counter()
        if end > now:
            time.sleep(end - now)
        state.device_free = max(end, now)
        return begin, state.device_free

    # -- compute handlers ------------------------------------------------------------------
    def _forward(self, action: Action, state: _StepState) -> None:
        _, s, k = action
        last = self.schedule.num_stages - 1
        x = None
        if s > 0:
            x = state.arrived.pop(("activation", s - 1, k))
            if state.training:
                x = x.detach().requires_grad_()
        hooks = self.tracker.saved_tensors_hooks() if self.tracker and state.training else nullcontext()
        with hooks:
            y = self.compute.forward(s, k, x, state.batch[k])
            if s == last:
                state.losses[k] = y.detach()
                if self.config.scale_loss:
                    y = y / self.schedule.microbatches
        handed_off = s < last and self._is_local(s + 1)
        if handed_off:
            state.arrived[("activation", s, k)] = y.detach()
        if state.training or (s < last and not handed_off):
            state.outputs[(s, k)] = y  # kept for B, or (evaluation) until its send
        if state.training:
            state.inputs[(s, k)] = x

    def _backward_input(self, action: Action, state: _StepState) -> None:
        _, s, k = action
        output = state.outputs.pop((s, k))
        last = s == self.schedule.num_stages - 1
        grad = None if last else state.arrived.pop(("gradient", s + 1, k))
        x = state.inputs.pop((s, k))
        self.compute.backward_input(s, k, output, grad)
        if x is None:
            return
        if x.grad is None:
            raise RuntimeError(f"{self._where(state, action)}: the stage input got no gradient; "
                               "does the stage's output depend on its input?")
        if self._is_local(s - 1):
            state.arrived[("gradient", s, k)] = x.grad
        else:
            state.input_grads[(s, k)] = x.grad

    def _backward_weight(self, action: Action, state: _StepState) -> None:
        self.compute.backward_weight(action.stage, action.microbatch)

    def _backward_fused(self, action: Action, state: _StepState) -> None:
        self._backward_input(action, state)
        self._backward_weight(action, state)

    # -- communication handlers ------------------------------------------------------------
    def _send_activation(self, action: Action, state: _StepState) -> None:
        key = (action.stage, action.microbatch)
        output = state.outputs[key] if state.training else state.outputs.pop(key)
        self.transport.send(output, route_of(action, self.schedule.placement), action,
                            self._where(state, action))
        if state.training and self.config.deallocate_outputs and output._base is None:
            deallocate(output)

    def _send_gradient(self, action: Action, state: _StepState) -> None:
        grad = state.input_grads.pop((action.stage, action.microbatch))
        self.transport.send(grad, route_of(action, self.schedule.placement), action,
                            self._where(state, action))

    def _receive(self, action: Action, state: _StepState) -> None:
        route = route_of(action, self.schedule.placement)
        state.arrived[route.message] = self.transport.wait_recv(route, self._where(state, action))
        if self.transport.last_arrival is not None:
            state.data_ready = max(state.data_ready, self.transport.last_arrival)

    # -- helpers ------------------------------------------------------------------------------
    def _is_local(self, stage: int) -> bool:
        return self.schedule.placement.rank_of(stage) == self.rank

    def _where(self, state: _StepState, action: Action | None) -> str:
        what = f"action {action}" if action is not None else "end of step"
        return (f"pipeline rank {self.rank}, iteration {state.iteration}, step {state.index} "
                f"({what}) of schedule {self.schedule.name!r}")

    def _check_drained(self, state: _StepState) -> None:
        leftovers = {
            "stage inputs": list(state.inputs), "stage outputs": list(state.outputs),
            "unconsumed messages": list(state.arrived), "unsent input gradients":
            list(state.input_grads), "pending receives": self.transport.pending,
            "W work": self.compute.pending_weight_work(),
        }
        leftovers = {name: left for name, left in leftovers.items() if left}
        if leftovers:
            raise RuntimeError(f"{self._where(state, None)}: step ended with leftovers {leftovers}")


def _check_same_schedule(schedule: Schedule, group) -> None:
    """Fail on every rank, before any work, unless all ranks of ``group`` run ``schedule``."""
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, schedule_digest(schedule), group=group)
    if len(set(digests)) != 1:
        raise ScheduleError(f"ranks run different schedules (digests by rank: {digests}); build "
                            "the schedule from the same name, ranks, microbatches and costs "
                            "everywhere")
