"""Actions, placement, dependency rule and simulator: exact, hand-checked values."""
import re

import pytest
from hypothesis import given, strategies as st

from megatron_vshape.schedule import (Action, Costs, Layout, PassKind, Placement, ScheduleError,
                                      build_schedule, parse_action, simulate)
from megatron_vshape.schedule.model.deps import dependencies


@given(st.sampled_from(list(PassKind)), st.integers(0, 10**4), st.integers(0, 10**4))
def test_action_string_parses_back_exactly(kind, stage, mb):
    action = Action(kind, stage, mb)
    assert parse_action(str(action)) == action


def test_action_string_examples_and_errors():
    assert str(Action(PassKind.F, 3, 7)) == "3F7"
    assert parse_action("12BW0") == Action(PassKind.BW, 12, 0)
    with pytest.raises(ScheduleError, match="kind one of"):
        parse_action("3Q7")


@pytest.mark.parametrize("p", [2, 3, 8])
def test_v_placement_is_the_v(p):
    place = Placement(p, Layout.V)
    for r in range(p):
        assert place.locate(r) == (r, 0)
        assert place.locate(2 * p - 1 - r) == (r, 1)
        assert place.stage_of(r, 1) == 2 * p - 1 - r
    loop = Placement(p, Layout.LOOP)
    assert [loop.rank_of(s) for s in range(2 * p)] == list(range(p)) * 2


def test_one_rank_is_rejected_with_the_setting_named():
    with pytest.raises(ScheduleError, match="ranks"):
        Placement(1, Layout.V)
    with pytest.raises(ScheduleError, match="microbatches"):
        build_schedule("v-half", 4, 0)
    with pytest.raises(ScheduleError, match="valid choices"):
        build_schedule("v-quarter", 4, 4)


def test_dependency_rule():
    S = 8
    assert dependencies(Action(PassKind.F, 0, 2), S) == ()
    assert dependencies(Action(PassKind.F, 5, 2), S) == (Action(PassKind.F, 4, 2),)
    assert dependencies(Action(PassKind.B, 7, 2), S) == (Action(PassKind.F, 7, 2),)
    assert dependencies(Action(PassKind.B, 3, 2), S) == (Action(PassKind.B, 4, 2),)
    assert dependencies(Action(PassKind.BW, 3, 2), S) == (Action(PassKind.B, 4, 2),)
    assert dependencies(Action(PassKind.W, 3, 2), S) == (Action(PassKind.B, 3, 2),)


def test_simulator_times_1f1b_by_hand():
    # p=2, m=1: F r0 [0,1], F r1 [1+c, 2+c], BW r1 [.., +2], BW r0 after one more hop.
    s = build_schedule("1f1b", 2, 1)
    assert simulate(s).makespan == pytest.approx(6.0)
    with_comm = simulate(s, Costs.build(2, 1, 1, 1, comm=0.5))
    assert with_comm.makespan == pytest.approx(7.0)
    assert with_comm.end[0][-1] == pytest.approx(7.0)


def test_chunk_passes_take_half_and_the_turn_is_local():
    # V with p=2, m=1: stages 0,1,2,3 on ranks 0,1,1,0; chunk passes take 2/2 = 1.
    # 0F0 r0 [0,1] hop 1F0 r1 [2,3] local 2F0 r1 [3,4] hop 3F0 r0 [5,6] 3B0 [6,7] hop
    # 2B0 r1 [8,9] local 1B0 [9,10] hop 0B0 r0 [11,12] 0W0 [12,13]; the other W fill waits.
    s = build_schedule("v-min", 2, 1)
    r = simulate(s, Costs.build(2, 2, 2, 2, comm=1.0))
    assert r.makespan == pytest.approx(13.0)
    assert r.start[1] == (2.0, 3.0, 8.0, 9.0, 10.0, 11.0)
    assert r.peak_memory == (1.0, 1.0)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-1p", "v-min", "v-half", "v-zb"])
def test_makespan_alone_is_the_simulators_float(name):
    """The search ranks candidates by ``makespan_of``: it must be the very float ``simulate``
    gives (ties are broken on it), with hop time and per-rank costs, and fail the same way."""
    from megatron_vshape.schedule.model.simulate import DeadlockError, makespan_of
    costs = Costs.build(4, forward=[1, 1.3, 1, 1.1], backward=1.7, weight=0.45, comm=0.07)
    schedule = build_schedule(name, 4, 12)
    assert makespan_of(schedule, costs) == simulate(schedule, costs).makespan
    orders = [list(order) for order in schedule.rank_actions]
    orders[1].reverse()  # its first pass now waits for passes behind it on its own rank
    stuck = schedule.with_actions(tuple(map(tuple, orders)))
    with pytest.raises(DeadlockError) as simulated:
        simulate(stuck, costs)
    with pytest.raises(DeadlockError, match=re.escape(str(simulated.value))):
        makespan_of(stuck, costs)


def test_per_rank_costs_and_bad_costs():
    costs = Costs.build(4, forward=[1, 1, 1, 2], backward=1, weight=1)
    slow = simulate(build_schedule("1f1b", 4, 8), costs)
    even = simulate(build_schedule("1f1b", 4, 8))
    assert slow.makespan > even.makespan
    with pytest.raises(ScheduleError, match="3 per-rank values for 4 ranks"):
        Costs.build(4, forward=[1, 1, 1])
    with pytest.raises(ScheduleError, match="finite number > 0"):
        Costs.build(4, forward=0)


NOT_A_TIME = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, "1", True, None]


@pytest.mark.parametrize("bad", NOT_A_TIME, ids=repr)
def test_every_way_of_making_costs_refuses_a_time_that_is_not_finite_and_positive(bad):
    """One check (Costs.__post_init__, by pass_time) behind every constructor: NaN would slip
    past a plain ``> 0`` test and time every schedule at ``makespan nan``."""
    from megatron_vshape.schedule import Layout, Placement, parse_costs
    v2 = Placement(2, Layout.V)
    makers = {
        "build": lambda: Costs.build(4, forward=[1, bad, 1, 1]),
        "constructor": lambda: Costs((1.0,) * 4, (1.0,) * 4, (bad,) * 4),
        "for_stages": lambda: Costs.for_stages(v2, [1, 1, 1, 1], [1, bad, 1, 1], [1] * 4),
        "from_list": lambda: Costs.from_list([1, 1, 1, 0, [[1, 1, 1]] * 3 + [[1, 1, bad]]], 2),
        "per-stage field": lambda: Costs((1.0,) * 2, (1.0,) * 2, (1.0,) * 2,
                                         stages=((1.0, 1.0, bad),) * 4),
    }
    for name, make in makers.items():
        with pytest.raises(ScheduleError, match="time must be a finite number > 0") as err:
            make()
        assert "\n" not in str(err.value), name
    if isinstance(bad, float):
        with pytest.raises(ScheduleError, match=r"^--costs '.*': costs: every forward \(F\)"):
            parse_costs(f"{bad},1,1", 4)
    if bad != 0.0:  # a hop may take no time, nothing else that is not a time
        with pytest.raises(ScheduleError, match="comm must be a finite number >= 0"):
            Costs.build(4, comm=bad)
    assert Costs.build(4, comm=0.0).comm == 0.0


def test_memory_model_lets_b_free_part():
    from megatron_vshape.schedule import MemoryModel
    s = build_schedule("v-min", 4, 16)
    full = simulate(s).peak_memory
    part = simulate(s, memory=MemoryModel(1.0, -0.5, -0.5)).peak_memory
    assert all(a <= b for a, b in zip(part, full)) and part[2] < full[2]
    with pytest.raises(ScheduleError, match="sum to 0"):
        MemoryModel(1.0, -0.5, -0.2)
