"""The critical tail as the search's last step (search/critical_path_step.py): kept only where
faster, the lines by memory, left out with ``shapes=False``, named in the description."""
import pytest

from megatron_vshape.schedule import (Layout, MemoryModel, Placement, Problem, parse_costs,
                                      search, simulate, validate)
from megatron_vshape.schedule.rewrite.critical_path_cooldown import (LINES, critical_tail,
                                                                      critical_tails)
from megatron_vshape.schedule.model.actions import ScheduleError
from megatron_vshape.schedule.model.provenance import step
from megatron_vshape.schedule.search import critical_path_step
from megatron_vshape.schedule.search.adaptive import SearchRequest, search_steps
from megatron_vshape.schedule.search.levels import clear_caches
from megatron_vshape.schedule.search.critical_path_step import (STEP, faster_tail, tail_step,
                                                                tail_lines)
from conftest import B_FREES, H100


def _tailed(found) -> bool:
    """Whether the search's answer had its cool-down re-scheduled critical path first."""
    return any(done.name == STEP for done in found.schedule.provenance.steps)


@pytest.mark.parametrize("limit, memory", [(6.0, MemoryModel()), (9.0, B_FREES)])
def test_search_ends_with_the_faster_tail_at_p16(limit, memory, monkeypatch):
    """At p = 16, m = 32 and the H100 costs the step gains 0.7-1.1% (measured: V-Min's 6
    units 339.33 -> 336.97; 9 units under ``1,-0.75,-0.25`` 251.88 -> 249.18); the answer
    still validates within the limit."""
    p, m = 16, 32
    costs = parse_costs(H100, p)
    with monkeypatch.context() as patched:
        patched.setattr(critical_path_step, "faster_tail", lambda *args: None)
        clear_caches()
        plain = search(p, m, costs, limit, memory)
    clear_caches()
    found = search(p, m, costs, limit, memory)
    assert _tailed(found) and not _tailed(plain)
    assert found.result.makespan < 0.995 * plain.result.makespan
    assert found.result.makespan == simulate(found.schedule, costs, memory).makespan
    validate(found.schedule, limit, memory)


def test_search_leaves_the_tail_out_without_shapes():
    p, m = 16, 32
    found = search(p, m, parse_costs(H100, p), 6.0, shapes=False)
    assert not _tailed(found)


def test_a_slower_tail_is_not_kept():
    """At 1F1B's memory, p = 4, the wave's W passes and forwards compete for memory in the
    cool-down and the rule loses (measured 50.43 -> 51.67): nothing is returned, and the
    search keeps its order."""
    p, m = 4, 8
    costs = parse_costs(H100, p)
    problem = Problem(Placement(p, Layout.V), m, costs, limit=4.0)
    plain = search_steps(SearchRequest(problem, shapes=True))
    assert faster_tail(problem, plain.schedule, plain.result.makespan) is None
    assert search(p, m, costs, 4.0).schedule.rank_actions == plain.schedule.rank_actions


def test_lines_by_memory_and_the_description():
    assert tail_lines(16, 16.0) == ("own",) and tail_lines(16, 12.0) == LINES
    other = step("polished")
    once = tail_step((other,), "own")
    assert once == step(STEP, line="own", again=False) and str(once) == f"{STEP} (own line)"
    again = tail_step((other, once), "first")
    assert again == step(STEP, line="first", again=True)
    assert str(again) == f"{STEP} (first line) again"


def test_a_deadlocking_tail_is_passed_over():
    """Above 1F1B's memory (p = 16, m = 32, 18 units, costs 2,2.4,1.6,0.1) the own line's tails
    of the search's winner deadlock: a rank keeps a pass that waits for one another rank
    re-schedules. The search used to raise DeadlockError there; now the line is left out (the
    lone line raises ScheduleError) and the search answers with a valid schedule within the
    limit."""
    p, m, limit = 16, 32, 18.0
    costs = parse_costs("2,2.4,1.6,0.1", p)
    plain = search_steps(SearchRequest(Problem(Placement(p, Layout.V), m, costs, limit=limit),
                                       shapes=True))
    orders, placement = plain.schedule.rank_actions, plain.schedule.placement
    setting = Problem(placement, m, costs, MemoryModel(), limit)
    assert critical_tails(setting, orders, ("own",)) == {}
    with pytest.raises(ScheduleError, match="deadlock"):
        critical_tail(setting, orders, "own")
    assert faster_tail(setting, plain.schedule, plain.result.makespan) is None
    clear_caches()
    found = search(p, m, costs, limit)
    validate(found.schedule, limit)
    assert found.schedule.rank_actions == plain.schedule.rank_actions
