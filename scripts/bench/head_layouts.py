"""Benchmark: a heavy LM head under a V, the even stage layout against a balanced one (CPU).

    python scripts/bench/head_layouts.py [--head-layers 2 4] [--ranks 4] [--microbatches 8]

``vshape demo``'s heavy-head case (megatron_vshape/harness/head_layouts.py, docs/demo.md): the
demo's tiny megatron-core GPT on gloo processes, the LM head and loss emulated as K layers on
the V's last stage, V-ZB built for and slowed to each layout's per-stage emulated costs (F of a
rank's even layer share 40 ms, B and W by the H100 ratios). One JSON line per head cost and
layout: layout, stage_layers, head_layers, rank_loads, max_loss_diff and max_grad_diff
(against megatron's own 1F1B), emulated_step_time_s (the fastest timed step, slowest rank),
simulated_makespan_s (the simulator, same schedule and per-stage costs), emulated_vs_simulated,
emulated_vs_even and simulated_vs_even.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_vshape.cli.demo import layout_rows, missing_backend_warnings_hidden  # noqa: E402
from megatron_vshape.harness.demo import DemoSettings, run_schedules  # noqa: E402

_FIELDS = ("layout", "schedule", "stage_layers", "head_layers", "rank_loads", "max_loss_diff",
           "max_grad_diff", "emulated_step_time_s", "simulated_makespan_s",
           "emulated_vs_simulated", "emulated_vs_even", "simulated_vs_even")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-layers", type=float, nargs="+", default=[2.0, 4.0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    for head in args.head_layers:
        settings = DemoSettings(ranks=args.ranks, microbatches=args.microbatches, steps=3,
                                head_layers=head)
        with missing_backend_warnings_hidden():
            result = run_schedules(settings, ["1f1b"])  # the reference: 3 steps, as emulated
        for row in layout_rows(settings, result.layouts, result.schedules["1f1b"]):
            print(json.dumps({"ranks": args.ranks, "microbatches": args.microbatches,
                              **{k: row[k] for k in _FIELDS}}), flush=True)


if __name__ == "__main__":
    main()
