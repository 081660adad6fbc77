"""Benchmark: schedule generation + simulation time, one JSON line per case.

    python scripts/bench/schedule.py [--ranks 8 16 32 64] [--microbatches 32 128 512]

Target: p=64, m=512 under 2 s for any schedule.
"""
import argparse
import json
import time

from megatron_vshape.schedule import SCHEDULES, ScheduleError, build_schedule, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    args = parser.parse_args()
    for p in args.ranks:
        for m in args.microbatches:
            for name in args.schedules:
                t0 = time.perf_counter()
                try:
                    schedule = build_schedule(name, p, m)
                except ScheduleError as err:
                    print(json.dumps({"schedule": name, "ranks": p, "microbatches": m, "error": str(err)}))
                    continue
                t1 = time.perf_counter()
                result = simulate(schedule)
                t2 = time.perf_counter()
                print(json.dumps({
                    "schedule": name, "ranks": p, "microbatches": m,
                    "generate_s": round(t1 - t0, 4), "simulate_s": round(t2 - t1, 4),
                    "total_s": round(t2 - t0, 4), "bubble_rate": round(result.bubble_rate, 4),
                    "peak_memory_max": result.peak_memory_max,
                }), flush=True)


if __name__ == "__main__":
    main()
