"""Validator errors, lowering/message matching, renderers, torch CSV, golden files, CLI."""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_vshape.cli import main
from megatron_vshape.schedule import (SCHEDULES, Action, PassKind, ValidationError, build_schedule, lower,
                                      parse_costs, simulate, validate)
from megatron_vshape.schedule.io.render_text import render_grid, render_steps
from megatron_vshape.schedule.model.simulate import DeadlockError
from megatron_vshape.schedule.io.torch_csv import from_torch_csv, to_torch_csv

GOLDEN = Path(__file__).parents[1] / "golden"
NAMES = ["1f1b", "zb-1p", "interleaved-1f1b", "v-min", "v-half", "v-zb"]


def _swap(schedule, rank, i, j):
    rows = [list(r) for r in schedule.rank_actions]
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    return schedule.with_actions(rows)


def test_dependency_cycle_is_reported_with_rank_step_and_marked_rendering():
    s = build_schedule("v-half", 4, 8)
    bad = _swap(s, 0, 0, len(s.rank_actions[0]) - 1)  # rank 0 starts with a backward
    with pytest.raises(ValidationError) as err:
        validate(bad)
    text = str(err.value)
    assert "rank 0 step 0" in text and "microbatch" in text and "<-- ERROR HERE" in text
    assert err.value.rank == 0 and err.value.step == 0


def test_simulator_names_the_stuck_rank_step_and_action_instead_of_hanging():
    """The simulator is also called on unvalidated orders (search, replay): a cycle must
    raise a DeadlockError that says where, not loop or return a partial timeline."""
    s = build_schedule("v-half", 4, 8)
    bad = _swap(s, 0, 0, len(s.rank_actions[0]) - 1)
    first = next(bad.compute_actions(0))
    with pytest.raises(DeadlockError) as err:
        simulate(bad, parse_costs("1,1,1,0", ranks=4))
    assert (err.value.rank, err.value.step, err.value.action) == (0, 0, first)
    assert "rank 0 step 0" in str(err.value) and "forever" in str(err.value)


def test_missing_duplicate_and_wrong_rank_are_rejected():
    s = build_schedule("v-min", 4, 8)
    rows = [list(r) for r in s.rank_actions]
    rows[1].append(rows[1][0])
    with pytest.raises(ValidationError, match="more than once"):
        validate(s.with_actions(rows))
    rows = [list(r) for r in s.rank_actions]
    moved = rows[2].pop()
    rows[3].append(moved)
    with pytest.raises(ValidationError, match="belongs on rank 2"):
        validate(s.with_actions(rows))
    rows = [list(r) for r in s.rank_actions]
    rows[0].pop()
    with pytest.raises(ValidationError, match="missing 1 action"):
        validate(s.with_actions(rows))


def test_memory_limit():
    s = build_schedule("v-zb", 4, 8)
    validate(s, memory_limit=4)
    with pytest.raises(ValidationError, match="exceeds the limit 3"):
        validate(s, memory_limit=3)


@pytest.mark.parametrize("name", NAMES)
def test_lowering_adds_matching_sends_and_receives(name):
    s = build_schedule(name, 2, 4)
    low = lower(s)
    sends = sum(a.kind.is_send for r in low.rank_actions for a in r)
    recvs = sum(a.kind.is_recv for r in low.rank_actions for a in r)
    assert sends == recvs > 0
    validate(low)  # p=2: the same two ranks exchange every stream


def test_receive_posted_in_the_wrong_order_is_caught():
    low = lower(build_schedule("1f1b", 2, 4))
    rows = [list(r) for r in low.rank_actions]
    recv = [i for i, a in enumerate(rows[1]) if a.kind is PassKind.RECV_F]
    rows[1][recv[0]], rows[1][recv[1]] = rows[1][recv[1]], rows[1][recv[0]]
    with pytest.raises(ValidationError, match="instead of|deadlock|cycle"):
        validate(low.with_actions(rows))


def test_v_turn_and_loss_are_local():
    low = lower(build_schedule("v-zb", 4, 4))
    assert not any(a.kind.is_send and a.stage == 3 and a.kind is PassKind.SEND_F for a in low.rank_actions[3])
    assert Action(PassKind.RECV_F, 4, 0) not in low.rank_actions[3]


@pytest.mark.parametrize("name", NAMES)
def test_torch_csv_round_trip(name):
    s = build_schedule(name, 4, 8)
    back = from_torch_csv(to_torch_csv(s))
    assert back.rank_actions == s.rank_actions
    assert back.placement == s.placement


@pytest.mark.parametrize("name", NAMES)
def test_golden_files(name):
    s = build_schedule(name, 4, 8, variant="paper")  # the paper's orders, as the paper draws them
    assert (GOLDEN / f"{name}.txt").read_text() == render_steps(s) + "\n"
    assert (GOLDEN / f"{name}.csv").read_text() == to_torch_csv(s)


def test_text_grid_and_svg(tmp_path):
    s = build_schedule("v-half", 4, 8)
    r = simulate(s)
    grid = render_grid(s, r.start, r.end)
    assert grid.count("\n") == 3 and grid.startswith("rank  0 | F0")
    assert "f0" in grid and "w7" in grid.lower()
    assert main(["render", "--schedule", "v-half", "-p", "4", "-m", "8", "-o", str(tmp_path / "s.svg")]) == 0
    root = ET.parse(tmp_path / "s.svg").getroot()
    rects = [e for e in root.iter() if e.tag.endswith("rect") and e.find("{http://www.w3.org/2000/svg}title") is not None]
    assert len(rects) == 4 * 8 * 6


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "s.png"
    assert main(["render", "--schedule", "v-zb", "-p", "4", "-m", "8", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_cli_simulate_json_contract(capsys):
    assert main(["simulate", "--schedule", "v-min", "-p", "8", "-m", "32", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    for key in ("schedule", "ranks", "microbatches", "costs", "makespan", "bubble_rate",
                "bubble_rate_span", "peak_memory", "peak_memory_max", "peak_memory_vs_1f1b", "valid"):
        assert key in record
    assert record["peak_memory_max"] == 4 and record["valid"] is True
    assert len(record["peak_memory"]) == 8 and record["peak_memory_vs_1f1b"] == 0.5


def test_cli_compare_and_bad_input(capsys):
    assert main(["compare", "-p", "4", "-m", "8", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(l)["schedule"] for l in lines] == list(SCHEDULES)
    assert main(["simulate", "--schedule", "v-min", "-p", "1", "-m", "8"]) == 2
    assert "ranks" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "v-min", "-p", "4", "-m", "8", "--costs", "1,x"]) == 2


def test_schedule_core_imports_without_torch_or_megatron():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None; "
            "sys.modules['numpy'] = None; import megatron_vshape.schedule as s; "
            "print(s.simulate(s.build_schedule('v-half', 4, 8)).peak_memory_max)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3.0"
