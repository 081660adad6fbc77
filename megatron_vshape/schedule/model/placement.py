"""Placement: which rank and chunk run a global stage.

This is the only place that knows the V. With p ranks and two chunks per rank (paper, section 3)::

    V     stage:  0 1 2 3 | 4 5 6 7        rank r holds stage r (chunk 0, the down-leg)
          rank :  0 1 2 3 | 3 2 1 0        and stage 2p-1-r (chunk 1, the up-leg)

    loop  stage:  0 1 2 3 | 4 5 6 7        interleaved 1F1B: rank r holds stages r and p+r
          rank :  0 1 2 3 | 0 1 2 3

    single stage: 0 1 2 3                  1F1B, ZB-1P: one stage per rank
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from .actions import ScheduleError

__all__ = ["Layout", "Placement", "stage_layer_counts"]


def stage_layer_counts(num_layers: int, stages: int) -> tuple[int, ...]:
    """Transformer layers per global stage: equal, and when they do not divide, the end stages
    give up one layer each first, moving inwards (stage 0, S-1, 1, S-2, ...)::

        V, p = 4, 14 layers     stage   0  1  2  3  4  5  6  7
                                layers  1  2  2  2  2  2  2  1    rank 0 holds stages 0 and 7

    The ends also hold the embedding (stage 0) and the LM head and loss (stage S-1), so under
    a V rank 0 is balanced by the paper's advice num_layers = k p - 2. Raises ValueError when a
    stage would get no layer.
    """
    if num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot give each of {stages} pipeline stages a "
                         f"layer: use num_layers >= {stages} or fewer pipeline ranks")
    per = -(-num_layers // stages)
    counts = [per] * stages
    order = [s for i in range((stages + 1) // 2) for s in dict.fromkeys((i, stages - 1 - i))]
    for i in range(stages * per - num_layers):
        counts[order[i % stages]] -= 1
    return tuple(counts)


class Layout(enum.Enum):
    """How global stages map onto ranks."""

    SINGLE = "single"
    V = "v"
    LOOP = "loop"

    @property
    def chunks(self) -> int:
        """Model chunks per rank."""
        return 1 if self is Layout.SINGLE else 2


@dataclass(frozen=True)
class Placement:
    """Maps global stages to (rank, chunk) for ``ranks`` pipeline ranks."""

    ranks: int
    layout: Layout

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 2:
            raise ScheduleError(
                f"ranks (pipeline-parallel size) must be an integer >= 2, got {self.ranks!r}; "
                "with one rank there is no pipeline to schedule"
            )

    @functools.cached_property  # read per pass by the builders: computed once
    def chunks(self) -> int:
        return self.layout.chunks

    @functools.cached_property
    def num_stages(self) -> int:
        return self.ranks * self.chunks

    def locate(self, stage: int) -> tuple[int, int]:
        """Return (rank, chunk) of a global stage."""
        p = self.ranks
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        if self.layout is Layout.SINGLE:
            return stage, 0
        if self.layout is Layout.LOOP:
            return stage % p, stage // p
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)

    def rank_of(self, stage: int) -> int:
        return self.locate(stage)[0]

    def stage_of(self, rank: int, chunk: int) -> int:
        """Inverse of :meth:`locate`."""
        p = self.ranks
        if not (0 <= rank < p and 0 <= chunk < self.chunks):
            raise ScheduleError(f"no chunk {chunk} on rank {rank} for {self.layout.value} layout")
        if self.layout is Layout.SINGLE:
            return rank
        if self.layout is Layout.LOOP:
            return chunk * p + rank
        return rank if chunk == 0 else 2 * p - 1 - rank
