"""The planner: evaluate every configuration, rank the ones that fit (``vshape plan``).

For every (DP, TP, PP, micro batch size) point of the :class:`~.candidates.SearchSpace`, every
fixed schedule and each recomputation kind that schedule takes (:mod:`.recompute`: ``1f1b-r``,
``v-half+sel``), :class:`~.evaluate.Evaluator` predicts memory and time. ``auto`` (the
paper's adaptive scheduler, section 4) is searched only at the ``auto_candidates`` best points:
a search costs up to seconds where a fixed schedule costs milliseconds, and it can only help
where the pipeline, not TP or DP, is the bottleneck. Likewise, under ``stage_layouts="best"``
the few fastest rows of each schedule are re-evaluated on the layout of whole layers per stage
their schedule runs fastest (:mod:`.layout_search`). The result ranks the feasible rows by
predicted throughput (tokens per second per GPU), fastest first.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from ..schedule.names import AUTO, V_HALF, V_MIN, schedule_info
from .candidates import NO_PIPELINE, GridPoint, SearchSpace, grid_points
from .evaluate import Evaluator, Prediction
from .model import ModelConfig
from .profile_file import MeasuredProfile
from .recompute import recompute_choices
from .settings import GIB, ClusterConfig, TrainingConfig

__all__ = ["PlanResult", "plan"]

log = logging.getLogger(__name__)

LAYOUT_ROWS = 4
"""Rows per schedule label that get a chosen layout under ``stage_layouts="best"``."""

_PROXIES = (V_MIN, V_HALF)
"""Schedules that rank points for ``auto`` when no fixed schedule was asked for."""


@dataclass(frozen=True)
class PlanResult:
    """Every evaluated configuration, the feasible ones ranked first."""

    model: ModelConfig
    training: TrainingConfig
    cluster: ClusterConfig
    space: SearchSpace
    predictions: tuple[Prediction, ...]
    """Feasible rows, fastest first, then the infeasible ones."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Points not evaluated, by reason (e.g. the global batch does not divide)."""
    seconds: float = 0.0
    costs: str = ""
    """Where pass times come from."""

    @property
    def feasible(self) -> list[Prediction]:
        return [p for p in self.predictions if p.feasible]

    @property
    def infeasible(self) -> list[Prediction]:
        return [p for p in self.predictions if not p.feasible]

    def infeasible_counts(self) -> Counter:
        """Infeasible rows by kind (memory, layers, schedule, search)."""
        return Counter(p.reason_kind for p in self.infeasible)

    def failure_message(self) -> str:
        """Why nothing fits: the counts, and the configuration closest to fitting."""
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.infeasible_counts().items()))
        text = (f"no configuration of {self.model.name} fits {self.cluster.gpus} GPUs x "
                f"{self.cluster.gpu_memory_gib:g} GiB (infeasible: {counts or 'none evaluated'}")
        if self.skipped:
            text += "; skipped: " + ", ".join(f"{n} {k}" for k, n in self.skipped.items())
        text += ")"
        memory = [p for p in self.infeasible if p.reason_kind == "memory"]
        if memory:
            best = min(memory, key=lambda p: p.peak_bytes)
            lay = best.layout
            text += (f"; the smallest needs {best.peak_bytes / GIB:.1f} GiB + "
                     f"{self.cluster.reserved_gib:g} GiB reserved per GPU (DP={lay.dp} "
                     f"TP={lay.tp} PP={lay.pp} micro batch {lay.micro_batch_size}, "
                     f"{lay.schedule}): use more or larger GPUs (--gpus, --gpu-memory), a "
                     "shorter --seq-length, or smaller --micro-batch-sizes")
        return text


def _rank_key(p: Prediction):
    return (-p.tokens_per_second_per_gpu, p.peak_bytes, p.layout.label, p.layout.pp,
            p.layout.tp, p.layout.micro_batch_size)


def _auto_points(evaluator: Evaluator, points: list[GridPoint], rows: list[Prediction],
                 space: SearchSpace) -> list[GridPoint]:
    """The ``auto_candidates`` points where the fixed schedules (or V proxies) do best."""
    model = evaluator.model
    pipelined = [p for p in points if 1 < p.pp and 2 * p.pp <= model.num_layers]  # a V fits
    fixed = [s for s in space.schedules if not schedule_info(s).memory_limited]
    by_point: dict[GridPoint, list[Prediction]] = {p: [] for p in pipelined}
    if fixed:
        for row in rows:
            key = _point_of(row)
            if key in by_point and row.layout.recompute == "none":  # auto recomputes nothing
                by_point[key].append(row)
    else:
        for point in pipelined:
            by_point[point] = [evaluator.evaluate(point, name) for name in _PROXIES]

    def score(point: GridPoint):
        found = by_point[point]
        fits = [r.tokens_per_second_per_gpu for r in found if r.feasible]
        if fits:
            return (0, -max(fits))
        return (1, min((r.peak_bytes for r in found if r.peak_bytes), default=float("inf")))

    return sorted(pipelined, key=score)[:space.auto_candidates]


def _with_best_layouts(evaluator: Evaluator, rows: list[Prediction]) -> list[Prediction]:
    """``rows`` (on the even layout) with the :data:`LAYOUT_ROWS` fastest pipelined ones of
    each schedule label re-evaluated on their best layout (plan/layout_search.py): a layout
    search simulates up to 60 layouts, so it runs where it can change the ranking; a layout
    gains 5-30%, and the rows below the few best of their schedule rarely climb over them. A
    label with fewer feasible rows tries its rows that missed the memory by least, which a
    layout moving layers off the fullest rank can bring in."""
    best: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if row.layout.pp > 1 and (row.feasible or row.reason_kind == "memory"):
            best.setdefault(row.layout.label, []).append(i)
    rows = list(rows)
    for label, indices in best.items():
        indices.sort(key=lambda i: (not rows[i].feasible, -rows[i].tokens_per_second_per_gpu,
                                    rows[i].peak_bytes))
        for i in indices[:LAYOUT_ROWS]:
            lay = rows[i].layout
            rows[i] = evaluator.evaluate(_point_of(rows[i]), lay.schedule, lay.recompute, "best")
    return rows


def _point_of(row: Prediction) -> GridPoint:
    lay = row.layout
    return GridPoint(lay.dp, lay.tp, lay.pp, lay.micro_batch_size, row.microbatches, lay.ep)


def plan(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig,
         space: SearchSpace = SearchSpace(), profile: MeasuredProfile | None = None
         ) -> PlanResult:
    """Predict every configuration of ``space``; feasible ones ranked fastest first."""
    started = time.perf_counter()
    evaluator = Evaluator(model, training, cluster, profile)
    points, skipped = grid_points(model, training, cluster, space)
    rows: list[Prediction] = []
    for point in points:
        names = [NO_PIPELINE] if point.pp == 1 else \
            [s for s in space.schedules if not schedule_info(s).memory_limited]
        rows.extend(evaluator.evaluate(point, name, kind) for name in names
                    for kind in recompute_choices(name, space.recompute,
                                                  training.flash_attention))
    log.info("evaluated %d fixed-schedule configurations in %.2f s", len(rows),
             time.perf_counter() - started)
    if space.stage_layouts == "best":
        rows = _with_best_layouts(evaluator, rows)
    if AUTO in space.schedules and space.auto_candidates and "none" in space.recompute:
        for point in _auto_points(evaluator, points, rows, space):
            rows.append(evaluator.evaluate_auto(point))
    feasible = sorted((r for r in rows if r.feasible), key=_rank_key)
    infeasible = [r for r in rows if not r.feasible]
    costs = evaluator.times(1, 1).source if evaluator.profile is None else \
        f"profile {profile.path}"
    return PlanResult(model, training, cluster, space, tuple(feasible + infeasible),
                      dict(skipped), time.perf_counter() - started, costs)
