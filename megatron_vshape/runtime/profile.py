"""Per-pass profiling: measured T_F, T_B, T_W per stage (and T_comm), as simulator Costs.

The adaptive scheduler (schedule/search/adaptive.py) plans from costs; this turns the interpreter's
timelines (``StepResult.timeline``: every compute pass's start and end) into those costs:
the median duration of each pass kind per stage over the profiled steps, kept per stage
(``Costs.for_stages``): under a V rank 0's chunk 1 also runs the LM head and the loss, with
today's vocabularies several layers' worth, so its chunks are not halves of one share. T_comm
is a ping-pong over one of the rank's streams. On GPUs, run the profiled steps with
``RunnerConfig(synchronize=True)`` so host timestamps bracket the kernels.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from ..schedule.model.actions import PassKind
from ..schedule.model.costs import Costs
from ..schedule.model.placement import Placement
from .streams import StreamGroups

__all__ = ["PassProfile", "stage_costs_of", "measure_hop_latency"]


class PassProfile:
    """Durations of this rank's passes, per (kind, stage), over the steps it was fed."""

    def __init__(self, window: int = 64):
        """Keep the last ``window`` durations of each (kind, stage)."""
        self._durations: dict[tuple[PassKind, int], deque] = defaultdict(
            lambda: deque(maxlen=window))
        self.steps = 0

    def add(self, timeline) -> None:
        """Add one step's ``StepResult.timeline``."""
        for action, start, end in timeline:
            if action.kind is PassKind.BW:
                continue  # a fused pass cannot be split into B and W
            self._durations[(action.kind, action.stage)].append(end - start)
        self.steps += 1

    def stage_costs(self) -> dict[int, dict[str, float]]:
        """{stage: {"F": s, "B": s, "W": s}}: median seconds of each pass kind."""
        out: dict[int, dict[str, float]] = defaultdict(dict)
        for (kind, stage), values in self._durations.items():
            out[stage][kind.value] = statistics.median(values)
        return dict(out)

    def measured_stages(self) -> dict[int, tuple[float, float, float]]:
        """{stage: (F, B, W)}: median seconds of each of this rank's stages; ValueError when
        a stage lacks a kind (a schedule that fuses B and W cannot be profiled)."""
        stages = self.stage_costs()
        missing = sorted(s for s, c in stages.items() if set(c) != {"F", "B", "W"})
        if not stages or missing:
            raise ValueError("profile needs F, B and W passes on every stage (a schedule with a "
                             f"B/W split, e.g. v-half, not 1f1b); incomplete stages: {missing}")
        return {s: (c["F"], c["B"], c["W"]) for s, c in stages.items()}

    def rank_costs(self) -> tuple[float, float, float]:
        """(F, B, W) of this rank's whole layer share: its stages' medians summed."""
        stages = self.measured_stages().values()
        return tuple(sum(c[k] for c in stages) for k in range(3))

    def gather_costs(self, placement: Placement, pipeline_rank: int, comm: float = 0.0,
                     group=None) -> Costs:
        """Every pipeline stage's costs as one :class:`Costs` (collective over ``group``, the
        pipeline's ranks; default the world)."""
        mine = self.measured_stages()
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (pipeline_rank, mine), group=group)
        by_rank = dict(gathered)
        if sorted(by_rank) != list(range(placement.ranks)):
            raise ValueError(f"expected costs from pipeline ranks 0..{placement.ranks - 1}, got "
                             f"{sorted(by_rank)}; pass the pipeline group")
        return stage_costs_of(placement, by_rank, comm)


def stage_costs_of(placement: Placement, by_rank: dict, comm: float = 0.0) -> Costs:
    """Per-stage :class:`Costs` from each pipeline rank's ``measured_stages()`` (``by_rank``:
    {rank: {stage: (F, B, W)}}); ValueError when a stage was measured on no rank or on the
    wrong one."""
    times: dict[int, tuple] = {}
    for rank, stages in by_rank.items():
        for stage, fbw in stages.items():
            if not 0 <= stage < placement.num_stages or placement.rank_of(stage) != rank:
                raise ValueError(f"pipeline rank {rank} measured stage {stage}, which the "
                                 f"{placement.layout.value} layout does not place on it")
            times[stage] = fbw
    missing = sorted(set(range(placement.num_stages)) - set(times))
    if missing:
        raise ValueError(f"no pipeline rank measured stages {missing}")
    f, b, w = zip(*(times[s] for s in range(placement.num_stages)))
    return Costs.for_stages(placement, f, b, w, comm=comm)


def measure_hop_latency(groups: StreamGroups, shape: tuple, dtype=torch.float32,
                        device="cpu", rounds: int = 20) -> float:
    """Seconds one activation-sized message takes between pipeline ranks 0 and 1 (ping-pong
    on their chunk-0 activation stream; every pipeline rank must call it; others wait)."""
    stream = ("activation", 0)
    result = torch.zeros(1, dtype=torch.float64, device=device)
    if groups.rank in (0, 1):
        group = groups.group(stream)
        peer = groups.global_rank(1 - groups.rank)
        buf = torch.zeros(shape, dtype=dtype, device=device)
        begin = time.perf_counter()
        for _ in range(rounds):
            if groups.rank == 0:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
        result[0] = (time.perf_counter() - begin) / (2 * rounds)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result[0])
