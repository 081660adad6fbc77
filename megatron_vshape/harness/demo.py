"""The CPU demo: a tiny megatron-core GPT trained on gloo processes under every schedule.

What a user should see before spending GPU hours: the V schedules train the *same* model to
the *same* losses and gradients as megatron's own 1F1B, with less activation memory (V-Min,
V-Half) or fewer bubbles (V-ZB), and ``auto`` re-planning itself from measured costs. One
spawned world runs the schedules in turn (:func:`run_schedules`); the CLI (``vshape demo``)
prints the table and draws the timelines.

Every rank builds the model with :mod:`.tiny_gpt` (weights by global name, data by step), so
1F1B and the V placements start from identical weights; plain SGD steps keep later iterations
comparable too.

Step times of 4 processes sharing 2 cores, with passes of a few milliseconds, measure Python
and messaging, not a device. So each schedule also runs a few steps with emulated device time (the
runtime's emulated-cost mode: every pass lasts at least its F, B or W, from the F : B : W
ratios measured on an H100), which the simulator's makespan predicts. Megatron's own 1F1B
cannot be slowed per pass, so the emulated 1F1B is the same order run by our runtime.

Last, the heavy-head case (:mod:`.head_layouts`): V-ZB with the even stage layout and with a
balanced one, each stage emulated by its layers and stage 2p-1 by the LM head's cost in layers
more, so the balanced layout's shorter step shows in measured time beside the simulator's.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ..schedule.names import PLUGIN_SCHEDULES, REFERENCE, schedule_info
from .head_layouts import LAYOUT_SCHEDULE, emulated_stage_costs, stage_layouts
from .pipeline_world import (forward_progress, model_parallel, no_gc_pauses, placed_chunks,
                             two_chunks)
from .tiny_gpt import TinyGPT

__all__ = ["DemoSettings", "ScheduleRun", "LayoutRun", "DemoRuns", "run_schedules",
           "DEMO_SCHEDULES", "DEVICE_RATIOS"]

DEMO_SCHEDULES = (REFERENCE,) + PLUGIN_SCHEDULES
"""megatron's 1F1B, the reference, and every schedule the plugin runs."""

DEVICE_RATIOS = (1.0, 1.39, 0.35)
"""F : B : W of megatron-core transformer layers measured on one H100 (README, "On a GPU")."""


@dataclass(frozen=True)
class DemoSettings:
    """The embedded default: 4 ranks, 8 microbatches, configs/models/tiny.yaml's shape."""

    ranks: int = 4
    microbatches: int = 8
    steps: int = 4
    """Training iterations per schedule (auto profiles the first, then re-plans)."""
    model: TinyGPT = field(default_factory=lambda: TinyGPT(
        num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        vocab_size=256, seq_length=32, micro_batch_size=2))
    tied: bool = True
    memory_limit: str = "0.75"
    """auto's limit: a fraction of 1F1B's activation memory, or bytes ("2MiB")."""
    timeout: float = 120.0
    """Seconds any point-to-point wait may take."""
    emulate_ms: float | None = 40.0
    """Emulated F of one rank's layer share in milliseconds (B and W by DEVICE_RATIOS); None:
    no emulated runs. Why 40: a V chunk's shortest pass (W, 40 x 0.35 / 2 = 7 ms) stays above
    the real work of a pass (2-4 ms on a contended core), so the sleeps set the pace, and what
    they cannot hide (host work between passes, message latency: 25-50 ms a step with 4
    processes on 2 cores) stays within 5% of a 1-1.3 s step; at 20 ms it was 5-12%."""
    emulate_steps: int = 3
    """Emulated iterations per schedule (the first builds runners and groups; the rest are
    timed, and the fastest of them is reported: the sleeps set a floor that host noise only
    adds to, and one timed step on a loaded 2-core machine came out 11% over). Fixed costs,
    no re-planning."""
    head_layers: float = 2.0
    """The heavy-head case (head_layouts.py): the LM head and loss emulated as costing this
    many transformer layers on stage 2p-1, V-ZB run with the even and a balanced stage layout
    (needs emulate_ms); 0: no such runs. Why 2: Llama-3-8B's head against its layers."""

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"--ranks must be >= 2 (a pipeline), got {self.ranks}")
        if self.microbatches < 1 or self.steps < 1:
            raise ValueError("--microbatches and --steps must be >= 1, got "
                             f"{self.microbatches} and {self.steps}")
        if self.emulate_ms is not None and self.emulate_ms <= 0:
            raise ValueError(f"--emulate-ms must be > 0 milliseconds, got {self.emulate_ms}")
        if self.emulate_steps < 1:
            raise ValueError(f"emulate_steps must be >= 1, got {self.emulate_steps}")
        if not self.head_layers >= 0:
            raise ValueError(f"--head-layers must be >= 0 layers (0: no stage-layout runs), "
                             f"got {self.head_layers}")
        if self.model.num_layers < 2 * self.ranks:
            raise ValueError(f"the model has {self.model.num_layers} layers; a V on "
                             f"{self.ranks} ranks needs >= {2 * self.ranks}: lower --ranks")

    def emulated_costs(self):
        """The emulated F, B, W (schedule.Costs, seconds per rank's share), or None."""
        if self.emulate_ms is None:
            return None
        from ..schedule.model.costs import Costs

        return Costs.build(self.ranks, *(self.emulate_ms / 1000 * r for r in DEVICE_RATIOS))

    def stage_layouts(self) -> dict[str, tuple[int, ...]]:
        """The heavy-head case's layouts by label (``even``, ``balanced``); none without
        emulated runs or with ``head_layers`` 0."""
        if self.emulate_ms is None or self.head_layers == 0:
            return {}
        return stage_layouts(self.model.num_layers, self.ranks, self.head_layers)

    def layer_costs(self) -> tuple[float, float, float]:
        """One transformer layer's emulated F, B, W in seconds: ``emulate_ms`` over a rank's
        even share of the layers, B and W by DEVICE_RATIOS."""
        layer_f = self.emulate_ms / 1000 * self.ranks / self.model.num_layers
        return tuple(layer_f * r for r in DEVICE_RATIOS)

    def layout_costs(self, stage_layers):
        """Per-stage emulated costs (schedule.Costs) of ``stage_layers`` with the heavy head."""
        return emulated_stage_costs(stage_layers, self.layer_costs(), self.head_layers)


@dataclass
class ScheduleRun:
    """One schedule's results, merged over ranks."""

    schedule: str
    losses: list
    """Per step, the microbatch losses (where the loss is computed)."""
    grads: list
    """Per step, {global parameter name: gradient} over all ranks."""
    peak_bytes: list
    """Per rank: the peak bytes kept for backward over the steps of the last plan (auto
    re-plans after its first step; the table compares the schedule that ran last)."""
    step_seconds: float
    """Median over the steps after the first, slowest rank (the fastest such step for an
    emulated run)."""
    timeline: list = field(default_factory=list)
    """Per rank: (action, start, end) of the last step's passes, seconds (measured)."""
    plans: list = field(default_factory=list)
    """auto: (iterations before, schedule description) of each plan."""
    costs: object = None
    """Measured F, B, W per stage (schedule.Costs, stage_costs_of) where the schedule splits
    B and W."""
    last_schedule: object = None
    """The schedule that ran last (None for megatron's own 1F1B)."""
    emulated: "ScheduleRun | None" = None
    """The same schedule's run with emulated device time (DemoSettings.emulate_ms), built for
    the emulated costs; for 1f1b, the 1F1B order run by our runtime."""


@dataclass
class LayoutRun:
    """The heavy-head case under one stage layout (emulated device time only)."""

    label: str
    """``even`` or ``balanced``."""
    stage_layers: tuple
    """Transformer layers per V stage, stage 0 first."""
    costs: object
    """The per-stage emulated costs (schedule.Costs.for_stages) it was built for and slowed to."""
    run: ScheduleRun


@dataclass
class DemoRuns:
    """Everything one demo world ran."""

    schedules: dict
    """{schedule name: ScheduleRun}, 1f1b first."""
    layouts: list = field(default_factory=list)
    """LayoutRun per stage layout of the heavy-head case (empty when not run)."""


def run_schedules(settings: DemoSettings, schedules, on_done=None) -> DemoRuns:
    """Train ``settings.steps`` iterations under each schedule, one after the other, then the
    heavy-head case's layouts, on one world of local gloo processes (spawning costs seconds,
    so the runs share it). ``on_done(name)`` is called as each run finishes (progress)."""
    import torch.multiprocessing as mp

    from ..runtime.launch import run_gloo
    from .cpu import prepare_cpu_imports

    prepare_cpu_imports()  # the ranks' results hold megatron objects: unpickled here

    done = mp.get_context("spawn").Queue()
    layouts = settings.stage_layouts()
    with forward_progress(done, on_done, len(schedules) + len(layouts)):
        outcomes = run_gloo(_worker, settings.ranks, settings, tuple(schedules), done,
                            timeout=1800)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"rank {failed[0].rank} failed: {failed[0].error}")
    return DemoRuns(
        schedules={name: _merge(name, [o.value[name] for o in outcomes]) for name in schedules},
        layouts=[LayoutRun(label, layers, settings.layout_costs(layers),
                           _merge(LAYOUT_SCHEDULE, [o.value["layouts"][label] for o in outcomes],
                                  min))
                 for label, layers in layouts.items()])


def _merge(schedule: str, values: list, statistic=statistics.median) -> ScheduleRun:
    """One schedule's run from every rank's values; its step time is ``statistic`` over the
    steps after the first of the slowest rank's times (min for emulated runs, see
    DemoSettings.emulate_steps)."""
    steps = len(values[0]["losses"])
    grads = []
    for s in range(steps):
        merged = {}
        for v in values:
            merged.update(v["grads"][s])
        grads.append(merged)
    seconds = [max(v["seconds"][s] for v in values) for s in range(steps)]
    emulated = [v["emulated"] for v in values if v.get("emulated") is not None]
    return ScheduleRun(
        schedule=schedule,
        losses=[[x for v in values for x in v["losses"][s]] for s in range(steps)],
        grads=grads, peak_bytes=[max(v["peaks"][_plan_start(values[0]["plans"]):])
                                 for v in values],
        step_seconds=statistic(seconds[1:] or seconds),
        timeline=[_aligned(v["timeline"], min(x["started"] for x in values)) for v in values],
        plans=values[0]["plans"], costs=values[0]["costs"],
        last_schedule=values[0]["schedule"],
        emulated=_merge(schedule, emulated, min) if emulated else None)


def _plan_start(plans) -> int:
    """The first step of the last plan (0 without plans)."""
    return plans[-1][0] if plans else 0


def _aligned(timeline, origin):
    """Rank timelines share perf_counter's clock (one machine): shift to a common origin."""
    if not timeline:
        return []
    started, passes = timeline
    return [(action, started - origin + s, started - origin + e) for action, s, e in passes]


# -- in every spawned rank ---------------------------------------------------------------------
def _worker(rank: int, world: int, settings: DemoSettings, schedules, done) -> dict:
    from .cpu import install_cpu_shims, prepare_cpu_imports

    prepare_cpu_imports()
    import megatron.core.models.gpt  # noqa: F401  (before the shims rebind megatron's RNG)

    install_cpu_shims()
    from megatron.core import parallel_state as ps

    out = {}
    costs = settings.emulated_costs()
    layout, groups = None, {}  # groups: our stream groups, shared by all runs (see model_parallel)
    for schedule in schedules:
        layout = model_parallel(settings.ranks, two_chunks(schedule), layout)
        out[schedule] = _train(settings, *_build(settings, schedule, groups), settings.steps)
        if costs is not None:
            out[schedule]["emulated"] = _train(
                settings, *_build(settings, schedule, groups, costs), settings.emulate_steps)
        if rank == 0:
            done.put(schedule)
    out["layouts"] = {}
    for label, layers in settings.stage_layouts().items():
        layout = model_parallel(settings.ranks, True, layout)
        costs = settings.layout_costs(layers)
        out["layouts"][label] = _train(
            settings, *_build(settings, LAYOUT_SCHEDULE, groups, costs, layers),
            settings.emulate_steps)
        if rank == 0:
            done.put(f"{label} layout")
    ps.destroy_model_parallel()
    return out


def _build(settings: DemoSettings, schedule: str, groups: dict, emulate=None, stage_layers=None):
    """This rank's chunks (placement of ``schedule``; a V's ``stage_layers`` per stage, None
    for the even split) and its forward-backward function (ours use and fill the shared stream
    ``groups``); with ``emulate`` (Costs), ours built for and slowed to those costs, never
    re-planned (1f1b too: megatron's own has no per-pass hook to sleep in; auto under a byte
    limit keeps its provisional V-Min, as nothing measures bytes)."""
    from ..megatron.forward_backward import VShapeForwardBackward
    from .tiny_gpt import init_by_name

    chunks = placed_chunks(settings.model.provider(settings.tied),
                           settings.model.transformer_config(settings.ranks), schedule,
                           settings.ranks, stage_layers)
    init_by_name(chunks, settings.tied)
    if schedule == REFERENCE and emulate is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return chunks, get_forward_backward_func()
    auto = schedule_info(schedule).memory_limited
    return chunks, VShapeForwardBackward(
        schedule, timeout=settings.timeout, memory_limit=settings.memory_limit if auto else None,
        replan_after=1 if auto and emulate is None else 0, costs=emulate, emulate=emulate,
        stream_groups=groups)


def _train(settings: DemoSettings, chunks, fb, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from ..runtime.memory import ActivationTracker
    from .tiny_gpt import batches, forward_step, global_grads
    from ..megatron.wgrad import store_of

    tracker = ActivationTracker([p for c in chunks for p in c.parameters()])
    for store in (store_of(c) for c in chunks):
        store.tracker = tracker
    out = {"losses": [], "grads": [], "seconds": [], "peaks": []}
    for step in range(steps):
        for p in (p for c in chunks for p in c.parameters()):
            p.grad = None
        data = [iter(batches(settings.model, settings.microbatches, step)) for _ in chunks]
        tracker.reset_peak()
        with no_gc_pauses(), tracker.saved_tensors_hooks():
            dist.barrier()
            begin = time.perf_counter()
            losses = fb(forward_step_func=forward_step,
                        data_iterator=data if len(chunks) > 1 else data[0], model=chunks,
                        num_microbatches=settings.microbatches,
                        seq_length=settings.model.seq_length,
                        micro_batch_size=settings.model.micro_batch_size)
            out["seconds"].append(time.perf_counter() - begin)
        if settings.tied and len(chunks) == 1:
            _sum_tied_grads_1f1b(chunks[0])
        out["losses"].append([d["lm loss"].item() for d in losses])
        out["grads"].append(global_grads(chunks))
        out["peaks"].append(tracker.peak)
        with torch.no_grad():  # plain SGD, so later iterations check updated weights too
            for p in (p for c in chunks for p in c.parameters() if p.grad is not None):
                p -= 0.01 * p.grad
    out.update(_schedule_facts(fb, settings))
    return out


def _schedule_facts(fb, settings: DemoSettings) -> dict:
    """Timeline of the last step, plans and measured costs (our schedules only)."""
    step = getattr(fb, "last_step", None)
    if step is None:
        return {"timeline": [], "plans": [], "costs": None, "started": 0.0, "schedule": None}
    timeline = [(str(a), s, e) for a, s, e in step.timeline]
    costs = fb.measured_costs(settings.microbatches) if _splits_bw(fb.last_schedule) else None
    return {"timeline": (step.started, timeline), "plans": list(fb.plans), "costs": costs,
            "started": step.started, "schedule": fb.last_schedule}


def _splits_bw(schedule) -> bool:
    """Whether ``schedule`` has W passes (the profile's costs need them; our 1F1B fuses BW)."""
    from ..schedule.model.actions import PassKind

    return any(a.kind is PassKind.W for a in schedule.compute_actions(0))


def _sum_tied_grads_1f1b(model) -> None:
    """What megatron's finalize_model_grads does for tied embeddings (it needs DDP-wrapped
    chunks, which this plain run is not): sum the first and last rank's gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.is_rank_in_embedding_group():
        dist.all_reduce(model.shared_embedding_or_output_weight().grad,
                        group=ps.get_embedding_group())
