"""Benchmark: the search's referee, one JSON line per case, with what won each answer.

    python scripts/bench/search_referee.py [--out FILE] [--sets digest reference levels stages]
    python scripts/bench/search_referee.py --compare BEFORE AFTER
    python scripts/bench/search_referee.py --table FILE [--design docs/design.md]

Wider than the digest (search_digest.py), to decide which step of the search and which
"also try" row stays (docs/design.md, "What each step wins"):

    digest      search_digest.py's 320 cases: p 4, 8, 16; m 8-64; the H100 and uniform costs;
                both memory models; the four named levels and auto at up to three limits
    reference   the reference comparison's 336 points (reference_compare.py's defaults at
                --ranks 4 8: m 8-64, costs 2,2,2 and 2,2.4,1.6, hops 0, 0.1 and 0.5; the four
                named levels and auto at V-Min's, V-Half's and 1F1B's memory), our side only
    levels      the named levels at the measured H100 costs (named_levels.py's grid: p 4, 8,
                16, m 4p and 8p, costs 2,2.78,0.7,0.05), under both memory models
    stages      per-stage uneven costs (``Costs.for_stages``): two layers a stage, the LM head
                as two layers more on the last stage, layer costs 1, 1.39, 0.35, hop 0.05;
                p 4, 8, 16, m 2p and 4p; v-min, v-half, v-zb and auto at 3p/4; both models

Each case is built from empty caches. Its line holds the makespan, the peak, a digest of the
orders and the CPU time, and what won: per search under one memory model (``searches``), the
``STEPS`` rows every candidate tying the winner's makespan went through (``needed``: without
one of them, none of those candidates is made) and those some of them went through (``some``);
per "also try" table run (``also``), each row's fastest answer; and where the critical-path
cool-down made the answer faster (``tail``). ``--table`` counts them into the markdown table of
docs/design.md (``--design`` writes it there, between the markers named after the file);
``--compare`` lists every case whose makespan or peak changed, better or worse.
"""
import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_vshape.schedule import build_schedule, parse_costs, parse_memory_model, simulate  # noqa: E402
from megatron_vshape.schedule.model.costs import Costs  # noqa: E402
from megatron_vshape.schedule.model.placement import Layout, Placement  # noqa: E402
from megatron_vshape.schedule.model.simulate import makespan_of  # noqa: E402
from megatron_vshape.schedule.search import adaptive, levels  # noqa: E402
from megatron_vshape.schedule.search.levels import clear_caches  # noqa: E402

import search_digest  # noqa: E402

SETS = ("digest", "reference", "levels", "stages")
MEMORY = ("1,0,-1", "1,-0.75,-0.25")
NAMES = ("zb-1p", "v-min", "v-half", "v-zb")


def markers(results: str) -> tuple[str, str]:
    """The lines around the table a results file writes into docs/design.md."""
    name = Path(results).stem
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def _level_units(level: str, p: int) -> int:
    return {"v-min": (p + 4) // 3, "v-half": (p + 2) // 2, "1f1b": p}[level]


def cases(sets):
    """(set, p, m, costs text, Costs maker, memory text, name, limit) for every case."""
    if "digest" in sets:
        for p, m, costs, memory, name, limit in search_digest.cases([4, 8, 16]):
            yield "digest", p, m, costs, memory, name, limit
    if "reference" in sets:
        for p in (4, 8):
            for m in (8, 16, 32, 64):
                for fbw in ("2,2,2", "2,2.4,1.6"):
                    for comm in (0.0, 0.1, 0.5):
                        for name in NAMES:
                            yield "reference", p, m, f"{fbw},{comm:g}", MEMORY[0], name, None
                        for level in ("v-min", "v-half", "1f1b"):
                            yield ("reference", p, m, f"{fbw},{comm:g}", MEMORY[0], "auto",
                                   float(_level_units(level, p)))
    if "levels" in sets:
        for p in (4, 8, 16):
            for m in (4 * p, 8 * p):
                for memory in MEMORY:
                    for name in NAMES:
                        yield "levels", p, m, "2,2.78,0.7,0.05", memory, name, None
    if "stages" in sets:
        for p in (4, 8, 16):
            for m in (2 * p, 4 * p):
                for memory in MEMORY:
                    for name in NAMES[1:]:
                        yield "stages", p, m, "head", memory, name, None
                    yield "stages", p, m, "head", memory, "auto", float(round(3 * p / 4))


def stage_costs(p: int) -> Costs:
    """Two layers a stage of costs 1, 1.39, 0.35; the last stage two layers more (the head)."""
    weights = [2.0] * (2 * p)
    weights[-1] += 2.0
    return Costs.for_stages(Placement(p, Layout.V), *([w * c for w in weights]
                                                      for c in (1.0, 1.39, 0.35)), comm=0.05)


class Referee:
    """Records, while a case builds, what won: the ``STEPS`` rows behind each search's winner,
    each "also try" table's rows, and the critical-path cool-down. It wraps the tables'
    functions in place and puts them back on ``close``."""

    def __init__(self):
        self.saved = []
        self.searches, self.also, self.tail = [], [], 0
        self._frames = []
        steps = tuple(self._wrapped_step(s) for s in adaptive.STEPS)
        self._swap(adaptive, "STEPS", steps + (adaptive.Step("record", lambda pool: True,
                                                             self._record, ""),))
        self._swap(adaptive, "ALSO_TRY", tuple(self._wrapped_row(r, self._search_makespans)
                                               for r in adaptive.ALSO_TRY))
        if hasattr(levels, "ALSO_TRY"):  # the named levels' table, before it went (issue 51)
            self._swap(levels, "ALSO_TRY", tuple(self._wrapped_row(r, self._level_makespans)
                                                 for r in levels.ALSO_TRY))
            self._swap(levels, "with_faster_tail", self._counted(levels.with_faster_tail))
        self._swap(adaptive, "_search_cached", self._framed("search", adaptive._search_cached))
        self._swap(levels, "_fastest_cached", self._framed("level", levels._fastest_cached))
        self._swap(adaptive, "with_faster_tail", self._counted(adaptive.with_faster_tail))

    def _swap(self, module, name, value):
        self.saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def close(self):
        for module, name, value in reversed(self.saved):
            setattr(module, name, value)

    def reset(self):
        self.searches, self.also, self.tail = [], [], 0

    # --- STEPS -------------------------------------------------------------------------------
    def _wrapped_step(self, step):
        def run(pool):
            spans = pool.__dict__.setdefault("_referee_spans", [])
            before = len(pool.candidates)
            step.run(pool)
            spans.append((step.name, before, len(pool.candidates)))
        return adaptive.Step(step.name, step.when, run, step.budget)

    def _record(self, pool):
        made_by = {}
        for name, start, end in pool.__dict__.get("_referee_spans", []):
            for position in range(start, end):
                made_by[position] = name
        latest = {}
        lineage = []
        for c in pool.candidates:
            rows = {made_by.get(c.position, "?")}
            for k in range(1, len(c.provenance)):
                ancestor = latest.get(c.provenance[:k])
                if ancestor is not None:
                    rows |= lineage[ancestor]
            lineage.append(rows)
            latest[c.provenance] = c.position
        best = round(pool.fastest().makespan, 9)
        tied = [lineage[c.position] for c in pool.candidates if round(c.makespan, 9) == best]
        self.searches.append({"needed": sorted(set.intersection(*tied)),
                              "some": sorted(set.union(*tied))})

    # --- ALSO_TRY ----------------------------------------------------------------------------
    @staticmethod
    def _search_makespans(asked, answers):
        return [round(a.result.makespan, 9) for a in answers]

    @staticmethod
    def _level_makespans(asked, answers):
        return [round(makespan_of(a[0], asked.costs), 9) for a in answers]

    def _wrapped_row(self, row, makespans):
        def run(asked, found):
            answers = row.run(asked, found)
            if self._frames:
                times = makespans(asked, answers)
                self._frames[-1]["rows"].append([row.name, min(times) if times else None])
            return answers
        return type(row)(row.name, row.when, run)

    def _framed(self, table, cached):
        def call(asked):
            self._frames.append({"table": table, "rows": []})
            try:
                return cached(asked)
            finally:
                frame = self._frames.pop()
                if frame["rows"]:
                    self.also.append(frame)
        call.cache_clear = cached.cache_clear
        return call

    def _counted(self, function):
        def call(*args, **kwargs):
            out = function(*args, **kwargs)
            self.tail += out is not None
            return out
        return call


def run_case(referee, group, p, m, costs_text, memory_text, name, limit) -> dict:
    costs = stage_costs(p) if costs_text == "head" else parse_costs(costs_text, p)
    memory = parse_memory_model(memory_text)
    clear_caches()
    referee.reset()
    cpu = time.process_time()
    try:
        schedule = build_schedule(name, p, m, costs, memory_limit=limit, memory=memory)
    except Exception as error:  # a case that cannot be built is a result too
        return {"set": group, "case": _label(name, limit), "ranks": p, "microbatches": m,
                "costs": costs_text, "memory_model": memory_text,
                "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    cpu = time.process_time() - cpu
    result = simulate(schedule, costs, memory)
    return {"set": group, "case": _label(name, limit), "ranks": p, "microbatches": m,
            "costs": costs_text, "memory_model": memory_text,
            "makespan": round(result.makespan, 6), "peak": round(result.peak_memory_max, 6),
            "orders_sha1": hashlib.sha1(repr(schedule.rank_actions).encode()).hexdigest()[:12],
            "cpu_seconds": round(cpu, 4), "searches": referee.searches, "also": referee.also,
            "tail": referee.tail}


def _label(name, limit):
    return f"{name}@{limit:g}" if limit else name


def key(row) -> tuple:
    return (row["set"], row["case"], row["ranks"], row["microbatches"], row["costs"],
            row["memory_model"])


def load(path: str) -> dict:
    rows = (json.loads(line) for line in open(path) if line.strip())
    return {key(r): r for r in rows if "run" not in r}


def header(path: str) -> dict:
    """The file's ``{"run": ...}`` line: the command, machine, date and the ``STEPS`` rows in
    the order the search ran them."""
    with open(path) as lines:
        return json.loads(next(lines)).get("run", {})


def compare(before_path: str, after_path: str) -> int:
    """Every case whose makespan or peak changed; exit status 1 where one got worse."""
    before, after = load(before_path), load(after_path)
    worse = better = same_answer_other_orders = 0
    for k in sorted(before.keys() | after.keys(), key=str):
        a, b = before.get(k), after.get(k)
        if a is None or b is None or ("error" in a) != ("error" in b):
            print(f"only one side has it (or an error): {k}")
            worse += 1
            continue
        if "error" in a:
            continue
        if (b["makespan"], b["peak"]) != (a["makespan"], a["peak"]):
            tag = "WORSE" if (b["makespan"] > a["makespan"] + 1e-9
                              or b["peak"] > a["peak"] + 1e-9) else "better"
            worse += tag == "WORSE"
            better += tag == "better"
            print(f"{tag}: {k}: makespan {a['makespan']} -> {b['makespan']}, "
                  f"peak {a['peak']} -> {b['peak']}")
        elif a["orders_sha1"] != b["orders_sha1"]:
            same_answer_other_orders += 1
    cpu_a = sum(r.get("cpu_seconds", 0) for r in before.values())
    cpu_b = sum(r.get("cpu_seconds", 0) for r in after.values())
    print(f"{len(before)} cases before, {len(after)} after: {worse} worse, {better} better, "
          f"{same_answer_other_orders} with the same makespan and peak from other orders; "
          f"CPU {cpu_a:.1f} s -> {cpu_b:.1f} s (not a timing: see the digest's ABBA run)")
    return 1 if worse else 0


def table(path: str) -> str:
    """The markdown table of what won, counted over the referee file at ``path``."""
    rows = list(load(path).values())
    sets = sorted({r["set"] for r in rows}, key=SETS.index)
    built = [r for r in rows if "error" not in r]
    searches = [s for r in built for s in r["searches"]]
    steps = {}
    for s in searches:
        for name in s["some"]:
            steps.setdefault(name, [0, 0])[1] += 1
        for name in s["needed"]:
            steps[name][0] += 1
    order = header(path).get("steps") or [s.name for s in adaptive.STEPS]
    lines = [f"Over {len(rows)} cases ({', '.join(sets)}; {len(rows) - len(built)} that no "
             f"schedule fits), {len(searches)} searches under one memory model:", "",
             "| `STEPS` row | needed for the winner (every tying candidate went through it) "
             "| behind some tying candidate |", "|---|---|---|"]
    names = order + sorted(set(steps) - set(order))
    for name in names:
        needed, some = steps.get(name, (0, 0))
        lines.append(f"| {name} | {needed} | {some} |")
    lines += ["", "| `ALSO_TRY` row | runs | gives the answer (the first of the fastest) "
              "| strictly faster than every other row (or the only one that ran) |", "|---|---|---|---|"]
    counts = {}
    for r in built:
        for frame in r["also"]:
            answered = [(name, t) for name, t in frame["rows"] if t is not None]
            best = min((t for _, t in answered), default=None)
            first = next((name for name, t in answered if t == best), None)
            for name, t in frame["rows"]:
                c = counts.setdefault((frame["table"], name), [0, 0, 0])
                c[0] += 1
                c[1] += name == first
                others = [u for other, u in answered if other != name]
                c[2] += t is not None and all(t < u - 1e-9 for u in others)
    for (group, name), (runs, first, strict) in sorted(counts.items()):
        table_name = "adaptive.py" if group == "search" else "levels.py"
        lines.append(f"| {table_name}: {name} | {runs} | {first} | {strict} |")
    tails = sum(r["tail"] > 0 for r in built)
    lines += ["", f"The critical-path cool-down made {tails} of {len(built)} answers faster."]
    return "\n".join(lines)


def write_design(path: str, results: str, command: str) -> None:
    """The table of ``results`` written into the page at ``path`` between its ``markers``."""
    begin, end = markers(results)
    page = Path(path).read_text()
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    text = table(results)
    Path(path).write_text(f"{head}{begin}\n<!-- written by: {command} -->\n\n{text}\n\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--out", help="write the lines here (default: standard output)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--table", metavar="FILE")
    parser.add_argument("--design", metavar="PAGE", help="with --table: write it into PAGE")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.table:
        if args.design:
            write_design(args.design, args.table, f"python scripts/bench/search_referee.py "
                                                  f"--table {args.table} --design {args.design}")
        else:
            print(table(args.table))
        return
    referee, started, rows = Referee(), time.perf_counter(), []
    out = open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout)
    with out as stream:
        if args.out:
            header = {"command": "python scripts/bench/search_referee.py "
                                 f"--sets {' '.join(args.sets)}",
                      "machine": f"a {os.cpu_count()}-core {platform.machine()} CPU, Python "
                                 f"{platform.python_version()}",
                      "date": datetime.date.today().isoformat(), "recorded": False,
                      "steps": [step.name for step in adaptive.STEPS]}
            print(json.dumps({"run": header}), file=stream, flush=True)
        for case in cases(args.sets):
            rows.append(run_case(referee, *case))
            print(json.dumps(rows[-1]), file=stream, flush=True)
    referee.close()
    print(f"{len(rows)} cases in {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
