"""Machine proof of issue 3's impossible case: p = 4, half memory, uniform costs, m = 16.

The shortest makespan of any V schedule with at most 4 chunk-activations per rank is 107
half-unit slots (53.5), V-Min's; issue 3 asks for <= 53.02 (0.6 x 1F1B's bubble). See
``test_half_memory_uniform_costs_bubble`` in test_search.py for the statement and the part that
can be seen by hand. This file holds the exhaustive part: a CP-SAT model whose optimum is that
bound. It needs OR-Tools (not a dependency of the project) and 40-80 s on two cores, so it
runs only with ``VSHAPE_PROOFS=1``::

    pip install ortools && VSHAPE_PROOFS=1 python -m pytest -q tests/test_search_bound.py

The model, in slots (every chunk pass takes one):

- one interval per (kind, stage, microbatch), no two overlapping on a rank;
- the dependency rule of ``schedule/deps.py`` as precedences (uniform costs, no comm);
- a reservoir per rank: +1 at each F's start, -1 at each W's end, level within 0..4 (the
  paper's memory model, as ``peak_memory`` counts it along a rank's order);
- every stage runs its F and B passes in microbatch order. This loses nothing: microbatches
  cost the same, so calling the j-th pass (in time) of every stage microbatch j keeps every
  start time and memory level, and keeps the dependencies (when the j-th pass of stage s+1
  starts, j+1 passes of stage s have ended, so the j-th has);
- stage 0's first forward starts at 0 (the first pass of any schedule is one);
- V-Min's timing as the solver's first solution (a hint: it speeds up, it does not restrict).
"""
import os

import pytest

from megatron_vshape.schedule import Costs, Layout, Placement, build_schedule, simulate
from megatron_vshape.schedule.actions import Action, PassKind
from megatron_vshape.schedule.deps import completion_key, dependencies

pytestmark = pytest.mark.skipif(os.environ.get("VSHAPE_PROOFS") != "1",
                                reason="slow machine proof; set VSHAPE_PROOFS=1 (needs ortools)")

P, M, CAP = 4, 16, 4  # ranks, microbatches, chunk-activations (= p/2 units)


def _shortest_makespan_slots(p: int, m: int, cap: int, seconds: float) -> tuple[str, int, int]:
    cp_model = pytest.importorskip("ortools.sat.python.cp_model")
    placement = Placement(p, Layout.V)
    stages = placement.num_stages
    horizon = 6 * p * m + 4 * stages
    model = cp_model.CpModel()
    start, end, per_rank = {}, {}, [[] for _ in range(p)]
    for kind in (PassKind.F, PassKind.B, PassKind.W):
        for stage in range(stages):
            for mb in range(m):
                action = Action(kind, stage, mb)
                start[action] = model.NewIntVar(0, horizon, str(action))
                end[action] = model.NewIntVar(0, horizon, "")
                per_rank[placement.rank_of(stage)].append(
                    model.NewIntervalVar(start[action], 1, end[action], ""))
    for intervals in per_rank:
        model.AddNoOverlap(intervals)
    for action in start:
        for dep in dependencies(action, stages):
            model.Add(start[action] >= end[completion_key(dep)])
        if action.kind is not PassKind.W and action.microbatch > 0:
            model.Add(start[action] >= end[action._replace(microbatch=action.microbatch - 1)])
    for rank in range(p):
        times, demands = [], []
        for chunk in range(2):
            stage = placement.stage_of(rank, chunk)
            for mb in range(m):
                times += [start[Action(PassKind.F, stage, mb)], end[Action(PassKind.W, stage, mb)]]
                demands += [1, -1]
        model.AddReservoirConstraint(times, demands, 0, cap)
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, list(end.values()))
    model.Add(start[Action(PassKind.F, 0, 0)] == 0)
    model.Minimize(makespan)
    hint = build_schedule("v-min", p, m)  # a good first solution speeds the proof up
    timing = simulate(hint)
    for rank in range(p):
        for action, at in zip(hint.compute_actions(rank), timing.start[rank]):
            model.AddHint(start[action], round(2 * at))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    return solver.StatusName(status), round(solver.ObjectiveValue()), round(solver.BestObjectiveBound())


def test_half_memory_at_p4_cannot_reach_0_6_of_1f1b():
    status, best, bound = _shortest_makespan_slots(P, M, CAP, seconds=600)
    assert status == "OPTIMAL" and best == bound == 107
    one = simulate(build_schedule("1f1b", P, M), Costs.build(P)).bubble_rate
    work = 3.0 * M  # per rank: F + B + W = 3 per microbatch
    assert 1 - work / (bound / 2) > 0.6 * one  # 0.1028 > 0.0947: the target is out of reach
    assert simulate(build_schedule("v-min", P, M)).makespan == bound / 2  # and V-Min is optimal
