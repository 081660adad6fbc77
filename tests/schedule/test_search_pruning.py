"""The adaptive search's shortcuts (blocks skipped on a bound, peaks read off a short repeat,
the family's gaps checked prefix by prefix) change its speed, never its answers."""
import itertools

import pytest

from megatron_vshape.schedule import Costs, Schedule, ScheduleError, build_schedule, search
from megatron_vshape.schedule.model.costs import MemoryModel
from megatron_vshape.schedule.model.deps import dependencies, dependency_table
from megatron_vshape.schedule.construct.family import VOffsets, v_block, v_family
from megatron_vshape.schedule.construct.blocks import V_HALF, V_MIN, V_ZB
from megatron_vshape.schedule.model.actions import PassKind
from megatron_vshape.schedule.search.adaptive import InfeasibleMemoryError, clear_cache
from megatron_vshape.schedule.search.constructions import (fixed_block_over, lifespan_bound,
                                                           probe_peak, reaches_steady_state)
from megatron_vshape.schedule.model.simulate import peak_memory
from megatron_vshape.schedule.model.problem import Problem
from megatron_vshape.schedule.rewrite.replay import replay_in_time


@pytest.mark.parametrize("p", range(2, 13))
def test_lifespan_bound_never_exceeds_the_steady_peak(p):
    """A family block is skipped when this bound exceeds the limit, so it must be a bound."""
    for offsets in v_family(p):
        block = v_block(p, offsets)
        if block is None:
            continue
        for m in (4 * p, 8 * p):
            if reaches_steady_state(block, m):
                assert lifespan_bound(block) <= probe_peak(block, m, MemoryModel()), offsets


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 12, 16, 20, 32])
def test_fixed_blocks_peak_exactly_at_their_bound_once_m_reaches_p(p):
    """The search skips V-Min, V-Half or V-ZB whose bound exceeds the limit without building
    them (m >= p, default memory model), so for m >= p their peak must equal the bound. These
    are the paper's fixed orders the search builds (the named levels run the search itself)."""
    for m in sorted({p, p + 1, 2 * p, 4 * p}):
        for family in (V_MIN, V_HALF, V_ZB):
            peak = max(peak_memory(build_schedule(family.name, p, m, variant="paper")))
            assert peak == family.memory_bound(p), (family.name, m)
            assert fixed_block_over(family, p, m, peak - 0.5, MemoryModel())
            assert not fixed_block_over(family, p, m, peak, MemoryModel())


def _family_slots(p, offsets, gaps):
    """Per rank, (pass, chunk) -> slot of the V family's block as family.py's module doc draws
    it: chunk 0's F from slot 0 on rank 0, ``offsets.offset(r)`` more on each next rank; after
    turn gap g1, chunk 1's F one slot more per rank back to rank 0; after g2, chunk 1's B down
    like chunk 0's F; after g3, chunk 0's B back up."""
    def down(start):
        slots = [start]
        for r in range(1, p):
            slots.append(slots[-1] + offsets.offset(r))
        return slots

    def up(start):
        return [start + (p - 1 - r) for r in range(p)]

    g1, g2, g3 = gaps
    f0 = down(0)
    f1 = up(f0[-1] + g1)
    b1 = down(f1[0] + g2)
    b0 = up(b1[-1] + g3)
    F, B = PassKind.F, PassKind.B
    return [{(F, 0): f0[r], (F, 1): f1[r], (B, 1): b1[r], (B, 0): b0[r]} for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 9, 16])
def test_v_block_takes_the_first_gaps_by_sum(p):
    """The prefix checks in v_block find what trying every gap triple in order (smallest sum
    first) finds: the first whose four passes fall in distinct slots of the 6-slot repeat on
    every rank."""
    triples = sorted(itertools.product(range(1, 7), repeat=3), key=sum)
    for offsets in v_family(p):
        first = next((g for g in triples
                      if all(len({s % 6 for s in rank.values()}) == 4
                             for rank in _family_slots(p, offsets, g))), None)
        block = v_block(p, offsets)
        assert (block is None) == (first is None)
        if block is not None:
            assert block.interval == 6
            expected = [tuple(sorted(s.items(), key=lambda kv: kv[1]))
                        for s in _family_slots(p, offsets, first)]
            assert list(block.slots) == expected


def test_v_family_splits():
    assert {o.split for o in v_family(16) if o.k1 != o.k2} == {2, 4, 6, 8, 10, 12, 14}
    assert {o.split for o in v_family(8) if o.k1 != o.k2} == {1, 2, 3, 4, 5, 6}
    assert VOffsets(3, 1, 5) in v_family(16) or VOffsets(3, 1, 6) in v_family(16)


def test_dependency_table_is_the_dependency_rule():
    table = dependency_table(8, 5)
    assert len(table) == 4 * 8 * 5
    assert all(deps == dependencies(action, 8) for action, deps in table.items())


def test_replay_keeps_the_cap_and_every_pass():
    p, m = 8, 32
    base = build_schedule("v-half", p, m)
    costs = Costs.build(p, 1, 1.2, 0.8, comm=0.1)
    problem = Problem(base.placement, m, costs)
    orders = replay_in_time(problem.with_cap(10), base.rank_actions, window=4).orders
    replayed = Schedule("replayed", base.placement, m, orders)
    assert [set(o) for o in orders] == [set(o) for o in base.rank_actions]
    assert max(peak_memory(replayed)) <= 5
    with pytest.raises(ScheduleError, match="leaves ranks waiting"):
        replay_in_time(problem.with_cap(1), base.rank_actions, window=4)


def test_infeasible_error_still_names_the_smallest_peak_of_every_block():
    """Skipped family blocks are probed when nothing fits, so the error stays exact."""
    clear_cache()
    with pytest.raises(InfeasibleMemoryError) as err:
        search(16, 64, Costs.build(16), 0.5)
    smallest = min(probe_peak(v_block(16, o), 64, MemoryModel()) for o in v_family(16)
                   if v_block(16, o) is not None)
    assert err.value.smallest <= smallest
