"""Building blocks as data (paper, sections 3-4).

A building block is the pattern of one microbatch's passes over all ranks: for every rank, the
slot of each pass of microbatch 0. Microbatch k adds ``interval * k``. W passes are placed into
the next free slot after their B, first in first out (see :func:`.compose.repeat`). Only the
*order* a block induces on each rank matters; timing comes later from the simulator.

V blocks (two chunks, interval 6: F0 F1 B1 B0 W W per microbatch per rank), slots for rank i::

    block   F (chunk 0)   F (chunk 1)   B (chunk 1)       B (chunk 0)       memory (units)
    V-Min   i             2p-1-i        2p+g+i            4p+g-1-i          (p+4)//3   g=2 if p%3==0
    V-Half  2i            3p-2-i        3p+g+2i-1         6p+g-2-i          (p+2)//2   g=3 if p%2==0
    V-ZB    6i            6p-3          6(p+i-1)+4        6(2p-1)+1         p

The gap g keeps the four passes of a rank in distinct slots modulo 6. V-ZB's offsets give
chunk 0 a lifespan of 2p-1-i microbatches and chunk 1 one of i+1: the sum, 2p chunk
activations, is 1F1B's memory, and the warm-up/cool-down passes make it bubble-free.

Single-chunk baselines use the same machinery: 1F1B (F, fused BW; interval 2) and ZB-1P
(F, B, W; interval 3) with rank i holding p-i microbatches in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..model.actions import PassKind, ScheduleError
from .. import names
from ..model.placement import Layout

__all__ = ["BuildingBlock", "BlockFamily", "V_MIN", "V_HALF", "V_ZB", "ONE_F_ONE_B", "ZB_1P"]

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW

# A block's slots: for each rank, ((kind, chunk), slot) pairs for microbatch 0.
RankSlots = tuple[tuple[tuple[PassKind, int], int], ...]


@dataclass(frozen=True)
class BuildingBlock:
    """One concrete block for a given number of ranks."""

    name: str
    layout: Layout
    ranks: int
    interval: int
    """Slots between consecutive microbatches (the repeat interval T)."""
    slots: tuple[RankSlots, ...]
    """Per rank: slot of each non-W pass of microbatch 0. W passes are placed by ``repeat``."""
    split_backward: bool
    """True when B and W are separate passes (W placed FIFO); False for a fused BW."""
    memory_bound: float
    """Stated peak activation memory, in units (one microbatch, one rank's whole share)."""
    reorders: tuple[str, ...]
    """Reorder variants that ``compose`` tries, fastest kept (names in ``compose.REORDERS``)."""

    def __post_init__(self) -> None:
        for rank, rank_slots in enumerate(self.slots):
            residues = [slot % self.interval for _, slot in rank_slots]
            if len(set(residues)) != len(residues):
                raise ScheduleError(
                    f"block {self.name}: two passes share a slot modulo {self.interval} on rank "
                    f"{rank}: {rank_slots}"
                )

    @property
    def memory_bound_chunks(self) -> int:
        """The bound in chunk-activations (the unit the list scheduler counts in)."""
        return round(self.memory_bound * self.layout.chunks)


@dataclass(frozen=True)
class BlockFamily:
    """A named block for every p: the data instance that a schedule name refers to."""

    name: str
    layout: Layout
    interval: int
    rank_slots: Callable[[int, int], dict]
    """(p, rank) -> {(kind, chunk): slot} for microbatch 0."""
    memory_bound: Callable[[int], float]
    split_backward: bool = True
    reorders: Callable[[int], tuple[str, ...]] = lambda p: ("plain",)
    """p -> the reorder variants ``compose`` tries for this block (see ``compose.REORDERS``)."""

    def build(self, ranks: int) -> BuildingBlock:
        if not isinstance(ranks, int) or ranks < 2:
            raise ScheduleError(
                f"ranks must be an integer >= 2 for {self.name}, got {ranks!r}: with one rank "
                "there is no pipeline (use plain data parallel training)"
            )
        slots = tuple(
            tuple(sorted(self.rank_slots(ranks, r).items(), key=lambda kv: kv[1]))
            for r in range(ranks)
        )
        return BuildingBlock(
            name=self.name,
            layout=self.layout,
            ranks=ranks,
            interval=self.interval,
            slots=slots,
            split_backward=self.split_backward,
            memory_bound=self.memory_bound(ranks),
            reorders=self.reorders(ranks),
        )


def _v_min(p: int, i: int) -> dict:
    g = 2 if p % 3 == 0 else 0
    return {(F, 0): i, (F, 1): 2 * p - 1 - i, (B, 1): 2 * p + g + i, (B, 0): 4 * p + g - 1 - i}


def _v_half(p: int, i: int) -> dict:
    g = 3 if p % 2 == 0 else 0
    return {
        (F, 0): 2 * i,
        (F, 1): 3 * p - 2 - i,
        (B, 1): 3 * p + g + 2 * i - 1,
        (B, 0): 6 * p + g - 2 - i,
    }


def _v_zb(p: int, i: int) -> dict:
    return {(F, 0): 6 * i, (F, 1): 6 * p - 3, (B, 1): 6 * (p + i - 1) + 4, (B, 0): 6 * (2 * p - 1) + 1}


def _one_f_one_b(p: int, i: int) -> dict:
    return {(F, 0): 0, (BW, 0): 2 * (p - 1 - i) + 1}


def _zb_1p(p: int, i: int) -> dict:
    return {(F, 0): 0, (B, 0): 3 * (p - 1 - i) + 1}


def _v_half_reorders(p: int) -> tuple[str, ...]:
    # Measured over p = 2..24 and m = 1..8p: the cool-down reorder is never worse than the plain
    # repeated order; list scheduling in block order beats it only for p <= 4 (p = 2: 0.04 vs
    # 0.11 bubble at m = 4) and costs seconds at p = 64, so it is tried only there.
    return ("cooldown", "head") if p <= 4 else ("cooldown",)


def _named(name: str) -> dict:
    """A named family's facts as the one table has them (schedule/names.py): its layout and
    whether W is split from B."""
    info = names.schedule_info(name)
    return dict(name=name, layout=info.layout, split_backward=info.splits_w)


V_MIN = BlockFamily(**_named(names.V_MIN), interval=6, rank_slots=_v_min,
                    memory_bound=lambda p: (p + 4) // 3, reorders=lambda p: ("cooldown",))
V_HALF = BlockFamily(**_named(names.V_HALF), interval=6, rank_slots=_v_half,
                     memory_bound=lambda p: (p + 2) // 2, reorders=_v_half_reorders)
# V-ZB is not built from its repeated block (neither is the reference's): the hand-written
# ZB-V order reaches zero bubble per rank. The block data still describes it (memory, offsets)
# and can be list-scheduled ("head") for comparison.
V_ZB = BlockFamily(**_named(names.V_ZB), interval=6, rank_slots=_v_zb, memory_bound=lambda p: p,
                   reorders=lambda p: ("zbv",))
ONE_F_ONE_B = BlockFamily(**_named(names.ONE_F_ONE_B), interval=2, rank_slots=_one_f_one_b,
                          memory_bound=lambda p: p)
# ZB-1P keeps its plain repeated order: deferring W passes in unit slots (zero bubble's ZB-H1
# idea) gains at uniform costs (0.094 vs 0.111 bubble, p=4, m=16) but loses to 1F1B once
# F, B and W differ (0.172 vs 0.121 at costs 1,1.2,0.8), while the plain order stays robust.
ZB_1P = BlockFamily(**_named(names.ZB_1P), interval=3, rank_slots=_zb_1p, memory_bound=lambda p: p)
