"""The dependency rule, written once (paper, section 2) and imported by everything.

For microbatch k and S global stages::

    F(s, k)  after F(s-1, k)                      activations flow down the stages
    B(s, k)  after B(s+1, k);  B(S-1, k) after F(S-1, k)   gradients flow back up; the loss
    W(s, k)  after B(s, k)                        weight gradient needs the output gradient
    BW       = B followed by W, with B's dependencies

Whether a dependency crosses ranks (and so costs a hop and needs a send/receive pair) is the
placement's business: the V's turn at rank p-1 and the loss at rank 0 are local.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .actions import Action, PassKind

if TYPE_CHECKING:
    from .placement import Placement

__all__ = ["dependencies", "completion_key", "dependency_table", "hop_table", "wake_table"]

_F, _B, _W, _BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW


def completion_key(action: Action) -> Action:
    """The event an action completes, as other actions refer to it.

    A fused BW completes the input gradient, which others wait for as ``B``; every other
    compute action completes itself.
    """
    if action.kind is _BW:
        return Action(_B, action.stage, action.microbatch)
    return action


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """Completion keys (see :func:`completion_key`) that ``action`` must wait for."""
    kind, stage, mb = action
    if kind is _F:
        return (Action(_F, stage - 1, mb),) if stage > 0 else ()
    if kind is _B or kind is _BW:
        if stage == num_stages - 1:
            return (Action(_F, stage, mb),)
        return (Action(_B, stage + 1, mb),)
    if kind is _W:
        return (Action(_B, stage, mb),)
    raise ValueError(f"dependencies are defined for compute actions only, got {action}")


@functools.lru_cache(maxsize=4)
def dependency_table(num_stages: int, microbatches: int) -> dict[Action, tuple[Action, ...]]:
    """:func:`dependencies` of every compute action of ``microbatches`` microbatches, built
    once per shape and shared read-only by the passes that look them up many times."""
    table = {}
    for kind in (_F, _B, _W, _BW):
        for stage in range(num_stages):
            for mb in range(microbatches):
                action = Action(kind, stage, mb)
                table[action] = dependencies(action, num_stages)
    return table


@functools.lru_cache(maxsize=4)
def hop_table(placement: "Placement", microbatches: int) -> dict[Action, tuple]:
    """Per compute action: (its completion key, its one dependency or None, whether that
    dependency crosses ranks). Every action waits for at most one other, so the timing loops
    (simulator, replay) read one entry instead of calling three functions per pass."""
    stages = placement.num_stages
    rank_of = [placement.rank_of(s) for s in range(stages)]
    table = {}
    for action, deps in dependency_table(stages, microbatches).items():
        dep = deps[0] if deps else None
        remote = dep is not None and rank_of[dep.stage] != rank_of[action.stage]
        table[action] = (completion_key(action), dep, remote)
    return table


@functools.lru_cache(maxsize=4)
def wake_table(placement: "Placement", comm: float, microbatches: int, kinds: frozenset):
    """Per completion key: the (rank, hop delay) of every pass of ``kinds`` that waits for it,
    i.e. whom a finished pass wakes in the list schedulers that advance in simulated time
    (timed replay, W deferral). Shared by every call of the same setting (read-only)."""
    table = hop_table(placement, microbatches)
    wakes: dict[Action, list[tuple[int, float]]] = {}
    for action, (_, dep, remote) in table.items():
        if dep is not None and action.kind in kinds:
            delay = comm if remote else 0.0
            wakes.setdefault(dep, []).append((placement.rank_of(action.stage), delay))
    return wakes
