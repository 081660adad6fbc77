"""Lowering: add the point-to-point actions a runtime must post.

For every dependency that crosses ranks (placement decides; the V's turn and the loss are
local), the producer's rank gets a send right after the producing pass and the consumer's rank
a receive right before the consuming pass::

    rank r:   ... 3F7  3SF7 ...           (send stage 3's output of microbatch 7)
    rank r+1: ... 4RF7 4F7  ...           (receive stage 4's input, then run it)

Gradients go the other way (``SB`` after B/BW on stage s, ``RB`` before B/BW on stage s-1).
"""
from __future__ import annotations

from .actions import Action, PassKind
from .schedule import Schedule

__all__ = ["lower", "message_of"]

_F, _SF, _RF, _SB, _RB = (PassKind.F, PassKind.SEND_F, PassKind.RECV_F, PassKind.SEND_B,
                          PassKind.RECV_B)


def message_of(action: Action) -> tuple[str, int, int]:
    """The message a send or receive carries: (stream, producing stage, microbatch).

    A send and the receive that matches it map to the same message.
    """
    if action.kind is _SF:
        return ("activation", action.stage, action.microbatch)
    if action.kind is _RF:
        return ("activation", action.stage - 1, action.microbatch)
    if action.kind is _SB:
        return ("gradient", action.stage, action.microbatch)
    if action.kind is _RB:
        return ("gradient", action.stage + 1, action.microbatch)
    raise ValueError(f"{action} is not a send or receive")


def _lower_rank(schedule: Schedule, rank: int) -> list[Action]:
    rank_of = schedule.placement.rank_of
    last = schedule.num_stages - 1
    out: list[Action] = []
    for action in schedule.compute_actions(rank):
        kind, stage, mb = action
        if kind is _F and stage > 0 and rank_of(stage - 1) != rank:
            out.append(Action(_RF, stage, mb))
        if kind.is_backward and stage < last and rank_of(stage + 1) != rank:
            out.append(Action(_RB, stage, mb))
        out.append(action)
        if kind is _F and stage < last and rank_of(stage + 1) != rank:
            out.append(Action(_SF, stage, mb))
        if kind.is_backward and stage > 0 and rank_of(stage - 1) != rank:
            out.append(Action(_SB, stage, mb))
    return out


def lower(schedule: Schedule) -> Schedule:
    """A new schedule with send/receive actions added on every rank."""
    if schedule.lowered:
        return schedule
    return schedule.with_actions(
        [_lower_rank(schedule, r) for r in range(schedule.ranks)], lowered=True
    )
