"""Render docs/benchmarks.md from the stored benchmark results, and store new ones.

    python scripts/bench/report.py                   # write docs/benchmarks.md from docs/results/
    python scripts/bench/report.py --check           # exit 1 when the page is not what that writes
    python scripts/bench/report.py --record NAME ... # run those benchmarks, store them, write the page
    python scripts/bench/report.py --verify [NAME ...] [--cheap]
                                                     # re-measure the stored deterministic results
    python scripts/bench/report.py --import NAME FILE --machine TEXT --seconds S [--date D]
                                                     # store a run made elsewhere (a GPU machine)

Every benchmark in scripts/bench prints one JSON line per case. A stored result file,
``docs/results/NAME.jsonl``, holds those lines after one header line, ``{"run": {...}}``: the
command that printed them, the machine, the date, how long the run took, and ``recorded``
(true where the numbers were copied from an earlier report and cannot be re-measured on a CPU:
the GPU timings). ``RUNS`` below says, per result file, which script and arguments produce it,
which fields of a case are deterministic (schedule makespans, bubbles, peaks, order digests:
pure Python, the same on any machine) and how the page shows it.

``--verify`` re-computes the deterministic fields of the stored cases with today's code and
names every case that differs; ``--cheap`` keeps to the small cases (tests/docs/test_benchmark_page.py
runs that). Timings are never re-measured by the page: they are what the stored run measured.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import runpy
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
H100_COSTS = "2,2.78,0.7,0.05"
B_FREES = "1,-0.75,-0.25"


# --- what each result file is ------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One stored result file: the benchmark that writes it and how the page shows it.

    ``args`` may hold ``{reference}``, replaced by $ZB_REFERENCE when the run is recorded.
    ``deterministic``: fields of a case that today's code must reproduce exactly; ``key``:
    the fields that name a case; ``cheap``: the cases small enough for the test's re-check;
    ``remeasure(run, row)``: today's deterministic fields of one stored case (None: not
    re-measurable here)."""

    name: str
    script: str
    args: tuple[str, ...]
    title: str
    about: str
    render: Callable[[list[dict]], list[str]]
    key: tuple[str, ...] = ()
    deterministic: tuple[str, ...] = ()
    cheap: Callable[[dict], bool] = lambda row: False
    remeasure: Callable[["Run", dict], dict] | None = None
    timeout: int = 1800
    recorded: bool = False
    stack: tuple[str, ...] = ()
    """Distributions whose versions the machine line names (torch, megatron-core)."""

    @property
    def path(self) -> Path:
        return RESULTS / f"{self.name}.jsonl"

    def command(self) -> str:
        args = [a.replace("{reference}", "PATH") for a in self.args]
        return shlex.join(["python", f"scripts/bench/{self.script}", *args])


def _in_process(script: str, argv: list[str]) -> list[dict]:
    """The JSON lines ``script`` prints for ``argv``, run in this process."""
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [str(BENCH / script), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(BENCH / script), run_name="__main__")
    finally:
        sys.argv = saved
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def _by_rerun(case_args: Callable[[dict], list[str]]):
    """A ``remeasure`` that re-runs the benchmark on one case and returns its matching line."""
    def remeasure(run: Run, row: dict) -> dict:
        for line in _in_process(run.script, case_args(row)):
            if all(line.get(k) == row.get(k) for k in run.key):
                return line
        raise AssertionError(f"{run.script} {case_args(row)} printed no case {_name(run, row)}")
    return remeasure


def _reference_ours(run: Run, row: dict) -> dict:
    """Our side of one reference_compare case (the reference's side needs its checkout)."""
    spec = importlib.util.spec_from_file_location("reference_compare", BENCH / run.script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    p = row["ranks"]
    costs = module.parse_costs(",".join(str(c) for c in [*row["costs"], row["comm"]]), p)
    name = row["schedule"].partition("@")[0]
    return module._ours(name, p, row["microbatches"], costs, row["memory_limit_units"])


def _arg(run: Run, flag: str, default: str) -> str:
    args = list(run.args)
    return args[args.index(flag) + 1] if flag in args else default


# --- formatting helpers -------------------------------------------------------------------------

def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return lines


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def _seconds(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _points(rows: list[dict], *fields: str) -> list[tuple]:
    return sorted({tuple(r[f] for f in fields) for r in rows})


def _one(rows: list[dict], **match) -> dict | None:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found[0] if found else None


def _name(run: Run, row: dict) -> str:
    return ", ".join(f"{k} {row.get(k)}" for k in run.key)


# --- the tables ---------------------------------------------------------------------------------

_ALL = ("1f1b", "zb-1p", "interleaved-1f1b", "v-min", "v-half", "v-zb", "auto")
_NAMES = ("zb-1p", "v-min", "v-half", "v-zb")


def _render_schedule(rows: list[dict]) -> list[str]:
    names = [n for n in _ALL if any(r["schedule"] == n for r in rows)]
    points = _points(rows, "ranks", "microbatches")
    bubble, timing = [], []
    for p, m in points:
        cells = [_one(rows, ranks=p, microbatches=m, schedule=n) for n in names]
        bubble.append([p, m] + [f"{_num(c['bubble_rate'])} ({c['peak_memory_max']:g})"
                                if c and "error" not in c else "-" for c in cells])
        timing.append([p, m] + [_seconds(c["total_s"]) if c and "error" not in c else "-"
                                for c in cells])
    return (["Bubble rate over the whole iteration, and in brackets the peak activation memory "
             "(units of one microbatch's activations of one rank's layer share), at uniform costs "
             "F = B = W = 1 without communication:", ""]
            + _table(["p", "m", *names], bubble)
            + ["", "Seconds to build and simulate (`auto` reads the search `v-zb` has just run "
               "from the cache, so it shows the simulation only):", ""]
            + _table(["p", "m", *names], timing))


def _render_named(rows: list[dict]) -> list[str]:
    points = _points(rows, "ranks", "microbatches")
    names = [n for n in _NAMES if any(r["schedule"] == n for r in rows)]
    ratio, timing, peaks = [], [], []
    for p, m in points:
        cells = [_one(rows, ranks=p, microbatches=m, schedule=n) for n in names]
        first = next(c for c in cells if c)
        ratio.append([p, m, _num(first["makespan_1f1b"], 2)]
                     + [_num(c["vs_1f1b"]) if c else "-" for c in cells]
                     + [_num(c["paper_vs_1f1b"]) if c else "-"
                        for n, c in zip(names, cells) if n != "zb-1p"])
        timing.append([p, m] + [_seconds(c["build_s_median"]) if c else "-" for c in cells])
        peaks.append([p, m] + [f"{c['peak_memory_max']:g} ({c['paper_peak_memory_max']:g})"
                               if c else "-" for c in cells])
    floors = [[p, m] + [_num(c.get("floor_vs_1f1b")) if c else "-" for c in
                        (_one(rows, ranks=p, microbatches=m, schedule=n) for n in names)]
              for p, m in points]
    papers = [f"{n}, paper order" for n in names if n != "zb-1p"]
    return (["Makespan over 1F1B's (below 1 is faster than 1F1B), the fastest order at each name's "
             "memory level and the paper's fixed order:", ""]
            + _table(["p", "m", "1F1B makespan", *names, *papers], ratio)
            + ["", "A lower bound for any schedule within each name's memory level, over 1F1B's "
               "makespan (`megatron_vshape/schedule/search/bounds.py`: the busiest rank's compute, "
               "Little's law on each rank's activation lifetimes, the pipeline's fill and drain); "
               "no order reaches below it:", ""]
            + _table(["p", "m", *names], floors)
            + ["", "Peak activation memory, ours (the paper order's), in units of one rank's layer "
               "share; the names' bounds are p, (p+4)//3, (p+2)//2 and p:", ""]
            + _table(["p", "m", *names], peaks)
            + ["", "Seconds to build the fastest order (median of the repeats, caches cleared):", ""]
            + _table(["p", "m", *names], timing))


def _render_search(rows: list[dict]) -> list[str]:
    body = []
    for row in sorted(rows, key=lambda r: (r["ranks"], r["microbatches"])):
        if "error" in row:
            body.append([row["ranks"], row["microbatches"], row["memory_limit_units"],
                         "-", "-", "-", "-", "-", "no schedule fits"])
            continue
        body.append([row["ranks"], row["microbatches"], f"{row['memory_limit_units']:g}",
                     _seconds(row["search_s"]), _seconds(row["search_s_median"]),
                     row["candidates"], _num(row["bubble_rate"]), _num(row["bubble_rate_1f1b"]),
                     f"{row['peak_memory_max']:g}"])
    return _table(["p", "m", "limit (units)", "search s (fastest)", "search s (median)",
                   "candidates", "bubble", "1F1B bubble", "peak"], body)


_TOLERANCE = 0.005


def _compare_class(diff: float) -> str:
    if diff > _TOLERANCE:
        return "worse"
    if diff > 1e-6:
        return "above"
    if diff >= -1e-6:
        return "equal"
    return "better"


def _point(row: dict) -> str:
    costs = ",".join(f"{c:g}" for c in row["costs"])
    return f"p{row['ranks']} m{row['microbatches']} {costs} hop {row['comm']:g}"


def _render_reference(rows: list[dict]) -> list[str]:
    order = ("v-min", "v-half", "v-zb", "zb-1p", "auto@v-min", "auto@v-half", "auto@1f1b")
    label = {"auto@v-min": "auto at V-Min's limit", "auto@v-half": "auto at V-Half's limit",
             "auto@1f1b": "auto at 1F1B's limit"}
    summary, timing = [], []
    for name in order:
        mine = [r for r in rows if r["schedule"] == name and "bubble_diff" in r]
        if not mine:
            continue
        counts = {k: 0 for k in ("worse", "above", "equal", "better")}
        for r in mine:
            counts[_compare_class(r["bubble_diff"])] += 1
        best = min(mine, key=lambda r: r["bubble_diff"])
        worst = max(mine, key=lambda r: r["bubble_diff"])
        high = sum(r["ours_peak"] > r["ref_peak"] + 1e-9 for r in mine)
        extreme = (f"{_point(best)}: {best['ours_bubble_rate']:.3f} vs {best['ref_bubble_rate']:.3f}"
                   if best["bubble_diff"] < -1e-6 else "")
        if worst["bubble_diff"] > 1e-6:
            extreme += (f"; worst {_point(worst)}: {worst['ours_bubble_rate']:.3f} vs "
                        f"{worst['ref_bubble_rate']:.3f}")
        over = sum(r["memory_limit_units"] is not None
                   and r["ours_peak"] > r["memory_limit_units"] + 1e-9 for r in mine)
        summary.append([label.get(name, name), len(mine), *counts.values(), high,
                        over if any(r["memory_limit_units"] is not None for r in mine) else "-",
                        extreme])
        ours = [r["ours_generator_s"] for r in mine]
        theirs = [r["ref_generator_s"] for r in mine]
        timing.append([label.get(name, name), _seconds(statistics.median(ours)), _seconds(max(ours)),
                       _seconds(statistics.median(theirs)), _seconds(max(theirs))])
    points = []
    for p, m, costs, comm in _points([dict(r, costs=tuple(r["costs"])) for r in rows],
                                     "ranks", "microbatches", "costs", "comm"):
        cells = [_one(rows, ranks=p, microbatches=m, costs=list(costs), comm=comm, schedule=n)
                 for n in order]
        points.append([p, m, ",".join(f"{c:g}" for c in costs), f"{comm:g}"]
                      + [f"{c['ours_bubble_rate']:.3f} / {c['ref_bubble_rate']:.3f}"
                         if c and "bubble_diff" in c else "-" for c in cells])
    failed = [r for r in rows if "bubble_diff" not in r]
    agree = max((r["ref_makespan_rel_diff"] for r in rows if "ref_makespan_rel_diff" in r), default=None)
    lines = (["Bubble rates under our simulator, ours against theirs per grid point: \"worse\" is "
              f"ours above theirs by more than {_TOLERANCE}, \"above\" by less, \"equal\" within "
              "1e-6; \"our peak higher\" counts the points where our peak memory is above theirs, "
              f"and \"over the limit\" those where ours is above the limit both searched under:", ""]
             + _table(["schedule", "points", "worse", "above", "equal", "better", "our peak higher",
                       "over the limit", "best point for us (ours vs theirs bubble)"], summary)
             + ["", "Seconds to generate one schedule, median and max over the points (`auto` at a "
                "name's level is the search that name has just run, read from the cache):", ""]
             + _table(["schedule", "ours median", "ours max", "theirs median", "theirs max"], timing)
             + ["", f"Their schedules timed by their own cost model and by our simulator differ by at "
                f"most {agree:g} (relative)." if agree is not None else ""]
             + ["", "<details><summary>Every point: bubble rate, ours / theirs</summary>", ""]
             + _table(["p", "m", "F,B,W", "hop", *(label.get(n, n) for n in order)], points)
             + ["", "</details>"])
    if failed:
        lines += ["", f"{len(failed)} points without a comparison: "
                  + "; ".join(f"{r['schedule']} {_point(r)}: "
                              f"{r.get('ref_error') or r.get('ref_invalid') or r.get('ours_error')}"
                              for r in failed)]
    return lines


def _render_runtime(rows: list[dict]) -> list[str]:
    body = [[r["schedule"], f"{r['max_loss_diff']:.3g}", f"{r['max_grad_diff']:.3g}",
             _num(r["peak_activation_vs_1f1b"]), _num(r["simulated_peak_vs_1f1b"]),
             _seconds(r["step_time_s"]), _seconds(r.get("simulated_makespan_s")),
             _num(r.get("step_time_vs_simulated"), 2)] for r in rows]
    return _table(["schedule", "max loss diff", "max grad diff", "peak activations vs 1F1B",
                   "simulated", "step s", "simulated step s", "step / simulated"], body)


def _render_megatron(rows: list[dict]) -> list[str]:
    body = [[r["schedule"], f"{r['max_loss_diff']:.3g}", f"{r['max_grad_diff']:.3g}",
             _num(r["peak_activation_vs_1f1b"]), _num(r["simulated_peak_vs_1f1b"]),
             _seconds(r["step_time_s"]), _seconds(r["step_time_1f1b_s"])] for r in rows]
    return _table(["schedule", "max loss diff vs megatron 1F1B", "max grad diff",
                   "peak activations vs 1F1B", "simulated", "step s", "1F1B step s"], body)


def _render_head_layouts(rows: list[dict]) -> list[str]:
    body = [[_num(r["head_layers"], 0), r["layout"], " ".join(map(str, r["stage_layers"])),
             " ".join(f"{x:g}" for x in r["rank_loads"]),
             f"{max(r['max_loss_diff'], r['max_grad_diff']):.3g}",
             _seconds(r["emulated_step_time_s"]), _seconds(r["simulated_makespan_s"]),
             _num(r["emulated_vs_simulated"]), _num(r["emulated_vs_even"]),
             _num(r["simulated_vs_even"])] for r in rows]
    return _table(["head (layers)", "layout", "layers per stage", "rank loads (layers)",
                   "max loss, grad diff vs 1F1B", "step s", "simulated step s",
                   "step / simulated", "step vs even", "simulated vs even"], body)


def _render_cooldown(rows: list[dict]) -> list[str]:
    names = [n for n in ("v-min", "v-half", "v-zb") if any(r["schedule"] == n for r in rows)]
    body = []
    for p, m in _points(rows, "ranks", "microbatches"):
        cells = []
        for name in names:
            r = _one(rows, ranks=p, microbatches=m, schedule=name)
            if r is None:
                cells.append("-")
                continue
            if r.get("exact_makespan") is None:
                cells.append(f"{r['makespan']:.2f} (no solution in time)")
                continue
            star = "*" if r["status"] == "OPTIMAL" else ""
            same = abs(r["exact_makespan"] - r["makespan"]) < 1e-9
            cells.append(f"{r['makespan']:.2f}{star}" if same
                         else f"{r['makespan']:.2f} -> {r['exact_makespan']:.2f}{star}")
        body.append([p, m, *cells])
    return (["Makespan of ours -> the solver's cool-down (* proven the best cool-down after the "
             "same start):", ""] + _table(["p", "m", *names], body))


def _render_bw_split(rows: list[dict]) -> list[str]:
    body = [[r["device"], r["hidden"], r["seq"], r["dtype"], _num(r.get("forward_ms"), 2),
             _num(r.get("fused_backward_ms"), 2), _num(r.get("b_ms"), 2), _num(r.get("w_ms"), 2),
             f"{100 * r['split_overhead']:+.1f}%" if r.get("split_overhead") is not None else "-",
             f"{100 * r['fraction_b_frees']:.0f}%" if r.get("fraction_b_frees") is not None else "-"]
            for r in rows]
    return _table(["device", "hidden", "seq", "dtype", "F ms", "fused backward ms", "B ms", "W ms",
                   "(B + W) / fused - 1", "share B frees"], body)



def _render_stage_layouts(rows: list[dict]) -> list[str]:
    """Per model and PP: each schedule's even and chosen layout, and the bounds."""
    out = []
    for model, pp in _points(rows, "model", "pp"):
        group = [r for r in rows if r["model"] == model and r["pp"] == pp]
        tp = group[0]["tp"]
        out += ["", f"**{model}, PP {pp}, TP {tp}** ({group[0]['microbatches']} microbatches, "
                    f"seq {group[0]['seq_length']})", ""]
        table = []
        for r in group:
            if not r["feasible"]:
                table.append([r["schedule"], "-", "-", "-", "-", "-", "-", "-",
                              r["reason"][:70]])
                continue
            gain = f"x{r['even_s'] / r['best_s']:.3f}" if r.get("even_s") else "even does not fit"
            table.append([r["schedule"], _num(r.get("even_tflops"), 0), _num(r["best_tflops"], 0),
                          gain, _seconds(r["best_s"]), _seconds(r["busiest_s"]),
                          _seconds(r["whole_layer_s"]), _seconds(r["balanced_s"]),
                          "`" + r["layout"].replace("|", "\\|") + "`"])  # | splits cells
        out += _table(["schedule", "even TFLOP/s", "best TFLOP/s", "best vs even", "best s",
                       "busiest s", "whole-layer s", "balanced s", "chosen layout"], table)
        fits = [r for r in group if r["feasible"]]
        v = min((r for r in fits if r["schedule"].startswith("v-")), key=lambda r: r["best_s"],
                default=None)
        megatron = min((r for r in fits if "1f1b" in r["schedule"]), key=lambda r: r["best_s"],
                       default=None)
        if v and megatron:
            out += ["", f"Best V ({v['schedule']}) vs best 1F1B ({megatron['schedule']}), each "
                        f"at its best layout: x{megatron['best_s'] / v['best_s']:.3f}; the V "
                        f"is {100 * (v['best_s'] / v['whole_layer_s'] - 1):+.1f}% from its "
                        f"whole-layer bound, {100 * (v['best_s'] / v['busiest_s'] - 1):+.1f}% "
                        f"from busiest."]
    return out


RUNS: tuple[Run, ...] = (
    Run("schedule", "schedule.py", ("--ranks", "8", "16", "32", "--microbatches", "32", "128"),
        "Building and simulating every schedule",
        "Every schedule built for p ranks and m microbatches (the V names run their search) and "
        "simulated at uniform costs. A smaller grid than the script's default (p up to 64, m up "
        "to 512), which takes longer than is reasonable on two cores.",
        _render_schedule, key=("schedule", "ranks", "microbatches"),
        deterministic=("bubble_rate", "peak_memory_max", "error"),
        cheap=lambda r: r["ranks"] == 8 and r["microbatches"] == 32
        and r["schedule"] in ("1f1b", "zb-1p", "interleaved-1f1b", "v-half"),
        remeasure=_by_rerun(lambda r: ["--ranks", str(r["ranks"]), "--microbatches",
                                       str(r["microbatches"]), "--schedules", r["schedule"]])),
    Run("named_levels", "named_levels.py", ("--costs", H100_COSTS, "--memory-model", B_FREES),
        "The named schedules against 1F1B at an H100's costs",
        f"`zb-1p`, `v-min`, `v-half` and `v-zb` name a memory level; each gives the fastest order "
        f"found within it. Costs F,B,W,hop = {H100_COSTS} (the ratio measured on an H100, below), "
        f"memory model `{B_FREES}` (B frees three quarters of a chunk's activations, as measured "
        "there), m = 4p and 8p.",
        _render_named, key=("schedule", "ranks", "microbatches", "costs", "memory_model"),
        deterministic=("vs_1f1b", "paper_vs_1f1b", "makespan", "makespan_1f1b", "peak_memory_max",
                       "paper_peak_memory_max", "orders_sha1", "steady_per_microbatch",
                       "floor_vs_1f1b", "description"),
        cheap=lambda r: r["ranks"] == 4 and r["microbatches"] == 16
        and r["schedule"] in ("zb-1p", "v-half"),
        remeasure=_by_rerun(lambda r: ["--ranks", str(r["ranks"]), "--per-rank",
                                       str(r["microbatches"] // r["ranks"]), "--names", r["schedule"],
                                       "--costs", r["costs"], "--memory-model", r["memory_model"],
                                       "--repeats", "1"])),
    Run("named_levels-default-memory", "named_levels.py",
        ("--costs", H100_COSTS, "--memory-model", "1,0,-1"),
        "The same under the default memory model",
        "As above, with the paper's memory model (`1,0,-1`: W frees a chunk's activations).",
        _render_named, key=("schedule", "ranks", "microbatches", "costs", "memory_model"),
        deterministic=("vs_1f1b", "paper_vs_1f1b", "makespan", "makespan_1f1b", "peak_memory_max",
                       "paper_peak_memory_max", "orders_sha1", "steady_per_microbatch",
                       "floor_vs_1f1b", "description"),
        cheap=lambda r: r["ranks"] == 4 and r["microbatches"] == 16 and r["schedule"] == "v-min",
        remeasure=_by_rerun(lambda r: ["--ranks", str(r["ranks"]), "--per-rank",
                                       str(r["microbatches"] // r["ranks"]), "--names", r["schedule"],
                                       "--costs", r["costs"], "--memory-model", r["memory_model"],
                                       "--repeats", "1"])),
    Run("search", "search.py", (),
        "The adaptive search (`auto`) under half of 1F1B's memory",
        "`vshape search` at costs F,B,W,hop = 1,1.2,0.8,0.1 and a limit of half of 1F1B's peak, "
        "fastest and median of 3 runs from empty caches.",
        _render_search, key=("ranks", "microbatches"),
        deterministic=("memory_limit_units", "candidates", "bubble_rate", "bubble_rate_1f1b",
                       "peak_memory_max", "description", "error"),
        cheap=lambda r: r["ranks"] == 4 and r["microbatches"] == 16,
        remeasure=_by_rerun(lambda r: ["--ranks", str(r["ranks"]), "--microbatches",
                                       str(r["microbatches"]), "--costs", r["costs"],
                                       "--repeats", "1"])),
    Run("reference_compare", "reference_compare.py",
        ("--reference", "{reference}", "--ranks", "4", "8", "--timeout", "300"),
        "Against the paper's own generators",
        "The schedule generators of sail-sg/zero-bubble-pipeline-parallelism (a checkout at PATH, "
        "commit 39f2c186, imported at run time, nothing copied) and ours on the same grid: "
        "p 4 and 8 x m 8/16/32/64 x costs F,B,W 2,2,2 and 2,2.4,1.6 x hop 0/0.1/0.5. Their "
        "schedules are converted, checked by our validator and timed by our simulator. `auto` "
        "is compared with their adaptive search (`v_auto_schedule`) at the same memory limit. "
        "The script's default grid adds p = 16, where their adaptive search takes up to a minute "
        "per point. To record it again: `ZB_REFERENCE=PATH python scripts/bench/report.py "
        "--record reference_compare`.",
        _render_reference, key=("schedule", "ranks", "microbatches", "costs", "comm"),
        deterministic=("ours_bubble_rate", "ours_makespan", "ours_peak", "ours_error"),
        cheap=lambda r: r["ranks"] == 4 and r["microbatches"] == 8 and r["comm"] == 0.1
        and r["costs"] == [2.0, 2.4, 1.6] and not r["schedule"].startswith("auto"),
        remeasure=_reference_ours),
    Run("runtime", "runtime.py",
        ("--schedule", "1f1b,zb-1p,v-min,v-half,v-zb", "--ranks", "4", "--microbatches", "16",
         "--emulate", "20,20,20"),
        "The torch runtime on gloo processes",
        "A toy model (fp64) trained under each schedule on 4 local gloo processes; losses and "
        "gradients compared with a single-process reference; every pass lasts an emulated 20 ms "
        "(one rank's layer share), so the step time compares with the simulator's makespan.",
        _render_runtime, timeout=900, stack=("torch",)),
    Run("megatron_cpu", "megatron_cpu.py",
        ("--schedule", "v-min,v-half,v-zb", "--ranks", "4", "--microbatches", "8", "--layers", "24"),
        "megatron-core on CPU",
        "A tiny megatron-core GPT (local spec, fp32, 24 layers) on 4 gloo processes under "
        "megatron's own 1F1B and under each V schedule, same model and data; differences are "
        "against megatron's 1F1B. Measured peak activations exceed the simulated ratio by rank "
        "0's logits and loss, which 1F1B keeps on its last rank for one microbatch only.",
        _render_megatron, timeout=1800, stack=("torch", "megatron-core")),
    Run("head_layouts", "head_layouts.py", ("--head-layers", "2", "4"),
        "A heavy LM head: even and balanced stage layouts (CPU, emulated device)",
        "`vshape demo`'s heavy-head case (docs/demo.md): its tiny megatron-core GPT on 4 gloo "
        "processes, 8 microbatches, the LM head and loss emulated as 2 or 4 layers on the V's "
        "last stage (one layer: F, B, W = 20, 27.8, 7 ms), V-ZB built for and slowed to each "
        "layout's per-stage costs (`Costs.for_stages`), with the even layout and a balanced one "
        "(`harness/head_layouts.py`); losses and gradients against megatron's own 1F1B; step: "
        "the fastest of 2 timed steps, slowest rank.",
        _render_head_layouts, timeout=900, stack=("torch", "megatron-core")),
    Run("cooldown_gap", "cooldown_gap.py",
        ("--ranks", "4", "8", "16", "--per-rank", "4", "8", "--workers", "1"),
        "How far the cool-down is from the best one",
        "Every pass that starts in a named schedule's last 60 time units is set free and "
        "CP-SAT (OR-Tools, 60 s and one thread per case) orders them anew under the same "
        f"dependencies and memory level; H100 costs, memory model `{B_FREES}`. Needs "
        "OR-Tools (`pip install ortools`; the project does not depend on it) and about 20 "
        "minutes. The solver stops at its time limit, so what it finds depends on the machine "
        "and what else runs there: a run beside other jobs (load average 5-13 on the same two "
        "cores) found a solution for only 11 of the 18 cases. The results below are the run "
        "first reported, kept as reported; the orders they start from are the named levels' "
        "above (the tests check that their makespans are today's).",
        _render_cooldown, timeout=3000, recorded=True, stack=("ortools",)),
    Run("bw_split_gpu", "bw_split_gpu.py", (),
        "The cost of splitting the backward into B and W (GPU)",
        "megatron-core transformer layers (local spec, no flash attention, micro batch 1) timed "
        "per layer: forward, megatron's fused backward, our input-gradient B and deferred "
        "weight-gradient W; and the share of the forward's saved activations that B frees (W "
        "keeps the rest: the linear layers' inputs and output gradients). F : B : W = 1 : 1.39 "
        ": 0.35 at hidden 4096, seq 2048 is where the H100 costs above come from, and the share "
        f"B frees is where the memory model `{B_FREES}` comes from.",
        _render_bw_split, recorded=True),
    Run("stage_layouts", "stage_layouts.py", (),
        "Layouts of whole layers per stage for today's models",
        "`vshape plan`'s choice of layers per pipeline stage (plan/layout_search.py) against the "
        "plugin's even layout, per bundled modern model (Llama-3-8B/70B, Qwen2.5-7B/72B, "
        "Gemma-2-9B: vocabularies of 128k-256k) and PP 4, 8, 16 on PP x TP H100s (DP 1; TP the smallest "
        "at which a V fits 80 GiB), seq 8192, micro batch 1, global batch 64, shape cost model, "
        "bf16, flash attention. *busiest*: the least busiest-rank work any whole-layer layout "
        "allows (a true lower bound); *whole-layer*: that plus the schedule's bubble when "
        "balanced; *balanced*: all work over p plus that bubble, what vocabulary parallelism "
        "could reach (plan/bounds.py). The chosen layout is megatron's "
        "`--pipeline-model-parallel-layout` (for a V the 2p stages in V order).",
        _render_stage_layouts, key=("model", "pp", "schedule"),
        deterministic=("tp", "even_s", "best_s", "layout", "busiest_s", "whole_layer_s",
                       "balanced_s", "feasible"),
        cheap=lambda r: r["model"] == "llama-3-8b" and r["pp"] == 8
        and r["schedule"] in ("1f1b", "v-zb"),
        remeasure=_by_rerun(lambda r: ["--models", r["model"], "--pp", str(r["pp"])])),
)
_BY_NAME = {run.name: run for run in RUNS}


# --- stored results -----------------------------------------------------------------------------

def load(run: Run, results: Path = RESULTS) -> tuple[dict, list[dict]]:
    """(header, cases) of ``run``'s stored file."""
    lines = (results / run.path.name).read_text().splitlines()
    header = json.loads(lines[0])["run"]
    return header, [json.loads(line) for line in lines[1:] if line.strip()]


def _machine(stack: tuple[str, ...] = ()) -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    arch = {"x86_64": "x86", "AMD64": "x86", "aarch64": "ARM", "arm64": "ARM"}.get(
        platform.machine(), platform.machine())
    text = f"a {os.cpu_count()}-core {arch} CPU" + (f" ({model})" if model else "")
    versions = "".join(f", {name} {importlib.metadata.version(name)}" for name in stack)
    return f"{text}, Python {platform.python_version()}{versions}"


def store(run: Run, lines: list[str], machine: str, seconds: float, date: str,
          note: str | None = None, results: Path = RESULTS) -> Path:
    """Write ``run``'s result file: its header, then the JSON lines as printed."""
    rows = [json.loads(line) for line in lines if line.strip()]
    header = {"command": run.command(), "machine": machine, "date": date,
              "seconds": round(seconds), "recorded": run.recorded, "note": note}
    results.mkdir(parents=True, exist_ok=True)
    path = results / run.path.name
    path.write_text("\n".join(json.dumps(x) for x in [{"run": header}, *rows]) + "\n")
    return path


def record(run: Run) -> Path:
    """Run ``run``'s benchmark here (its timeout) and store what it printed."""
    reference = os.environ.get("ZB_REFERENCE", "")
    args = [a.replace("{reference}", reference) for a in run.args]
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCH / run.script), *args], capture_output=True,
                          text=True, timeout=run.timeout, cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{run.command()} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    note = (f"load average {load_before:.1f} when it started" if load_before is not None else None)
    return store(run, done.stdout.splitlines(), _machine(run.stack), seconds,
                 datetime.date.today().isoformat(), note)


def verify(run: Run, cheap: bool = False, results: Path = RESULTS) -> list[str]:
    """The stored cases of ``run`` whose deterministic fields today's code no longer gives,
    one line each (empty: all hold)."""
    if run.remeasure is None:
        return []
    _, rows = load(run, results)
    differ = []
    for row in rows:
        if cheap and not run.cheap(row):
            continue
        now = run.remeasure(run, row)
        changed = [f"{k} {row.get(k)!r} -> {now.get(k)!r}" for k in run.deterministic
                   if row.get(k) != now.get(k)]
        if changed:
            differ.append(f"{run.name}: {_name(run, row)}: " + ", ".join(changed))
    return differ


# --- the page -----------------------------------------------------------------------------------

_INTRO = """\
# Benchmarks

Generated by `python scripts/bench/report.py` from the stored results in
[docs/results/](results/), one file per benchmark run: the JSON lines the scripts in
`scripts/bench/` print, after a header with the command, the machine, the date and how long
the run took. Do not edit by hand: `python scripts/bench/report.py --record NAME` runs a
benchmark again and rewrites its file and this page.

Schedule makespans, bubbles, peak memory and order digests are pure Python and the same on any
machine: `python scripts/bench/report.py --verify` re-computes every stored one with today's
code, and the tests (`tests/docs/test_benchmark_page.py`) re-compute a small subset and fail when
this page is not what the stored results render. Timings are what the stored run measured, on
the machine it names. The CPU runs here shared two cores with other jobs (each names the load
average when it started): their timings are up to several times what the same build takes on
an idle machine, and vary by 10-25% from run to run. Results marked *recorded* come from a GPU
and cannot be repeated on a CPU machine; they are kept as they were reported.

Memory is counted in units of one microbatch's activations of one rank's whole layer share
(1F1B's rank 0 holds p of them); costs `F,B,W,hop` are the pass times of one rank's whole layer
share and one pipeline hop; `bubble` is idle time over the whole iteration (1 - the busiest
rank's compute / makespan).
"""


def _provenance(run: Run, header: dict, rows: list[dict]) -> list[str]:
    seconds = header["seconds"]
    took = f"{seconds} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    if header["recorded"]:
        where = f"*Recorded*: {header['machine']}, reported by {header['date']}"
    else:
        where = f"Measured on {header['machine']}, {header['date']}, in {took}"
    note = f" ({header['note']})" if header.get("note") else ""
    return [f"`{header['command']}`", "", f"{where}{note}; {len(rows)} cases, "
            f"[{run.path.name}](results/{run.path.name})."]


def render(results: Path = RESULTS) -> str:
    """docs/benchmarks.md as the stored results give it."""
    summary, sections = [], []
    for run in RUNS:
        header, rows = load(run, results)
        anchor = run.title.lower()
        checked = ("yes (a subset in the tests)" if run.remeasure else
                   "recorded" if header["recorded"] else "no (timings, gloo processes)")
        summary.append([f"[{run.title}](#{_slug(anchor)})", f"`{run.script}`", len(rows),
                        header["machine"].split(",")[0], header["date"], checked])
        sections += ["", f"## {run.title}", "", run.about, "", *_provenance(run, header, rows), "",
                     *run.render(rows)]
    body = [_INTRO, *_table(["benchmark", "script", "cases", "where", "date",
                             "deterministic results re-computed"], summary), *sections]
    return "\n".join(body).rstrip() + "\n"


def _slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    kept = "".join(c for c in title if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when docs/benchmarks.md is stale")
    parser.add_argument("--record", nargs="+", choices=list(_BY_NAME), metavar="NAME",
                        help=f"run these benchmarks and store them: {', '.join(_BY_NAME)}")
    parser.add_argument("--verify", nargs="*", choices=list(_BY_NAME), metavar="NAME",
                        help="re-compute the stored deterministic results (default: all)")
    parser.add_argument("--cheap", action="store_true", help="with --verify: the small cases only")
    parser.add_argument("--import", dest="imported", nargs=2, metavar=("NAME", "FILE"),
                        help="store FILE (a run's JSON lines made elsewhere) as NAME's results")
    parser.add_argument("--machine", help="with --import: where it ran, e.g. 'one NVIDIA H100'")
    parser.add_argument("--seconds", type=float, help="with --import: how long it ran")
    parser.add_argument("--date", default=datetime.date.today().isoformat(),
                        help="with --import: when it ran (default today)")
    args = parser.parse_args()
    if args.verify is not None:
        differ = []
        for run in (_BY_NAME[name] for name in args.verify or list(_BY_NAME)):
            if run.remeasure is None:
                print(f"{run.name}: timings or a solver run, not re-computed", file=sys.stderr)
                continue
            found = verify(run, args.cheap)
            checked = sum(not args.cheap or run.cheap(row) for row in load(run)[1])
            print(f"{run.name}: {checked} cases re-computed, {len(found)} differ", file=sys.stderr)
            differ += found
        for line in differ:
            print(line, file=sys.stderr)
        return 1 if differ else 0
    if args.imported:
        name, file = args.imported
        if name not in _BY_NAME or not args.machine or args.seconds is None:
            parser.error("--import NAME FILE needs a known NAME, --machine and --seconds")
        store(_BY_NAME[name], Path(file).read_text().splitlines(), args.machine, args.seconds,
              args.date)
    for name in args.record or ():
        print(f"stored {record(_BY_NAME[name]).relative_to(ROOT)}", file=sys.stderr)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/bench/report.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
