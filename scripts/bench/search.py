"""Benchmark: adaptive search time, one JSON line per case.

    python scripts/bench/search.py [--ranks 4 8 16 32] [--microbatches 16 64 256]
                                   [--costs 1,1.2,0.8,0.1] [--memory-limit 0.5] [--repeats 3]

Targets: under 1 s for p <= 16 and m <= 64; under 10 s for p = 32, m = 256.
Each run starts from a fresh cache (the search caches results per setting). ``search_s`` is the
fastest of ``--repeats`` runs, ``search_s_median`` their median: on a shared 2-core machine one
run varies by +-25%, and the fastest is the one least disturbed by its neighbours.
"""
import argparse
import json
import statistics
import time

from megatron_vshape.schedule import build_schedule, parse_costs, simulate
from megatron_vshape.schedule.search.adaptive import InfeasibleMemoryError, memory_limit_units, search
from megatron_vshape.schedule.search.levels import clear_caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--costs", default="1,1.2,0.8,0.1")
    parser.add_argument("--memory-limit", type=float, default=0.5, help="fraction of 1F1B's peak")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (fastest reported)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    for p in args.ranks:
        for m in args.microbatches:
            costs = parse_costs(args.costs, p)
            limit = memory_limit_units(p, m, fraction=args.memory_limit)
            started = time.perf_counter()
            try:
                found, times = _timed_search(p, m, costs, limit, args.repeats)
            except InfeasibleMemoryError as err:  # raised by the first run: its time to say so
                print(json.dumps({"ranks": p, "microbatches": m, "memory_limit_units": limit,
                                  "search_s": round(time.perf_counter() - started, 4),
                                  "error": str(err)}))
                continue
            one = simulate(build_schedule("1f1b", p, m), costs)
            print(json.dumps({
                "ranks": p, "microbatches": m, "costs": args.costs, "memory_limit_units": limit,
                "search_s": round(min(times), 4),
                "search_s_median": round(statistics.median(times), 4),
                "candidates": found.candidates,
                "bubble_rate": round(found.result.bubble_rate, 4),
                "bubble_rate_1f1b": round(one.bubble_rate, 4),
                "peak_memory_max": found.result.peak_memory_max,
                "description": found.schedule.description,
            }), flush=True)


def _timed_search(p, m, costs, limit, repeats):
    """The search's result and the wall time of each of ``repeats`` uncached runs."""
    times = []
    for _ in range(repeats):
        clear_caches()
        started = time.perf_counter()
        found = search(p, m, costs, limit)
        times.append(time.perf_counter() - started)
    return found, times


if __name__ == "__main__":
    main()
