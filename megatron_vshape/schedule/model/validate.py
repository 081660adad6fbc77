"""Validator: is a schedule safe to run?

Checks, in order, each raising :class:`ValidationError` that names rank, step, stage and
microbatch and carries the step rendering with the failing step marked:

1. every (stage, microbatch, pass) exactly once, on the rank the placement gives;
2. the ranks' orders respect the dependency rule without waiting on each other in a cycle;
3. the lowered sends/receives cannot deadlock: simulated with blocking receives, sends that
   complete when posted, and first-in-first-out matching per stream (one stream per stage
   boundary and direction, the way the runtime gives each its own process group, since gloo
   and NCCL match messages per peer and tag in posting order); a receive that would match
   the wrong message fails;
4. the peak activation memory is within ``memory_limit`` (units), when given.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque

from .actions import Action, PassKind, ScheduleError
from .costs import MemoryModel
from .deps import completion_key, dependencies
from .lower import lower, message_of
from ..io.render_text import render_steps
from .schedule import Schedule
from .simulate import DeadlockError, peak_memory, simulate

__all__ = ["ValidationError", "validate"]


class ValidationError(ScheduleError):
    """A schedule failed validation at (rank, step)."""

    def __init__(self, problem: str, schedule: Schedule, rank: int, step: int):
        action = schedule.rank_actions[rank][step] if step < len(schedule.rank_actions[rank]) else None
        where = f"rank {rank} step {step}"
        if action is not None:
            where += f" ({action}: stage {action.stage}, microbatch {action.microbatch})"
        super().__init__(f"{where}: {problem}\n{render_steps(schedule, (rank, step))}")
        self.rank, self.step, self.action = rank, step, action


def _expected(schedule: Schedule) -> dict[Action, int]:
    """Every compute action the schedule must contain, with the rank it must run on."""
    fused = any(a.kind is PassKind.BW for r in schedule.rank_actions for a in r)
    kinds = (PassKind.F, PassKind.BW) if fused else (PassKind.F, PassKind.B, PassKind.W)
    return {
        Action(kind, s, k): schedule.placement.rank_of(s)
        for s in range(schedule.num_stages)
        for k in range(schedule.microbatches)
        for kind in kinds
    }


def _check_coverage(schedule: Schedule) -> None:
    expected = _expected(schedule)
    seen: Counter = Counter()
    for r, actions in enumerate(schedule.rank_actions):
        for step, action in enumerate(actions):
            if not action.kind.is_compute:
                continue
            if action not in expected:
                raise ValidationError(f"unexpected action {action} (mixing B/W with BW, or out of range)", schedule, r, step)
            if expected[action] != r:
                raise ValidationError(f"{action} belongs on rank {expected[action]}", schedule, r, step)
            seen[action] += 1
            if seen[action] > 1:
                raise ValidationError(f"{action} appears more than once", schedule, r, step)
    missing = [a for a in expected if not seen[a]]
    if missing:
        rank = expected[missing[0]]
        raise ValidationError(
            f"missing {len(missing)} action(s), first {missing[0]} on rank {rank}",
            schedule, rank, len(schedule.rank_actions[rank]),
        )


def _step_of(schedule: Schedule, rank: int, action: Action) -> int:
    return schedule.rank_actions[rank].index(action)


def _check_p2p(lowered: Schedule) -> None:
    """Run the lowered lists with blocking receives and FIFO streams; fail on a stall."""
    p, stages = lowered.ranks, lowered.num_stages
    rank_of = lowered.placement.rank_of
    streams: dict[tuple, deque] = defaultdict(deque)
    done: set[Action] = set()
    ptr = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            actions = lowered.rank_actions[r]
            while ptr[r] < len(actions):
                action = actions[ptr[r]]
                if action.kind.is_send:
                    msg = message_of(action)
                    peer = rank_of(msg[1] + 1) if action.kind is PassKind.SEND_F else rank_of(msg[1] - 1)
                    streams[(r, peer, msg[0], msg[1])].append(msg)
                elif action.kind.is_recv:
                    msg = message_of(action)
                    queue = streams[(rank_of(msg[1]), r, msg[0], msg[1])]
                    if not queue:
                        break
                    if queue[0] != msg:
                        raise ValidationError(
                            f"receive would match {queue[0]} instead of {msg}: sends and receives "
                            "on this stream are posted in different orders", lowered, r, ptr[r])
                    queue.popleft()
                else:
                    if any(d not in done for d in dependencies(action, stages)):
                        break
                    done.add(completion_key(action))
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(p) if ptr[r] < len(lowered.rank_actions[r])]
    if stuck:
        r = stuck[0]
        blocked = ", ".join(f"rank {q} at {lowered.rank_actions[q][ptr[q]]}" for q in stuck)
        raise ValidationError(f"deadlock: {blocked} wait for each other", lowered, r, ptr[r])


def validate(
    schedule: Schedule,
    memory_limit: float | None = None,
    memory: MemoryModel = MemoryModel(),
) -> None:
    """Raise :class:`ValidationError` unless ``schedule`` is complete, ordered, deadlock-free
    and within ``memory_limit`` units (see the module docstring)."""
    _check_coverage(schedule)
    try:
        simulate(schedule)
    except DeadlockError as err:
        raise ValidationError(
            f"waits forever for {list(dependencies(err.action, schedule.num_stages))}: the ranks' "
            "orders form a dependency cycle", schedule, err.rank,
            _step_of(schedule, err.rank, err.action),
        ) from None
    _check_p2p(lower(schedule))
    if memory_limit is not None:
        peaks = peak_memory(schedule, memory)
        worst = max(range(schedule.ranks), key=lambda r: peaks[r])
        if peaks[worst] > memory_limit + 1e-9:
            raise ValidationError(
                f"peak activation memory {peaks[worst]:g} units exceeds the limit {memory_limit:g}",
                schedule, worst, 0,
            )
