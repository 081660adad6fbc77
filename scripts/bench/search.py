"""Benchmark: adaptive search time, one JSON line per case.

    python scripts/bench/search.py [--ranks 4 8 16 32] [--microbatches 16 64 256]
                                   [--costs 1,1.2,0.8,0.1] [--memory-limit 0.5]

Targets (issue 3): under 1 s for p <= 16 and m <= 64; under 10 s for p = 32, m = 256.
Each case runs in a fresh cache (the search caches results per setting).
"""
import argparse
import json
import time

from megatron_vshape.schedule import build_schedule, parse_costs, simulate
from megatron_vshape.schedule.search import InfeasibleMemoryError, _search_cached, memory_limit_units, search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--costs", default="1,1.2,0.8,0.1")
    parser.add_argument("--memory-limit", type=float, default=0.5, help="fraction of 1F1B's peak")
    args = parser.parse_args()
    for p in args.ranks:
        for m in args.microbatches:
            costs = parse_costs(args.costs, p)
            limit = memory_limit_units(p, m, fraction=args.memory_limit)
            _search_cached.cache_clear()
            t0 = time.perf_counter()
            try:
                found = search(p, m, costs, limit)
            except InfeasibleMemoryError as err:
                print(json.dumps({"ranks": p, "microbatches": m, "memory_limit_units": limit,
                                  "search_s": round(time.perf_counter() - t0, 4), "error": str(err)}))
                continue
            seconds = time.perf_counter() - t0
            one = simulate(build_schedule("1f1b", p, m), costs)
            print(json.dumps({
                "ranks": p, "microbatches": m, "costs": args.costs, "memory_limit_units": limit,
                "search_s": round(seconds, 4), "candidates": found.candidates,
                "bubble_rate": round(found.result.bubble_rate, 4),
                "bubble_rate_1f1b": round(one.bubble_rate, 4),
                "peak_memory_max": found.result.peak_memory_max,
                "description": found.schedule.description,
            }), flush=True)


if __name__ == "__main__":
    main()
