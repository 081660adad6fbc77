"""The CLI's per-stage cost forms (``--stage-costs``): inline text or a JSON file.

Inline, one ``F,B,W`` triple per global stage in stage order, ``/`` between stages, and
optionally a last item of one number, the hop time::

    --stage-costs 1,1,1/1,1,1/1,1,1/2,2,2         p = 2 under a V: stage 3 (rank 0's chunk 1,
    --stage-costs 1,1,1/1,1,1/1,1,1/2,2,2/0.1     with the LM head) twice as heavy; one hop 0.1

A file (a name ending in ``.json``) holds ``{"forward": [...], "backward": [...],
"weight": [...], "comm": 0.1}`` (``comm`` optional), each list one value per global stage.
Every time is one pass of that stage for one microbatch (:meth:`.Costs.for_stages`). A
one-chunk schedule (1F1B, ZB-1P) takes p stages, or a two-chunk model's 2p stages, which it
reads in pairs (its stage k: stages 2k and 2k + 1, the same layers).
"""
from __future__ import annotations

import json
from pathlib import Path

from .actions import ScheduleError
from .costs import Costs
from .placement import Layout, Placement

__all__ = ["parse_stage_costs", "STAGE_COSTS_FORM"]

STAGE_COSTS_FORM = ("F,B,W/F,B,W/... (one F,B,W per global stage, optionally /COMM last, "
                    "e.g. 1,1,1/1,1,1/1,1,1/2,2,2/0.1) or FILE.json with "
                    '{"forward": [...], "backward": [...], "weight": [...], "comm": 0}')
"""The valid forms, as errors and the CLI's help name them."""


def parse_stage_costs(text: str, placement: Placement, option: str = "--stage-costs") -> Costs:
    """Per-stage :class:`.Costs` from ``text`` (module doc) for ``placement``'s stages; a
    ScheduleError naming ``option`` and the valid forms for anything else."""
    try:
        if text.strip().endswith(".json"):
            forward, backward, weight, comm = _from_file(Path(text.strip()))
        else:
            forward, backward, weight, comm = _from_text(text)
        if placement.chunks == 1 and len(forward) == 2 * placement.num_stages:
            placement = Placement(placement.ranks, Layout.V)  # read in pairs (pass_times)
        if len(forward) != placement.num_stages:
            raise ScheduleError(
                f"gives {len(forward)} stages, the schedule has {placement.num_stages} "
                f"({placement.ranks} ranks x {placement.chunks} chunks, "
                f"{placement.layout.value} layout)")
        return Costs.for_stages(placement, forward, backward, weight, comm)
    except ScheduleError as err:
        raise ScheduleError(f"{option} {text!r}: {err}; valid forms: {STAGE_COSTS_FORM}") \
            from None


def _from_text(text: str) -> tuple[list, list, list, float]:
    items = [item.strip() for item in text.split("/")]
    comm = 0.0
    if len(items) > 1 and "," not in items[-1]:
        comm = _number(items.pop())
    triples = [[_number(x) for x in item.split(",")] for item in items]
    if any(len(t) != 3 for t in triples):
        raise ScheduleError("every stage needs three numbers, F,B,W")
    forward, backward, weight = (list(column) for column in zip(*triples))
    return forward, backward, weight, comm


def _from_file(path: Path) -> tuple[list, list, list, float]:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ScheduleError(f"cannot read the file ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ScheduleError(f"not JSON ({err})") from None
    if not isinstance(data, dict) or not {"forward", "backward", "weight"} <= data.keys() \
            or not data.keys() <= {"forward", "backward", "weight", "comm"}:
        raise ScheduleError("the file must hold an object with the keys forward, backward, "
                            "weight (lists) and optionally comm")
    lists = [data[k] for k in ("forward", "backward", "weight")]
    if any(not isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1:
        raise ScheduleError("forward, backward and weight must be lists of one length")
    return (*lists, data.get("comm", 0.0))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ScheduleError(f"{text!r} is not a number") from None
