"""Benchmark: the named schedules (memory levels) against 1F1B, one JSON line per case.

    python scripts/bench/named_levels.py [--ranks 4 8 16] [--per-rank 4 8]
        [--costs 2,2.78,0.7,0.05] [--memory-model 1,-0.75,-0.25] [--repeats 3]

Defaults are the F : B : W ratio measured on an H100 (docs/benchmarks.md) and what B leaves for
W there (8-25% of a chunk: ``1,-0.75,-0.25``); m = per-rank x p. Per case and name: the makespan
of the fastest order at the name's memory level and of the paper's fixed order, both over
1F1B's, their peaks, the build time of the fastest (median of ``--repeats`` uncached runs) and
a digest of its orders (``orders_sha1``): two runs that print the same digests built the same
orders, which is how a speed-up is checked to change nothing; and its steady state
(``steady_per_microbatch``: how far apart rank 0 starts its stage-0 forwards over the middle half
of the microbatches), to compare with the fastest steady state a block allows
(tests/schedule/test_search_bound.py); and ``floor_vs_1f1b``, the lower bound for any schedule within the
name's memory level (schedule/search/bounds.py: compute, Little's law, fill and drain).
Targets: v-half <= 1.0 x 1F1B (goal 0.95), v-min <= 1.10 x, v-zb <= 0.92 x; a named schedule
under 0.5 s for p <= 16, m <= 64 (on an idle machine).
"""
import argparse
import hashlib
import json
import statistics
import time

from megatron_vshape.schedule import build_schedule, parse_costs, parse_memory_model, simulate
from megatron_vshape.schedule.model.actions import PassKind
from megatron_vshape.schedule.names import MEMORY_LEVELS
from megatron_vshape.schedule.search.bounds import makespan_floor
from megatron_vshape.schedule.search.levels import clear_caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--per-rank", type=int, nargs="+", default=[4, 8],
                        help="microbatches per rank: m = this x p")
    parser.add_argument("--costs", default="2,2.78,0.7,0.05")
    parser.add_argument("--memory-model", default="1,-0.75,-0.25")
    parser.add_argument("--names", nargs="+", default=list(MEMORY_LEVELS), choices=MEMORY_LEVELS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    memory = parse_memory_model(args.memory_model)
    for p in args.ranks:
        costs = parse_costs(args.costs, p)
        for per in args.per_rank:
            m = per * p
            one = simulate(build_schedule("1f1b", p, m), costs, memory).makespan
            for name in args.names:
                times = []
                for _ in range(args.repeats):
                    clear_caches()
                    started = time.perf_counter()
                    fastest = build_schedule(name, p, m, costs, memory=memory)
                    times.append(time.perf_counter() - started)
                paper = build_schedule(name, p, m, variant="paper")
                ours, fixed = simulate(fastest, costs, memory), simulate(paper, costs, memory)
                print(json.dumps({
                    "schedule": name, "ranks": p, "microbatches": m, "costs": args.costs,
                    "memory_model": args.memory_model,
                    "vs_1f1b": round(ours.makespan / one, 4),
                    "paper_vs_1f1b": round(fixed.makespan / one, 4),
                    "makespan": round(ours.makespan, 4), "makespan_1f1b": round(one, 4),
                    "peak_memory_max": round(ours.peak_memory_max, 4),
                    "paper_peak_memory_max": round(fixed.peak_memory_max, 4),
                    "build_s_median": round(statistics.median(times), 4),
                    "orders_sha1": orders_digest(fastest),
                    "steady_per_microbatch": steady_per_microbatch(fastest, ours),
                    "floor_vs_1f1b": round(makespan_floor(
                        fastest.placement, m, costs, fastest.memory_bound, memory) / one, 4),
                    "description": fastest.description,
                }), flush=True)


def steady_per_microbatch(schedule, result) -> float | None:
    """Rank 0's stage-0 forwards from microbatch m/4 to 3m/4, over their count: the steady
    state's time per microbatch where m is large enough for one (None below 4 microbatches).
    At m = 4p the warm-up reaches into that half (its forwards run ahead: v-zb at p = 16,
    m = 64 reads 4.86, v-half 7.55, where the compute is 5.48); at m = 8p it is the steady
    state (5.48, 5.75)."""
    m = schedule.microbatches
    if m < 4:
        return None
    starts = {a.microbatch: start for a, start in zip(schedule.compute_actions(0), result.start[0])
              if a.kind is PassKind.F and a.stage == 0}
    first, last = m // 4, 3 * m // 4
    return round((starts[last] - starts[first]) / (last - first), 4)


def orders_digest(schedule) -> str:
    """The first 12 hex digits of the SHA-1 of the schedule's per-rank orders."""
    return hashlib.sha1(repr(schedule.rank_actions).encode()).hexdigest()[:12]


if __name__ == "__main__":
    main()
