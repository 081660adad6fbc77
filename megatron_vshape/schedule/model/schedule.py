"""The schedule value: per-rank action lists plus what is needed to interpret them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .actions import Action, PassKind, ScheduleError
from .placement import Placement
from .provenance import Provenance

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists for one training iteration.

    ``memory_bound`` is the peak activation memory the generator promises (in units of one
    microbatch's activations of one rank's whole share of layers), or None when it states none.
    ``provenance`` is how the schedule was built (block, offsets, passes: model/provenance.py),
    as data; ``description`` renders it for people.
    """

    name: str
    placement: Placement
    microbatches: int
    rank_actions: tuple[tuple[Action, ...], ...]
    memory_bound: float | None = None
    provenance: Provenance = Provenance()
    lowered: bool = field(default=False)

    def __post_init__(self) -> None:
        if len(self.rank_actions) != self.placement.ranks:
            raise ScheduleError(
                f"schedule {self.name!r} has {len(self.rank_actions)} rank lists for "
                f"{self.placement.ranks} ranks"
            )

    @property
    def description(self) -> str:
        """How the schedule was built, in words (its provenance rendered)."""
        return str(self.provenance)

    @property
    def ranks(self) -> int:
        return self.placement.ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def compute_actions(self, rank: int) -> Iterator[Action]:
        """The compute passes of a rank, in order (send/receive kinds skipped)."""
        return (a for a in self.rank_actions[rank] if a.kind.is_compute)

    def forward_only(self) -> "Schedule":
        """The forwards alone, in each rank's order: evaluation (megatron's forward_only).

        Forwards depend only on forwards, so dropping the backward passes of a valid schedule
        keeps it valid; the memory bound no longer applies (nothing is kept for backward).
        """
        return self.with_actions(
            [[a for a in self.compute_actions(r) if a.kind is PassKind.F] for r in range(self.ranks)],
            name=f"{self.name} (forward only)", memory_bound=None, lowered=False,
        )

    def with_actions(self, rank_actions, **changes) -> "Schedule":
        """A copy with other action lists (and optionally other fields)."""
        values = dict(
            name=self.name,
            placement=self.placement,
            microbatches=self.microbatches,
            rank_actions=tuple(tuple(a) for a in rank_actions),
            memory_bound=self.memory_bound,
            provenance=self.provenance,
            lowered=self.lowered,
        )
        values.update(changes)
        return Schedule(**values)
