"""Adaptive re-planning in training: ``auto`` re-planned from measured costs and memory.

The paper's adaptive scheduler (section 4) needs T_F, T_B, T_W, T_comm and a memory limit; the
reference implementation never fed it measured values. Here the first ``after`` training
iterations run a provisional schedule while every pass is timed (runtime/profile.py) and the
bytes kept for backward are tracked: around every F and B, so the share of a chunk's
activations that B leaves for W is measured (the memory model, runtime/memory.py
``backward_leftover``), and for a limit in bytes the peak; then every rank agrees on one set of
per-stage costs (each chunk's F, B and W apart: rank 0's chunk 1 holds the LM head and the loss),
one memory model and one bytes-per-unit figure, and the schedule is searched again from
them::

    iteration   0 .. after-1                 after ...
    schedule    provisional (profiled)       auto(measured costs, memory model, limit)

Every rank must end with the same schedule: data-parallel replicas issue their gradient-bucket
reductions in W order, so different orders would mismatch collectives. Hence the measured
values are averaged (costs) or maxed (memory) over the whole world before searching, and the
search is deterministic.

Measured costs that are not times (NaN, infinite, zero or negative: a timer that failed, a
pass that never ran) do not re-plan: the run keeps the schedule it has been training with and
logs why, once. A user expects the training to go on (the provisional schedule is correct,
only perhaps slower) rather than stop hours in, or a search fed NaN to pick an arbitrary
order. Every rank decides alike: the costs it checks are the all-reduced ones, the same
everywhere (a NaN on one rank makes the mean NaN on all).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..runtime.memory import ActivationTracker, backward_leftover
from ..runtime.profile import PassProfile, measure_hop_latency
from ..schedule.model.actions import ScheduleError
from ..schedule.model.costs import Costs, MemoryModel
from ..schedule.model.limits import MemoryLimit
from ..schedule.model.schedule import Schedule
from ..schedule.model.simulate import simulate

__all__ = ["Replanner"]

log = logging.getLogger(__name__)


@dataclass
class Replanner:
    """When and from what ``auto`` is re-planned (one per forward-backward function)."""

    after: int = 0
    """Training iterations to profile before re-planning (0: never re-plan)."""
    limit: MemoryLimit | None = None
    """The memory limit; in bytes it needs the measured bytes per unit."""
    steps: int = 0
    """Training iterations seen so far."""
    done: bool = False
    activation_bytes: float | None = None
    """Measured bytes of one unit (one microbatch's activations of one rank's layer share)."""
    memory: MemoryModel | None = None
    """The measured memory model (B frees what it does not leave for W), once re-planned."""
    tracker: ActivationTracker | None = None
    _peaks: list = field(default_factory=list)
    """(this rank's measured peak bytes, its simulated peak units) per profiled iteration."""
    _leftovers: list = field(default_factory=list)
    """This rank's largest per-chunk share that B leaves for W, per profiled iteration."""

    def __post_init__(self) -> None:
        if self.after < 0:
            raise ValueError(f"re-plan after must be >= 0 iterations (0 = never), got {self.after}")

    @property
    def profiling(self) -> bool:
        """Still in the profiled iterations (time passes exactly, track memory)?"""
        return self.after > 0 and not self.done

    def start_step(self, parameters) -> ActivationTracker | None:
        """A fresh tracker for a profiled iteration, else None."""
        if not self.profiling:
            return None
        self.tracker = ActivationTracker(parameters)
        return self.tracker

    def end_step(self, schedule: Schedule, rank: int, pass_bytes=()) -> bool:
        """Record a profiled iteration (``pass_bytes``: the step's tracked bytes change per F
        and B pass); True when it is time to re-plan."""
        if not self.profiling:
            return False
        if self.tracker is not None:
            if self.limit is not None and self.limit.needs_activation_bytes:
                units = simulate(schedule).peak_memory[rank]
                self._peaks.append((self.tracker.peak, units))
            self.tracker = None
        leftover = backward_leftover(pass_bytes, schedule.placement)
        if leftover:
            self._leftovers.append(max(leftover.values()))
        self.steps += 1
        return self.steps >= self.after

    def measured(self, profile: PassProfile, schedule: Schedule, rank: int, pp_group, groups,
                 spec) -> Costs | None:
        """Agree on per-stage costs (and bytes per unit) over every rank (collective over the
        world): each stage's F, B and W apart, so rank 0's chunk 1 (LM head and loss) keeps
        its own weight in the search. None, on every rank alike, where the agreed costs are
        not times (:meth:`agreed_costs`): keep the schedule running."""
        placement = schedule.placement
        try:
            local = [t[k] for k in range(3) for t in profile.gather_costs(
                placement, rank, group=pp_group).stage_times(placement)]
        except ScheduleError as err:  # not times: NaN makes the mean fall back on every rank
            log.warning("[vshape] pipeline rank %d measured %s", rank, err)
            local = [math.nan] * (3 * placement.num_stages)
        comm = measure_hop_latency(groups, spec.shape, spec.dtype, spec.wire_device)
        device = spec.wire_device  # gloo with CUDA ranks (one shared GPU): reduce on the host
        values = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(values)
        values /= dist.get_world_size()  # every rank holds its pipeline's costs: the mean
        s = placement.num_stages
        f, b, w = (values[i * s:(i + 1) * s].tolist() for i in range(3))
        self.done = True
        costs = self.agreed_costs(placement, f, b, w, comm)
        if costs is None:
            return None
        if self._peaks:
            per_unit = max(peak / units for peak, units in self._peaks if units > 0)
            top = torch.tensor([per_unit], dtype=torch.float64, device=device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            self.activation_bytes = float(top[0])
        self.memory = self._agreed_memory(device)
        return costs

    @staticmethod
    def agreed_costs(placement, forward, backward, weight, comm) -> Costs | None:
        """The measured per-stage costs, or None with a logged warning when any of them is not
        a time (the one check, :func:`..schedule.model.costs.pass_time`, in ``Costs``)."""
        try:
            return Costs.for_stages(placement, forward, backward, weight, comm=comm)
        except ScheduleError as err:
            log.warning("[vshape] not re-planning: the measured %s; keeping the schedule "
                        "trained with so far", err)
            return None

    def _agreed_memory(self, device) -> MemoryModel | None:
        """The memory model every rank uses: the largest leftover any rank measured (what
        fits under it fits everywhere); None when nothing was measured (-1 on every rank)."""
        mine = max(self._leftovers, default=-1.0)
        top = torch.tensor([mine], dtype=torch.float64, device=device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        leftover = float(top[0])
        if leftover < 0:
            return None
        leftover = round(leftover, 3)  # a few bytes' noise must not change the plan
        return MemoryModel(1.0, leftover - 1.0, -leftover)

    def limit_units(self, ranks: int, microbatches: int) -> float | None:
        """The limit in units for the next search (None: no limit)."""
        if self.limit is None:
            return None
        return self.limit.units(ranks, microbatches, self.activation_bytes)
