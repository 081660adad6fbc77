"""The cool-down re-scheduled critical path first (rewrite/critical_path_cooldown.py): the rule
of its doc, valid orders, and what it takes off the search's V-Min at p = 16."""
import functools
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from megatron_vshape.schedule import (Action, Costs, Layout, MemoryModel, PassKind, Placement,
                                      Problem, ScheduleError, build_schedule, parse_costs,
                                      simulate, validate)
from megatron_vshape.schedule.rewrite.critical_path_cooldown import (LINES, bottom_levels,
                                                                      critical_tail)
from megatron_vshape.schedule.model.deps import dependencies
from megatron_vshape.schedule.model.indexed import PassIndex
from megatron_vshape.schedule.model.simulate import action_durations, pass_durations
from megatron_vshape.schedule.search.adaptive import SearchRequest, search_steps
from conftest import H100

F, B, W = PassKind.F, PassKind.B, PassKind.W


def _cut(schedule, timing, line):
    """Per rank, how many of its passes stay (critical_tail's ``line``), from its doc."""
    own = [max((i + 1 for i, a in enumerate(order)
                if a.kind is F and a.stage == schedule.placement.stage_of(r, 0)), default=0)
           for r, order in enumerate(schedule.rank_actions)]
    if line == "own":
        return own
    last = [timing.start[r][k - 1] for r, k in enumerate(own) if k]
    at = min(last) if line == "first" else (min(last) + max(last)) / 2
    return [sum(1 for start in starts if start <= at) for starts in timing.start]


def _reference(schedule, costs, memory, cap, line):
    """The module doc's rule, written plainly on actions: every step looks at every pass left
    (quadratic, for small schedules only)."""
    stages = schedule.num_stages
    durations = action_durations(schedule, costs)
    timing = simulate(schedule, costs)

    def took(action):
        rank, chunk = schedule.placement.locate(action.stage)
        return durations[rank][chunk][action.kind]

    def hop(action, dep):
        same = schedule.placement.locate(action.stage)[0] == schedule.placement.locate(dep.stage)[0]
        return 0.0 if same else costs.comm

    @functools.lru_cache(maxsize=None)
    def level(action):  # longest path from its start to the end, by the dependency rule
        waiters = [a for a in every if dependencies(a, stages) == (action,)]
        return took(action) + max((hop(a, action) + level(a) for a in waiters), default=0.0)

    every = [a for order in schedule.rank_actions for a in order]
    end, out, tails, clock, held = {}, [], [], [], []
    for r, (order, cut) in enumerate(zip(schedule.rank_actions, _cut(schedule, timing, line))):
        out.append(list(order[:cut]))
        tails.append(list(order[cut:]))
        for a, e in zip(order[:cut], timing.end[r][:cut]):
            end[a] = e
        clock.append(timing.end[r][cut - 1] if cut else 0.0)
        held.append(sum(memory.deltas[a.kind] for a in order[:cut]))
    levels = {a: level(a) for tail in tails for a in tail}
    while any(tails):
        found = []
        for r, tail in enumerate(tails):
            for position, a in enumerate(tail):
                deps = dependencies(a, stages)
                if any(d not in end for d in deps):
                    continue
                if a.kind is not W and a.microbatch and Action(a.kind, a.stage,
                                                               a.microbatch - 1) not in end:
                    continue
                if held[r] + memory.deltas[a.kind] > cap + 1e-9:
                    continue
                ready = max([clock[r]] + [end[d] + hop(a, d) for d in deps])
                found.append((ready, r, position, a))
        first_end, r = min((ready + took(a), r) for ready, r, _, a in found)
        conflict = [(ready, pos, a) for ready, q, pos, a in found
                    if q == r and ready < first_end - 1e-9]
        ready, pos, a = max(conflict, key=lambda c: (levels[c[2]], -c[1]))
        tails[r].pop(pos)
        out[r].append(a)
        clock[r] = end[a] = ready + took(a)
        held[r] += memory.deltas[a.kind]
    return tuple(tuple(order) for order in out)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 5), m_factor=st.integers(1, 3),
       name=st.sampled_from(["v-min", "v-half", "v-zb"]),
       ratios=st.tuples(st.sampled_from([1.0, 2.0]), st.sampled_from([1.0, 1.2, 2.78]),
                        st.sampled_from([0.35, 0.7, 1.0]), st.sampled_from([0.0, 0.05, 0.5])),
       frees=st.sampled_from([0.0, 0.75]), line=st.sampled_from(LINES))
def test_critical_tail_is_the_rule_of_its_doc_and_a_valid_schedule(p, m_factor, name, ratios,
                                                                  frees, line):
    """The same orders as the plain reference over paper orders of every V name and every
    line; what comes before the line kept, the same passes per rank, within the cap, and valid
    (matching sends and receives)."""
    paper = build_schedule(name, p, m_factor * p, variant="paper")
    costs, memory = Costs.build(p, *ratios), MemoryModel(1, -frees, frees - 1)
    cap = paper.memory_bound * paper.placement.chunks
    setting = Problem(paper.placement, paper.microbatches, costs, memory, paper.memory_bound)
    orders = critical_tail(setting, paper.rank_actions, line)
    assert orders == _reference(paper, costs, memory, cap, line)
    tailed = paper.with_actions(orders)
    validate(tailed, paper.memory_bound, memory)
    kept = _cut(paper, simulate(paper, costs), line)
    for old, new, k in zip(paper.rank_actions, orders, kept):
        assert Counter(old) == Counter(new)
        assert new[:k] == old[:k]


def test_bottom_levels_follow_the_longest_chain_to_the_end():
    """p = 2, V: F0 -> F1 -> F2 -> F3 -> B3 -> B2 -> B1 -> B0 -> W0; F = 1, B = 2, W = 0.5 per
    chunk, hop 0.25 between ranks (stages 0, 3 on rank 0; 1, 2 on rank 1)."""
    schedule = build_schedule("v-half", 2, 1, variant="paper")
    costs = Costs.build(2, 2.0, 4.0, 1.0, 0.25)
    index = PassIndex.of(schedule.placement, 1)
    levels = bottom_levels(index, index.durations(pass_durations(schedule.placement, costs)),
                           index.delays(costs.comm))
    at = {index.actions[i]: level for i, level in enumerate(levels)}
    assert at[Action(W, 0, 0)] == 0.5
    assert at[Action(B, 0, 0)] == 2.5  # then its W
    assert at[Action(B, 1, 0)] == 2 + 0.25 + 2.5  # B1 on rank 1, B0 on rank 0
    assert at[Action(F, 3, 0)] == 1 + 2 + 0.25 + 2 + 2 + 0.25 + 2.5  # B3, hop, B2, B1, hop, B0
    assert at[Action(F, 0, 0)] == 1 + 0.25 + 1 + 1 + 0.25 + at[Action(F, 3, 0)]


def test_critical_tail_shortens_v_mins_cool_down_at_p16_h100_costs():
    """The search's V-Min at p = 16, m = 64, before its last step (this), runs a down-leg
    backward before the up-leg passes that head the last walk (measured: 615.36 -> 612.75,
    what CP-SAT finds best for the last 60 time units after the same start)."""
    p, m = 16, 64
    costs = parse_costs(H100, p)
    problem = Problem(Placement(p, Layout.V), m, costs, limit=6.0)
    found = search_steps(SearchRequest(problem, shapes=True)).schedule
    before = simulate(found, costs).makespan
    setting = Problem(found.placement, m, costs, MemoryModel(), 6.0)
    after = simulate(found.with_actions(critical_tail(setting, found.rank_actions)),
                     costs).makespan
    assert after < before - 2.0


def test_critical_tail_refuses_fused_passes_an_unknown_line_and_a_cap_nothing_fits():
    fused = build_schedule("1f1b", 2, 2)  # one chunk, BW passes
    with pytest.raises(ScheduleError, match="fused BW"):
        critical_tail(Problem(fused.placement, 2, Costs.build(2), limit=2.0),
                      fused.rank_actions)
    paper = build_schedule("v-half", 4, 8, variant="paper")
    setting = Problem(paper.placement, 8, Costs.build(4))
    with pytest.raises(ScheduleError, match="line 'last' is not one of own, first, middle"):
        critical_tail(setting.with_cap(6.0), paper.rank_actions, line="last")
    with pytest.raises(ScheduleError, match="no rank can run its next pass"):
        critical_tail(setting.with_cap(0.5), paper.rank_actions)
