"""Benchmark: V schedules on megatron-core GPTModel over local gloo processes (CPU).

    python scripts/bench/megatron_cpu.py --schedule v-half --ranks 4 --microbatches 8 --layers 24
        [--steps 2] [--tied]

Trains a tiny GPT (local spec, fp32) under megatron's own 1F1B and under each schedule given
(comma-separated), on the same model and data, and prints one JSON line per schedule: schedule,
ranks, microbatches, layers, max_loss_diff and max_grad_diff (vs megatron's 1F1B),
peak_activation_bytes (per rank: saved tensors plus what W keeps), peak_activation_vs_1f1b,
simulated_peak_vs_1f1b, step_time_s (median over steps after the first, max over ranks),
step_time_1f1b_s.
Runs megatron-core on CPU through the test-support shims (tests/support/megatron_cpu.py).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from megatron_vshape.schedule import build_schedule, simulate  # noqa: E402
from megatron_vshape.schedule.names import PLUGIN_SCHEDULES  # noqa: E402
from support.megatron_workers import compare_runs  # noqa: E402

OURS = PLUGIN_SCHEDULES


def _steps(values, name):
    """Per step: losses (sorted), {key: grad}, peaks per rank, max seconds over ranks."""
    out = []
    for s in range(len(values[0][name])):
        grads = {}
        for v in values:
            grads.update(v[name][s]["grads"])
        out.append((sorted(x for v in values for x in v[name][s]["losses"]), grads,
                    [v[name][s]["peak"] for v in values],
                    max(v[name][s]["seconds"] for v in values)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True, help="comma-separated: v-min,v-half,v-zb,auto")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tied", action="store_true", help="tie embeddings and LM head")
    args = parser.parse_args()
    names = tuple(n.strip() for n in args.schedule.split(","))
    bad = [n for n in names if n not in OURS or n == "zb-1p"]
    if bad:
        raise SystemExit(f"--schedule: {bad} not runnable here; choose from v-min, v-half, v-zb, auto")
    outcomes = run_gloo(compare_runs, args.ranks, names, args.layers, args.microbatches,
                        args.steps, args.tied, timeout=3600)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"rank {failed[0].rank} failed: {failed[0].error}")
    values = [o.value for o in outcomes]
    ref = _steps(values, "1f1b")
    base = max(max(step[2]) for step in ref)
    for name in names:
        got = _steps(values, name)
        peaks = [max(step[2][r] for step in got) for r in range(args.ranks)]
        print(json.dumps({
            "schedule": name, "ranks": args.ranks, "microbatches": args.microbatches,
            "layers": args.layers, "tied": args.tied,
            "max_loss_diff": max(abs(a - b) for g, r in zip(got, ref) for a, b in zip(g[0], r[0])),
            "max_grad_diff": max((g[1][k] - r[1][k]).abs().max().item()
                                 for g, r in zip(got, ref) for k in r[1]),
            "peak_activation_bytes": peaks,
            "peak_activation_vs_1f1b": max(peaks) / base,
            "simulated_peak_vs_1f1b": simulate(
                build_schedule(name, args.ranks, args.microbatches)).peak_memory_vs_1f1b,
            "step_time_s": statistics.median(step[3] for step in got[1:] or got),
            "step_time_1f1b_s": statistics.median(step[3] for step in ref[1:] or ref),
        }), flush=True)


if __name__ == "__main__":
    main()
