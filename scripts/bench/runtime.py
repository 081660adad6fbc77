"""Benchmark: the torch runtime on local gloo processes, one JSON line per schedule.

    python scripts/bench/runtime.py --schedule v-half --ranks 4 --microbatches 16
        [--dtype float32|float64] [--emulate F,B,W] [--model mlp|transformer]
        [--layers L] [--steps N]

Trains a toy model (runtime/toy.py) under the schedule and under 1F1B, and compares every loss
and gradient with a single-process reference. ``--schedule`` takes a comma-separated list.
``--emulate`` gives F, B, W in milliseconds for one rank's whole layer share: every pass then
lasts its emulated time (runtime/interpreter.py, emulated-cost mode) and the step time is
compared with the simulator's makespan for those costs (no communication cost).

Fields: schedule, ranks, microbatches, model, dtype, max_loss_diff, max_grad_diff (absolute,
and *_rel_diff over the largest reference value), peak_activation_bytes (per rank),
peak_activation_vs_1f1b (max over ranks over 1F1B's), simulated_peak_vs_1f1b, step_time_s
(median over steps after the first, max over ranks), simulated_makespan_s and
step_time_vs_simulated (with --emulate). w_share is the measured fraction of a layer's saved
bytes still kept after B (for W); simulated_peak_vs_1f1b_measured_split re-simulates the memory
with B freeing the rest (the default model frees everything at W).
"""
import argparse
import json

import torch

from megatron_vshape.runtime.launch import run_gloo
from megatron_vshape.runtime.toy import MODEL_KINDS, ToyModel, split_memory
from megatron_vshape.runtime.toy_run import ToyRun, summarize, toy_worker
from megatron_vshape.schedule import (SCHEDULES, Costs, MemoryModel, ScheduleError, build_schedule,
                                      simulate)
from megatron_vshape.schedule.names import REFERENCE, schedule_info


def _emulate(text):
    if text is None:
        return None
    try:
        values = tuple(float(v) / 1000 for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) <= 0:
        raise SystemExit(f"--emulate must be three positive milliseconds F,B,W, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True, help=f"one or more of {', '.join(SCHEDULES)}")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--emulate", help="F,B,W in milliseconds (one rank's layer share)")
    parser.add_argument("--model", choices=MODEL_KINDS, default="mlp")
    parser.add_argument("--layers", type=int, help="default: 4 x ranks")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    names = [n.strip() for n in args.schedule.split(",")]
    for name in names:
        try:
            schedule_info(name, "--schedule")
        except ScheduleError as err:
            raise SystemExit(str(err)) from None
    model = ToyModel(kind=args.model, layers=args.layers or 4 * args.ranks,
                     dtype=getattr(torch, args.dtype))
    run = ToyRun(tuple(dict.fromkeys([REFERENCE] + names)), args.microbatches, model,
                 steps=args.steps, emulate=_emulate(args.emulate))
    outcomes = run_gloo(toy_worker, args.ranks, run, timeout=1800)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"rank {failed[0].rank} failed: {failed[0].error}")
    forward_bytes, kept_bytes = split_memory(model)
    w_share = min(1.0, kept_bytes / forward_bytes)
    split = MemoryModel(1.0, -(1.0 - w_share), -w_share)
    for name in names:
        row = summarize([o.value for o in outcomes], name)
        costs = Costs.build(args.ranks, *run.emulate) if run.emulate else None
        schedule = build_schedule(name, args.ranks, args.microbatches, costs=costs)
        row["w_share"] = round(w_share, 4)
        row["simulated_peak_vs_1f1b_measured_split"] = round(
            simulate(schedule, memory=split).peak_memory_vs_1f1b, 4)
        row.pop("losses")
        row.update(ranks=args.ranks, microbatches=args.microbatches, model=args.model,
                   dtype=args.dtype, layers=model.layers)
        if row["simulated_makespan_s"]:
            row["step_time_vs_simulated"] = row["step_time_s"] / row["simulated_makespan_s"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
