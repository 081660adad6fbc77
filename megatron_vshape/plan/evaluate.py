"""One plan row: the memory and time a (DP, TP, PP, micro batch, schedule) point should take.

Memory per rank = parameters, gradients and optimizer state of its chunks (:mod:`.memory`)
plus its peak activation bytes, found by walking the schedule's order for that rank; the point
fits when every rank stays within the GPU's memory less the reserve. Time = the simulator's
makespan (:func:`megatron_vshape.schedule.model.simulate`) with per-rank costs from the part times
(:mod:`.cost` or a profile file) and the pipeline hop, plus the exposed data-parallel
communication. ``auto`` searches (:func:`megatron_vshape.schedule.search`) for the fastest V
schedule under the memory left on the tightest rank.

Schedules depend only on (name, p, m) and makespans scale with the costs, so the
:class:`Evaluator` keeps each schedule once and each simulation once per cost ratio.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable

from ..schedule import Costs, MemoryModel, ScheduleError, build_schedule, simulate
from ..schedule.model.placement import Layout as StageLayout, Placement
from ..schedule.search import InfeasibleMemoryError, memory_limit_units, search
from ..schedule.names import AUTO
from .candidates import NO_PIPELINE, STAGE_LAYOUTS, GridPoint
from .cost import (PartTimes, PassTimes, analytic_times, dp_seconds, model_flops_per_sample,
                   p2p_seconds, rank_costs, replay_share, stage_costs, stage_times,
                   with_recompute)
from .layout_search import best_layout
from .memory import (ChunkBytes, activation_sizes, chunk_bytes, peak_activation_bytes,
                     static_memory)
from .model import ModelConfig
from .profile_file import MeasuredProfile
from .settings import GIB, ClusterConfig, ParallelLayout, TrainingConfig
from .shares import (even_stages, rank_shares, shares_by_rank, stages_from_counts,
                     whole_model_share)

__all__ = ["Prediction", "Evaluator", "RankMemory"]

log = logging.getLogger(__name__)

_AUTO_RETRIES = 2
_PROBE = 3
"""Every fixed schedule reaches its peak memory within its first 3p microbatches (warm-up and
one steady-state period; tests/plan/test_plan.py checks it), so memory is checked on a schedule of
min(m, 3p) microbatches and the full one is built only for configurations that fit."""


@dataclass(frozen=True)
class Prediction:
    """Predicted memory and time of one configuration (memory of its fullest rank)."""

    layout: ParallelLayout
    microbatches: int
    feasible: bool
    reason: str = ""
    """Why it does not fit or cannot run (empty when feasible)."""
    reason_kind: str = ""
    """``memory``, ``layers``, ``schedule`` or ``search`` (empty when feasible)."""
    peak_rank: int = 0
    """The pipeline rank with the most memory."""
    activation_bytes: float = 0.0
    weight_bytes: float = 0.0
    gradient_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes_per_rank: tuple[float, ...] = ()
    iteration_seconds: float = 0.0
    bubble_rate: float = 0.0
    """Idle fraction of the busiest rank over the pipeline's makespan."""
    dp_seconds: float = 0.0
    """Exposed data-parallel communication included in ``iteration_seconds``."""
    p2p_seconds: float = 0.0
    tokens_per_second_per_gpu: float = 0.0
    tflops_per_gpu: float = 0.0
    """Model FLOPs (3 x forward, no recomputation) per second per GPU."""
    costs: str = ""
    description: str = ""
    stage_layers: tuple[int, ...] = ()
    """Transformer layers per global stage (the layout, :mod:`.layout_search`), stage 0
    first; the embedding is on the first, the LM head and loss on the last."""

    @property
    def peak_bytes(self) -> float:
        return (self.activation_bytes + self.weight_bytes + self.gradient_bytes
                + self.optimizer_bytes)

    @property
    def dominant(self) -> str:
        """The largest memory component on the fullest rank."""
        parts = {"activations": self.activation_bytes, "weights": self.weight_bytes,
                 "gradients": self.gradient_bytes, "optimizer": self.optimizer_bytes}
        return max(parts, key=parts.get)


@dataclass(frozen=True)
class RankMemory:
    """What the memory check needs of one configuration, per rank."""

    chunks: tuple[tuple[ChunkBytes, ...], ...]
    static: tuple
    shares: tuple


class Evaluator:
    """Evaluates configurations of one model on one cluster, reusing schedules and simulations."""

    def __init__(self, model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig,
                 profile: MeasuredProfile | None = None, stage_layouts: str = "even"):
        if profile is not None and profile.seq_length != training.seq_length:
            raise ValueError(f"--profile {profile.path!r} was measured at seq_length "
                             f"{profile.seq_length}, the plan is for --seq-length "
                             f"{training.seq_length}; measure at that length or change "
                             "--seq-length")
        if stage_layouts not in STAGE_LAYOUTS:
            raise ValueError(f"--stage-layouts must be one of {', '.join(STAGE_LAYOUTS)}, got "
                             f"{stage_layouts!r}")
        self.model, self.training, self.cluster, self.profile = model, training, cluster, profile
        self.stage_layouts = stage_layouts
        self._schedules: dict = {}
        self._simulations: dict = {}
        self._analytic_times: dict = {}

    # -- the parts ---------------------------------------------------------------------------
    def _analytic(self, tp: int, micro_batch_size: int, ep: int = 1) -> PartTimes:
        """The cost model's times (cached: the shape model times every kernel)."""
        key = (tp, micro_batch_size, ep)
        if key not in self._analytic_times:
            self._analytic_times[key] = analytic_times(self.model, self.training, self.cluster,
                                                       tp, micro_batch_size, ep)
        return self._analytic_times[key]

    def times(self, tp: int, micro_batch_size: int, recompute: str = "none",
              ep: int = 1) -> PartTimes:
        analytic = self._analytic(tp, micro_batch_size, ep)
        times = analytic if self.profile is None else self.profile.times(
            tp, micro_batch_size, analytic, lambda t, b: self._analytic(t, b, ep))
        if recompute != "selective":
            return with_recompute(times, recompute, 0.0)
        return with_recompute(times, recompute, replay_share(
            self.model, self.training, self.cluster, tp, micro_batch_size, ep))

    def hop(self, point: GridPoint) -> float:
        if self.profile is not None and self.profile.p2p_seconds is not None and point.pp > 1:
            return self.profile.p2p_seconds * point.micro_batch_size
        return p2p_seconds(self.training, self.cluster, self.model.hidden_size, point.tp,
                           point.pp, point.micro_batch_size)

    def schedule(self, name: str, p: int, m: int):
        """The paper's order for a name (``variant="paper"``): its memory probe needs orders
        whose peak settles within 3p microbatches, and training's fastest order of the same
        level is at most as slow (schedule/search/levels.py), so ranking by it is conservative."""
        key = (name, p, m)
        if key not in self._schedules:
            try:
                self._schedules[key] = build_schedule(name, p, m, variant="paper")
            except ScheduleError as err:
                self._schedules[key] = err
        return self._schedules[key]

    def simulate_stages(self, name: str, schedule, passes: tuple[PassTimes, ...],
                  comm: float) -> tuple[float, float]:
        """(makespan, bubble rate) of ``schedule`` with ``passes[s]`` the F, B, W of one
        microbatch through global stage s (:func:`.cost.stage_times`), simulated once per
        cost ratio."""
        scale = max(t.forward for t in passes)
        rel = tuple(tuple(max(round(getattr(t, k) / scale, 4), 1e-4)
                          for k in ("forward", "backward", "weight")) for t in passes)
        comm = round(comm / scale, 4)
        key = (name, schedule.ranks, schedule.microbatches, rel, comm)
        if key not in self._simulations:
            costs = Costs.for_stages(schedule.placement, *zip(*rel), comm=comm)
            result = simulate(schedule, costs)
            self._simulations[key] = (result.makespan, result.bubble_rate)
        makespan, bubble = self._simulations[key]
        return makespan * scale, bubble

    def rank_memory(self, point: GridPoint, shares, single: bool, recompute: str = "none"
                    ) -> RankMemory:
        """Per rank, its chunks' activation bytes and static memory. A profile's measured
        ``backward_leftover`` replaces the formula's share of a layer B leaves for W (a ratio,
        so it holds in any dtype); ``auto``'s memory model follows from it."""
        sizes = activation_sizes(self.model, self.training, point.tp, point.micro_batch_size,
                                 recompute)
        leftover = None if self.profile is None else self.profile.backward_leftover
        if leftover is not None:
            whole = activation_sizes(self.model, self.training, point.tp,
                                     point.micro_batch_size).layer
            sizes = dataclasses.replace(sizes, wgrad=leftover * whole)
        chunks = tuple(tuple(chunk_bytes(c, sizes) for c in rank) for rank in shares)
        shards = point.dp * self.training.context_parallel  # the optimizer shards over DP x CP
        static = tuple(static_memory(self.model, self.training, rank, point.tp, shards, single,
                                     point.ep) for rank in shares)
        return RankMemory(chunks, static, shares)

    # -- one configuration --------------------------------------------------------------------
    def evaluate(self, point: GridPoint, name: str, recompute: str = "none",
                 stage_layouts: str | None = None) -> Prediction:
        """The prediction for ``point`` under the fixed schedule ``name`` (at PP 1: none) with
        ``recompute`` (none, selective, full), on the even layout or the best one
        (``stage_layouts``; default the evaluator's)."""
        layouts = stage_layouts or self.stage_layouts
        if layouts not in STAGE_LAYOUTS:
            raise ValueError(f"--stage-layouts must be one of {', '.join(STAGE_LAYOUTS)}, got "
                             f"{layouts!r}")
        if point.pp == 1:
            return self._no_pipeline(point, ParallelLayout(
                point.dp, point.tp, 1, point.micro_batch_size, NO_PIPELINE, recompute, point.ep))
        layout = ParallelLayout(point.dp, point.tp, point.pp, point.micro_batch_size, name,
                                recompute, point.ep)
        probe = self.schedule(name, point.pp, min(point.microbatches, _PROBE * point.pp))
        if isinstance(probe, ScheduleError):
            return Prediction(layout, point.microbatches, False, str(probe), "schedule")
        try:
            even = even_stages(self.model, probe.placement)
        except ValueError as err:
            return Prediction(layout, point.microbatches, False, str(err), "layers")
        ranks = self.rank_memory(point, shares_by_rank(even, probe.placement), single=False,
                                 recompute=recompute)
        peaks = peak_activation_bytes(probe, ranks.chunks)
        if max(s.total + a for s, a in zip(ranks.static, peaks)) > self.cluster.budget_bytes \
                and layouts == "even":
            return self._memory_failure(point, layout, ranks, peaks,
                                        "parameters, optimizer state and activations")
        schedule = self.schedule(name, point.pp, point.microbatches)
        if isinstance(schedule, ScheduleError):
            return Prediction(layout, point.microbatches, False, str(schedule), "schedule")
        times = self.times(point.tp, point.micro_batch_size, recompute, point.ep)
        hop = self.hop(point)
        stages = even if layouts == "even" else self.choose_stages(
            point, name, recompute, probe, schedule, even, times, hop)
        if stages is None:  # no layout fits: report the even one's memory
            return self._memory_failure(point, layout, ranks, peaks,
                                        "parameters, optimizer state and activations")
        ranks = self.rank_memory(point, shares_by_rank(stages, schedule.placement),
                                 single=False, recompute=recompute)
        peaks = peak_activation_bytes(schedule, ranks.chunks)
        passes = stage_times(stages, times)
        return self._finish(point, layout, ranks, peaks, schedule.description,
                            lambda: self.simulate_stages(name, schedule, passes, hop), times, hop,
                            tuple(s.layers for s in stages))

    def choose_stages(self, point: GridPoint, name: str, recompute: str, probe, schedule,
                      even, times: PartTimes, hop: float):
        """The layout (:mod:`.layout_search`) whose simulated makespan is least among those
        whose memory fits on the probe schedule; None when none fits."""
        placement = schedule.placement

        def score(counts) -> float:
            stages = stages_from_counts(counts)
            ranks = self.rank_memory(point, shares_by_rank(stages, placement), single=False,
                                     recompute=recompute)
            peaks = peak_activation_bytes(probe, ranks.chunks)
            if max(s.total + a for s, a in zip(ranks.static, peaks)) > \
                    self.cluster.budget_bytes:
                return math.inf
            return self.simulate_stages(name, schedule, stage_times(stages, times), hop)[0]

        counts = tuple(s.layers for s in even)
        choice = best_layout(placement, self.model.num_layers, times, counts, score)
        return None if math.isinf(choice.score) else stages_from_counts(choice.counts)

    def evaluate_auto(self, point: GridPoint) -> Prediction:
        """``auto``: the fastest V schedule under the memory the tightest rank has left."""
        layout = ParallelLayout(point.dp, point.tp, point.pp, point.micro_batch_size, AUTO,
                                ep=point.ep)
        placement = Placement(point.pp, StageLayout.V)
        try:
            even = even_stages(self.model, placement)
        except ValueError as err:
            return Prediction(layout, point.microbatches, False, str(err), "layers")
        shares = shares_by_rank(even, placement)
        ranks = self.rank_memory(point, shares, single=False)
        times, hop = self.times(point.tp, point.micro_batch_size, ep=point.ep), self.hop(point)
        costs = stage_costs(placement, even, times, hop)  # rank 0's chunk 1 is the heavy one
        free = [self.cluster.budget_bytes - s.total for s in ranks.static]
        if min(free) <= 0:
            return self._memory_failure(point, layout, ranks, (0.0,) * point.pp,
                                        "parameters and optimizer state alone")
        # the search counts memory in units of a rank's share; B keeps what W needs
        unit = [sum(c.forward for c in chunks) for chunks in ranks.chunks]
        wgrad_share = max(sum(c.wgrad for c in ch) / sum(c.forward for c in ch)
                          for ch in ranks.chunks)
        kept = min(1.0, wgrad_share)
        memory = MemoryModel(1.0, -(1.0 - kept), -kept)
        shapes = wgrad_share <= 1.0  # else B grows the bytes: W-deferring shapes cost more
        limit = min(memory_limit_units(point.pp, point.microbatches, limit_bytes=f,
                                       activation_bytes=u) for f, u in zip(free, unit))
        for _ in range(_AUTO_RETRIES):
            try:
                found = search(point.pp, point.microbatches, costs, limit, memory, shapes)
            except InfeasibleMemoryError as err:
                return Prediction(layout, point.microbatches, False, str(err), "search")
            peaks = peak_activation_bytes(found.schedule, ranks.chunks)
            over = max(p / f for p, f in zip(peaks, free))
            if over <= 1.0:
                break
            limit /= over * 1.001  # the search's one-unit model missed uneven chunks: tighten
        schedule = found.schedule
        result = found.result
        return self._finish(point, layout, ranks, peaks, schedule.description,
                            lambda: (result.makespan, result.bubble_rate), times, hop,
                            tuple(c.layers for c in even))

    def activation_bytes(self, point: GridPoint, schedule, workspace: bool = True,
                         recompute: str = "none", stage_layers=None) -> tuple[float, ...]:
        """Per pipeline rank, the peak activation bytes of an already-built ``schedule`` (the
        one a run actually executed, e.g. what ``auto`` re-planned to) at ``point``: what
        ``vshape gpu-check`` compares with the bytes it measures (``workspace``: with the
        passes' scratch bytes, as the CUDA allocator sees them; without, the bytes kept for
        backward, as the runtime's saved-tensor tracker sees them) under ``recompute``;
        ``stage_layers``: layers per global stage (the layout that ran), None for the even
        one."""
        shares = rank_shares(self.model, schedule.placement) if stage_layers is None else \
            shares_by_rank(stages_from_counts(tuple(stage_layers)), schedule.placement)
        ranks = self.rank_memory(point, shares, single=False, recompute=recompute)
        return tuple(peak_activation_bytes(schedule, ranks.chunks, workspace))

    # -- helpers ------------------------------------------------------------------------------
    def _no_pipeline(self, point: GridPoint, layout: ParallelLayout) -> Prediction:
        shares = whole_model_share(self.model)
        ranks = self.rank_memory(point, shares, single=True, recompute=layout.recompute)
        chunk = ranks.chunks[0][0]
        # one microbatch at a time: F (and its scratch), then a fused backward on top of it
        ws = chunk.workspace
        peaks = (chunk.forward + max(ws.forward, chunk.transient + ws.backward),)

        times = self.times(point.tp, point.micro_batch_size, layout.recompute, point.ep)
        costs = rank_costs(shares, times, 0.0)

        def run() -> tuple[float, float]:
            per = costs.forward[0] + costs.backward[0] + costs.weight[0]
            return point.microbatches * per, 0.0

        return self._finish(point, layout, ranks, peaks,
                            "no pipeline: gradient accumulation over the microbatches", run,
                            times, 0.0, (self.model.num_layers,))

    def _memory_failure(self, point, layout, ranks: RankMemory, peaks, what: str) -> Prediction:
        totals = [s.total + a for s, a in zip(ranks.static, peaks)]
        r = max(range(len(totals)), key=totals.__getitem__)
        c = self.cluster
        reason = (f"memory: {what} need {totals[r] / GIB:.1f} GiB on pipeline rank {r}, "
                  f"{c.budget_bytes / GIB:.1f} GiB available ({c.gpu_memory_gib:g} GiB GPU - "
                  f"{c.reserved_gib:g} GiB reserved)")
        s = ranks.static[r]
        return Prediction(layout, point.microbatches, False, reason, "memory", r, peaks[r],
                          s.weights, s.gradients, s.optimizer, tuple(peaks))

    def _finish(self, point: GridPoint, layout: ParallelLayout, ranks: RankMemory, peaks,
                description: str, run: Callable[[], tuple[float, float]], times: PartTimes,
                hop: float, stage_layers: tuple[int, ...]) -> Prediction:
        totals = [s.total + a for s, a in zip(ranks.static, peaks)]
        if max(totals) > self.cluster.budget_bytes:
            return self._memory_failure(point, layout, ranks, peaks,
                                        "parameters, optimizer state and activations")
        r = max(range(len(totals)), key=totals.__getitem__)
        makespan, bubble = run()
        fullest = max(ranks.static, key=lambda s: s.parameters)
        # dense parameters reduce over DP, routed experts over DP x TP / EP ranks
        exposed = dp_seconds(self.training, self.cluster,
                             fullest.parameters - fullest.expert_parameters, point.tp,
                             point.dp * self.training.context_parallel)
        if fullest.expert_parameters:
            exposed += dp_seconds(self.training, self.cluster, fullest.expert_parameters,
                                  point.ep, point.dp * self.training.context_parallel
                                  * point.tp // point.ep)
        iteration = makespan + exposed
        tokens = self.training.global_batch * self.training.seq_length
        flops = model_flops_per_sample(self.model, self.training.seq_length)
        s = ranks.static[r]
        return Prediction(
            layout, point.microbatches, True, "", "", r, peaks[r], s.weights, s.gradients,
            s.optimizer, tuple(peaks), iteration, bubble, exposed, hop,
            tokens / iteration / self.cluster.gpus,
            flops * self.training.global_batch / iteration / self.cluster.gpus / 1e12,
            times.source, description, stage_layers)
