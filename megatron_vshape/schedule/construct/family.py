"""The V building-block family the adaptive scheduler searches (paper, adaptive scheduler).

Rank 0's pattern is (F0, F1, B1, B0) in a 6-slot repeat; each next rank adds the offset vector
(k, -1, k, -1): the down-leg passes (chunk-0 F, chunk-1 B) move k slots per rank, the up-leg
passes (chunk-1 F, chunk-0 B) one slot back. Larger k means longer lifespans, so more memory
and fewer bubbles (k = 1 is V-Min's, k = 2 V-Half's). Two-segment offsets use k1 on the first
``split`` ranks and k2 after, which gives the memory levels in between. The three turns
(the V's tip on rank p-1, the loss on rank 0, the tip again for chunk 0's backward) take the
smallest gaps that keep a rank's four passes in distinct slots modulo 6.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..model.actions import PassKind
from .blocks import BuildingBlock
from ..model.placement import Layout

__all__ = ["VOffsets", "v_block", "v_family"]

F, B = PassKind.F, PassKind.B
_INTERVAL = 6
_MAX_OFFSET = 6
"""The largest down-leg offset k tried: k = 6 moves a pass one whole interval per rank (V-ZB's
spacing, chunk-0 F at slot 6i), and its block already holds p units, 1F1B's memory (the
default limit, the top of the frontier); k = 7 holds more (p = 8: 11 units, p = 16: 21)."""
_GAPS = tuple(sorted(itertools.product(range(1, _INTERVAL + 1), repeat=3), key=sum))
"""Turn gaps (g1, g2, g3) in the order they are tried: smallest sum first, then lexicographic."""


@dataclass(frozen=True, order=True)
class VOffsets:
    """Down-leg offset k1 on ranks 1..split, k2 on the ranks after (k1 == k2: one segment)."""

    k1: int
    k2: int
    split: int

    def offset(self, rank: int) -> int:
        return self.k1 if rank <= self.split else self.k2

    def describe(self) -> str:
        if self.k1 == self.k2:
            return f"offsets (k={self.k1}, -1, k={self.k1}, -1)"
        return f"offsets k={self.k1} on ranks 1..{self.split}, k={self.k2} after"


def _down(start: int, p: int, offsets: VOffsets) -> list[int]:
    """Slots of a down-leg pass on ranks 0..p-1: ``start`` on rank 0, then k more per rank."""
    slots = [start]
    for r in range(1, p):
        slots.append(slots[-1] + offsets.offset(r))
    return slots


def _up(start: int, p: int) -> list[int]:
    """Slots of an up-leg pass: ``start`` on rank p-1, one more per rank towards rank 0."""
    return [start + (p - 1 - r) for r in range(p)]


def _slots(p: int, offsets: VOffsets, gaps: tuple[int, int, int]) -> list[dict]:
    g1, g2, g3 = gaps
    f0 = _down(0, p, offsets)
    f1 = _up(f0[p - 1] + g1, p)
    b1 = _down(f1[0] + g2, p, offsets)
    b0 = _up(b1[p - 1] + g3, p)
    return [{(F, 0): f0[r], (F, 1): f1[r], (B, 1): b1[r], (B, 0): b0[r]} for r in range(p)]


def _distinct(rank_slots: list[dict]) -> bool:
    return all(len({s % _INTERVAL for s in slots.values()}) == 4 for slots in rank_slots)


def v_block(p: int, offsets: VOffsets) -> BuildingBlock | None:
    """The block for ``offsets``, or None when no gaps keep the passes apart.

    Gaps are tried in ``_GAPS`` order, the first that keeps every rank's passes apart wins; the
    residues of each prefix of the V (F0 + F1, then + B1) are checked once per prefix.
    """
    f0 = _down(0, p, offsets)
    f1_of, b1_of, ok1, ok2 = {}, {}, {}, {}
    for gaps in _GAPS:
        g1, g2, g3 = gaps
        if g1 not in ok1:
            f1_of[g1] = _up(f0[p - 1] + g1, p)
            ok1[g1] = _apart(f0, f1_of[g1])
        if not ok1[g1]:
            continue
        if (g1, g2) not in ok2:
            b1_of[g1, g2] = _down(f1_of[g1][0] + g2, p, offsets)
            ok2[g1, g2] = _apart(f0, f1_of[g1], b1_of[g1, g2])
        if not ok2[g1, g2]:
            continue
        rank_slots = _slots(p, offsets, gaps)
        if _distinct(rank_slots):
            return BuildingBlock(
                name=f"v-family {offsets.describe()}",
                layout=Layout.V,
                ranks=p,
                interval=_INTERVAL,
                slots=tuple(tuple(sorted(s.items(), key=lambda kv: kv[1])) for s in rank_slots),
                split_backward=True,
                memory_bound=float(p),
                # Cool-down never loses to the plain order in unit slots (898 family blocks,
                # p = 4..16, m = p..4p: 889 wins, 9 ties); compose falls back to the plain order
                # when the cool-down cannot keep the bound, and skips the scoring otherwise.
                reorders=("cooldown",),
            )
    return None


def _apart(*legs: list[int]) -> bool:
    """Whether, on every rank, the given passes fall in distinct slots modulo 6."""
    return all(len({s % _INTERVAL for s in slots}) == len(slots) for slots in zip(*legs))


def v_family(p: int) -> list[VOffsets]:
    """Every offset pair, one- and two-segment, in order.

    Two-segment splits: every ``max(1, p // 8)``-th rank (and the quarters). The split sets how
    many ranks get the longer offsets, so how much memory is spent where: at half of 1F1B's
    memory (p = 16, m = 64, uniform costs) the best quarter split reaches 0.639 x 1F1B's bubble
    after replay, k = 1 on ranks 1..10 then k = 3 reaches 0.585 x.
    """
    step = max(1, p // 8)
    candidates = {p // 4, p // 2, (3 * p) // 4, *range(step, p - 1, step)}
    splits = sorted(s for s in candidates if 1 <= s < p - 1)
    out = [VOffsets(k, k, p) for k in range(1, _MAX_OFFSET + 1)]
    for k1, k2 in itertools.permutations(range(1, _MAX_OFFSET + 1), 2):
        out.extend(VOffsets(k1, k2, s) for s in splits)
    return sorted(out)
