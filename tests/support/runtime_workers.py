"""Workers for the runtime's gloo tests; each runs in every spawned rank via run_gloo."""
import time

import torch
import torch.distributed as dist

from megatron_vshape.runtime import (ModuleStages, PipelineRunner, RunnerConfig,
                                     StreamGroups, TensorSpec)
from megatron_vshape.runtime.toy import (ToyModel, build_layers, make_batch, pipeline_stages,
                                         reference_step)
from megatron_vshape.schedule import build_schedule

MODEL = ToyModel(kind="mlp", layers=12)  # splits into 2, 4 and 6 stages


def _runner(rank, world, name, microbatches=4, timeout=60.0, spec=None, stages_fn=None,
            check=True, variant="fastest"):
    schedule = build_schedule(name, world, microbatches, variant=variant)
    layers = build_layers(MODEL)
    stages = (stages_fn or pipeline_stages)(layers, schedule.placement, rank)
    groups = StreamGroups.create(schedule.placement)
    spec = spec or TensorSpec(MODEL.sample_shape(), MODEL.dtype)
    runner = PipelineRunner(schedule, stages, groups, spec, RunnerConfig(timeout=timeout),
                            check_group=dist.group.WORLD if check else None)
    return runner, layers


def killed_peer(rank, world, timeout):
    """The last rank dies after setup; the others step and must fail within ``timeout``."""
    runner, _ = _runner(rank, world, "v-half", timeout=timeout)
    dist.barrier()
    if rank == world - 1:
        import os
        os._exit(7)
    begin = time.monotonic()
    try:
        runner.step(make_batch(MODEL, 4, 0))
    except Exception as err:  # the test inspects type and message
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - begin}
    return {"error": None, "seconds": time.monotonic() - begin}


def silent_peer(rank, world, timeout):
    """The last rank is alive but never steps: the others time out with a named wait."""
    runner, _ = _runner(rank, world, "1f1b", timeout=timeout)
    if rank == world - 1:
        time.sleep(timeout + 3)
        return {"error": None}
    begin = time.monotonic()
    try:
        runner.step(make_batch(MODEL, 4, 0))
    except Exception as err:
        seconds = time.monotonic() - begin
        try:
            runner.step(make_batch(MODEL, 4, 1))
            again = None
        except RuntimeError as second:
            again = str(second)
        return {"error": f"{type(err).__name__}: {err}", "seconds": seconds, "again": again}
    return {"error": None}


def different_schedules(rank, world):
    """Rank 0 builds v-half's paper order, the others v-min's: every rank must refuse before
    running (the paper's orders, since at p = 2 both levels are 2 units: one fastest order)."""
    try:
        _runner(rank, world, "v-half" if rank == 0 else "v-min", variant="paper")
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


class _SkipsW(ModuleStages):
    def backward_weight(self, stage, microbatch):
        pass


def leftover_w(rank, world):
    """A compute that never runs W: the end-of-step check must name the leftover W work."""
    def stages_fn(layers, placement, r):
        base = pipeline_stages(layers, placement, r)
        return _SkipsW(base.modules, base.num_stages, base.loss_fn, base.stores)
    runner, _ = _runner(rank, world, "v-half", stages_fn=stages_fn)
    try:
        runner.step(make_batch(MODEL, 4, 0))
    except RuntimeError as err:
        return str(err)
    return None


def variable_shapes_and_eval(rank, world):
    """Shapes travel with messages; then an evaluation step; both against the reference."""
    runner, layers = _runner(rank, world, "v-half",
                             spec=TensorSpec(dtype=MODEL.dtype, variable=True))
    import copy
    reference = copy.deepcopy(layers)
    batch = make_batch(MODEL, 4, 0)
    result = runner.step(batch)
    want = reference_step(reference, batch)
    grads = [(p.grad - q.grad).abs().max().item() for p, q in
             zip(_rank_params(runner, layers), _rank_params(runner, reference)) if p.grad is not None]
    for p in layers.parameters():
        p.grad = None
    evaluation = runner.step(batch, forward_only=True)
    with torch.no_grad():
        want_eval = reference_step_no_grad(reference, batch)
    return {
        "losses": [(a - b).abs().item() for a, b in zip(result.losses, want)],
        "grads": grads, "n_grads": len(grads),
        "eval": [(a - b).abs().item() for a, b in zip(evaluation.losses, want_eval)],
        "eval_peak": evaluation.peak_activation_bytes,
        "grads_after_eval": sum(p.grad is not None for p in layers.parameters()),
    }


def reference_step_no_grad(layers, batch):
    from megatron_vshape.runtime.toy import loss_fn
    return [loss_fn(torch.nn.Sequential(*layers)(x), t) for x, t in batch]


def _rank_params(runner, layers):
    per = len(layers) // runner.schedule.num_stages
    for stage in sorted(runner.compute.modules):
        for i in range(stage * per, (stage + 1) * per):
            yield from layers[i].parameters()
