"""The pure-Python benchmarks still run and print one JSON line per case (their numbers go in
notes; a refactor that breaks them would otherwise go unnoticed until someone needs them)."""
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_vshape.schedule import build_schedule, parse_costs, simulate
from megatron_vshape.schedule.model.actions import PassKind
from conftest import B_FREES, H100

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def _lines(script: str, *args: str) -> list[dict]:
    done = subprocess.run([sys.executable, str(BENCH / script), *args],
                          capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.slow
def test_search_bench_reports_each_case_and_the_infeasible_one():
    rows = _lines("search.py", "--ranks", "4", "8", "--microbatches", "4", "16", "--repeats", "2")
    assert [(r["ranks"], r["microbatches"]) for r in rows] == [(4, 4), (4, 16), (8, 4), (8, 16)]
    # p = 8, m = 4: half of 1F1B's 4 units is 2, below every block; the wave construction fits
    for row in rows:
        assert 0 < row["search_s"] <= row["search_s_median"]
        assert row["peak_memory_max"] <= row["memory_limit_units"] + 1e-9
        assert 0 <= row["bubble_rate"] < 1 and 0 <= row["bubble_rate_1f1b"] < 1
    # below one microbatch per chunk (0.2 x 4 = 0.8 units) nothing fits: reported, not raised
    [row] = _lines("search.py", "--ranks", "8", "--microbatches", "4", "--memory-limit", "0.2",
                   "--repeats", "1")
    assert "smallest achievable peak is 1 units" in row["error"] and row["search_s"] > 0


def test_search_bench_refuses_zero_repeats():
    with pytest.raises(subprocess.CalledProcessError) as err:
        _lines("search.py", "--ranks", "4", "--microbatches", "8", "--repeats", "0")
    assert "--repeats must be >= 1" in err.value.stderr


def test_schedule_bench_times_every_schedule():
    rows = _lines("schedule.py", "--ranks", "4", "--microbatches", "8")
    timed = {r["schedule"]: r for r in rows if "error" not in r}
    assert {"1f1b", "v-min", "v-half", "v-zb"} <= set(timed)
    for row in timed.values():
        assert row["total_s"] >= row["generate_s"] >= 0 and 0 <= row["bubble_rate"] < 1
    assert timed["v-min"]["peak_memory_max"] < timed["1f1b"]["peak_memory_max"]


def test_named_levels_bench_reports_each_name_against_1f1b_and_the_paper():
    rows = _lines("named_levels.py", "--ranks", "4", "--per-rank", "4", "--names", "zb-1p",
                  "v-half", "--repeats", "1")
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("zb-1p", 16), ("v-half", 16)]
    for row in rows:
        assert row["vs_1f1b"] <= row["paper_vs_1f1b"] + 1e-9  # never slower than the paper
        assert row["peak_memory_max"] <= {"zb-1p": 4, "v-half": 3}[row["schedule"]] + 1e-9
        assert row["build_s_median"] > 0 and row["memory_model"] == "1,-0.75,-0.25"
    built = build_schedule("v-half", 4, 16, parse_costs(H100, 4), memory=B_FREES)
    digest = hashlib.sha1(repr(built.rank_actions).encode()).hexdigest()[:12]
    assert rows[1]["orders_sha1"] == digest != rows[0]["orders_sha1"]
    timed = simulate(built, parse_costs(H100, 4), B_FREES)
    forwards = [start for a, start in zip(built.rank_actions[0], timed.start[0])
                if a.kind is PassKind.F and a.stage == 0]  # rank 0, microbatch order
    assert rows[1]["steady_per_microbatch"] == round((forwards[12] - forwards[4]) / 8, 4)


def test_cooldown_gap_bench_solves_or_skips_without_ortools():
    """With OR-Tools, a whole small schedule set free: the solver's order is validated and
    never slower than ours (ours is its hint); without, one skipped line (CI)."""
    rows = _lines("cooldown_gap.py", "--ranks", "2", "--per-rank", "2", "--names", "v-half",
                  "--window", "1000", "--seconds", "20", "--workers", "1")
    try:
        import ortools  # noqa: F401
    except ImportError:
        assert rows == [{"skipped": "OR-Tools is not installed (pip install ortools)"}]
        return
    [row] = rows
    assert row["free_passes"] == 6 * 2 * 4  # F, B, W of two chunks, 4 microbatches, 2 ranks
    assert row["status"] == "OPTIMAL" and row["bound"] <= row["exact_makespan"] + 1e-9
    assert row["exact_makespan"] <= row["makespan"] + 1e-9


def test_cooldown_gap_bench_refuses_an_empty_window():
    with pytest.raises(subprocess.CalledProcessError) as err:
        _lines("cooldown_gap.py", "--ranks", "2", "--window", "0")
    assert "--window and --seconds must be > 0" in err.value.stderr


def test_cooldown_gap_scales_times_to_integers_or_says_why():
    spec = importlib.util.spec_from_file_location("cooldown_gap", BENCH / "cooldown_gap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # OR-Tools is imported only where a model is built
    assert module.integer_scale([1.0, 1.39, 0.35, 0.05], "durations") == 100
    assert module.integer_scale([1.0, -0.75, -0.25], "deltas") == 100
    assert module.integer_scale([2.0, 3.0], "durations") == 1
    with pytest.raises(ValueError, match=r"durations \[0.3333333333333333\] need more than 6"):
        module.integer_scale([1 / 3], "durations")


def _search_digest():
    spec = importlib.util.spec_from_file_location("search_digest", BENCH / "search_digest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_search_digest_baseline_holds_at_its_smallest_points():
    """The committed digest (docs/results/search_digest.jsonl) still describes the search at
    p = 4, m = 8, H100 costs, default memory: same makespans, peaks and orders (the whole grid:
    ``search_digest.py --out NEW`` then ``--compare``)."""
    digest = _search_digest()
    baseline = Path(__file__).resolve().parents[2] / "docs" / "results" / "search_digest.jsonl"
    rows = digest.load(str(baseline))
    cases = [c for c in digest.cases([4]) if c[1] == 8 and c[2] == digest.COSTS[0]
             and c[3] == digest.MEMORY[0]]
    assert len(cases) == 6
    for case in cases:
        row = digest.run_case(*case, steps=False)
        old = rows[digest.key(row)]
        assert (row["makespan"], row["peak"], row["orders_sha1"]) == (
            old["makespan"], old["peak"], old["orders_sha1"]), row["case"]


def test_search_digest_compare_fails_on_a_changed_order(tmp_path):
    row = {"case": "v-min", "ranks": 4, "microbatches": 8, "costs": "1,1,1",
           "memory_model": "1,0,-1", "makespan": 1.0, "peak": 2.0, "orders_sha1": "a",
           "description": "x", "seconds": 1.0}
    same, other = tmp_path / "same.jsonl", tmp_path / "other.jsonl"
    same.write_text(json.dumps(row) + "\n")
    other.write_text(json.dumps({**row, "orders_sha1": "b", "seconds": 2.0}) + "\n")
    done = subprocess.run([sys.executable, str(BENCH / "search_digest.py"), "--compare",
                           str(same), str(same)], capture_output=True, text=True, check=True)
    assert "0 differences" in done.stdout and "+0.0%" in done.stdout
    done = subprocess.run([sys.executable, str(BENCH / "search_digest.py"), "--compare",
                           str(same), str(other)], capture_output=True, text=True)
    assert done.returncode == 1 and "orders_sha1 differs" in done.stdout
