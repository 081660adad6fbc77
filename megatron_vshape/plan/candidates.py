"""Which (DP, TP, PP, EP, micro batch size) points a plan considers.

TP stays inside a node (it divides the GPUs per node) and must divide the attention heads (and
query groups); PP must leave every pipeline stage a layer; DP is what is left of the GPUs. A
point runs global_batch / (DP x micro batch size) microbatches, and is skipped (and counted)
when that is not a whole number. MoE models add expert parallelism (EP): the routed experts are
split over EP ranks taken from the DP x TP ranks of a pipeline stage (expert tensor parallel 1,
megatron-core's ``--expert-tensor-parallel-size 1``), so EP divides the experts and DP x TP.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..schedule.model.size import MAX_SIZE, too_large
from ..schedule.names import SCHEDULES, schedule_info
from .model import ModelConfig
from .recompute import RECOMPUTE
from .settings import ClusterConfig, TrainingConfig

__all__ = ["SearchSpace", "GridPoint", "tensor_parallel_choices", "pipeline_parallel_choices",
           "expert_parallel_choices", "grid_points", "NO_PIPELINE", "STAGE_LAYOUTS"]

STAGE_LAYOUTS = ("best", "even")
"""How layers are laid over the stages: ``best`` chooses per schedule (plan/layout_search.py),
``even`` keeps the plugin's default (plan/shares.py ``even_stages``)."""

NO_PIPELINE = "none"
"""The schedule name of PP = 1 rows: gradient accumulation over the microbatches, no pipeline."""


def _ints(values, flag: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    values = tuple(values)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise ValueError(f"{flag} must be positive integers, got {list(values)}")
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class SearchSpace:
    """What to search over; None means every valid value."""

    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules for PP > 1 (``--schedules``); PP = 1 rows are schedule ``none``."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro batch sizes (``--micro-batch-sizes``)."""
    tensor_parallel: tuple[int, ...] | None = None
    """TP sizes (``--tp``); None: every divisor of the GPUs that fits a node and the heads."""
    pipeline_parallel: tuple[int, ...] | None = None
    """PP sizes (``--pp``); None: every divisor of the GPUs up to the layer count."""
    auto_candidates: int = 3
    """``auto`` searches only at the best this many (DP, TP, PP, micro batch) points of the
    fixed schedules (``--auto-candidates``): each search takes up to seconds."""
    recompute: tuple[str, ...] = RECOMPUTE
    """Activation recomputation kinds to plan (``--recompute``; which schedules take which:
    plan/recompute.py)."""
    expert_parallel: tuple[int, ...] | None = None
    """EP sizes for MoE models (``--ep``); None: every valid one (1 for dense models)."""
    stage_layouts: str = "even"
    """``best``: each pipelined row runs the layout of whole layers per stage its schedule
    runs fastest (plan/layout_search.py; ``vshape plan``'s default, ``--stage-layouts``);
    ``even``: the plugin's default layout, what the paper's grid (``vshape paper``,
    ``vshape grid``) launches and so predicts."""

    def __post_init__(self) -> None:
        bad = [r for r in self.recompute if r not in RECOMPUTE]
        if bad or not self.recompute:
            raise ValueError(f"--recompute: unknown {bad or 'none given'}; valid choices: "
                             f"{', '.join(RECOMPUTE)}")
        object.__setattr__(self, "recompute", tuple(dict.fromkeys(self.recompute)))
        if not self.schedules:
            raise ValueError(f"--schedules: none given; valid choices: {', '.join(SCHEDULES)}")
        for schedule in self.schedules:
            schedule_info(schedule, "--schedules")
        object.__setattr__(self, "schedules", tuple(dict.fromkeys(self.schedules)))
        object.__setattr__(self, "micro_batch_sizes",
                           _ints(self.micro_batch_sizes, "--micro-batch-sizes"))
        object.__setattr__(self, "tensor_parallel", _ints(self.tensor_parallel, "--tp"))
        object.__setattr__(self, "pipeline_parallel", _ints(self.pipeline_parallel, "--pp"))
        object.__setattr__(self, "expert_parallel", _ints(self.expert_parallel, "--ep"))
        if self.stage_layouts not in STAGE_LAYOUTS:
            raise ValueError(f"--stage-layouts must be one of {', '.join(STAGE_LAYOUTS)}, "
                             f"got {self.stage_layouts!r}")
        if not isinstance(self.auto_candidates, int) or self.auto_candidates < 0:
            raise ValueError(f"--auto-candidates must be an integer >= 0, got "
                             f"{self.auto_candidates!r}")


@dataclass(frozen=True)
class GridPoint:
    """One (DP, TP, PP, micro batch size) point and its microbatch count."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    microbatches: int
    ep: int = 1
    """Expert-parallel ranks (MoE; 1 for dense models)."""


def tensor_parallel_choices(model: ModelConfig, cluster: ClusterConfig,
                            space: SearchSpace) -> tuple[int, ...]:
    node = min(cluster.gpus, cluster.gpus_per_node)
    valid = tuple(t for t in range(1, node + 1)
                  if cluster.gpus % t == 0 and node % t == 0
                  and model.num_attention_heads % t == 0 and model.query_groups % t == 0)
    return _chosen(space.tensor_parallel, valid, "--tp",
                   f"for {model.name} on {cluster.gpus} GPUs ({cluster.gpus_per_node} per node; "
                   f"TP must divide the GPUs, the GPUs of a node and the "
                   f"{model.num_attention_heads} heads)")


def pipeline_parallel_choices(model: ModelConfig, cluster: ClusterConfig,
                              space: SearchSpace) -> tuple[int, ...]:
    valid = tuple(p for p in range(1, min(cluster.gpus, model.num_layers) + 1)
                  if cluster.gpus % p == 0)
    return _chosen(space.pipeline_parallel, valid, "--pp",
                   f"for {model.name} on {cluster.gpus} GPUs (PP must divide the GPUs and not "
                   f"exceed the {model.num_layers} layers)")


def expert_parallel_choices(model: ModelConfig, space: SearchSpace) -> tuple[int, ...]:
    """EP sizes to try: divisors of the expert count (only 1 for a dense model); each point
    keeps those that also divide its DP x TP."""
    valid = tuple(e for e in range(1, (model.num_experts or 1) + 1)
                  if (model.num_experts or 1) % e == 0)
    why = (f"for {model.name} ({model.num_experts} experts: EP must divide them)" if model.moe
           else f"for {model.name}, a dense model (EP applies to MoE models only)")
    return _chosen(space.expert_parallel, valid, "--ep", why)


def _chosen(given, valid: tuple[int, ...], flag: str, why: str) -> tuple[int, ...]:
    """The user's choices (every valid one when none were given), refusing invalid ones."""
    if given is None:
        return valid
    bad = [v for v in given if v not in valid]
    if bad:
        raise ValueError(f"{flag} {bad} invalid {why}; valid choices: "
                         f"{', '.join(map(str, valid))}")
    return given


def grid_points(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig,
                space: SearchSpace) -> tuple[list[GridPoint], Counter]:
    """Every point whose microbatch count is whole, and how many were skipped, by reason."""
    points, skipped = [], Counter()
    cp = training.context_parallel
    if cluster.gpus % cp:
        raise ValueError(f"--gpus {cluster.gpus} must be a multiple of --cp {cp} (DP x TP x PP "
                         f"x CP GPUs); e.g. --cp 1, or --gpus {cluster.gpus // cp * cp or cp}")
    eps = expert_parallel_choices(model, space)
    for tp in tensor_parallel_choices(model, cluster, space):
        for pp in pipeline_parallel_choices(model, cluster, space):
            if cluster.gpus % (tp * pp * cp):
                continue
            dp = cluster.gpus // (tp * pp * cp)
            for ep in eps:
                if (dp * tp) % ep:
                    skipped["EP does not divide DP x TP"] += 1
                    continue
                for b in space.micro_batch_sizes:
                    if training.global_batch % (dp * b):
                        skipped["global batch not divisible by DP x micro batch size"] += 1
                        continue
                    microbatches = training.global_batch // (dp * b)
                    if pp > 1 and too_large(pp, microbatches):
                        skipped[f"PP x microbatches over {MAX_SIZE:,}, too large to schedule "
                                f"in about a minute"] += 1
                        continue
                    points.append(GridPoint(dp, tp, pp, b, microbatches, ep))
    return points, skipped
