"""The fixed orders: each named block repeated and squeezed (paper, sections 3-4), and
megatron's interleaved 1F1B. Cost-independent; what ``--variant paper`` reproduces and what every
cost-aware search keeps as a candidate."""
from __future__ import annotations

from ..model.actions import Action, PassKind, ScheduleError
from ..model.placement import Layout, Placement
from ..model.provenance import Provenance, step
from ..names import INTERLEAVED_1F1B
from ..model.schedule import Schedule
from .blocks import ONE_F_ONE_B, V_HALF, V_MIN, V_ZB, ZB_1P, BlockFamily
from .compose import compose

__all__ = ["FAMILIES", "paper_schedule", "interleaved_1f1b"]

FAMILIES: dict[str, BlockFamily] = {f.name: f for f in (ONE_F_ONE_B, ZB_1P, V_MIN, V_HALF, V_ZB)}
"""The named building blocks."""


def paper_schedule(name: str, ranks: int, microbatches: int) -> Schedule:
    """The named block's order (1f1b, zb-1p, v-min, v-half, v-zb), or interleaved 1F1B."""
    if name == INTERLEAVED_1F1B:
        return interleaved_1f1b(ranks, microbatches)
    family = FAMILIES[name]
    block = family.build(ranks)
    orders = compose(block, microbatches)
    return Schedule(
        name=name,
        placement=Placement(ranks, family.layout),
        microbatches=microbatches,
        rank_actions=orders,
        memory_bound=block.memory_bound,
        provenance=Provenance((step("paper block", family=name, interval=block.interval,
                                    bound=block.memory_bound),)),
    )


def interleaved_1f1b(ranks: int, microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B with two chunks on the loop placement.

    Forwards go in groups of p microbatches (chunk 0 of the group, then chunk 1); rank r warms up
    with 2(p-r-1) + p forwards, then alternates one forward and one fused backward.
    """
    p, m = ranks, microbatches
    if m % p:
        raise ScheduleError(
            f"interleaved-1f1b needs microbatches divisible by ranks (as megatron-core requires), "
            f"got microbatches={m}, ranks={p}; use a multiple of {p}, e.g. {p * max(1, m // p)}"
        )
    placement = Placement(p, Layout.LOOP)
    groups = [range(g, min(g + p, m)) for g in range(0, m, p)]
    fwd = [(c, k) for grp in groups for c in (0, 1) for k in grp]
    bwd = [(c, k) for grp in groups for c in (1, 0) for k in grp]
    orders = []
    for r in range(p):
        warm = min(len(fwd), 2 * (p - r - 1) + p)
        seq = [Action(PassKind.F, placement.stage_of(r, c), k) for c, k in fwd[:warm]]
        back = [Action(PassKind.BW, placement.stage_of(r, c), k) for c, k in bwd]
        rest = [Action(PassKind.F, placement.stage_of(r, c), k) for c, k in fwd[warm:]]
        for j, b in enumerate(back):
            if j < len(rest):
                seq.append(rest[j])
            seq.append(b)
        orders.append(tuple(seq))
    return Schedule(
        name=INTERLEAVED_1F1B,
        placement=placement,
        microbatches=m,
        rank_actions=tuple(orders),
        memory_bound=(3 * p - 1) / 2,
        provenance=Provenance((step("interleaved 1F1B"),)),
    )
