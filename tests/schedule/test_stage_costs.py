"""Per-stage pass costs (Costs.for_stages): the simulator, constructions, search and bounds time
each chunk by its own stage, and per-rank costs stay what they were."""
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_vshape.schedule import (Action, Costs, Layout, PassKind, Placement, Schedule,
                                      ScheduleError, build_schedule, parse_action, simulate,
                                      validate)
from megatron_vshape.schedule.model.costs import PassTimes
from megatron_vshape.schedule.model.stage_costs import parse_stage_costs
from megatron_vshape.schedule.names import schedule_info
from megatron_vshape.schedule.search.bounds import makespan_floor

V2 = Placement(2, Layout.V)
HEAVY_HEAD = ([1, 1, 1, 2], [1, 1, 1, 2], [1, 1, 1, 2])
"""p = 2 under a V: stage 3 (rank 0's chunk 1, the LM head and loss) twice as heavy."""


def _tiny() -> Schedule:
    """p = 2, one microbatch, each rank's passes in the V's order."""
    orders = (("0F0", "3F0", "3B0", "3W0", "0B0", "0W0"),
              ("1F0", "2F0", "2B0", "1B0", "2W0", "1W0"))
    return Schedule("tiny", V2, 1, tuple(tuple(map(parse_action, o)) for o in orders))


def test_a_heavy_stage_lengthens_the_makespan_as_counted_by_hand():
    """Uniform chunk passes of 1: F0 0-1, F1 1-2, F2 2-3, F3 3-4, B3 4-5, B2 5-6, B1 6-7,
    B0 7-8, W0 8-9: makespan 9. With stage 3's passes taking 2: F3 3-5, B3 5-7, W3 7-9,
    B2 7-8, B1 8-9, B0 9-10, W0 10-11: makespan 11."""
    schedule = _tiny()
    assert simulate(schedule, Costs.build(2, 2, 2, 2)).makespan == 9.0
    heavy = Costs.for_stages(V2, *HEAVY_HEAD)
    result = simulate(schedule, heavy)
    assert result.makespan == 11.0
    rank0 = dict(zip(schedule.rank_actions[0], zip(result.start[0], result.end[0])))
    assert rank0[Action(PassKind.F, 3, 0)] == (3.0, 5.0)
    assert rank0[Action(PassKind.W, 3, 0)] == (7.0, 9.0)
    assert rank0[Action(PassKind.B, 0, 0)] == (9.0, 10.0)


def test_pass_times_read_each_stage_where_the_placement_puts_it():
    costs = Costs.for_stages(V2, [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], comm=0.5)
    times = costs.pass_times(V2)
    assert times[0] == (PassTimes(1, 5, 9, 14), PassTimes(4, 8, 12, 20))  # stages 0 and 3
    assert times[1] == (PassTimes(2, 6, 10, 16), PassTimes(3, 7, 11, 18))  # stages 1 and 2
    assert [t.forward for t in costs.stage_times(V2)] == [1, 2, 3, 4]
    assert costs.forward == (5.0, 5.0) and costs.weight == (21.0, 21.0)  # a rank's share
    loop = Placement(2, Layout.LOOP)  # the same stages' layers, placed the interleaved way
    assert [t.forward for t in costs.stage_times(loop)] == [1, 2, 3, 4]
    assert costs.pass_times(loop)[0][1].forward == 3  # rank 0's chunk 1 is stage 2 there
    single = costs.pass_times(Placement(2, Layout.SINGLE))  # 1F1B: the same layers, 2 stages
    assert single == ((PassTimes(3, 11, 19, 30),), (PassTimes(7, 15, 23, 38),))
    with pytest.raises(ScheduleError, match="2 ranks, schedule has 4"):
        costs.pass_times(Placement(4, Layout.SINGLE))
    three = Costs.from_list([1, 1, 1, 0, [[1, 1, 1], [2, 2, 2], [3, 3, 3]]], 2)
    with pytest.raises(ScheduleError, match="given for 3 stages, schedule has 4"):
        three.pass_times(V2)


def test_uniform_stages_are_the_uniform_costs():
    """Stages that all cost the same give Costs.build's value: equal, same hash and list."""
    uniform = Costs.build(4, 2.0, 2.78, 0.7, comm=0.05)
    placement = Placement(4, Layout.V)
    staged = Costs.for_stages(placement, [1.0] * 8, [1.39] * 8, [0.35] * 8, comm=0.05)
    assert staged == uniform and hash(staged) == hash(uniform)
    assert staged.stages is None and staged.as_list() == uniform.as_list() == [2.0, 2.78, 0.7,
                                                                             0.05]


@pytest.mark.parametrize("name", ["v-half", "auto", "interleaved-1f1b"])
def test_stages_that_halve_per_rank_shares_time_as_the_shares(name):
    """Each rank's chunks given as halves of its per-rank share: the same makespan, bit for
    bit, from the same build and from the build for the per-stage form."""
    per_rank = Costs.build(4, [2.0, 2.2, 1.6, 3.0], 1.39, 0.35, comm=0.05)
    placement = Placement(4, schedule_info(name).layout)
    staged = Costs.for_stages(placement,
                              *[[xs[placement.rank_of(s)] / 2 for s in range(8)]
                                for xs in (per_rank.forward, per_rank.backward,
                                           per_rank.weight)], comm=0.05)
    assert staged.pass_times(placement) == per_rank.pass_times(placement)
    assert staged.forward == per_rank.forward
    schedule = build_schedule(name, 4, 8, costs=per_rank)
    assert simulate(schedule, staged).makespan == simulate(schedule, per_rank).makespan
    assert build_schedule(name, 4, 8, costs=staged).rank_actions == schedule.rank_actions


def test_the_list_form_round_trips():
    per_rank = Costs.build(2, [1, 2], 1.5, 0.5, comm=0.1)
    assert per_rank.as_list() == [[1.0, 2.0], 1.5, 0.5, 0.1]
    assert Costs.from_list(per_rank.as_list(), 2) == per_rank
    staged = Costs.for_stages(V2, *HEAVY_HEAD, comm=0.1)
    listed = json.loads(json.dumps(staged.as_list()))
    assert listed[4] == [[1, 1, 1], [1, 1, 1], [1, 1, 1], [2, 2, 2]]
    back = Costs.from_list(listed, 2)
    assert back == staged and hash(back) == hash(staged)


@pytest.mark.parametrize("bad, match", [
    (([1, 1, 1], [1] * 4, [1] * 4), "forward \\(F\\) has 3 per-stage values for 4 stages"),
    (([1] * 4, [1, 1, 0, 1], [1] * 4), "every backward \\(B\\) time must be a finite number > 0"),
    (([1] * 4, [1] * 4, [1, 1, -1, 1]), "every weight \\(W\\) time must be a finite number > 0"),
])
def test_for_stages_rejects_bad_lists(bad, match):
    with pytest.raises(ScheduleError, match=match):
        Costs.for_stages(V2, *bad)


def test_the_stage_costs_forms_parse(tmp_path):
    inline = parse_stage_costs("1,1,1/1,1,1/1,1,1/2,2,2/0.1", V2)
    assert inline == Costs.for_stages(V2, *HEAVY_HEAD, comm=0.1)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"forward": [1, 1, 1, 2], "backward": [1, 1, 1, 2],
                                "weight": [1, 1, 1, 2], "comm": 0.1}))
    assert parse_stage_costs(str(path), V2) == inline
    assert parse_stage_costs("1,1,1/1,1,1/1,1,1/2,2,2", V2).comm == 0.0


@pytest.mark.parametrize("text, match", [
    ("1,1,1/1,1,1/2,2,2", "gives 3 stages, the schedule has 4"),
    ("1,1,1/1,1,1/1,1,1/2,2", "every stage needs three numbers"),
    ("1,1,1/1,1,1/1,1,1/2,x,2", "'x' is not a number"),
    ("1,1,1/1,1,1/1,1,1/2,0,2", "must be a finite number > 0"),
    ("1,1,1/1,1,1/1,1,1/2,inf,2", "every backward \\(B\\) time must be a finite number > 0"),
    ("1,1,1/1,1,1/1,1,1/2,2,nan", "every weight \\(W\\) time must be a finite number > 0"),
    ("1,1,1/1,1,1/1,1,1/2,2,2/-1", "comm must be a finite number >= 0"),
    ("1,1,1/1,1,1/1,1,1/2,2,2/inf", "comm must be a finite number >= 0"),
    ("missing.json", "cannot read the file"),
])
def test_bad_stage_costs_name_the_option_and_the_valid_forms(text, match):
    with pytest.raises(ScheduleError, match=match) as err:
        parse_stage_costs(text, V2)
    assert str(err.value).startswith(f"--stage-costs {text!r}:")
    assert "valid forms: F,B,W/F,B,W/..." in str(err.value)


def test_a_stage_costs_file_with_other_keys_is_refused(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"forward": [1] * 4, "backward": [1] * 4, "w": [1] * 4}))
    with pytest.raises(ScheduleError, match="keys forward, backward, weight"):
        parse_stage_costs(str(path), V2)


def test_the_search_plans_for_a_heavy_head():
    """auto under per-stage costs: valid, within its limit, and at least as fast under those
    costs as the plan made for the same work spread evenly over each rank's chunks."""
    p, m = 4, 16
    placement = Placement(p, Layout.V)
    f = [1.0] * 7 + [4.0]  # stage 7: the LM head and loss on rank 0
    staged = Costs.for_stages(placement, f, [1.2] * 7 + [4.8], [0.6] * 7 + [0.3], comm=0.05)
    even = Costs.build(p, staged.forward, staged.backward, staged.weight, comm=0.05)
    aware = build_schedule("auto", p, m, costs=staged, memory_limit=3.0)
    blind = build_schedule("auto", p, m, costs=even, memory_limit=3.0)
    validate(aware, memory_limit=3.0)
    assert simulate(aware, staged).makespan <= simulate(blind, staged).makespan + 1e-9
    assert makespan_floor(placement, m, staged, 3.0) <= simulate(aware, staged).makespan + 1e-9


_STAGE_TIME = st.floats(0.1, 4.0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 4), m_factor=st.sampled_from([1, 2]),
       name=st.sampled_from(["1f1b", "zb-1p", "interleaved-1f1b", "v-min", "v-half", "v-zb",
                             "auto"]),
       data=st.data(), comm=st.floats(0, 0.5), freed_by_b=st.floats(0, 0.9))
def test_no_schedule_for_per_stage_costs_beats_the_floor(p, m_factor, name, data, comm,
                                                         freed_by_b):
    """The lower bounds stay lower bounds when a rank's chunks differ: every schedule, built
    (and, for the levels and auto, searched) for random per-stage costs, is valid and no
    faster than makespan_floor at its own peak."""
    from megatron_vshape.schedule.model.costs import MemoryModel

    m = m_factor * p
    placement = Placement(p, schedule_info(name).layout)
    lists = [data.draw(st.lists(_STAGE_TIME, min_size=placement.num_stages,
                                max_size=placement.num_stages)) for _ in range(3)]
    costs = Costs.for_stages(placement, *lists, comm=comm)
    memory = MemoryModel(1.0, -freed_by_b, freed_by_b - 1.0)
    schedule = build_schedule(name, p, m, costs=costs, memory=memory)
    result = simulate(schedule, costs, memory)
    validate(schedule, memory_limit=result.peak_memory_max, memory=memory)
    floor = makespan_floor(placement, m, costs, result.peak_memory_max, memory)
    assert result.makespan >= floor - 1e-9
