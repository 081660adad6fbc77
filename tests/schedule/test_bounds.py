"""The memory lower bound on the makespan (schedule/search/bounds.py): valid, and what it rules out."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_vshape.schedule import Costs, build_schedule, simulate
from megatron_vshape.schedule.search.bounds import lifetime_per_microbatch, makespan_floor
from megatron_vshape.schedule.model.costs import MemoryModel
from megatron_vshape.schedule.model.placement import Layout, Placement
from conftest import h100_costs

UNBALANCED = (1.0, 1.2, 0.8)


def test_lifetime_matches_a_hand_count():
    """p = 16, chunk passes F, B, W = 0.5, 0.6, 0.4. Rank 0's chunk 0 waits for 16 + 16
    forwards, 16 + 16 backwards and its W: 8 + 8 + 9.6 + 9.6 + 0.4; its chunk 1 for its own
    F, B and W: 1.5. With comm 0.1 the chunk-0 path crosses 30 hops each way (+6.0); the
    V's turn and the loss are local."""
    placement = Placement(16, Layout.V)
    assert lifetime_per_microbatch(placement, Costs.build(16, *UNBALANCED), 0) == pytest.approx(37.1)
    assert lifetime_per_microbatch(placement, Costs.build(16, *UNBALANCED, comm=0.1), 0) == pytest.approx(43.1)
    half = MemoryModel(1.0, -0.5, -0.5)  # half freed at B: that half skips the W
    assert lifetime_per_microbatch(placement, Costs.build(16, *UNBALANCED), 0, half) == pytest.approx(37.1 - 0.4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 6), m_factor=st.sampled_from([1, 2, 4]),
       name=st.sampled_from(["1f1b", "zb-1p", "v-min", "v-half", "v-zb", "auto"]),
       costs=st.tuples(*[st.floats(0.2, 3)] * 3, st.floats(0, 0.5)),
       freed_by_b=st.floats(0, 0.9))
def test_no_schedule_beats_the_floor_at_its_own_peak(p, m_factor, name, costs, freed_by_b):
    m = m_factor * p
    c = Costs.build(p, *costs[:3], comm=costs[3])
    memory = MemoryModel(1.0, -freed_by_b, freed_by_b - 1.0)
    schedule = build_schedule(name, p, m)
    result = simulate(schedule, c, memory)
    floor = makespan_floor(schedule.placement, m, c, result.peak_memory_max, memory)
    assert result.makespan >= floor - 1e-9


@pytest.mark.parametrize("comm,m", [(0.0, 512), (0.1, 128)])
def test_p16_unbalanced_target_is_unreachable_for_large_m(comm, m):
    """1F1B's bubble at V-Min's memory ((p+4)//3 = 6 units) with costs 1, 1.2, 0.8 for
    m >= 4p (a target the search was set): at p = 16 no schedule reaches it: rank 0 holds 37.1 (43.1 with comm 0.1)
    activation-time per microbatch in 12 chunk-activations, so the makespan is at least
    3.09 m (3.59 m), while 1F1B's is 3 m + 45 (and with comm its steady state waits on
    every hop). The floor passes 1F1B's makespan from m = 492 (comm 0) and m = 120 (comm 0.1)."""
    p = 16
    c = Costs.build(p, *UNBALANCED, comm=comm)
    one = simulate(build_schedule("1f1b", p, m), c)
    assert makespan_floor(Placement(p, Layout.V), m, c, (p + 4) // 3) > one.makespan


def test_fill_and_drain_rule_out_v_zb_at_092_of_1f1b_for_p4_m32():
    """v-zb within 0.92 x 1F1B's makespan at the H100 costs (2,2.78,0.7,0.05, m = 8p) cannot
    be met at p = 4 under either memory model. Rank 3 starts after 3 x (1 + 0.05) = 3.15. Its
    first gradient comes back after the 8 forwards and 6 hops to the loss (8.3) and the B
    passes of stages 7, 6, 5 with their 3 hops (4.32): until 12.62 it can run only the 8
    forwards its 4 units hold, so it waits 1.47 more. It computes 32 x 5.48; its last B is
    followed by 3 x 1.39 + 3 x 0.05 of drain, of which at most 8 deferred W passes (0.35
    each, one chunk-activation each) hide 2.8: 181.5, 0.934 x 1F1B's 194.4. When B frees
    three quarters (1,-0.75,-0.25), 32 W fit and hide the drain: 179.98, still 0.926 x."""
    p, m = 4, 32
    c = h100_costs(p)
    one = simulate(build_schedule("1f1b", p, m), c).makespan
    floor = makespan_floor(Placement(p, Layout.V), m, c, p)
    assert floor == pytest.approx(181.5) and floor > 0.92 * one
    frees = MemoryModel(1, -0.75, -0.25)
    floor = makespan_floor(Placement(p, Layout.V), m, c, p, frees)
    assert floor == pytest.approx(179.98) and floor > 0.92 * one


@pytest.mark.parametrize("p,default,frees", [(8, 0.9259, 0.9145), (16, 0.9221, 0.9090)])
def test_fill_and_drain_rule_out_v_zb_at_092_of_1f1b_at_m_8p(p, default, frees):
    """The same target at p = 8 and 16 (m = 8p): out of reach under the default memory model
    (the last rank waits for its first gradient with its p units full: 3.43 at p = 8); when B
    frees three quarters the floor is below 0.92 (no proof there)."""
    m = 8 * p
    c = h100_costs(p)
    one = simulate(build_schedule("1f1b", p, m), c).makespan
    placement = Placement(p, Layout.V)
    assert makespan_floor(placement, m, c, p) / one == pytest.approx(default, abs=1e-4)
    assert makespan_floor(placement, m, c, p, MemoryModel(1, -0.75, -0.25)) / one == \
        pytest.approx(frees, abs=1e-4)
    assert default > 0.92 > frees


def test_little_rules_out_v_min_at_110_of_1f1b_for_p16_m128():
    """v-min within 1.10 x 1F1B's makespan at the H100 costs (2,2.78,0.7,0.05, m = 8p) cannot
    be met at p = 16 under the default memory model: at V-Min's 6 units, rank 0 keeps each
    microbatch's activations for so long that no order finishes before 1.105 x 1F1B's
    makespan (797.0). When B frees three quarters the floor is 1.098: no proof there."""
    p, m = 16, 128
    c = h100_costs(p)
    one = simulate(build_schedule("1f1b", p, m), c).makespan
    level = (p + 4) // 3
    assert makespan_floor(Placement(p, Layout.V), m, c, level) > 1.10 * one
    frees = MemoryModel(1, -0.75, -0.25)
    assert makespan_floor(Placement(p, Layout.V), m, c, level, frees) < 1.10 * one
