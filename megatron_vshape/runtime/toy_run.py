"""Train a toy model under several schedules on one gloo world and compare with the reference.

The worker behind the runtime tests and ``scripts/bench/runtime.py``: every rank builds the same
model, runs ``steps`` optimizer steps under each schedule, and each step compares its losses and
gradients with a single-process reference it runs itself on the same data (so nothing needs
gathering). Start it with :func:`.launch.run_gloo`.
"""
from __future__ import annotations

import copy
import gc
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedule.model.costs import Costs
from ..schedule.registry import build_schedule
from ..schedule.names import REFERENCE
from ..schedule.model.simulate import simulate
from .interpreter import PipelineRunner, RunnerConfig
from .memory import ActivationTracker
from .p2p import TensorSpec
from .streams import StreamGroups
from .toy import ToyModel, build_layers, make_batch, pipeline_stages, reference_step

__all__ = ["ToyRun", "toy_worker"]


@dataclass(frozen=True)
class ToyRun:
    """One comparison: schedules x (model, microbatches, steps), optionally with emulated costs."""

    schedules: tuple[str, ...]
    microbatches: int
    model: ToyModel = ToyModel()
    steps: int = 3
    lr: float = 0.002
    emulate: tuple[float, float, float] | None = None
    """Emulated F, B, W seconds of one rank's whole layer share (see RunnerConfig.emulate)."""
    timeout: float = 60.0


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, that over max |b|)."""
    abs_diff = (a - b).abs().max().item()
    return abs_diff, abs_diff / max(b.abs().max().item(), 1e-30)


def _pairs(layers, reference, stages, placement):
    """(pipeline parameter, reference parameter) for this rank's stages."""
    per = len(layers) // placement.num_stages
    for stage in stages.modules:
        for i in range(stage * per, (stage + 1) * per):
            yield from zip(layers[i].parameters(), reference[i].parameters())


def _run_schedule(rank: int, world: int, run: ToyRun, name: str, groups_by_layout: dict) -> dict:
    costs = Costs.build(world, *run.emulate) if run.emulate else None
    schedule = build_schedule(name, world, run.microbatches, costs=costs)
    placement = schedule.placement
    if placement.layout not in groups_by_layout:
        groups_by_layout[placement.layout] = StreamGroups.create(placement)
    layers = build_layers(run.model)
    reference = copy.deepcopy(layers)
    tracker = ActivationTracker(layers.parameters())
    stages = pipeline_stages(layers, placement, rank, tracker)
    pairs = list(_pairs(layers, reference, stages, placement))
    runner = PipelineRunner(
        schedule, stages, groups_by_layout[placement.layout],
        TensorSpec(run.model.sample_shape(), run.model.dtype),
        RunnerConfig(timeout=run.timeout, emulate=costs), tracker, check_group=dist.group.WORLD)
    opt = torch.optim.SGD([p for p, _ in pairs], lr=run.lr, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=run.lr, momentum=0.9)
    out = {"loss": [0.0, 0.0], "grad": [0.0, 0.0], "peak": 0, "times": [], "losses": []}
    for step in range(run.steps):
        batch = make_batch(run.model, run.microbatches, step)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        result = _timed_step(runner, batch)
        out["times"].append(_all_max(result.seconds))
        ref_losses = reference_step(reference, batch)
        for got, want in zip(result.losses, ref_losses):
            out["loss"] = [max(x, y) for x, y in zip(out["loss"], _diff(got, want))]
        for param, ref in pairs:
            out["grad"] = [max(x, y) for x, y in zip(out["grad"], _diff(param.grad, ref.grad))]
        out["peak"] = max(out["peak"], result.peak_activation_bytes)
        out["losses"].append([x.item() for x in result.losses])
        opt.step()
        ref_opt.step()
    out["simulated"] = simulate(schedule, costs).makespan if costs else None
    out["simulated_peak_vs_1f1b"] = simulate(schedule).peak_memory_vs_1f1b
    out["description"] = schedule.description
    return out


def _timed_step(runner: PipelineRunner, batch):
    """One step with the ranks started together, and no garbage collection inside it.

    A full collection in one process pauses it for tens of milliseconds and stalls the whole
    pipeline (Megatron-LM's --manual-gc exists for the same reason): collect before the step.
    """
    gc.collect()
    gc.freeze()
    dist.barrier()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return runner.step(batch)
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def _all_max(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def toy_worker(rank: int, world: int, run: ToyRun) -> dict:
    """Per schedule: max loss/grad differences (abs, relative), peak activation bytes, step
    times (max over ranks; the first step is warm-up), losses, simulated makespan."""
    groups: dict = {}
    results = {}
    for name in run.schedules:
        out = _run_schedule(rank, world, run, name, groups)
        timed = out["times"][1:] or out["times"]
        out["step_time_s"] = statistics.median(timed)
        results[name] = out
    return results


def summarize(values: list[dict], name: str, baseline: str = REFERENCE) -> dict:
    """One schedule's results over ranks (``values``: each rank's :func:`toy_worker` result).

    ``peak_activation_vs_1f1b`` needs ``baseline`` to have run too (else it is None).
    """
    mine = [v[name] for v in values]
    peaks = [v["peak"] for v in mine]
    base = max(v[baseline]["peak"] for v in values) if all(baseline in v for v in values) else None
    first = mine[0]
    return {
        "schedule": name,
        "max_loss_diff": max(v["loss"][0] for v in mine),
        "max_loss_rel_diff": max(v["loss"][1] for v in mine),
        "max_grad_diff": max(v["grad"][0] for v in mine),
        "max_grad_rel_diff": max(v["grad"][1] for v in mine),
        "losses": next((v["losses"] for v in mine if v["losses"][0]), []),
        "peak_activation_bytes": peaks,
        "peak_activation_vs_1f1b": max(peaks) / base if base else None,
        "simulated_peak_vs_1f1b": first["simulated_peak_vs_1f1b"],
        "step_time_s": first["step_time_s"],
        "simulated_makespan_s": first["simulated"],
        "description": first["description"],
    }
