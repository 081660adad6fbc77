"""A memory limit as users give it: a fraction of 1F1B's peak, or bytes per GPU.

The search works in units (one microbatch's activations of one rank's layer share, see
:func:`memory_limit_units`). A fraction converts once p and m are known; bytes convert once
the bytes of a unit are known too, which training measures in its first profiled iterations
(megatron/replan.py). ``MemoryLimit.parse("0.5")`` and ``MemoryLimit.parse("40GiB")`` are what
``--memory-limit`` and Megatron-LM's ``--pipeline-memory-limit`` accept.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .actions import ScheduleError

__all__ = ["MemoryLimit", "parse_bytes", "BYTE_UNITS", "memory_limit_units"]

BYTE_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
              "gb": 1e9, "tb": 1e12}


def parse_bytes(text: str, setting: str) -> float:
    """``"40GiB"`` -> bytes; errors name ``setting`` and the units."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]+)\s*", str(text))
    try:
        value = float(match.group(1)) * BYTE_UNITS[match.group(2).lower()]
    except (AttributeError, ValueError, KeyError):
        raise ScheduleError(f"{setting} must be a number with a unit ({', '.join(BYTE_UNITS)}), "
                            f"got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ScheduleError(f"{setting} must be a finite number of bytes > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class MemoryLimit:
    """Peak activation memory allowed per rank."""

    fraction: float | None = None
    """Of 1F1B's peak on the same p and m (0.5 = half)."""
    bytes: float | None = None
    """Per GPU, for activations (what parameters and optimizer state leave free)."""

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ScheduleError("a memory limit is a fraction of 1F1B's peak or a number of "
                                "bytes: give exactly one")
        if self.fraction is not None and not (math.isfinite(self.fraction) and
                                              self.fraction > 0):
            raise ScheduleError(f"memory limit fraction must be a finite number > 0 (e.g. "
                                f"0.5), got {self.fraction!r}")

    @classmethod
    def parse(cls, text: str, setting: str = "--memory-limit") -> "MemoryLimit":
        """``"0.5"`` (fraction of 1F1B) or ``"40GiB"`` (bytes); a ScheduleError naming
        ``setting`` and both forms for anything else."""
        try:
            fraction = float(text)
        except ValueError:
            return cls(bytes=parse_bytes(text, setting))
        try:
            return cls(fraction=fraction)
        except ScheduleError:
            raise ScheduleError(f"{setting} must be a fraction of 1F1B's peak, a finite number "
                                f"> 0 (e.g. 0.5), or bytes with a unit (e.g. 40GiB), got "
                                f"{text!r}") from None

    @property
    def needs_activation_bytes(self) -> bool:
        return self.bytes is not None

    def units(self, ranks: int, microbatches: int, activation_bytes: float | None = None) -> float:
        """The limit in units; a byte limit needs ``activation_bytes`` (bytes of one unit)."""
        if self.fraction is not None:
            return memory_limit_units(ranks, microbatches, fraction=self.fraction)
        if activation_bytes is None:
            raise ScheduleError("a memory limit in bytes needs the bytes of one microbatch's "
                                "activations of one rank's layer share (measured or given)")
        return memory_limit_units(ranks, microbatches, limit_bytes=self.bytes,
                                  activation_bytes=activation_bytes)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of 1F1B"
        return f"{self.bytes / 2**30:.4g} GiB"


def memory_limit_units(ranks: int, microbatches: int, fraction: float | None = None,
                       limit_bytes: float | None = None, activation_bytes: float | None = None) -> float:
    """A memory limit in units (one microbatch's activations of one rank's share of layers).

    Either ``fraction`` of 1F1B's peak (min(p, m) units), or ``limit_bytes`` together with
    ``activation_bytes`` (the bytes of one such unit).
    """
    if fraction is not None:
        if limit_bytes is not None:
            raise ScheduleError("give the memory limit as a fraction of 1F1B or in bytes, not both")
        if not fraction > 0:
            raise ScheduleError(f"memory limit fraction must be > 0 (e.g. 0.5), got {fraction!r}")
        return fraction * min(ranks, microbatches)
    if limit_bytes is None or activation_bytes is None:
        raise ScheduleError("a memory limit in bytes needs the per-microbatch activation bytes too")
    if limit_bytes <= 0 or activation_bytes <= 0:
        raise ScheduleError(f"memory limit bytes and activation bytes must be > 0, got "
                            f"{limit_bytes!r}, {activation_bytes!r}")
    return limit_bytes / activation_bytes
