"""Actions: the atoms of a pipeline schedule.

An action is one pass of one microbatch through one *global* stage (paper, section 2): the
forward F, the input-gradient backward B, the weight-gradient backward W, or the fused BW.
The lowering pass (see :mod:`.lower`) adds the point-to-point kinds. Which rank and chunk a
stage lives on is not part of the action: :mod:`.placement` decides that, in one place.

The canonical string ``"3F7"`` (stage 3, forward, microbatch 7) is used in logs, golden files
and error messages, and :func:`parse_action` reads it back exactly.
"""
from __future__ import annotations

import enum
import re
from typing import NamedTuple

__all__ = ["PassKind", "Action", "parse_action", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule or a schedule request is invalid; the message says what and where."""


class PassKind(enum.Enum):
    """What an action does. Compute kinds first, then the kinds added by lowering."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    # Members are singletons compared by identity; hashing by identity keeps the schedule
    # builders' dictionaries fast (Enum's default hashes the member name in Python code).
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW: the passes that take compute time and change memory."""
        return self in _COMPUTE

    @property
    def is_backward(self) -> bool:
        """True for the passes that produce the input gradient (B, or BW which includes it)."""
        return self in (PassKind.B, PassKind.BW)

    @property
    def is_send(self) -> bool:
        return self in (PassKind.SEND_F, PassKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (PassKind.RECV_F, PassKind.RECV_B)

    @property
    def carries_gradient(self) -> bool:
        """True for communication of gradients (flows from stage s+1 to stage s)."""
        return self in (PassKind.SEND_B, PassKind.RECV_B)


_COMPUTE = frozenset({PassKind.F, PassKind.B, PassKind.W, PassKind.BW})
# Longest codes first so that "BW" is not read as "B" followed by garbage.
_CODES = sorted((k.value for k in PassKind), key=len, reverse=True)
_ACTION_RE = re.compile(r"^(\d+)(" + "|".join(_CODES) + r")(\d+)$")


class Action(NamedTuple):
    """One pass of one microbatch through one global stage. Immutable and hashable."""

    kind: PassKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


def parse_action(text: str) -> Action:
    """Parse the canonical form produced by ``str(action)``, e.g. ``"3F7"`` or ``"12BW0"``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        choices = ", ".join(k.value for k in PassKind)
        raise ScheduleError(
            f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one of "
            f"{choices}, e.g. '3F7'"
        )
    stage, code, microbatch = match.groups()
    return Action(PassKind(code), int(stage), int(microbatch))
