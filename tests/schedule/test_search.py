"""The adaptive V scheduler (``auto``): never slower than a fixed block at its memory, within
its limit, deterministic; its frontier, its CLI, and its bubble targets, met or proven out of
reach."""
import dataclasses
import gc
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_vshape.cli import main
from megatron_vshape.schedule import Costs, ScheduleError, build_schedule, simulate, validate
from megatron_vshape.schedule.search import adaptive
from megatron_vshape.schedule.search.adaptive import (InfeasibleMemoryError, clear_cache, frontier,
                                                      memory_limit_units, search)
from megatron_vshape.schedule.search.settings import SETTINGS

UNBALANCED = (1.0, 1.2, 0.8)


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("costs", [(1, 1, 1, 0), (1, 1.2, 0.8, 0), (1, 1.2, 0.8, 0.1)])
@pytest.mark.parametrize("name", ["v-min", "v-half", "v-zb"])
def test_auto_never_loses_to_a_fixed_block_at_its_memory(p, costs, name):
    m = 4 * p
    c = Costs.build(p, *costs[:3], comm=costs[3])
    fixed = simulate(build_schedule(name, p, m, variant="paper"), c)
    found = search(p, m, c, fixed.peak_memory_max)
    assert found.result.peak_memory_max <= fixed.peak_memory_max
    assert found.result.bubble_rate <= fixed.bubble_rate + 1e-9


@pytest.mark.parametrize("p,m,costs", [(4, 16, (1, 1, 1, 0)),
                                       pytest.param(8, 32, (1, 1, 1, 0), marks=pytest.mark.slow),
                                       pytest.param(8, 32, (1, 1.2, 0.8, 0.1), marks=pytest.mark.slow)])
def test_frontier_bubble_falls_as_memory_grows(p, m, costs):
    points = frontier(p, m, Costs.build(p, *costs[:3], comm=costs[3]))
    assert len(points) >= 2
    peaks = [f.result.peak_memory_max for f in points]
    bubbles = [f.result.bubble_rate for f in points]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert all(a > b for a, b in zip(bubbles, bubbles[1:]))
    assert peaks[-1] <= min(p, m)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 8), m_factor=st.floats(0.2, 4), fraction=st.floats(0.2, 2.0),
       costs=st.tuples(*[st.floats(0.2, 3)] * 3, st.floats(0, 0.5)))
def test_everything_search_returns_is_valid_and_within_the_limit(p, m_factor, fraction, costs):
    m = max(1, round(m_factor * p))
    c = Costs.build(p, *costs[:3], comm=costs[3])
    limit = memory_limit_units(p, m, fraction=fraction)
    try:
        found = search(p, m, c, limit)
    except InfeasibleMemoryError as err:
        assert err.smallest > limit
        return
    validate(found.schedule, memory_limit=limit)
    assert found.result.peak_memory_max <= limit + 1e-9


def test_search_is_deterministic():
    c = Costs.build(8, 1, 1.2, 0.8, comm=0.1)
    first = search(8, 32, c, 4).schedule
    clear_cache()
    second = search(8, 32, c, 4).schedule
    assert first.rank_actions == second.rank_actions and first.description == second.description


def test_infeasible_limit_names_smallest_peak_and_schedule():
    # one microbatch of each chunk in flight (1 unit) is the least any V order holds: the
    # wave construction keeps it, and the error says so
    with pytest.raises(InfeasibleMemoryError,
                       match=r"smallest achievable peak is 1 units, reached by V-ZB wave"):
        search(8, 32, Costs.build(8), 0.75)
    assert search(8, 32, Costs.build(8), 1.0).result.peak_memory_max == 1.0


def test_memory_limit_units():
    assert memory_limit_units(8, 32, fraction=0.5) == 4
    assert memory_limit_units(8, 4, fraction=0.5) == 2  # 1F1B holds min(p, m)
    assert memory_limit_units(8, 32, limit_bytes=10 * 2**30, activation_bytes=2 * 2**30) == 5
    with pytest.raises(ScheduleError, match="activation bytes"):
        memory_limit_units(8, 32, limit_bytes=1e9)
    with pytest.raises(ScheduleError, match="fraction must be > 0"):
        memory_limit_units(8, 32, fraction=0)


def test_a_search_refuses_a_setting_it_cannot_schedule():
    """The placement checks the ranks and the Problem the microbatches, before any step."""
    with pytest.raises(ScheduleError, match="ranks .* must be an integer >= 2, got 1"):
        search(1, 8)
    for bad in (0, 2.5):
        with pytest.raises(ScheduleError, match=f"microbatches must be an integer >= 1, got {bad}"):
            search(4, bad)


def test_auto_is_a_schedule_name_everywhere(capsys):
    assert main(["simulate", "--schedule", "auto", "-p", "4", "-m", "8", "--memory-limit", "0.5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["schedule"] == "auto" and record["peak_memory_max"] <= 2 and record["valid"]
    assert main(["export", "--schedule", "auto", "-p", "4", "-m", "8", "--memory-limit", "0.75"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4


def test_fixed_schedule_over_the_limit_is_reported_invalid(capsys):
    assert main(["simulate", "--schedule", "v-zb", "-p", "4", "-m", "8", "--memory-limit", "0.5", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["valid"] is False


def test_search_cli_json_contract(capsys):
    args = ["search", "-p", "8", "-m", "32", "--costs", "1,1.2,0.8,0.1", "--memory-limit", "8GiB",
            "--activation-bytes", "2GiB", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    for key in ("schedule", "bubble_rate", "peak_memory", "peak_memory_max", "description", "search_seconds"):
        assert key in record
    assert record["memory_limit"] == 4 and record["peak_memory_max"] <= 4
    assert 32 * 3 <= record["makespan_floor"] <= record["makespan"]  # at least the compute


@pytest.mark.parametrize("argv,needle", [
    (["--memory-limit", "8GiB"], "--activation-bytes"),
    (["--memory-limit", "8 parsecs", "--activation-bytes", "1GiB"], "--memory-limit must be a number with a unit"),
    (["--memory-limit", "0.1"], "smallest achievable peak"),
])
def test_search_cli_errors_name_the_setting(argv, needle, capsys):
    assert main(["search", "-p", "8", "-m", "32", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow
def test_frontier_cli_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "frontier.png"
    assert main(["frontier", "-p", "4", "-m", "16", "--json", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and out.read_bytes()[:4] == b"\x89PNG"


# Two bubble targets: 0.6 x 1F1B's bubble at half of 1F1B's memory (uniform costs), and 1F1B's
# bubble at V-Min's memory (costs 1, 1.2, 0.8). At half of 1F1B's memory p = 8 and 16 are met;
# p = 4 is provably out of reach (docstring below). At V-Min's memory with costs 1, 1.2, 0.8
# none of the six cases is met yet (docstring of that test).

@pytest.mark.xfail(strict=True, reason="not met: at V-Min's memory with costs 1,1.2,0.8 auto stays "
                   "above 1F1B's bubble (ratios 1.04-1.54, see the docstring)")
@pytest.mark.parametrize("p", [4, 8, 16])
@pytest.mark.parametrize("comm", [0.0, 0.1])
def test_unbalanced_costs_at_v_min_memory_beat_1f1b(p, comm):
    """Target: bubble <= 1F1B's at (p+4)//3 units, costs F, B, W = 1, 1.2, 0.8, m = 4p.

    Measured (auto vs 1F1B bubble, m = 4p): comm 0: p=4 0.213 vs 0.158, p=8 0.187 vs 0.179,
    p=16 0.265 vs 0.190; comm 0.1: p=4 0.274 vs 0.197, p=8 0.243 vs 0.225, p=16 0.364 vs 0.237
    (with the deferred W passes of rewrite/weight_deferral.py; before them p=8 0.205 and 0.263).

    What is known (memory model: a chunk's activation lives from its F's start to its W's end):

    - p = 16 cannot be met for large m at all (tests/schedule/test_bounds.py, proven by Little's law):
      rank 0 holds 37.1 (comm 0.1: 43.1) activation-time per microbatch in 12 chunk-activations,
      so any schedule needs >= 3.09 m (3.59 m) against 1F1B's 3 m + 45 (comm 0); the floor
      passes 1F1B from m = 492 (comm 0.1: m = 120). At m = 64 the floor (bubble >= 0.030,
      0.165) does not decide it.
    - No building block runs at full rate here (tests/schedule/test_search_bound.py, CP-SAT, with
      VSHAPE_PROOFS=1): at V-Min's memory with these costs (comm 0 or 0.1; p = 4, 8, 16) no
      timing pattern that every microbatch repeats, one microbatch per period, has a period
      of F+B+W = 3. The shortest that fits is 3.4 at p = 4 and 3.3 at p = 8 (comm 0): such
      steady states idle >= 11.8% and 9.1%, where 1F1B's bubble tends to 0 as m grows. With
      comm 0.1 it is 3.8 and 3.7. auto's steady states (makespan growth per microbatch from
      m = 128 to 256) run 3.55 and 3.375 (comm 0), 3.84 and 3.575 (comm 0.1).
    - Not covered: steady states that alternate between patterns, and they matter: at p = 8,
      comm 0.1 auto's schedule already runs 3.575 per microbatch in steady state, below every
      single-pattern block (test_auto_beats_every_single_pattern_block_at_p8_comm_0_1). Nor
      m = 4p as such, where the ends of the schedule weigh as much as its steady state.
    - For arbitrary orders, CP-SAT on the exact model of tests/schedule/test_search_bound.py (times in
      tenths, hinted with auto's schedule) finds better schedules than auto, none reaching
      1F1B's makespan: p = 4, m = 16: 59.3 vs 57.0 (comm 0, 20 min; auto 61.9), 64.7 vs 59.8
      (comm 0.1, 5 min; auto 67.8); p = 8, m = 32: 118.7 vs 117.0 (comm 0, 7 min; auto 120.7),
      129.3 vs 123.8 (comm 0.1, 5 min; auto 130.2). auto has since passed those time-limited
      runs at p = 8 (118.1 and 126.9) but not at p = 4 (61.0 and 66.1). "Makespan <= 57.0"
      at p = 4, m = 16, comm 0 stays undecided after 20 minutes, even with F, B and W each run
      in microbatch order per stage (no loss, as in test_half_memory_uniform_costs_bubble's
      argument).
      Hill climbing on auto's orders (adjacent swaps,
      moves of up to 6 places, memory kept) stops at 61.4 there.
    """
    m = 4 * p
    c = Costs.build(p, *UNBALANCED, comm=comm)
    one = simulate(build_schedule("1f1b", p, m), c).bubble_rate
    assert search(p, m, c, (p + 4) // 3).result.bubble_rate <= one


@pytest.mark.parametrize("p,comm,target", [(4, 0.0, 61.1), (4, 0.1, 66.6), (8, 0.0, 122.3),
                                           (8, 0.1, 133.2)])
def test_unbalanced_costs_reach_the_orders_cp_sat_found(p, comm, target):
    """At V-Min's memory, costs 1,1.2,0.8, m = 4p: at or below the makespans of the best
    orders that time-limited CP-SAT runs (the exact model of test_search_bound.py) had found. p = 4 needs the final polish (61.4 and 67.2
    without it); measured 61.0, 66.1, 118.1, 126.9 (61.0, 66.4, 119.5, 128.6 before the
    deferred W passes of rewrite/weight_deferral.py; 61.1, 66.6, 120.7, 129.7 before the re-laid
    warm-ups and cool-downs of rewrite/reshape_ends.py): below the time-limited CP-SAT runs'."""
    m = 4 * p
    c = Costs.build(p, *UNBALANCED, comm=comm)
    assert search(p, m, c, (p + 4) // 3).result.makespan <= target + 1e-9


def test_auto_beats_every_single_pattern_block_at_p8_comm_0_1():
    """At p = 8, V-Min's memory, costs 1, 1.2, 0.8, comm 0.1, no block that repeats one timing
    pattern per microbatch has a period below 3.7 (CP-SAT proof, tests/schedule/test_search_bound.py);
    auto's steady state (makespan growth per microbatch from m = 128 to 256) is faster."""
    c = Costs.build(8, *UNBALANCED, comm=0.1)
    makespan = {m: search(8, m, c, 4).result.makespan for m in (128, 256)}
    assert (makespan[256] - makespan[128]) / 128 < 3.6


_HALF_MEMORY_P4 = (
    "impossible: at p=4 half memory is V-Min's 4 chunk-activations and the shortest makespan "
    "any schedule has there is 53.5 (bubble 0.651 x 1F1B's); 0.6 x needs <= 53.02"
)


@pytest.mark.parametrize("p", [pytest.param(4, marks=pytest.mark.xfail(strict=True, reason=_HALF_MEMORY_P4)),
                               8, 16])
def test_half_memory_uniform_costs_bubble(p):
    """Target: at half of 1F1B's memory, uniform costs, m = 4p: bubble <= 0.6 x 1F1B's.

    p = 8: 0.596 x, p = 16: 0.585 x. p = 4 cannot be met. There half memory is 2 units =
    4 chunk-activations per rank, and 0.6 x 1F1B's bubble (0.6 x 3/19) means a makespan of at
    most 48 / (1 - 0.0947) = 53.02 for each rank's 48 units of work; the optimum is 53.5
    (107 half-unit slots), which V-Min already reaches:

    - by hand, rank 0 idles >= 5 slots: until microbatch 0 has crossed the V (slot 7) only
      chunk-0 forwards exist and at most 3 may run (the 4th activation is needed by the
      chunk-1 forward, the only way memory is ever freed), so >= 4 idle slots; after its last
      chunk-1 forward the gradient needs 10 more slots to come back to stage 0 and finish,
      while at most 4 activations (9 passes) are left on rank 0, so >= 1 more. That gives
      makespan >= 101 slots.
    - exhaustively, the remaining gap is closed by CP-SAT (OR-Tools 9.15, under 80 s, see
      tests/schedule/test_search_bound.py): passes as intervals, no overlap per rank, the dependency
      rule, a reservoir per rank (+1 at an F's start, -1 at a W's end, level 0..4): 107
      slots is optimal. The model runs every stage's passes in microbatch order, which loses
      nothing: microbatches cost the same, so naming the j-th pass of each stage (in time)
      microbatch j keeps every start, dependency and memory level.
    """
    m = 4 * p
    c = Costs.build(p)
    one = simulate(build_schedule("1f1b", p, m), c).bubble_rate
    assert search(p, m, c, p / 2).result.bubble_rate <= 0.6 * one


@pytest.mark.parametrize("enabled", [True, False])
def test_the_search_pauses_the_cyclic_collector_and_restores_it(enabled, monkeypatch):
    """search.gc_pause: off while the search runs (a training process's heap made it 31%
    slower), back as the caller had it afterwards, also when the search raises."""
    seen = []
    recorded = adaptive.Step("the collector recorded", lambda pool: True,
                             lambda pool: seen.append(gc.isenabled()), "0")
    monkeypatch.setattr(adaptive, "STEPS", adaptive.STEPS + (recorded,))
    clear_cache()
    (gc.enable if enabled else gc.disable)()
    try:
        search(4, 6, Costs.build(4, 1, 1.1, 0.9), 3.0)
        assert seen == [False] and gc.isenabled() == enabled
        with pytest.raises(InfeasibleMemoryError):
            search(4, 6, Costs.build(4, 1, 1.1, 0.9), 0.5)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_the_steps_table_says_the_budgets_its_settings_give():
    """Every budget in ``STEPS`` is words whose numbers are ``Settings`` fields: the settings a
    search runs with write its table (search(..., settings=...) changes both)."""
    by_name = {step.name: step for step in adaptive.STEPS}
    assert len(by_name) == len(adaptive.STEPS)
    for step in adaptive.STEPS:
        assert "{" not in step.budget_in(SETTINGS), step.name
    assert by_name["polish"].budget_in(SETTINGS) == \
        "3 x 100,000 passes, then the winner 600,000 (150,000 from 4,000 passes)"
    assert by_name["blocks"].budget_in(SETTINGS).endswith("the 6 family blocks closest under")
    fewer = dataclasses.replace(SETTINGS, polished=2, polish_budget=50_000, family_budget=4)
    assert by_name["polish"].budget_in(fewer).startswith("2 x 50,000 passes, then")
    assert by_name["blocks"].budget_in(fewer).endswith("the 4 family blocks closest under")
    assert {s.name for s in adaptive.STEPS if s.budget_in(fewer) != s.budget_in(SETTINGS)} == \
        {"polish", "blocks"}


def test_the_search_runs_the_settings_it_is_given(fresh_caches):
    """With no polish budgets no step of the answer is a polish, and it is slower than the
    default settings' (p = 4, m = 8, H100 costs at 3 units: 55.80 against 55.41, polished)."""
    costs = Costs.build(4, 2, 2.78, 0.7, comm=0.05)
    default = search(4, 8, costs, 3.0)
    bare = search(4, 8, costs, 3.0, settings=dataclasses.replace(
        SETTINGS, polished=0, polish_budget=0, final_polish_budget=0, final_polish_large=0,
        repeated_budget=0))
    polishes = {"polished", "polished further", "moves repeated per microbatch",
                "W deferred and polished under the model"}
    assert not any(step.name in polishes for step in bare.provenance)
    assert "polished" in [step.name for step in default.provenance]
    assert bare.result.makespan > default.result.makespan + 0.3
    assert search(4, 8, costs, 3.0) is default  # cached per settings: the default's stays
