"""What a memory model that frees at B adds to the default model's answer
(schedule/search/freeing_at_b.py): refined orders stay valid and within their cap, and the
refinement is what makes v-min reach 1.10 x 1F1B at the H100 costs, p = 8, m = 32."""
import importlib

import pytest

from megatron_vshape.schedule import (Layout, MemoryModel, Placement, Problem, build_schedule,
                                      parse_costs, simulate, validate)
from megatron_vshape.schedule.search.freeing_at_b import freeing_nothing_at_b, refined_under
from conftest import B_FREES, H100

adaptive = importlib.import_module("megatron_vshape.schedule.search.adaptive")



def test_the_default_shape_of_a_model_is_the_one_whose_b_frees_nothing():
    assert freeing_nothing_at_b(MemoryModel()) is None
    assert freeing_nothing_at_b(B_FREES) == MemoryModel(1, 0, -1)
    assert freeing_nothing_at_b(MemoryModel(2, -0.5, -1.5)) == MemoryModel(2, 0, -2)


@pytest.mark.parametrize("name,p,m", [("v-half", 4, 16), ("v-min", 6, 12), ("v-zb", 4, 8)])
def test_refined_orders_validate_within_the_cap_and_the_polish_never_worsens(name, p, m):
    costs = parse_costs(H100, p)
    paper = build_schedule(name, p, m, variant="paper")
    problem = Problem(paper.placement, m, costs, B_FREES, paper.memory_bound)
    refined = {how.name: orders for how, orders in refined_under(problem, paper.rank_actions,
                                                                  20_000)}
    assert set(refined) == {"W deferred under the model", "W deferred and polished under the model"}
    times = {}
    for how, orders in refined.items():
        schedule = paper.with_actions(orders)
        validate(schedule, memory_limit=paper.memory_bound, memory=B_FREES)
        times[how] = simulate(schedule, costs, B_FREES).makespan
    assert times["W deferred and polished under the model"] <= \
        times["W deferred under the model"] + 1e-9


def test_fused_passes_are_not_refined():
    paper = build_schedule("1f1b", 4, 8)
    problem = Problem(paper.placement, 8, parse_costs(H100, 4), B_FREES).with_cap(8)
    assert refined_under(problem, paper.rank_actions, 1000) == []


def test_v_min_at_h100_costs_reaches_the_target_only_through_the_refinement(fresh_caches):
    """p = 8, m = 32: the default model's answer and a whole search under the model stay above
    1.10 x 1F1B (239.6 = 1.104 x); deferring the W passes of the default model's answer under
    the model and polishing it gets below."""
    p, m = 8, 32
    costs = parse_costs(H100, p)
    one = simulate(build_schedule("1f1b", p, m), costs, B_FREES).makespan
    level = float((p + 4) // 3)
    default = adaptive.search(p, m, costs, level).result.makespan
    problem = Problem(Placement(p, Layout.V), m, costs, B_FREES, level)
    own = adaptive.search_steps(adaptive.SearchRequest(problem, shapes=True)).result.makespan
    named = build_schedule("v-min", p, m, costs, memory=B_FREES)
    ours = simulate(named, costs, B_FREES)
    assert min(default, own) > 1.10 * one
    assert ours.makespan <= 1.10 * one
    assert {"W deferred under the model", "W deferred and polished under the model"} & \
        {step.name for step in named.provenance.steps}
    assert ours.peak_memory_max <= level + 1e-9


def test_the_model_gets_no_search_of_its_own_where_the_default_model_fits(monkeypatch,
                                                                         fresh_caches):
    """p = 4, m = 16 at V-Half's memory (384 passes; a search of its own used to run there):
    the only search is the default model's, and the answer is at least as fast as it."""
    p, m, level = 4, 16, 3.0
    costs = parse_costs(H100, p)
    searched = []
    search_steps = adaptive.search_steps
    monkeypatch.setattr(adaptive, "search_steps",
                        lambda request: searched.append(request.problem.memory)
                        or search_steps(request))
    found = adaptive.search(p, m, costs, level, B_FREES)
    default = adaptive.search(p, m, costs, level)
    assert searched == [MemoryModel()]
    assert found.result.makespan <= simulate(default.schedule, costs, B_FREES).makespan + 1e-9
    validate(found.schedule, memory_limit=level, memory=B_FREES)
