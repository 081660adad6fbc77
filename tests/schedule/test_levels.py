"""Named schedules as memory levels (schedule/search/levels.py), the local search over orders
(search/local.py) and the cost-aware greedy (construct/greedy.py): every order they return is valid
and within its level, never slower than the paper's order, and a memory model that frees more
at B never makes them slower."""
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_vshape.schedule import (Costs, Layout, MemoryModel, Placement, Problem, Schedule,
                                      ScheduleError, build_schedule, parse_memory_model, search,
                                      simulate, validate)
from megatron_vshape.schedule.construct.greedy import Policy, greedy_schedule
from megatron_vshape.schedule.model.provenance import Chosen, Provenance, step
from megatron_vshape.schedule.names import MEMORY_LEVELS
from megatron_vshape.schedule.search.levels import memory_level
from megatron_vshape.schedule.search.local import LocalSearch, improve, improve_repeated
from conftest import B_FREES, h100_costs

costs_strategy = st.tuples(
    st.sampled_from([1.0, 2.0]), st.sampled_from([1.0, 1.2, 1.39 * 2, 2.4]),
    st.sampled_from([0.35, 0.8, 1.6, 2.0]), st.sampled_from([0.0, 0.05, 0.5]))


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(MEMORY_LEVELS), p=st.integers(2, 6), m=st.integers(1, 14),
       costs=costs_strategy, frees=st.booleans())
def test_a_level_is_valid_within_its_bound_and_never_slower_than_the_paper(name, p, m, costs, frees):
    memory = B_FREES if frees else MemoryModel()
    c = Costs.build(p, *costs)
    fastest = build_schedule(name, p, m, c, memory=memory)
    paper = build_schedule(name, p, m, variant="paper")
    validate(fastest, memory_limit=memory_level(name, p), memory=memory)
    assert simulate(fastest, c, memory).makespan <= simulate(paper, c, memory).makespan + 1e-9


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(MEMORY_LEVELS), p=st.integers(2, 6), m=st.integers(2, 14),
       costs=costs_strategy, backward=st.sampled_from([-0.25, -0.5, -0.75, -1.0]))
@example(name="zb-1p", p=3, m=6, costs=(1.0, 1.0, 0.8, 0.05), backward=-1.0)  # stop 54's CI
def test_a_model_that_frees_more_at_b_is_never_slower(name, p, m, costs, backward):
    c = Costs.build(p, *costs)
    freeing = MemoryModel(1, backward, -1 - backward)
    default = simulate(build_schedule(name, p, m, c), c).makespan
    assert simulate(build_schedule(name, p, m, c, memory=freeing), c, freeing).makespan \
        <= default + 1e-9


@pytest.mark.parametrize("p,m,limit", [(4, 16, 3.0), (4, 8, 2.5), (8, 16, 5.0)])
def test_auto_under_a_model_that_frees_at_b_is_never_slower(p, m, limit):
    c = Costs.build(p, 1, 1.2, 0.8, 0.05)
    default = search(p, m, c, limit).result.makespan
    assert search(p, m, c, limit, B_FREES).result.makespan <= default + 1e-9


def test_default_costs_keep_the_papers_memory_table():
    for p in (4, 6, 8):
        for name, fraction in (("v-min", (p + 4) // 3 / p), ("v-half", (p + 2) // 2 / p),
                               ("v-zb", 1.0), ("zb-1p", 1.0)):
            result = simulate(build_schedule(name, p, 3 * p))
            assert result.peak_memory_vs_1f1b <= fraction + 1e-9, (name, p)


@pytest.mark.parametrize("name,p,m,costs,at_most", [
    # the reference generator's bubbles at these points (scripts/bench/reference_compare.py),
    # ours at or below them
    ("zb-1p", 8, 8, (2, 2, 2, 0), 0.226),
    ("zb-1p", 16, 16, (2, 2, 2, 0.1), 0.256),
    ("v-half", 4, 64, (2, 2, 2, 0.5), 0.040),
    ("v-half", 4, 16, (2, 2, 2, 0.5), 0.143),
])
def test_named_levels_reach_the_reference_generator_at_its_points(name, p, m, costs, at_most):
    c = Costs.build(p, *costs)
    assert simulate(build_schedule(name, p, m, c), c).bubble_rate <= at_most + 0.005


def test_the_paper_variant_is_the_fixed_order_and_bad_variants_are_refused():
    c = h100_costs(4)
    paper = build_schedule("v-half", 4, 16, c, variant="paper")
    assert paper.rank_actions == build_schedule("v-half", 4, 16, variant="paper").rank_actions
    assert paper.provenance == Provenance((step("paper block", family="v-half", interval=6,
                                                bound=3),))
    assert paper.description == "v-half block, interval 6, bound 3 units"
    fastest = build_schedule("v-half", 4, 16, c).provenance
    assert fastest.chosen == Chosen("v-half", "level", 3.0)
    assert str(fastest).startswith("v-half: ") and str(fastest).endswith(" (level 3 units)")
    with pytest.raises(ScheduleError, match="unknown variant 'best'.*fastest, paper"):
        build_schedule("v-half", 4, 16, variant="best")


def test_memory_model_parsing_names_the_flag():
    assert parse_memory_model("1,-0.75,-0.25") == B_FREES
    with pytest.raises(ScheduleError, match="--memory-model must be F,B,W"):
        parse_memory_model("1,0")
    with pytest.raises(ScheduleError, match="sum to 0"):
        parse_memory_model("1,0,-0.5")


def test_local_search_never_worsens_and_keeps_the_limit():
    p, m = 4, 8
    c = Costs.build(p, 2, 2.4, 1.6, 0.1)
    start = build_schedule("v-half", p, m, variant="paper")
    problem = Problem(Placement(p, Layout.V), m, c, limit=3)
    better = improve(problem, start.rank_actions, 200_000)
    polished = start.with_actions(better.orders)
    validate(polished, memory_limit=3)
    assert better.makespan == pytest.approx(simulate(polished, c).makespan)
    assert better.makespan < simulate(start, c).makespan  # this start has gaps to fill
    with pytest.raises(ScheduleError, match="exceed 4 chunk-activations"):
        improve(problem.with_limit(2), start.rank_actions, 200_000)


def test_a_move_repeated_per_microbatch_is_made_in_every_period_and_keeps_the_order_valid():
    p, m = 4, 16
    c = h100_costs(p)
    start = build_schedule("v-min", p, m, variant="paper")
    search = LocalSearch(Problem(start.placement, m, c, limit=2), start.rank_actions)
    r, i, (new, changed) = next((r, i, moved) for r, j, i in search.moves()
                                if (moved := search.repeated(r, j, i, 1)))
    old = search.orders[r]
    assert sorted(new) == sorted(old) and changed <= i
    assert new[:changed] == old[:changed] and new[changed] != old[changed]
    moved_ids = {a for a, b in zip(new, old) if a != b}
    assert len({search.index.actions[a].microbatch for a in moved_ids}) >= 4  # many periods
    orders = list(search.orders)
    orders[r] = new
    validate(start.with_actions(search.index.decode(orders)), memory_limit=2)


@pytest.mark.parametrize("name, p, m", [("v-min", 4, 8), ("v-half", 8, 8)])
def test_the_deadlock_check_agrees_with_timing_every_single_move(name, p, m):
    """Every move of one pass earlier (window 6) of a paper order, not blocked outright:
    ``deadlocks`` says True exactly when timing the moved orders gets stuck (with room to
    search the whole graph), and with the default probe only ever for moves that get stuck."""
    c = h100_costs(p)
    start = build_schedule(name, p, m, variant="paper")
    search = LocalSearch(Problem(start.placement, m, c, limit=p), start.rank_actions)
    moves = []
    for r, order in enumerate(search.orders):
        for j in range(1, len(order)):
            for i in range(max(0, j - 6), j):
                if not search.blocked(order, i, j):
                    trial = list(search.orders)
                    trial[r] = order[:i] + [order[j]] + order[i:j] + order[j + 1:]
                    moves.append((r, i, j, search.flow.time(trial).stuck is not None))
    caught = [search.deadlocks(r, i, j) for r, i, j, _ in moves]
    search.probe = 10**9  # settings.py's deadlock_probe, for this search alone
    assert [search.deadlocks(r, i, j) for r, i, j, _ in moves] == [s for *_, s in moves]
    assert all(stuck for (*_, stuck), dead in zip(moves, caught) if dead)
    assert sum(caught) > 10 and sum(not s for *_, s in moves) > 10  # both kinds were checked


@pytest.mark.parametrize("name, p, m", [("v-min", 4, 16), ("v-min", 8, 16), ("v-half", 8, 8)])
def test_a_repeated_move_whose_single_move_deadlocks_is_not_timed_and_would_deadlock(
        name, p, m):
    """``repeated`` drops a move whose single move surely deadlocks (``deadlocks``); made in
    every period anyway, each of those orders gets stuck when timed (local.py's claim)."""
    c = h100_costs(p)
    start = build_schedule(name, p, m, variant="paper")
    search = LocalSearch(Problem(start.placement, m, c, limit=p), start.rank_actions)
    dead = [(r, j, i) for r, order in enumerate(search.orders) for j in range(1, len(order))
            for i in range(max(0, j - 6), j)
            if not search.blocked(order, i, j) and search.deadlocks(r, i, j)]
    assert all(search.repeated(r, j, i, 1) is None for r, j, i in dead)
    search.deadlocks = lambda r, i, j: False  # the repeated orders as made without the check
    stuck = 0
    for r, j, i in dead:
        moved = search.repeated(r, j, i, 1)
        if moved is not None:
            trial = list(search.orders)
            trial[r] = moved[0]
            assert search.flow.time(trial).stuck is not None, (r, j, i)
            stuck += 1
    assert stuck > 10


def test_moves_repeated_per_microbatch_cross_the_single_moves_plateau():
    """From the paper's V-Min at p = 4, m = 16 and the H100 costs, the same budget of passes
    takes the single moves' local search to 134.9 and the one with repeated moves to 127.0
    (1F1B: 105.5): a steady state improves only when every period of it changes."""
    p, m = 4, 16
    c = h100_costs(p)
    start = build_schedule("v-min", p, m, variant="paper")
    problem = Problem(start.placement, m, c, limit=2)
    single = improve(problem, start.rank_actions, budget=1_000_000)
    repeated = improve_repeated(problem, start.rank_actions, budget=1_000_000)
    polished = start.with_actions(repeated.orders)
    validate(polished, memory_limit=2)
    assert repeated.makespan == pytest.approx(simulate(polished, c).makespan)
    assert single.makespan > 134.0 and repeated.makespan < 128.0


def test_v_min_at_p4_takes_the_moves_repeated_per_microbatch():
    """The search's last step at V-Min's memory on small schedules (adaptive.py): at the H100
    costs, p = 4, m = 16, it takes v-min from 1.219 to 1.196 x 1F1B."""
    p, m = 4, 16
    c = h100_costs(p)
    v_min = build_schedule("v-min", p, m, c)
    validate(v_min, memory_limit=memory_level("v-min", p))
    assert "moves repeated per microbatch" in [s.name for s in v_min.provenance.steps]
    one = simulate(build_schedule("1f1b", p, m), c).makespan
    assert simulate(v_min, c).makespan <= 1.197 * one


def test_greedy_one_chunk_orders_are_valid_and_refuse_an_impossible_limit():
    p, m = 4, 12
    placement = Placement(p, Layout.SINGLE)
    c = Costs.build(p, 1, 1.39, 0.35, 0.05)
    for policy in (Policy(), Policy(ranked_warm_up=True, alternate=True)):
        found = greedy_schedule(Problem(placement, m, c, B_FREES, p), policy)
        schedule = Schedule("g", placement, m, found.orders)
        validate(schedule, memory_limit=p, memory=B_FREES)
        assert simulate(schedule, c, B_FREES).makespan <= found.makespan + 1e-9
    with pytest.raises(ScheduleError, match="cannot hold one microbatch"):
        greedy_schedule(Problem(placement, m, c, limit=0.5))


@pytest.mark.parametrize("memory", [MemoryModel(), B_FREES], ids=["default", "b-frees"])
def test_a_named_build_is_its_levels_search_and_never_slower_than_the_papers_order(
        memory, fresh_caches):
    """A V name is the search at its level (levels.py: nothing else is tried around it), at
    least as fast as the paper's order, which is among the search's candidates, and under a
    model that frees at B as fast as the name where B frees nothing (adaptive.py's
    ``ALSO_TRY`` starts there), within the level (p = 4, m = 16, H100 costs, v-half)."""
    p, m, c = 4, 16, h100_costs(4)
    built = build_schedule("v-half", p, m, c, memory=memory)
    timed = simulate(built, c, memory)
    found = search(p, m, c, memory_level("v-half", p), memory)
    assert built.rank_actions == found.schedule.rank_actions
    paper = build_schedule("v-half", p, m, variant="paper")
    assert timed.makespan <= simulate(paper, c, memory).makespan + 1e-9
    nothing_freed = build_schedule("v-half", p, m, c)
    assert timed.makespan <= simulate(nothing_freed, c, memory).makespan + 1e-9
    assert timed.peak_memory_max <= memory_level("v-half", p) + 1e-9
