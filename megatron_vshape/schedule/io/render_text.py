"""Text renderings: the time grid (paper-style figure in characters) and the step list.

Grid cells are one chunk-pass long (unit costs); letters follow the paper's figures: F/B/W for
chunk 0 (the V's down-leg), f/b/w for chunk 1, ``X``/``x`` for a fused BW, ``.`` for idle::

    rank 0 | F0 F1 F2 f0 b0 w0 ...
"""
from __future__ import annotations

from ..model.actions import PassKind
from ..model.schedule import Schedule

__all__ = ["pass_label", "render_grid", "render_steps"]

_LETTER = {PassKind.F: "F", PassKind.B: "B", PassKind.W: "W", PassKind.BW: "X"}


def pass_label(schedule: Schedule, action) -> str:
    """Short label of a compute action: letter by pass (lower case for chunk 1) + microbatch."""
    chunk = schedule.placement.locate(action.stage)[1]
    letter = _LETTER[action.kind]
    return f"{letter.lower() if chunk else letter}{action.microbatch}"


def render_grid(schedule: Schedule, start, end, width: int | None = None) -> str:
    """One row per rank; each cell is one chunk-pass slot of the unit-cost timing ``start``."""
    slot = min(e - s for ends, starts in zip(end, start) for s, e in zip(starts, ends))
    cell = max(len(pass_label(schedule, a)) for r in range(schedule.ranks)
               for a in schedule.compute_actions(r)) + 1
    rows = []
    for r in range(schedule.ranks):
        line: list[str] = []
        for action, s, e in zip(schedule.compute_actions(r), start[r], end[r]):
            gap = round(s / slot) - len(line)
            line.extend(["." .ljust(cell)] * gap)
            label = pass_label(schedule, action).ljust(cell * round((e - s) / slot))
            line.extend([label] + [""] * (round((e - s) / slot) - 1))
        text = "".join(line).rstrip()
        rows.append(f"rank {r:>2} | {text[:width] if width else text}")
    return "\n".join(rows)


def render_steps(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """Each rank's actions in order, canonical strings; ``mark`` = (rank, step) is flagged."""
    rows = []
    for r, actions in enumerate(schedule.rank_actions):
        cells = [str(a) for a in actions]
        if mark is not None and mark[0] == r and mark[1] < len(cells):
            cells[mark[1]] = f">>{cells[mark[1]]}<<"
        suffix = "   <-- ERROR HERE" if mark is not None and mark[0] == r else ""
        rows.append(f"rank {r:>2}: {' '.join(cells)}{suffix}")
    return "\n".join(rows)
