"""The list schedulers' one event loop (model/event_loop.py): its event order and times on
hand-made cases, a policy that waits, both orders of ties, and a deadlock left to the caller."""
import pytest

from megatron_vshape.schedule import Costs, Placement, Layout, PassKind, ScheduleError, Action
from megatron_vshape.schedule.model.event_loop import EventLoop
from megatron_vshape.schedule.model.problem import Problem
from megatron_vshape.schedule.rewrite.replay import replay_in_time
from megatron_vshape.schedule.rewrite.weight_deferral import defer_weight_passes

F, B, W = PassKind.F, PassKind.B, PassKind.W

# Three passes on two ranks, a hop of 0.5 between them: 0 (rank 0, 1 long), then 1 (rank 1,
# 2 long, waits for 0), then 2 (rank 0, 1 long, waits for 1).
_RANK, _DEP, _DURATION, _HOP = (0, 1, 0), (-1, 0, 1), (1.0, 2.0, 1.0), 0.5
_WAKES = [((1, _HOP),), ((0, _HOP),), ()]


class _InOrder:
    """Each rank runs its passes in id order, a pass once its dependency ended a hop ago."""

    def __init__(self, loop: EventLoop):
        self.loop, self.calls = loop, []
        self.rest = [[a for a in range(3) if _RANK[a] == r] for r in range(2)]

    def __call__(self, rank: int, now: float):
        self.calls.append((rank, now))
        rest = self.rest[rank]
        if not rest:
            return None
        d = _DEP[rest[0]]
        if d >= 0 and not 0.0 <= self.loop.finished[d] <= now - _HOP:
            return None
        return rest.pop(0)


def test_a_two_rank_chain_runs_at_the_times_its_hops_allow():
    """Rank 1 waits for pass 0's end plus the hop (1.5), rank 0 for pass 1's (4.0); every end
    wakes its rank, every end a hop later the rank waiting for it, in time order."""
    loop = EventLoop(2, _DURATION, (0, 1, 2), _WAKES)
    policy = _InOrder(loop)
    loop.run(policy)
    assert policy.calls == [(0, 0.0), (1, 0.0), (0, 1.0), (1, 1.5), (1, 3.5), (0, 4.0),
                            (0, 5.0)]
    assert loop.finished == [1.0, 3.5, 5.0]
    assert loop.free_at == [5.0, 3.5] and loop.first == [0.0, 1.5]
    assert loop.makespan() == 5.0


def test_a_policy_that_waits_is_asked_again_when_it_said():
    """Rank 0's one pass is released at 2.0 and nothing ends before: without its own wake the
    rank would never run it; with it, it starts at 2.0."""
    loop = EventLoop(1, (1.0,), (0,), [()])
    calls = []

    def release_at_two(rank, now):
        calls.append(now)
        if loop.finished[0] >= 0.0:
            return None
        if now < 2.0:
            loop.wake_at(2.0, rank)
            return None
        return 0

    loop.run(release_at_two)
    assert calls == [0.0, 2.0, 3.0]
    assert loop.first == [2.0] and loop.finished == [3.0] and loop.makespan() == 1.0


@pytest.mark.parametrize("batch,second_calls", [
    (None, [(1, 0.0), (0, 1e-13)]),   # one at a time: by time, then rank
    (1e-12, [(0, 0.0), (1, 0.0)]),    # batched: due within 1e-12, one event in rank order
])
def test_ties_are_ordered_one_at_a_time_or_batched(batch, second_calls):
    """Rank 0 asks again at 1e-13, rank 1 at 0.0: popped one by one, rank 1 goes first; as
    one batch both run at 0.0, rank 0 first (the replay's order)."""
    loop = EventLoop(2, (), (), [], batch=batch, busy=0.0)
    asked = {0: 1e-13, 1: 0.0}
    calls = []

    def twice(rank, now):
        if rank in asked:
            loop.wake_at(asked.pop(rank), rank)
        else:
            calls.append((rank, now))
        return None

    loop.run(twice)
    assert calls == second_calls


def test_a_batched_loop_queues_a_rank_again_whose_end_it_took_early():
    """Batched, rank 1's wake at 1.0 - 5e-13 takes rank 0's end (1.0) into its event while
    rank 0 is still busy: rank 0 is queued again at 1.0 and starts its second pass there."""
    loop = EventLoop(2, (1.0, 1.0), (0, 1), [(), ()], batch=1e-12, busy=0.0)
    calls, rest = [], {0: [1, 0], 1: []}

    def run_all(rank, now):
        calls.append((rank, now))
        if rank == 1 and now == 0.0:
            loop.wake_at(1.0 - 5e-13, 1)
        return rest[rank].pop() if rest[rank] else None

    loop.run(run_all)
    assert calls == [(0, 0.0), (1, 0.0), (1, 1.0 - 5e-13), (0, 1.0), (0, 2.0)]
    assert loop.finished == [1.0, 2.0] and loop.first == [0.0, None]


def test_ranks_waiting_on_each_other_end_the_loop_and_the_schedulers_raise():
    """Rank 0's order puts B before the F that rank 1's F waits for: the loop ends with both
    passes left, and the replay and the deferral say which ranks wait."""
    placement = Placement(2, Layout.SINGLE)
    loop = EventLoop(2, _DURATION, (0, 1, 2), _WAKES)
    policy = _InOrder(loop)
    policy.rest = [[2, 0], [1]]  # rank 0 waits for 1, which waits for 0
    loop.run(policy)
    assert policy.rest == [[2, 0], [1]] and loop.finished == [-1.0] * 3
    orders = ((Action(F, 0, 0), Action(B, 0, 0), Action(W, 0, 0)),
              (Action(B, 1, 0), Action(F, 1, 0), Action(W, 1, 0)))
    problem = Problem(placement, 1, Costs.build(2, 1, 1, 1))
    with pytest.raises(ScheduleError, match="leaves ranks waiting"):
        replay_in_time(problem.with_cap(4), orders, window=1)
    with pytest.raises(ScheduleError, match="leaves ranks waiting"):
        defer_weight_passes(problem.with_cap(4), orders)
