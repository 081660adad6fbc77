"""Pass costs and the per-pass memory model used by the simulator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .actions import PassKind, ScheduleError

__all__ = ["Costs", "MemoryModel", "parse_costs", "parse_memory_model"]

Number = Union[int, float]


def _per_rank(name: str, value: Number | Sequence[Number], ranks: int) -> tuple[float, ...]:
    values = [value] * ranks if isinstance(value, (int, float)) else list(value)
    if len(values) != ranks:
        raise ScheduleError(f"costs: {name} has {len(values)} per-rank values for {ranks} ranks")
    if any(not isinstance(v, (int, float)) or v <= 0 for v in values):
        raise ScheduleError(f"costs: every {name} time must be a positive number, got {values}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class Costs:
    """Pass times for one rank's *whole* share of layers (what one 1F1B stage costs).

    In two-chunk schedules each chunk holds half of that share, so a chunk's pass takes half.
    Per-rank tuples allow unbalanced stages (e.g. rank 0 also runs embedding and LM head).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    """Input-gradient backward (B)."""
    weight: tuple[float, ...]
    """Weight-gradient backward (W); a fused BW costs backward + weight."""
    comm: float = 0.0
    """Time of one pipeline hop; local hand-offs (the V's turn, the loss) cost nothing."""

    @classmethod
    def build(cls, ranks: int, forward=1.0, backward=1.0, weight=1.0, comm=0.0) -> "Costs":
        """Costs from single values (same on every rank) or per-rank lists."""
        if not isinstance(comm, (int, float)) or comm < 0:
            raise ScheduleError(f"costs: comm must be a number >= 0, got {comm!r}")
        return cls(
            forward=_per_rank("forward (F)", forward, ranks),
            backward=_per_rank("backward (B)", backward, ranks),
            weight=_per_rank("weight (W)", weight, ranks),
            comm=float(comm),
        )

    def as_list(self) -> list:
        """JSON-friendly form: scalars when uniform, per-rank lists otherwise."""

        def squash(values):
            return values[0] if len(set(values)) == 1 else list(values)

        return [squash(self.forward), squash(self.backward), squash(self.weight), self.comm]


def parse_costs(text: str, ranks: int) -> Costs:
    """Parse ``"F,B,W[,COMM]"`` (the CLI form) into :class:`Costs`."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise ScheduleError(f"--costs must be F,B,W or F,B,W,COMM (e.g. 1,1,1,0), got {text!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ScheduleError(f"--costs must be numbers, got {text!r}") from None
    return Costs.build(ranks, *values)


@dataclass(frozen=True)
class MemoryModel:
    """Activation-memory change of each pass, in chunk-activations (one microbatch, one chunk).

    The default is the reference implementation's model: F allocates, B frees nothing, W frees
    all. A real B can free what W does not need; give ``backward`` a negative value for that.
    """

    forward: float = 1.0
    backward: float = 0.0
    weight: float = -1.0

    def __post_init__(self) -> None:
        if self.forward <= 0:
            raise ScheduleError(f"memory: forward delta must be > 0, got {self.forward}")
        if abs(self.forward + self.backward + self.weight) > 1e-9:
            raise ScheduleError(
                "memory: forward + backward + weight deltas must sum to 0 (a microbatch frees "
                f"what it allocated), got {self.forward}, {self.backward}, {self.weight}"
            )
        if self.backward > 0 or self.weight > 0:
            raise ScheduleError("memory: backward and weight deltas must be <= 0")

    @property
    def deltas(self) -> dict[PassKind, float]:
        """Per compute kind, what the pass adds (a fused BW: B's and W's together); the one
        table the simulator, the replay, the greedy and the local search step memory by."""
        return {PassKind.F: self.forward, PassKind.B: self.backward, PassKind.W: self.weight,
                PassKind.BW: self.backward + self.weight}


def parse_memory_model(text: str) -> MemoryModel:
    """Parse ``"F,B,W"`` (the CLI's ``--memory-model``): chunk-activations each pass adds."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3:
        raise ScheduleError(f"--memory-model must be F,B,W (e.g. 1,0,-1 or 1,-0.75,-0.25), got {text!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ScheduleError(f"--memory-model must be numbers, got {text!r}") from None
    return MemoryModel(*values)
