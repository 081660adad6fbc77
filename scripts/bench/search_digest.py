"""Benchmark: a fixed grid of searches and named builds, one JSON line per case, to check that a
change to the search changes no result (and makes nothing slower).

    python scripts/bench/search_digest.py [--out FILE] [--ranks 4 8 16] [--steps]
    python scripts/bench/search_digest.py --compare BASELINE NEW

The grid: p 4, 8 and 16; m 8, 16, 32 and 64; the H100 costs (1,1.39,0.35, hop 0.05) and
uniform ones (1,1,1); the default memory model and one where B frees three quarters of a chunk
(1,-0.75,-0.25). At each point the named memory levels (zb-1p, v-min, v-half, v-zb) and ``auto``
at V-Min's level + 1, at 3p/4 and at its default (1F1B's memory). Each case is built from
empty caches; its line holds the makespan, the peak (units), the description, the first 12
hex digits of the SHA-1 of its per-rank orders and the build's wall time and CPU time (this
process's: on a shared machine the steadier of the two).

``--compare`` reads two such files and says where makespans, peaks or order digests differ
(exit status 1 if anywhere), how many descriptions changed, and the total wall and CPU time of
each.

``--steps`` adds, per case, for every search under one memory model that the case ran, its
winner's provenance step by step, each with what that step took off the makespan of the
candidate it started from (``chain``: [step, gain], the first step a construction with gain
0), and the last step of every candidate that ties the winner's makespan (``tied``): how
docs/design.md counts what each step wins.
The baseline is docs/results/search_digest.jsonl (the grid at the commit that wrote it).
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import time

from megatron_vshape.schedule import build_schedule, parse_costs, parse_memory_model, simulate
from megatron_vshape.schedule.search.levels import clear_caches

COSTS = ("1,1.39,0.35,0.05", "1,1,1")
MEMORY = ("1,0,-1", "1,-0.75,-0.25")
NAMES = ("zb-1p", "v-min", "v-half", "v-zb")


def auto_limits(p: int, m: int) -> list:
    """The limits ``auto`` is searched at: V-Min's level + 1, 3p/4, and its default."""
    return sorted({float((p + 4) // 3 + 1), float(round(3 * p / 4)), float(min(p, m))})


def cases(ranks):
    for p in ranks:
        for m in (8, 16, 32, 64):
            for costs in COSTS:
                for memory in MEMORY:
                    for name in NAMES:
                        yield p, m, costs, memory, name, None
                    for limit in auto_limits(p, m):
                        yield p, m, costs, memory, "auto", limit


def run_case(p, m, costs_text, memory_text, name, limit, steps: bool) -> dict:
    costs, memory = parse_costs(costs_text, p), parse_memory_model(memory_text)
    clear_caches()
    tied = _Ties() if steps else None
    started, cpu = time.perf_counter(), time.process_time()
    schedule = build_schedule(name, p, m, costs, memory_limit=limit, memory=memory)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if tied is not None:
        tied.stop()
    result = simulate(schedule, costs, memory)
    row = {"case": f"{name}@{limit:g}" if limit else name, "ranks": p, "microbatches": m,
           "costs": costs_text, "memory_model": memory_text,
           "makespan": round(result.makespan, 6), "peak": round(result.peak_memory_max, 6),
           "orders_sha1": hashlib.sha1(repr(schedule.rank_actions).encode()).hexdigest()[:12],
           "description": schedule.description, "seconds": round(seconds, 4),
           "cpu_seconds": round(cpu, 4)}
    if steps:
        row["chain"], row["tied"] = tied.chains, tied.found
    return row


class _Ties:
    """Records, for every search under one memory model, its winner's chain and the last step
    of each candidate that ties its makespan: a step appended to the search's ``STEPS`` reads
    the pool once every other step has run."""

    def __init__(self):
        from megatron_vshape.schedule.search import adaptive
        self.found, self.chains, self._module = [], [], adaptive
        self._original = adaptive.STEPS
        adaptive.STEPS = adaptive.STEPS + (
            adaptive.Step("record", lambda pool: True, self._record, ""),)

    def _record(self, pool):
        winner = pool.fastest()
        best = round(winner.makespan, 9)
        self.found.append(sorted({str(c.provenance[-1]) for c in pool.candidates
                                  if round(c.makespan, 9) == best}))
        made = {c.provenance: c.makespan for c in reversed(pool.candidates)}
        chain, before = [], None
        for i, step in enumerate(winner.provenance):
            now = made.get(winner.provenance[:i + 1])
            gain = 0.0 if before is None or now is None else round(before - now, 9)
            chain.append([str(step), gain])
            before = now if now is not None else before
        self.chains.append(chain)

    def stop(self):
        self._module.STEPS = self._original


def key(row) -> tuple:
    return (row["case"], row["ranks"], row["microbatches"], row["costs"], row["memory_model"])


def load(path: str) -> dict:
    """The cases of a digest file by ``key`` (its ``{"run": ...}`` header line skipped)."""
    rows = (json.loads(line) for line in open(path) if line.strip())
    return {key(r): r for r in rows if "run" not in r}


def compare(old_path: str, new_path: str) -> int:
    old, new = load(old_path), load(new_path)
    differ = 0
    for k in old.keys() | new.keys():
        a, b = old.get(k), new.get(k)
        if a is None or b is None:
            print(f"only in {'new' if a is None else 'baseline'}: {k}")
            differ += 1
            continue
        for field in ("makespan", "peak", "orders_sha1"):
            if a[field] != b[field]:
                print(f"{field} differs at {k}: {a[field]} -> {b[field]}")
                differ += 1
    worded = sum(old[k]["description"] != new[k]["description"] for k in old.keys() & new.keys())
    before = sum(r["seconds"] for r in old.values())
    after = sum(r["seconds"] for r in new.values())
    print(f"{len(old)} cases in the baseline, {len(new)} new; {differ} differences in makespan, "
          f"peak or orders; {worded} descriptions worded differently")
    print(f"wall time: {before:.2f} s -> {after:.2f} s ({after / before - 1:+.1%})")
    if all("cpu_seconds" in r for r in [*old.values(), *new.values()]):
        before = sum(r["cpu_seconds"] for r in old.values())
        after = sum(r["cpu_seconds"] for r in new.values())
        print(f"CPU time: {before:.2f} s -> {after:.2f} s ({after / before - 1:+.1%})")
    return 1 if differ else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", help="write the lines here (default: standard output)")
    parser.add_argument("--steps", action="store_true", help="add the winners' steps and ties")
    parser.add_argument("--compare", nargs=2, metavar=("BASELINE", "NEW"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    started, rows = time.perf_counter(), []
    for case in cases(args.ranks):
        rows.append(run_case(*case, steps=args.steps))
        if not args.out:
            print(json.dumps(rows[-1]), flush=True)
    if args.out:  # a header line as the other files of docs/results/ have (report.py)
        header = {"command": "python scripts/bench/search_digest.py",
                  "machine": f"a {os.cpu_count()}-core {platform.machine()} CPU, Python "
                             f"{platform.python_version()}",
                  "date": datetime.date.today().isoformat(),
                  "seconds": round(time.perf_counter() - started), "recorded": False,
                  "note": None}
        with open(args.out, "w") as out:
            for row in [{"run": header}, *rows]:
                print(json.dumps(row), file=out)


if __name__ == "__main__":
    main()
