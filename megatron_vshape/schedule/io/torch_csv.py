"""CSV in torch.distributed.pipelining's action format, so schedules run in PyTorch/torchtitan.

One row per rank, one cell per action: ``{stage}{type}{microbatch}`` with type F (forward),
I (input gradient: our B), W (weight gradient) or B (full backward: our fused BW), e.g.
``0F3,7I2,7W2,3B1``. Only compute actions are written: torch lowers communication itself.
"""
from __future__ import annotations

import csv
import io
import re

from ..model.actions import Action, PassKind, ScheduleError
from ..model.placement import Layout, Placement
from ..model.schedule import Schedule

__all__ = ["to_torch_csv", "from_torch_csv"]

_TO_TORCH = {PassKind.F: "F", PassKind.B: "I", PassKind.W: "W", PassKind.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_CELL = re.compile(r"^(\d+)([FIWB])(\d+)$")


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule's compute actions as torch CSV text."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for r in range(schedule.ranks):
        writer.writerow(f"{a.stage}{_TO_TORCH[a.kind]}{a.microbatch}" for a in schedule.compute_actions(r))
    return buffer.getvalue()


def _infer_layout(rows: list[list[Action]]) -> Layout:
    p = len(rows)
    stages = [{a.stage for a in row} for row in rows]
    for layout in (Layout.SINGLE, Layout.V, Layout.LOOP):
        placement = Placement(p, layout)
        wanted = [{placement.stage_of(r, c) for c in range(layout.chunks)} for r in range(p)]
        if all(s <= w for s, w in zip(stages, wanted)) and set().union(*stages) == set().union(*wanted):
            return layout
    raise ScheduleError("CSV stages fit none of the layouts single, v (r, 2p-1-r), loop (r, p+r)")


def from_torch_csv(text: str, name: str = "imported") -> Schedule:
    """Read torch CSV text back into a :class:`Schedule` (layout inferred from the stages)."""
    rows: list[list[Action]] = []
    for line_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        actions = []
        for cell in (c.strip() for c in row):
            if not cell:
                continue
            match = _CELL.match(cell)
            if match is None:
                raise ScheduleError(f"CSV row {line_no}: cannot read {cell!r} (expected e.g. 0F3, 7I2, 7W2, 3B1)")
            stage, kind, mb = match.groups()
            actions.append(Action(_FROM_TORCH[kind], int(stage), int(mb)))
        rows.append(actions)
    if len(rows) < 2:
        raise ScheduleError(f"CSV has {len(rows)} rank rows; a pipeline needs at least 2")
    microbatches = 1 + max(a.microbatch for row in rows for a in row)
    placement = Placement(len(rows), _infer_layout(rows))
    return Schedule(name, placement, microbatches, tuple(tuple(r) for r in rows))
