"""Pass costs and the per-pass memory model used by the simulator."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

from .actions import PassKind, ScheduleError
from .placement import Placement

__all__ = ["Costs", "PassTimes", "MemoryModel", "COSTS_FORM", "pass_time", "parse_costs",
           "parse_memory_model"]

Number = Union[int, float]


COSTS_FORM = "F,B,W or F,B,W,COMM: finite numbers, F, B, W > 0 and COMM >= 0 (e.g. 1,1,1,0)"
"""The CLI's ``--costs`` form, as its errors and help name it."""


def pass_time(value, name: str, zero_ok: bool = False) -> float:
    """``value`` as a float when it is a finite number > 0 (>= 0 where ``zero_ok``: a hop, or
    a part of a pass such as the LM head's W), else a ScheduleError naming ``name``.

    The one check of a time, wherever times enter (the CLI's --costs and --stage-costs, profile
    files, the costs a re-plan measured): NaN compares false to everything, so it would slip
    past ``> 0`` and a simulator fed it reports ``makespan nan`` with a bubble of 0; an
    infinite time makes every schedule equally infinite and the search's choice meaningless.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not (value >= 0 if zero_ok else value > 0):
        raise ScheduleError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                            f"got {value!r}")
    return float(value)


def _times(name: str, values) -> tuple[float, ...]:
    """Every one of ``values`` checked by :func:`pass_time`; the error lists them all."""
    values = tuple(values)
    try:
        return tuple(pass_time(v, name) for v in values)
    except ScheduleError:
        raise ScheduleError(f"costs: every {name} time must be a finite number > 0, got "
                            f"{list(values)}") from None


def _per_rank(name: str, value: Number | Sequence[Number], ranks: int) -> tuple:
    values = [value] * ranks if isinstance(value, (int, float)) else list(value)
    if len(values) != ranks:
        raise ScheduleError(f"costs: {name} has {len(values)} per-rank values for {ranks} ranks")
    return tuple(values)


class PassTimes(NamedTuple):
    """How long one pass of one stage takes for one microbatch, by kind."""

    forward: float
    backward: float
    weight: float
    fused: float
    """A fused BW: B and W together."""


@dataclass(frozen=True)
class Costs:
    """Pass times: per rank, or per pipeline stage.

    ``forward``, ``backward`` and ``weight`` are one rank's *whole* share (what one 1F1B stage
    costs). By default each of a rank's chunks holds half of that share, so a chunk's pass
    takes half (:meth:`build`). Where the chunks differ (under a V rank 0 holds the embedding
    in stage 0 and the LM head and loss in stage 2p-1), ``stages`` holds each global stage's
    own pass times (:meth:`for_stages`) and the per-rank fields are their sums. Read a pass's
    time through :meth:`pass_times` (per rank and chunk) or :meth:`stage_times` (per stage).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    """Input-gradient backward (B)."""
    weight: tuple[float, ...]
    """Weight-gradient backward (W); a fused BW costs backward + weight."""
    comm: float = 0.0
    """Time of one pipeline hop; local hand-offs (the V's turn, the loss) cost nothing."""
    stages: tuple[tuple[float, float, float], ...] | None = None
    """Per global stage, (F, B, W) of one pass of that stage; None: every chunk of a rank
    takes its share of the rank's times."""

    def __post_init__(self) -> None:
        """Every time a finite number > 0 and the hop >= 0 (:func:`pass_time`), however the
        costs were made: a ScheduleError names the bad one before anything is timed."""
        for name, kind in (("forward (F)", "forward"), ("backward (B)", "backward"),
                           ("weight (W)", "weight")):
            object.__setattr__(self, kind, _times(name, getattr(self, kind)))
        object.__setattr__(self, "comm", pass_time(self.comm, "costs: comm", zero_ok=True))
        if self.stages is not None:
            if any(len(s) != 3 for s in self.stages):
                raise ScheduleError(f"costs: every stage needs [F, B, W], got {self.stages!r}")
            object.__setattr__(self, "stages", tuple(
                zip(*(_times(name, column) for name, column in
                      zip(("per-stage forward (F)", "per-stage backward (B)",
                           "per-stage weight (W)"), zip(*self.stages))))))

    @classmethod
    def build(cls, ranks: int, forward=1.0, backward=1.0, weight=1.0, comm=0.0) -> "Costs":
        """Costs from single values (same on every rank) or per-rank lists."""
        return cls(
            forward=_per_rank("forward (F)", forward, ranks),
            backward=_per_rank("backward (B)", backward, ranks),
            weight=_per_rank("weight (W)", weight, ranks),
            comm=comm,
        )

    @classmethod
    def for_stages(cls, placement: Placement, forward: Sequence[Number],
                   backward: Sequence[Number], weight: Sequence[Number],
                   comm: Number = 0.0) -> "Costs":
        """Costs from per-stage times: ``forward[s]`` is one forward pass of global stage ``s``
        for one microbatch (not a rank's share), likewise ``backward`` (B) and ``weight`` (W).

        Where every stage costs the same this is :meth:`build`'s uniform form (each rank's
        chunks summed): equal, same hash, same serialisation. Stages that halve per-rank
        shares time bit for bit as those shares do, but stay per stage: 1F1B's stage k reads
        stages 2k and 2k + 1 (:meth:`pass_times`), not the V's rank k share.
        """
        count = placement.num_stages
        times = []
        for name, values in (("forward (F)", forward), ("backward (B)", backward),
                             ("weight (W)", weight)):
            values = [values] if isinstance(values, (int, float)) else list(values)
            if len(values) != count:
                raise ScheduleError(
                    f"costs: {name} has {len(values)} per-stage values for {count} stages "
                    f"({placement.ranks} ranks x {placement.chunks} chunks, "
                    f"{placement.layout.value} layout)")
            times.append(_times(name, values))  # before they are summed per rank
        per_stage = tuple(zip(*times))
        chunks = [[per_stage[placement.stage_of(r, c)] for c in range(placement.chunks)]
                  for r in range(placement.ranks)]
        sums = [tuple(sum(t[k] for t in mine) for mine in chunks) for k in range(3)]
        uniform = len(set(per_stage)) == 1  # not per rank: the per-rank form is a rank's
        return cls(*sums, comm=comm, stages=None if uniform else per_stage)  # share anywhere

    def pass_times(self, placement: Placement) -> tuple[tuple[PassTimes, ...], ...]:
        """``[rank][chunk]``: how long one pass of that chunk takes, by kind, under
        ``placement``; what the simulator, constructions and bounds time passes by.

        Per-stage costs are the model's layers in stage order, so any placement of as many
        stages reads them (a V's and the interleaved layout's 2p alike); one with fewer
        stages sums consecutive ones (1F1B's stage k: stages 2k and 2k + 1). Raises
        ScheduleError when the costs were given for another number of ranks, or of stages
        that does not divide that way."""
        if len(self.forward) != placement.ranks:
            raise ScheduleError(
                f"costs are given for {len(self.forward)} ranks, schedule has {placement.ranks}")
        share = placement.chunks
        if self.stages is None:
            return tuple(
                (PassTimes(f / share, b / share, w / share, (b + w) / share),) * share
                for f, b, w in zip(self.forward, self.backward, self.weight))
        stages = self._cut_into(placement.num_stages)
        return tuple(tuple(PassTimes(f, b, w, b + w) for f, b, w in
                           (stages[placement.stage_of(r, c)] for c in range(share)))
                     for r in range(placement.ranks))

    def _cut_into(self, count: int) -> tuple[tuple[float, float, float], ...]:
        """The per-stage times for ``count`` stages: as given, or, where a placement cuts the
        same layers into fewer stages (1F1B's p against a V's 2p), each of its stages the sum
        of the consecutive given stages it holds."""
        given = len(self.stages)
        if given % count:
            raise ScheduleError(f"costs are given for {given} stages, schedule has {count}")
        k = given // count
        if k == 1:
            return self.stages
        return tuple(tuple(sum(t[i] for t in self.stages[s * k:(s + 1) * k]) for i in range(3))
                     for s in range(count))

    def stage_times(self, placement: Placement) -> tuple[PassTimes, ...]:
        """Per global stage, how long one of its passes takes (:meth:`pass_times`)."""
        per_chunk = self.pass_times(placement)
        return tuple(per_chunk[r][c] for r, c in map(placement.locate,
                                                     range(placement.num_stages)))

    def as_list(self) -> list:
        """JSON-friendly form: ``[F, B, W, COMM]``, scalars when uniform, per-rank lists
        otherwise; per-stage costs add a fifth item, ``[[F, B, W] per stage]``."""

        def squash(values):
            return values[0] if len(set(values)) == 1 else list(values)

        out = [squash(self.forward), squash(self.backward), squash(self.weight), self.comm]
        return out if self.stages is None else out + [[list(s) for s in self.stages]]

    @classmethod
    def from_list(cls, values: Sequence, ranks: int) -> "Costs":
        """The inverse of :meth:`as_list`."""
        if len(values) not in (4, 5):
            raise ScheduleError(f"costs list must be [F, B, W, COMM] or [F, B, W, COMM, "
                                f"stages], got {values!r}")
        costs = cls.build(ranks, *values[:4])
        if len(values) == 4:
            return costs
        return dataclasses.replace(costs, stages=tuple(tuple(s) for s in values[4]))


def parse_costs(text: str, ranks: int, option: str = "--costs") -> Costs:
    """Parse ``"F,B,W[,COMM]"`` (the CLI form) into :class:`Costs`; a ScheduleError naming
    ``option`` and the valid form for anything else."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) not in (3, 4):
            raise ScheduleError("needs three or four numbers")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ScheduleError("not numbers") from None
        return Costs.build(ranks, *values)
    except ScheduleError as err:
        raise ScheduleError(f"{option} {text!r}: {err}; valid form: {COSTS_FORM}") from None


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
        values = (self.forward, self.backward, self.weight)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ScheduleError(f"memory: forward, backward and weight deltas must be finite "
                                f"numbers, got {', '.join(map(repr, values))}")
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
    try:
        return MemoryModel(*values)
    except ScheduleError as err:
        raise ScheduleError(f"--memory-model {text!r}: {err}") from None
