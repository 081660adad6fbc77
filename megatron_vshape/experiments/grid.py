"""A grid search over hybrid parallelism, as ``configs/grid/NAME.yaml`` describes it.

The paper compares schedules the way a practitioner would pick them: for every data, tensor and
pipeline parallel size (DP x TP x PP = GPUs), microbatch size and schedule, train a few
iterations and keep the fastest point that fits in memory. A grid file names the model, the
GPUs, the global batch, the sequence lengths and the lists to cross; :func:`expand` crosses them
and keeps the points Megatron-LM and the plugin can run, skipping the rest with a reason::

    seq x TP x PP x mbs x schedule  --rules-->  points (run)  +  skipped (rule, reason)

The rules (:data:`RULES`, checked in order, the first failure names the skip) are Megatron-LM's
own argument checks (core_v0.16.1 ``validate_args`` and ``TransformerConfig``) and the V's layer
placement (``megatron/layers.py``), so a point that passes does not die at argument parsing.
:mod:`.grid_file` reads the YAML (configs/grid/README.md documents its schema).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..plan.candidates import GridPoint
from ..plan.evaluate import Evaluator
from ..plan.model import ModelConfig
from ..plan.settings import ClusterConfig, TrainingConfig
from ..schedule import SCHEDULES, Layout
from ..schedule.names import AUTO, REFERENCE, V_MIN, schedule_info

__all__ = ["ScheduleChoice", "Gpus", "SlurmOptions", "GridConfig", "LayerSplit", "Point", "Skip",
           "Expansion", "RULES", "PLAN_RULE", "expand", "prune", "layer_split",
           "model_state_bytes_lower_bound"]

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MEMORY_LIMIT = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*(?:[KMGT]i?B|B)?", re.I)


@dataclass(frozen=True)
class ScheduleChoice:
    """One entry of a grid's ``schedules`` list: a schedule and the flags that go with it."""

    schedule: str
    """One of :data:`SCHEDULES`; passed as ``--pipeline-schedule``."""
    label: str | None = None
    """Its name in run names, the CSV and plots; None: the schedule, plus ``-mem<limit>`` when
    memory_limit is set. Two choices of one grid must differ in label."""
    memory_limit: str | None = None
    """``--pipeline-memory-limit``: a fraction of 1F1B's activation memory (``0.5``) or bytes per
    GPU (``40GiB``); ``auto`` searches under it, fixed schedules are checked against it."""
    replan_after: int | None = None
    """``--pipeline-replan-after N``: re-plan ``auto`` from profiled costs after N iterations
    (0 = never); None leaves the entry's default."""
    extra_args: tuple[str, ...] = ()
    """Flags for this choice only, e.g. full activation recomputation for the paper's 1F1B-R."""

    def __post_init__(self) -> None:
        schedule_info(self.schedule, "schedules")
        if self.label is not None and not _LABEL.fullmatch(self.label):
            raise ValueError(f"schedules: label {self.label!r} must be letters, digits, '.', '_' "
                             f"or '-' (it becomes part of run and file names)")
        if self.memory_limit is not None and not _MEMORY_LIMIT.fullmatch(self.memory_limit):
            raise ValueError(f"schedules: memory_limit {self.memory_limit!r} must be a fraction "
                             f"of 1F1B's activation memory (0.5) or bytes with a unit (40GiB)")
        if self.replan_after is not None and self.replan_after < 0:
            raise ValueError(f"schedules: replan_after must be >= 0 (0 = never), got "
                             f"{self.replan_after}")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.memory_limit is None:
            return self.schedule
        return f"{self.schedule}-mem{self.memory_limit.replace(' ', '')}"


@dataclass(frozen=True)
class Gpus:
    """The GPUs every point of a grid runs on (one slurm allocation)."""

    nodes: int
    """Nodes (``#SBATCH --nodes``; one torchrun per node)."""
    per_node: int
    """GPUs per node (``torchrun --nproc-per-node``)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"gpus.{name} must be an integer >= 1, got {value!r}")

    @property
    def total(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class SlurmOptions:
    """``#SBATCH`` settings of the array job ``vshape grid --format slurm`` writes."""

    time: str = "01:00:00"
    """Time limit of one point (one array task)."""
    partition: str | None = None
    """``--partition``; None: the cluster's default."""
    account: str | None = None
    """``--account``; None: the user's default."""
    max_parallel: int | None = None
    """At most this many points at once (``--array=0-N%max_parallel``); None: no limit."""
    directives: tuple[str, ...] = ()
    """Further ``#SBATCH`` options, written as given (e.g. ``--qos=high``)."""

    def __post_init__(self) -> None:
        if self.max_parallel is not None and (not isinstance(self.max_parallel, int)
                                              or self.max_parallel < 1):
            raise ValueError(f"slurm.max_parallel must be an integer >= 1, got "
                             f"{self.max_parallel!r}")
        for option in self.directives:
            if not str(option).startswith("--"):
                raise ValueError(f"slurm.directives: {option!r} must be a long option such as "
                                 f"--qos=high")


@dataclass(frozen=True)
class GridConfig:
    """A grid file: what to cross, on which model and GPUs, with which fixed flags."""

    name: str
    """Prefix of every run name (default: the grid file's stem)."""
    model: ModelConfig
    """The model (``model:`` names a model YAML, relative to the grid file, or a bundled model)."""
    model_file: str
    """That YAML's path, as written in the grid file."""
    gpus: Gpus
    """Nodes x GPUs per node; DP = GPUs / (TP x PP)."""
    seq_lengths: tuple[int, ...]
    """Sequence lengths (``--seq-length``); the paper uses 1024, 3072 and 16384."""
    global_batch: tuple[tuple[int, int], ...]
    """(sequence length, global batch in sequences) for every sequence length."""
    tp: tuple[int, ...]
    """Tensor parallel sizes to try."""
    pp: tuple[int, ...]
    """Pipeline parallel sizes to try (1: no pipeline, only ``1f1b`` runs)."""
    mbs: tuple[int, ...]
    """Microbatch sizes to try."""
    schedules: tuple[ScheduleChoice, ...]
    """Schedules to try at every (TP, PP, mbs)."""
    train_iters: int = 30
    """Iterations per point (``--train-iters``): enough for a steady median."""
    log_interval: int = 1
    """``--log-interval``; 1 logs every iteration, so the median needs no averaging."""
    extra_args: tuple[str, ...] = ()
    """Flags every point gets, e.g. ``--use-distributed-optimizer --sequence-parallel --bf16``."""
    gpu_memory_gib: float | None = None
    """GPU memory; when set, points whose weights, gradients and optimizer state alone cannot
    fit (:func:`model_state_bytes_lower_bound`) are skipped. None: no memory check."""
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    """Settings of the slurm array job."""

    def __post_init__(self) -> None:
        for name in ("seq_lengths", "tp", "pp", "mbs"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1
                                 for v in values):
                raise ValueError(f"{name} must be a non-empty list of integers >= 1, got "
                                 f"{list(values)!r}")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} lists a value twice: {list(values)!r}")
        if not self.schedules:
            raise ValueError(f"schedules must list at least one of: {', '.join(SCHEDULES)}")
        labels = [c.name for c in self.schedules]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"schedules: label(s) {twice} used twice; give each entry its own "
                             f"label")
        if {s for s, _ in self.global_batch} != set(self.seq_lengths):
            raise ValueError(f"global_batch must give a batch for every sequence length "
                             f"{list(self.seq_lengths)}")
        for name in ("train_iters", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not _LABEL.fullmatch(self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits, '.', '_' or '-'")

    def global_batch_for(self, seq_length: int) -> int:
        return dict(self.global_batch)[seq_length]

    @property
    def distributed_optimizer(self) -> bool:
        return "--use-distributed-optimizer" in self.extra_args


class LayerSplit(enum.Enum):
    """How a point's transformer layers are spread over its pipeline ranks.

    The paper's models have k x p - 2 layers: the two missing layers make room for the
    embedding and the LM head. On a V both sit on rank 0 and the plugin places the layers
    (``megatron/layers.py``). On the standard placements Megatron-LM's
    ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`` counts
    them as one layer each, so the first and last ranks run one layer fewer.
    """

    NO_PIPELINE = "none"
    """PP = 1: every layer on every rank."""
    EVEN = "even"
    """num_layers divides evenly over the stages."""
    EMBEDDING_AND_LOSS = "embedding-and-loss"
    """num_layers + 2 divides evenly (embedding and loss counted as layers)."""
    V = "v"
    """The plugin's V placement (2 stages per rank, missing layers taken from rank 0)."""


@dataclass(frozen=True)
class Point:
    """One run of the grid."""

    index: int
    """Line of the commands file (0-based) = slurm array task id."""
    grid: str
    """The grid's name (run-name prefix)."""
    seq_length: int
    """``--seq-length``."""
    global_batch: int
    """``--global-batch-size``, in sequences."""
    dp: int
    """Data parallel size: GPUs / (TP x PP)."""
    tp: int
    """``--tensor-model-parallel-size``."""
    pp: int
    """``--pipeline-model-parallel-size``."""
    mbs: int
    """``--micro-batch-size``."""
    choice: ScheduleChoice
    """The schedule and its flags."""
    layout: Layout
    """Where the schedule puts the stages (V, one stage per rank, or interleaved loop)."""
    layer_split: LayerSplit

    @property
    def microbatches(self) -> int:
        """Microbatches per iteration on each pipeline: global batch / (DP x mbs)."""
        return self.global_batch // (self.dp * self.mbs)

    @property
    def name(self) -> str:
        """Run name; :func:`..logs.parse_run_name` reads it back."""
        return (f"{self.grid}-s{self.seq_length}-gb{self.global_batch}-dp{self.dp}-tp{self.tp}"
                f"-pp{self.pp}-mbs{self.mbs}-{self.choice.name}")


@dataclass(frozen=True)
class Skip:
    """A grid point that is not run, and why."""

    seq_length: int
    """Where in the grid: sequence length, TP, PP, microbatch size and DP."""
    tp: int
    pp: int
    mbs: int
    dp: int | None
    """None when TP x PP does not divide the GPUs."""
    label: str
    """The schedule choice's name."""
    rule: str
    """The first rule it fails (a key of :data:`RULES`), or :data:`PLAN_RULE` (:func:`prune`)."""
    reason: str
    """What is wrong, with the numbers, and what would make it valid."""

    def describe(self) -> str:
        dp = "?" if self.dp is None else self.dp
        return (f"s{self.seq_length} dp{dp} tp{self.tp} pp{self.pp} mbs{self.mbs} {self.label}: "
                f"{self.reason}")


@dataclass(frozen=True)
class Expansion:
    """What :func:`expand` returns: the points to run and the skipped ones."""

    grid: GridConfig
    points: tuple[Point, ...]
    skipped: tuple[Skip, ...]

    def skipped_by_rule(self) -> dict[str, list[Skip]]:
        groups: dict[str, list[Skip]] = {}
        for skip in self.skipped:
            groups.setdefault(skip.rule, []).append(skip)
        return groups


def layer_split(model: ModelConfig, pp: int, layout: Layout) -> LayerSplit | None:
    """How ``model``'s layers go on ``pp`` ranks under ``layout``; None when they cannot."""
    layers = model.num_layers
    if pp == 1:
        return LayerSplit.NO_PIPELINE
    if layout is Layout.V:
        return LayerSplit.V if layers >= 2 * pp else None
    stages = pp * layout.chunks
    if (layers + 2) % stages == 0:
        return LayerSplit.EMBEDDING_AND_LOSS
    if layers % stages == 0:
        return LayerSplit.EVEN
    return None


def model_state_bytes_lower_bound(model: ModelConfig, tp: int, pp: int, dp: int,
                                  distributed_optimizer: bool) -> float:
    """Bytes of weights, gradients and optimizer state on the fullest GPU, from below.

    Per parameter: bf16 weight, fp32 gradient and fp32 master weight plus Adam's two moments
    (18 bytes), the last 12 sharded over DP with the distributed optimizer (6 + 12 / DP), as
    Megatron-LM's ``theoretical_memory_usage.py`` counts them. Only the average rank's share of
    the transformer layers is counted (no embedding, no activations), so a point over the GPU's
    memory by this bound cannot run.
    """
    per_parameter = 6 + 12 / dp if distributed_optimizer else 18
    return model.num_layers * model.layer_parameters() / (pp * tp) * per_parameter


@dataclass(frozen=True)
class _Candidate:
    seq_length: int
    global_batch: int
    tp: int
    pp: int
    mbs: int
    dp: int | None
    choice: ScheduleChoice
    layout: Layout


def _rule_gpus(c: _Candidate, grid: GridConfig) -> str | None:
    if c.dp is None:
        return f"TP x PP = {c.tp * c.pp} does not divide the grid's {grid.gpus.total} GPUs"
    return None


def _rule_heads(c: _Candidate, grid: GridConfig) -> str | None:
    model = grid.model
    if model.num_attention_heads % c.tp or model.query_groups % c.tp:
        return (f"TP={c.tp} must divide num_attention_heads={model.num_attention_heads} and "
                f"num_query_groups={model.query_groups}")
    return None


def _rule_batch(c: _Candidate, grid: GridConfig) -> str | None:
    if c.global_batch % (c.dp * c.mbs):
        return (f"DP x mbs = {c.dp} x {c.mbs} must divide the global batch {c.global_batch}")
    return None


def _rule_pipeline(c: _Candidate, grid: GridConfig) -> str | None:
    if c.pp == 1 and c.choice.schedule != REFERENCE:
        return f"PP=1 has no pipeline: only {REFERENCE} runs there, not {c.choice.schedule}"
    return None


def _rule_memory(c: _Candidate, grid: GridConfig) -> str | None:
    if grid.gpu_memory_gib is None:
        return None
    need = model_state_bytes_lower_bound(grid.model, c.tp, c.pp, c.dp, grid.distributed_optimizer)
    if need > grid.gpu_memory_gib * 2**30:
        return (f"weights, gradients and optimizer state alone need at least "
                f"{need / 2**30:.1f} GiB per GPU > gpu_memory_gib={grid.gpu_memory_gib:g}")
    return None


def _rule_layers(c: _Candidate, grid: GridConfig) -> str | None:
    if layer_split(grid.model, c.pp, c.layout) is not None:
        return None
    layers = grid.model.num_layers
    if c.layout is Layout.V:
        return (f"{c.choice.schedule} puts 2 stages on each rank: num_layers={layers} must be "
                f">= 2 x PP = {2 * c.pp}")
    stages = c.pp * c.layout.chunks
    what = f"PP x {c.layout.chunks} chunks = {stages}" if c.layout.chunks > 1 else f"PP={c.pp}"
    return (f"{c.choice.schedule} needs num_layers={layers} (or {layers + 2}, counting the "
            f"embedding and loss) divisible by {what}")


def _rule_interleaved_microbatches(c: _Candidate, grid: GridConfig) -> str | None:
    microbatches = c.global_batch // (c.dp * c.mbs)
    if c.layout is Layout.LOOP and microbatches % c.pp:
        return (f"{c.choice.schedule} needs microbatches (global batch / (DP x mbs) = "
                f"{microbatches}) divisible by PP={c.pp}")
    return None


RULES: tuple[tuple[str, Callable[[_Candidate, GridConfig], str | None]], ...] = (
    ("gpus", _rule_gpus),
    ("heads", _rule_heads),
    ("batch", _rule_batch),
    ("pipeline", _rule_pipeline),
    ("memory", _rule_memory),
    ("layers", _rule_layers),
    ("interleaved-microbatches", _rule_interleaved_microbatches),
)
"""(name, check) in the order they are applied; a check returns the reason a point is invalid
or None."""


def _first_failure(candidate: _Candidate, grid: GridConfig) -> tuple[str, str] | None:
    for rule, check in RULES:
        reason = check(candidate, grid)
        if reason is not None:
            return rule, reason
    return None


def _candidates(grid: GridConfig):
    layouts = {c.schedule: schedule_info(c.schedule).layout for c in grid.schedules}
    for seq in grid.seq_lengths:
        for tp in grid.tp:
            for pp in grid.pp:
                dp = grid.gpus.total // (tp * pp) if grid.gpus.total % (tp * pp) == 0 else None
                for mbs in grid.mbs:
                    for choice in grid.schedules:
                        yield _Candidate(seq, grid.global_batch_for(seq), tp, pp, mbs, dp, choice,
                                         layouts[choice.schedule])


def expand(grid: GridConfig) -> Expansion:
    """Every valid point of the grid, numbered in order (sequence length, TP, PP, mbs,
    schedule), and every invalid one with the first rule it fails."""
    points: list[Point] = []
    skipped: list[Skip] = []
    for c in _candidates(grid):
        failure = _first_failure(c, grid)
        if failure is not None:
            skipped.append(Skip(c.seq_length, c.tp, c.pp, c.mbs, c.dp, c.choice.name, *failure))
            continue
        split = layer_split(grid.model, c.pp, c.layout)
        points.append(Point(len(points), grid.name, c.seq_length, c.global_batch, c.dp, c.tp,
                            c.pp, c.mbs, c.choice, c.layout, split))
    return Expansion(grid, tuple(points), tuple(skipped))


PLAN_RULE = "plan-memory"
"""The rule of the points :func:`prune` drops."""
_RECOMPUTE_FLAGS = {"full": "--recompute-granularity full",
                    "selective": "--recompute-granularity selective"}


def _recompute(choice: ScheduleChoice) -> str:
    """The planner's recomputation kind for a schedule choice's flags."""
    flags = " ".join(choice.extra_args)
    return next((kind for kind, flag in _RECOMPUTE_FLAGS.items() if flag in flags), "none")


def _training(grid: GridConfig, seq_length: int) -> TrainingConfig:
    """The planner's training settings for the grid's Megatron-LM flags at ``seq_length``."""
    flags = " ".join(grid.extra_args)
    precision = "bf16" if ("--bf16" in flags or "--fp16" in flags) else "fp32"
    return TrainingConfig(
        seq_length, grid.global_batch_for(seq_length), precision=precision,
        flash_attention="--attention-backend flash" in flags or "--use-flash-attn" in flags,
        sequence_parallel="--sequence-parallel" in flags,
        distributed_optimizer=grid.distributed_optimizer)


def prune(expansion: Expansion, on_point: Callable[[], None] | None = None) -> Expansion:
    """``expansion`` without the points the planner predicts cannot fit the GPU's memory
    (weights, gradients, optimizer state and the schedule's peak activations on its fullest
    rank, :mod:`..plan.evaluate` and :mod:`..plan.memory`), each skipped under
    :data:`PLAN_RULE` with the planner's reason; the rest renumbered 0, 1, ... in order.

    Needs ``gpu_memory_gib`` in the grid. The flags the planner models are read off the grid's
    ``extra_args`` (bf16, flash attention, sequence parallel, distributed optimizer, full or
    selective recomputation); ``auto`` fits where the planner's search finds a V schedule under
    the memory left. ``on_point`` is called after each point (progress).
    """
    grid = expansion.grid
    if grid.gpu_memory_gib is None:
        raise ValueError(f"grid {grid.name}: pruning by memory needs gpu_memory_gib in the grid "
                         f"file (e.g. gpu_memory_gib: 80)")
    cluster = ClusterConfig(grid.gpus.total, grid.gpu_memory_gib,
                            gpus_per_node=grid.gpus.per_node)
    evaluators = {s: Evaluator(grid.model, _training(grid, s), cluster) for s in grid.seq_lengths}
    reasons: dict[tuple, str | None] = {}  # auto and auto-mem0.5 share a point's verdict
    kept: list[Point] = []
    skipped = list(expansion.skipped)
    for point in expansion.points:
        key = (point.seq_length, point.dp, point.tp, point.pp, point.mbs,
               point.choice.schedule, _recompute(point.choice))
        if key not in reasons:
            reasons[key] = _memory_failure(evaluators[point.seq_length], point, key[-1])
        if reasons[key] is None:
            kept.append(dataclasses.replace(point, index=len(kept)))
        else:
            skipped.append(Skip(point.seq_length, point.tp, point.pp, point.mbs, point.dp,
                                point.choice.name, PLAN_RULE, reasons[key]))
        if on_point is not None:
            on_point()
    return Expansion(grid, tuple(kept), tuple(skipped))


def _memory_failure(evaluator: Evaluator, point: Point, recompute: str) -> str | None:
    """The planner's reason ``point`` cannot fit, or None. ``auto`` fits where V-Min does (the
    search reaches V-Min's memory), else where the planner's own search finds a schedule."""
    at = GridPoint(point.dp, point.tp, point.pp, point.mbs, point.microbatches)
    if point.choice.schedule == AUTO and point.pp > 1:
        if evaluator.evaluate(at, V_MIN).feasible:
            return None
        prediction = evaluator.evaluate_auto(at)
    else:
        prediction = evaluator.evaluate(at, point.choice.schedule, recompute)
    return prediction.reason if prediction.reason_kind in ("memory", "search") else None
