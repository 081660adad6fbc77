"""The reorder variants compose chooses from: cool-down pass, ZB-V order, list scheduling."""
import pytest
from hypothesis import given, settings, strategies as st

from megatron_vshape.schedule import (Layout, Placement, PassKind, Schedule, ScheduleError, simulate,
                                      validate)
from megatron_vshape.schedule.construct.blocks import V_HALF, V_MIN, ZB_1P
from megatron_vshape.schedule.construct.compose import REORDERS, compose, repeat
from megatron_vshape.schedule.construct.cooldown_reorder import cool_down
from megatron_vshape.schedule.model.deps import completion_key, dependencies
from megatron_vshape.schedule.model.simulate import peak_memory
from megatron_vshape.schedule.construct.zbv import zbv_order


def _schedule(orders, layout, p, m):
    return Schedule("t", Placement(p, layout), m, tuple(tuple(o) for o in orders))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 16), m_factor=st.floats(0.1, 6), family=st.sampled_from([V_MIN, V_HALF, ZB_1P]))
def test_cool_down_keeps_bound_and_never_loses_to_plain(p, m_factor, family):
    m = max(1, round(m_factor * p))
    block = family.build(p)
    plain = repeat(block, m)
    cooled = REORDERS["cooldown"](block, plain, m)
    schedule = _schedule(cooled, block.layout, p, m)
    validate(schedule)
    assert max(peak_memory(schedule)) <= block.memory_bound
    before = simulate(_schedule(plain, block.layout, p, m)).makespan
    assert simulate(schedule).makespan <= before + 1e-9


def _slot_walk(orders, placement, cap):
    """The cool-down reorder walked slot by slot from slot 0, on actions, as its module doc
    states it: the reference ``cool_down`` must match (it takes the part before the first
    tail from one dataflow timing instead)."""
    stages = placement.num_stages
    delta = {PassKind.F: 1, PassKind.B: 0, PassKind.W: -1, PassKind.BW: -1}
    rest, tails, memory, out, finished = [list(o) for o in orders], [None] * len(orders), \
        [0] * len(orders), [[] for _ in orders], {}
    switch = [max(i for i, a in enumerate(o) if a.kind is PassKind.F
                  and a.stage == placement.stage_of(r, 0)) for r, o in enumerate(orders)]

    def ready(action, t):
        return all(finished.get(d, float("inf")) <= t for d in dependencies(action, stages))

    def pick(r, t):
        if tails[r] is None:
            if rest[r] and ready(rest[r][0], t):
                if len(out[r]) == switch[r]:
                    tails[r] = rest[r][1:]
                return rest[r].pop(0)
            return None
        for weights in (False, True):
            for i, a in enumerate(tails[r]):
                fits = a.kind is not PassKind.F or memory[r] + 1 <= cap
                if (a.kind is PassKind.W) == weights and fits and ready(a, t):
                    return tails[r].pop(i)
        return None

    t = 0
    while any(tails[r] if tails[r] is not None else rest[r] for r in range(len(orders))):
        started = [(r, a) for r in range(len(orders)) if (a := pick(r, t)) is not None]
        assert started, f"stalled at slot {t}"
        for r, a in started:
            out[r].append(a)
            memory[r] += delta[a.kind]
            finished[completion_key(a)] = t + 1
        t += 1
    return out


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 12), m_factor=st.floats(0.2, 4), family=st.sampled_from([V_MIN, V_HALF, ZB_1P]))
def test_cool_down_is_the_slot_walk_of_its_doc(p, m_factor, family):
    m = max(1, round(m_factor * p))
    block = family.build(p)
    placement = Placement(p, block.layout)
    plain = repeat(block, m)
    assert cool_down(plain, placement, block.memory_bound_chunks) == \
        _slot_walk(plain, placement, block.memory_bound_chunks)


def test_cool_down_names_the_slot_where_orders_stall():
    block = V_HALF.build(4)
    orders = [list(order) for order in repeat(block, 8)]
    orders[1].reverse()  # rank 1 starts with a pass that waits for passes behind it
    with pytest.raises(ScheduleError, match="made no progress at slot"):
        cool_down(orders, Placement(4, Layout.V), block.memory_bound_chunks)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_order_shape(p):
    m = 3 * p
    orders = zbv_order(p, m)
    placement = Placement(p, Layout.V)
    for rank, order in enumerate(orders):
        # warm-up: 2(p-i)-1 chunk-0 forwards come first
        head = order[: 2 * (p - rank) - 1]
        assert all(a.kind is PassKind.F and a.stage == placement.stage_of(rank, 0) for a in head)
        # every pass of both chunks exactly once
        assert len(order) == 6 * m
    schedule = _schedule(orders, Layout.V, p, m)
    validate(schedule)
    assert max(peak_memory(schedule)) == p
    assert simulate(schedule).bubble_rate_span == 0


@pytest.mark.parametrize("m", [1, 2, 5, 7])
def test_zbv_order_with_few_microbatches_drops_padding(m):
    schedule = _schedule(zbv_order(4, m), Layout.V, 4, m)
    validate(schedule)
    assert all(a.microbatch < m for order in schedule.rank_actions for a in order)


def test_unknown_reorder_is_named():
    import dataclasses
    block = dataclasses.replace(V_MIN.build(4), reorders=("sideways",))
    with pytest.raises(Exception, match="sideways"):
        compose(block, 8)


@pytest.mark.parametrize("p", [4, 8])
def test_continuous_block_at_uniform_costs_is_v_min(p):
    from megatron_vshape.schedule import Costs, Problem, build_schedule
    from megatron_vshape.schedule.construct.periodic import periodic_block, periodic_orders

    m = 4 * p
    block = periodic_block(Problem(Placement(p, Layout.V), m, Costs.build(p)), 1.0)
    schedule = _schedule(periodic_orders(block, m), Layout.V, p, m)
    validate(schedule)
    ours, v_min = simulate(schedule), simulate(build_schedule("v-min", p, m, variant="paper"))
    assert ours.peak_memory_max == v_min.peak_memory_max
    assert ours.bubble_rate == pytest.approx(v_min.bubble_rate, abs=1e-9)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 10), m_factor=st.floats(0.2, 4), window=st.sampled_from([1, 4, 12]),
       costs=st.tuples(*[st.floats(0.2, 3)] * 3, st.floats(0, 0.5)))
def test_timed_replay_is_valid_keeps_the_cap_and_times_like_the_simulator(p, m_factor, window, costs):
    from megatron_vshape.schedule import Costs, ScheduleError, build_schedule
    from megatron_vshape.schedule.model.problem import Problem
    from megatron_vshape.schedule.rewrite.replay import replay_in_time

    m = max(1, round(m_factor * p))
    base = build_schedule("v-half", p, m)
    c = Costs.build(p, *costs[:3], comm=costs[3])
    cap = 2 * base.memory_bound
    try:
        replay = replay_in_time(Problem(base.placement, m, c).with_cap(cap), base.rank_actions,
                                window=window)
    except ScheduleError:
        assert window > 1  # a strict replay of a fitting order never gets stuck
        return
    schedule = base.with_actions(replay.orders)
    validate(schedule)
    assert max(peak_memory(schedule)) <= base.memory_bound
    # the search ranks replays by their own makespan, unsimulated: it must be the simulator's
    assert replay.makespan == pytest.approx(simulate(schedule, c).makespan, rel=1e-12, abs=1e-9)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 10), m_factor=st.floats(0.5, 4), slack=st.sampled_from([1, 2]),
       costs=st.tuples(*[st.floats(0.2, 3)] * 3, st.floats(0, 0.5)),
       freeing=st.booleans())
def test_a_replay_is_abandoned_exactly_when_its_peak_would_pass_the_mark(p, m_factor, slack,
                                                                         costs, freeing):
    """The search replays with slack over its limit and keeps only replays within it:
    ``abandon_above`` raises exactly when the full replay's peak passes the mark, and
    otherwise changes nothing."""
    from megatron_vshape.schedule import Costs, MemoryModel, build_schedule
    from megatron_vshape.schedule.model.problem import Problem
    from megatron_vshape.schedule.rewrite.replay import replay_in_time

    m = max(1, round(m_factor * p))
    memory = MemoryModel(1, -0.75, -0.25) if freeing else MemoryModel()
    base = build_schedule("v-min", p, m)
    c = Costs.build(p, *costs[:3], comm=costs[3])
    mark = 2 * base.memory_bound
    problem = Problem(base.placement, m, c, memory).with_cap(mark + slack)
    try:
        full = replay_in_time(problem, base.rank_actions, 4)
    except ScheduleError:
        return  # stuck either way: nothing to compare
    over = max(peak_memory(base.with_actions(full.orders), memory)) * 2 > mark + 1e-6
    try:
        cut = replay_in_time(problem, base.rank_actions, 4, abandon_above=base.memory_bound)
    except ScheduleError as error:
        assert over and "over" in str(error)
        return
    assert not over and cut == full


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 12), m=st.integers(1, 24), pick=st.integers(0, 10**6),
       backward=st.sampled_from([0.0, -0.5, -0.75]))
def test_repeated_peak_is_the_highest_level_of_the_repeated_orders(p, m, pick, backward):
    """``repeated_peak`` (the search's probe of a block's memory) gives, without building
    them, the highest level of ``repeat``'s orders: V family blocks and the fixed blocks,
    split or fused backward, under memory models that free at B or not."""
    from megatron_vshape.schedule import MemoryModel
    from megatron_vshape.schedule.construct.blocks import ONE_F_ONE_B, V_HALF, V_ZB
    from megatron_vshape.schedule.construct.compose import repeated_peak
    from megatron_vshape.schedule.construct.family import v_block, v_family
    from megatron_vshape.schedule.model.simulate import level_peak

    blocks = [b for b in (v_block(p, o) for o in v_family(p)) if b is not None]
    blocks += [f.build(p) for f in (V_MIN, V_HALF, V_ZB, ONE_F_ONE_B, ZB_1P)]
    block = blocks[pick % len(blocks)]
    memory = MemoryModel(1.0, backward, -1.0 - backward)
    levels = max(level_peak((a.kind for a in order), memory) for order in repeat(block, m))
    assert repeated_peak(block, m, memory) == pytest.approx(levels, abs=1e-9)
