"""Message streams: one process group per stage boundary and direction.

gloo and NCCL match point-to-point messages per (peer, tag) in posting order. On the V with
p = 2, ranks 0 and 1 exchange four streams (chunk-0 activations, chunk-1 activations and both
gradient streams); sharing one group would let a receive match the wrong stream's message and
swap tensors silently. So every stream gets its own two-rank group::

    stream ("activation", b): stage b  -> stage b+1   (rank_of(b) sends, rank_of(b+1) receives)
    stream ("gradient",   b): stage b+1 -> stage b

Within a stream, messages arrive first-in first-out; the validator checks that every rank posts
a stream's sends and receives in the same microbatch order, so matching is exact for every p.
Boundaries inside one rank (the V's turn) have no stream: the hand-off is local.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from ..schedule.model.actions import Action, PassKind
from ..schedule.model.lower import message_of
from ..schedule.model.placement import Placement

__all__ = ["Route", "StreamGroups", "route_of"]


@dataclass(frozen=True)
class Route:
    """Where one send or receive goes: its stream, the peer's pipeline rank, and the message."""

    stream: tuple[str, int]
    """(``"activation"`` or ``"gradient"``, boundary b between stages b and b+1)."""
    peer: int
    """Pipeline rank (0..p-1) of the other end."""
    message: tuple[str, int, int]
    """(stream kind, producing stage, microbatch): equal for a send and its receive."""


def route_of(action: Action, placement: Placement) -> Route:
    """The route of a lowered send/receive action (see :func:`..schedule.model.lower.message_of`)."""
    message = message_of(action)
    kind, producer, _ = message
    boundary = producer if kind == "activation" else producer - 1
    if action.kind in (PassKind.SEND_F, PassKind.RECV_B):
        peer = placement.rank_of(action.stage + 1)
    else:
        peer = placement.rank_of(action.stage - 1)
    return Route((kind, boundary), peer, message)


def _streams(placement: Placement) -> list[tuple[str, int]]:
    """Every stream that crosses ranks, in a fixed order (all processes create groups alike)."""
    out = []
    for b in range(placement.num_stages - 1):
        if placement.rank_of(b) != placement.rank_of(b + 1):
            out += [("activation", b), ("gradient", b)]
    return out


class StreamGroups:
    """The calling process's stream groups, and its pipeline's global ranks.

    Create with :meth:`create`, which every process of the world must call (process-group
    creation is collective), with the same arguments.
    """

    def __init__(self, pipeline_ranks: Sequence[int], groups: dict, placement: Placement):
        self.pipeline_ranks = tuple(pipeline_ranks)
        self.placement = placement
        self._groups = dict(groups)

    @classmethod
    def create(
        cls,
        placement: Placement,
        pipelines: Sequence[Sequence[int]] | None = None,
        timeout: timedelta | None = None,
        backend: str | None = None,
    ) -> "StreamGroups":
        """Create one two-rank group per stream for every pipeline in ``pipelines``.

        ``pipelines`` lists each pipeline's global ranks in pipeline order (megatron's pipeline
        groups); default: the whole world is one pipeline. The calling process keeps the groups
        of the pipeline it belongs to.
        """
        world = dist.get_world_size()
        me = dist.get_rank()
        pipelines = [list(range(world))] if pipelines is None else [list(p) for p in pipelines]
        for ranks in pipelines:
            if len(ranks) != placement.ranks:
                raise ValueError(
                    f"pipeline {ranks} has {len(ranks)} ranks, the schedule needs {placement.ranks}"
                )
        mine = [ranks for ranks in pipelines if me in ranks]
        if len(mine) != 1:
            raise ValueError(f"global rank {me} must be in exactly one pipeline, got {pipelines}")
        kwargs = {"timeout": timeout} if timeout is not None else {}
        if backend is not None:
            kwargs["backend"] = backend
        groups = {}
        for ranks in pipelines:
            for stream in _streams(placement):
                _, b = stream
                pair = sorted({ranks[placement.rank_of(b)], ranks[placement.rank_of(b + 1)]})
                group = dist.new_group(pair, **kwargs)
                if ranks is mine[0]:
                    groups[stream] = group
        return cls(mine[0], groups, placement)

    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self.pipeline_ranks.index(dist.get_rank())

    def group(self, stream: tuple[str, int]):
        return self._groups[stream]

    def global_rank(self, pipeline_rank: int) -> int:
        return self.pipeline_ranks[pipeline_rank]
