"""scripts/bench/search_referee.py: docs/design.md's table of what each step of the search wins
is what the script writes from its stored run, and the script's records are the search's own
(its rows, named as the tables name them), with the tables put back afterwards."""
import importlib.util
import sys
from pathlib import Path

from megatron_vshape.schedule.search import adaptive

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # the referee imports search_digest
spec = importlib.util.spec_from_file_location("search_referee",
                                              ROOT / "scripts" / "bench" / "search_referee.py")
referee = importlib.util.module_from_spec(spec)
spec.loader.exec_module(referee)

STORED = ("search_referee-before.jsonl", "search_referee.jsonl")


def test_the_design_pages_tables_of_wins_are_what_the_stored_runs_give():
    page = (ROOT / "docs" / "design.md").read_text()
    for name in STORED:
        results = str(ROOT / "docs" / "results" / name)
        begin, end = referee.markers(results)
        block = page.split(begin)[1].split(end)[0]
        assert referee.table(results) in block, \
            "docs/design.md is stale: run the command written above its table of wins"


def test_the_referee_records_the_searchs_own_rows_and_puts_the_tables_back():
    steps, also = adaptive.STEPS, adaptive.ALSO_TRY
    watch = referee.Referee()
    try:
        row = referee.run_case(watch, "digest", 4, 8, "1,1.39,0.35,0.05", "1,-0.75,-0.25",
                               "v-min", None)
    finally:
        watch.close()
    assert adaptive.STEPS is steps and adaptive.ALSO_TRY is also
    names = {step.name for step in steps}
    assert row["searches"] and all(set(s["needed"]) <= set(s["some"]) <= names
                                   for s in row["searches"])
    rows = {name for frame in row["also"] for name, _ in frame["rows"]}
    assert rows <= {a.name for a in also} and "the search" in rows
    assert row["makespan"] > 0 and row["peak"] <= (4 + 4) // 3 + 1e-9
