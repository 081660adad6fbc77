"""The one thing every construction, rewrite and search step is given: the setting and its limit.

A ``Problem`` holds the placement, the number of microbatches, the pass costs, the memory model
and the memory limit in units (one microbatch's activations of one rank's layer share: 1F1B's
rank 0 reaches p of them; limits.py's ``memory_limit_units``). The passes that lay orders out
count in chunk-activations (one microbatch, one chunk; the memory model's deltas), so the limit
is converted here, once: ``cap`` and ``full``. A step that works under another limit (a replay
with a chunk of slack, the zb-1p policies at other peaks) asks ``with_limit``, never a number in
another unit.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .actions import ScheduleError
from .costs import Costs, MemoryModel
from .placement import Placement

__all__ = ["Problem"]

_EPS = 1e-9


@dataclass(frozen=True)
class Problem:
    """One schedule to make: where the stages are, how many microbatches, what each pass costs,
    what each pass does to memory, and the peak allowed per rank (units). Hashable: searches
    cache by it."""

    placement: Placement
    microbatches: int
    costs: Costs
    memory: MemoryModel = MemoryModel()
    limit: float = float("inf")
    """Peak activation memory per rank, in units (module doc)."""

    def __post_init__(self) -> None:
        """The placement checks the ranks; a problem checks its microbatches, once, before a
        step reads them."""
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"microbatches must be an integer >= 1, got "
                                f"{self.microbatches!r}")

    @property
    def ranks(self) -> int:
        return self.placement.ranks

    @property
    def chunks(self) -> int:
        return self.placement.chunks

    @property
    def cap(self) -> float:
        """The limit in chunk-activations: what a pass-by-pass layout keeps each rank within."""
        return self.limit * self.placement.chunks

    @property
    def full(self) -> int:
        """The limit in whole chunk-activations: the peak a layout in unit slots lays out to."""
        return int(self.cap + _EPS)

    def with_limit(self, limit: float) -> Problem:
        """The same setting under another limit (units)."""
        return dataclasses.replace(self, limit=limit)

    def with_cap(self, cap: float) -> Problem:
        """The same setting under a limit given in chunk-activations (a candidate's own peak
        as a layout counts it)."""
        return dataclasses.replace(self, limit=cap / self.placement.chunks)
