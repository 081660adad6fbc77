"""Measured pass times for the planner (``vshape plan --profile FILE``), instead of the FLOP model.

The file is YAML (or JSON, which YAML reads too)::

    # seconds of one transformer layer's passes, measured at one sequence length
    seq_length: 3072
    p2p_seconds: 0.0004              # optional: one pipeline hop at micro batch size 1
                                     # (scaled by the micro batch size; else the bandwidth model)
    measurements:                    # one entry per measured (micro batch, TP) setting
      - micro_batch_size: 1
        tensor_parallel: 1
        layer: {F: 0.0112, B: 0.0118, W: 0.0101}   # TP communication included
        head: {F: 0.0031, B: 0.0062}               # optional: final norm, LM head, loss
        embedding: {F: 0.0001, B: 0.0001}          # optional
      - micro_batch_size: 2
        tensor_parallel: 2
        layer: {F: 0.0119, B: 0.0125, W: 0.0104}

F, B and W are what the runtime's ``PassProfile`` measures per stage (``stage_costs()``:
median seconds per pass kind); divide a stage's numbers by its layer count for ``layer``. A
setting that was not measured is scaled from the nearest one: linearly in micro batch size,
inversely in TP (same TP preferred), which ignores how efficiency changes with size; the
plan's ``costs`` column says which measurement was used. Parts left out (head, embedding)
come from the analytic model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cost import PartTimes, PassTimes

__all__ = ["Measurement", "MeasuredProfile", "load_profile"]

_KINDS = {"F": "forward", "B": "backward", "W": "weight"}


@dataclass(frozen=True)
class Measurement:
    """Pass times measured at one (micro batch size, TP) setting."""

    micro_batch_size: int
    tensor_parallel: int
    layer: PassTimes
    head: PassTimes | None = None
    embedding: PassTimes | None = None

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.tensor_parallel < 1:
            raise ValueError(f"profile: micro_batch_size and tensor_parallel must be >= 1, got "
                             f"{self.micro_batch_size}, {self.tensor_parallel}")
        if min(self.layer.forward, self.layer.backward, self.layer.weight) <= 0:
            raise ValueError("profile: a layer's F, B and W must all be > 0 (measure a schedule "
                             "with a B/W split, e.g. v-half)")


@dataclass(frozen=True)
class MeasuredProfile:
    """A profile file's contents."""

    seq_length: int
    """The sequence length the times hold for; a plan for another one is refused."""
    measurements: tuple[Measurement, ...]
    p2p_seconds: float | None = None
    """One pipeline hop at micro batch size 1 (scaled by the micro batch size); None: the
    bandwidth model."""
    path: str = ""

    def __post_init__(self) -> None:
        if not self.measurements:
            raise ValueError(f"profile {self.path!r}: no measurements")
        if self.p2p_seconds is not None and self.p2p_seconds < 0:
            raise ValueError(f"profile {self.path!r}: p2p_seconds must be >= 0")

    def times(self, tp: int, micro_batch_size: int, fallback: PartTimes) -> PartTimes:
        """Times at (tp, micro_batch_size), scaled from the nearest measurement; ``fallback``
        (analytic) fills the parts the profile lacks."""
        def distance(m: Measurement) -> tuple:
            return (m.tensor_parallel != tp, abs(m.tensor_parallel - tp),
                    abs(m.micro_batch_size - micro_batch_size))

        base = min(self.measurements, key=distance)
        factor = micro_batch_size / base.micro_batch_size * base.tensor_parallel / tp
        exact = factor == 1 and base.tensor_parallel == tp
        label = f"profile {Path(self.path).name} b={base.micro_batch_size} t={base.tensor_parallel}"
        return PartTimes(
            base.layer.scaled(factor),
            base.embedding.scaled(factor) if base.embedding else fallback.embedding,
            base.head.scaled(factor) if base.head else fallback.head,
            label if exact else label + " scaled",
        )


def _passes(data, where: str, need_weight: bool) -> PassTimes:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping like {{F: 0.01, B: 0.01, W: 0.01}}")
    unknown = sorted(set(data) - set(_KINDS))
    missing = [k for k in (_KINDS if need_weight else ("F", "B")) if k not in data]
    if unknown or missing:
        raise ValueError(f"{where}: keys must be F, B{', W' if need_weight else ' (and W)'}; "
                         f"unknown {unknown}, missing {missing}")
    try:
        return PassTimes(*(float(data.get(k, 0.0)) for k in _KINDS))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: pass times must be numbers of seconds ({err})") from None


def _measurement(entry, where: str) -> Measurement:
    valid = {"micro_batch_size", "tensor_parallel", "layer", "head", "embedding"}
    if not isinstance(entry, dict) or "layer" not in entry:
        raise ValueError(f"{where} must be a mapping with micro_batch_size, tensor_parallel "
                         "and layer")
    unknown = sorted(set(entry) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(sorted(valid))}")
    optional = {k: _passes(entry[k], f"{where}.{k}", False) for k in ("head", "embedding")
                if k in entry}
    return Measurement(int(entry.get("micro_batch_size", 1)), int(entry.get("tensor_parallel", 1)),
                       _passes(entry["layer"], f"{where}.layer", True), **optional)


def load_profile(path: str | Path) -> MeasuredProfile:
    """Read a profile file (format in the module docstring); errors name the bad entry."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--profile {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text())
    where = f"profile {str(path)!r}"
    valid = {"seq_length", "p2p_seconds", "measurements"}
    if not isinstance(data, dict) or "seq_length" not in data or "measurements" not in data:
        raise ValueError(f"{where} must be a mapping with seq_length and measurements (see "
                         "docs/plan.md)")
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(sorted(valid))}")
    entries = data["measurements"]
    if not isinstance(entries, list):
        raise ValueError(f"{where}: measurements must be a list")
    hop = data.get("p2p_seconds")
    return MeasuredProfile(int(data["seq_length"]),
                           tuple(_measurement(e, f"{where} measurements[{i}]")
                                 for i, e in enumerate(entries)),
                           None if hop is None else float(hop), str(path))
