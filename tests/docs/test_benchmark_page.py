"""docs/benchmarks.md is what scripts/bench/report.py renders from the stored results
(docs/results/*.jsonl), each stored file is the run its benchmark's command makes, and the
stored deterministic results (makespans, bubbles, peaks, order digests) are what today's code
gives, re-computed on a cheap subset (``report.py --verify`` re-computes them all)."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_report", ROOT / "scripts" / "bench" / "report.py")
report = importlib.util.module_from_spec(spec)
sys.modules["bench_report"] = report  # dataclasses look their module up by name
spec.loader.exec_module(report)

REMEASURED = [run.name for run in report.RUNS if run.remeasure is not None]


def test_the_page_is_what_the_stored_results_render():
    assert report.PAGE.read_text() == report.render(), \
        "docs/benchmarks.md is stale: run python scripts/bench/report.py"


@pytest.mark.parametrize("run", report.RUNS, ids=lambda run: run.name)
def test_each_stored_file_is_its_benchmark_run_with_where_and_when(run):
    header, rows = report.load(run)
    assert header["command"] == run.command(), f"re-record: report.py --record {run.name}"
    assert rows and header["machine"] and header["date"] and header["recorded"] == run.recorded
    assert all(k in row for row in rows for k in run.key)
    text = report.PAGE.read_text()
    assert header["command"] in text and f"results/{run.name}.jsonl" in text


@pytest.mark.parametrize("name", REMEASURED)
def test_the_stored_deterministic_results_still_hold(name):
    run = report._BY_NAME[name]
    _, rows = report.load(run)
    assert any(run.cheap(row) for row in rows), "the cheap subset is empty"
    assert report.verify(run, cheap=True) == [], \
        f"re-record with python scripts/bench/report.py --record {name}"


def test_a_changed_result_is_found(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    run = report._BY_NAME["schedule"]
    path = results / run.path.name
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines[1:], 1) if run.cheap(json.loads(line)))
    row = json.loads(lines[at])
    row["bubble_rate"] = round(row["bubble_rate"] + 0.1, 4)
    lines[at] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    [found] = report.verify(run, cheap=True, results=results)
    assert f"schedule {row['schedule']}, ranks 8, microbatches 32: bubble_rate" in found
    assert report.render(results) != report.render()


def test_the_recorded_cool_downs_start_from_the_stored_named_schedules():
    """The solver's runs are recorded, not re-run; the orders they started from are today's
    (the named levels' makespans, which the test above re-computes)."""
    _, cool = report.load(report._BY_NAME["cooldown_gap"])
    _, named = report.load(report._BY_NAME["named_levels"])
    makespan = {(r["schedule"], r["ranks"], r["microbatches"]): r["makespan"] for r in named}
    for row in cool:
        assert row["makespan"] == makespan[row["schedule"], row["ranks"], row["microbatches"]]
        assert row["exact_makespan"] <= row["makespan"]


def test_the_page_uses_no_tracker_or_session_words():
    text = report.PAGE.read_text().lower()
    for word in ("issue", "session", "this machine", "this 2-core", "readme"):
        assert word not in text, word
