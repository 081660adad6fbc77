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
measured setting always replaces the cost model's times; one that was not measured is scaled
from the nearest one (same TP preferred) by how the cost model's times change between the two
settings (:meth:`MeasuredProfile.times`), so the shape model's efficiency changes carry over;
the plan's ``costs`` column says which measurement was used. Parts left out (head, embedding)
come from the analytic model.

``vshape profile`` (:mod:`megatron_vshape.harness.profiling`) writes these files, with
optional memory facts and provenance the planner's time model does not need::

    backward_leftover: 0.3287        # share of a layer's kept bytes B leaves for W
    command: vshape profile --model small ...                     # how to measure it again
    machine: {kind: cpu, device: AMD EPYC, dtype: float32, threads: 1, torch: 2.13.0+cpu}
    measurements:
      - micro_batch_size: 1
        ...
        activation_bytes_per_layer: 306216960   # what one microbatch's forward keeps, per layer

(the bundled configs/profiles/cpu-small.yaml). ``backward_leftover`` is the runtime's measurement
(:func:`..runtime.memory.backward_leftover`) taken on a stack of layers: after B, W still
holds the linear layers' inputs and output gradients, the rest is freed. It may be left out
(older files, hand-written ones), as may the rest of these keys.
:meth:`MeasuredProfile.memory_model` turns it into the simulator's memory model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..configs import find_config
from ..schedule.model.costs import MemoryModel, pass_time
from .cost import PartTimes, PassTimes

__all__ = ["Machine", "Measurement", "MeasuredProfile", "load_profile", "format_profile"]

_KINDS = {"F": "forward", "B": "backward", "W": "weight"}
_DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Machine:
    """Where a profile was measured: provenance only, the planner does not read it."""

    kind: str
    """``cpu`` or ``cuda``."""
    device: str = ""
    """The GPU's name (``torch.cuda.get_device_name``) or the CPU model."""
    dtype: str = ""
    """The layers' dtype (``float32`` on CPU, ``bfloat16`` on GPU)."""
    threads: int | None = None
    """CPU threads torch used (None on GPU)."""
    torch: str = ""
    megatron_core: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _DEVICE_KINDS:
            raise ValueError(f"profile machine.kind must be one of {', '.join(_DEVICE_KINDS)}, "
                             f"got {self.kind!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"profile machine.threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class Measurement:
    """Pass times measured at one (micro batch size, TP) setting."""

    micro_batch_size: int
    tensor_parallel: int
    layer: PassTimes
    head: PassTimes | None = None
    embedding: PassTimes | None = None
    activation_bytes_per_layer: int | None = None
    """Bytes one microbatch's forward keeps for backward, per layer on one TP rank (None: not
    measured)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.tensor_parallel < 1:
            raise ValueError(f"profile: micro_batch_size and tensor_parallel must be >= 1, got "
                             f"{self.micro_batch_size}, {self.tensor_parallel}")
        if self.activation_bytes_per_layer is not None and self.activation_bytes_per_layer <= 0:
            raise ValueError("profile: activation_bytes_per_layer must be > 0, got "
                             f"{self.activation_bytes_per_layer}")
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
    backward_leftover: float | None = None
    """Share (0..1) of a layer's kept bytes still held after B, until W; None: not measured."""
    command: str | None = None
    """The command that measured the file (run it again to re-measure)."""
    machine: Machine | None = None

    def __post_init__(self) -> None:
        if not self.measurements:
            raise ValueError(f"profile {self.path!r}: no measurements")
        if self.p2p_seconds is not None and self.p2p_seconds < 0:
            raise ValueError(f"profile {self.path!r}: p2p_seconds must be >= 0")
        if self.backward_leftover is not None and not 0 <= self.backward_leftover <= 1:
            raise ValueError(f"profile {self.path!r}: backward_leftover must be a fraction "
                             f"between 0 and 1, got {self.backward_leftover}")

    def memory_model(self) -> MemoryModel | None:
        """The simulator's memory model from the measured leftover ``l``: F adds one
        chunk-activation, B frees ``1 - l``, W the last ``l`` (paper, section 3, with B freeing
        what W does not need); None when the file has no ``backward_leftover``."""
        if self.backward_leftover is None:
            return None
        return MemoryModel(1.0, self.backward_leftover - 1.0, -self.backward_leftover)

    def times(self, tp: int, micro_batch_size: int, fallback: PartTimes,
              model: Callable[[int, int], PartTimes] | None = None) -> PartTimes:
        """Times at (tp, micro_batch_size): the measurement there, else the nearest one scaled;
        ``fallback`` (the cost model's times at this setting) fills the parts the profile lacks.

        With ``model`` (the cost model's times at any (tp, micro batch)), a measurement is
        scaled by how the model's times change between the two settings, pass by pass, so
        shape effects carry over; without it, linearly in micro batch size and inversely in
        TP."""
        def distance(m: Measurement) -> tuple:
            return (m.tensor_parallel != tp, abs(m.tensor_parallel - tp),
                    abs(m.micro_batch_size - micro_batch_size))

        base = min(self.measurements, key=distance)
        label = f"profile {Path(self.path).name} b={base.micro_batch_size} t={base.tensor_parallel}"
        if (base.tensor_parallel, base.micro_batch_size) == (tp, micro_batch_size):
            return PartTimes(base.layer, base.embedding or fallback.embedding,
                             base.head or fallback.head, label)
        if model is None:
            factor = micro_batch_size / base.micro_batch_size * base.tensor_parallel / tp
            return PartTimes(base.layer.scaled(factor),
                             base.embedding.scaled(factor) if base.embedding else fallback.embedding,
                             base.head.scaled(factor) if base.head else fallback.head,
                             label + " scaled")
        there = model(base.tensor_parallel, base.micro_batch_size)
        return PartTimes(_rescaled(base.layer, there.layer, fallback.layer),
                         _rescaled(base.embedding, there.embedding, fallback.embedding)
                         if base.embedding else fallback.embedding,
                         _rescaled(base.head, there.head, fallback.head)
                         if base.head else fallback.head,
                         label + " scaled by the cost model")


def _rescaled(measured: PassTimes, model_there: PassTimes, model_here: PassTimes) -> PassTimes:
    """``measured`` times the model's ratio here / there, per pass (a pass the model gives no
    time there keeps its measured time)."""
    def one(kind: str) -> float:
        there = getattr(model_there, kind)
        ratio = getattr(model_here, kind) / there if there else 1.0
        return getattr(measured, kind) * ratio

    return PassTimes(one("forward"), one("backward"), one("weight"))


def _passes(data, where: str, need_weight: bool) -> PassTimes:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping like {{F: 0.01, B: 0.01, W: 0.01}}")
    unknown = sorted(set(data) - set(_KINDS))
    missing = [k for k in (_KINDS if need_weight else ("F", "B")) if k not in data]
    if unknown or missing:
        raise ValueError(f"{where}: keys must be F, B{', W' if need_weight else ' (and W)'}; "
                         f"unknown {unknown}, missing {missing}")
    # A layer's passes all take time; the head's or embedding's W (or B) may take none. The
    # one check of a time (pass_time) names the entry: a NaN here would time every plan at nan.
    return PassTimes(*(pass_time(data.get(k, 0.0), f"{where}.{k} (seconds)",
                                 zero_ok=not need_weight) for k in _KINDS))


def _check_keys(data, valid: set, where: str) -> None:
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(sorted(valid))}")


def _byte_count(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where} must be a whole number of bytes > 0, got {value!r}")
    return value


def _measurement(entry, where: str) -> Measurement:
    valid = {"micro_batch_size", "tensor_parallel", "layer", "head", "embedding",
             "activation_bytes_per_layer"}
    if not isinstance(entry, dict) or "layer" not in entry:
        raise ValueError(f"{where} must be a mapping with micro_batch_size, tensor_parallel "
                         "and layer")
    _check_keys(entry, valid, where)
    optional = {k: _passes(entry[k], f"{where}.{k}", False) for k in ("head", "embedding")
                if k in entry}
    if "activation_bytes_per_layer" in entry:
        optional["activation_bytes_per_layer"] = _byte_count(
            entry["activation_bytes_per_layer"], f"{where}.activation_bytes_per_layer")
    return Measurement(int(entry.get("micro_batch_size", 1)), int(entry.get("tensor_parallel", 1)),
                       _passes(entry["layer"], f"{where}.layer", True), **optional)


def _machine(data, where: str) -> Machine:
    fields = {"kind": str, "device": str, "dtype": str, "threads": int, "torch": str,
              "megatron_core": str}
    if not isinstance(data, dict) or "kind" not in data:
        raise ValueError(f"{where} must be a mapping with kind ({' or '.join(_DEVICE_KINDS)}) "
                         "and optionally device, dtype, threads, torch, megatron_core")
    _check_keys(data, set(fields), where)
    for key, value in data.items():
        if value is not None and (not isinstance(value, fields[key]) or isinstance(value, bool)):
            kind = "a whole number" if fields[key] is int else "text"
            raise ValueError(f"{where}.{key} must be {kind}, got {value!r}")
    try:
        return Machine(**{k: v for k, v in data.items() if v is not None})
    except ValueError as err:  # Machine's own check, with the file named
        raise ValueError(f"{where}: {err}") from None


def _leftover(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{where}: backward_leftover must be a fraction between 0 and 1 (the "
                         f"share of a layer's kept bytes B leaves for W), got {value!r}")
    return float(value)


def load_profile(path: str | Path) -> MeasuredProfile:
    """Read a profile file (format in the module docstring), by path or a bundled profile's bare
    name (``cpu-small``: :func:`megatron_vshape.configs.find_config`); errors name the bad
    entry."""
    import yaml

    try:
        path = find_config("profiles", path)
    except ValueError as err:
        raise ValueError(f"--profile: {err}") from None
    data = yaml.safe_load(path.read_text())
    where = f"profile {str(path)!r}"
    valid = {"seq_length", "p2p_seconds", "measurements", "backward_leftover", "command",
             "machine"}
    if not isinstance(data, dict) or "seq_length" not in data or "measurements" not in data:
        raise ValueError(f"{where} must be a mapping with seq_length and measurements (see "
                         "docs/plan.md)")
    _check_keys(data, valid, where)
    entries = data["measurements"]
    if not isinstance(entries, list):
        raise ValueError(f"{where}: measurements must be a list")
    command = data.get("command")
    if command is not None and not isinstance(command, str):
        raise ValueError(f"{where}: command must be text (the command line that measured the "
                         f"file), got {command!r}")
    hop = data.get("p2p_seconds")
    if hop is not None:
        hop = pass_time(hop, f"{where}: p2p_seconds", zero_ok=True)
    machine = data.get("machine")
    return MeasuredProfile(int(data["seq_length"]),
                           tuple(_measurement(e, f"{where} measurements[{i}]")
                                 for i, e in enumerate(entries)),
                           hop, str(path),
                           _leftover(data.get("backward_leftover"), where), command,
                           None if machine is None else _machine(machine, f"{where} machine"))


def format_profile(profile: MeasuredProfile, comment: str = "") -> str:
    """The YAML text :func:`load_profile` reads back to ``profile`` (but its ``path``), with
    ``comment`` as ``#`` lines on top."""
    import yaml

    about: dict = {"seq_length": profile.seq_length}
    if profile.command is not None:
        about["command"] = profile.command
    if profile.machine is not None:
        about["machine"] = {k: v for k, v in vars(profile.machine).items() if v not in ("", None)}
    data: dict = {}
    if profile.p2p_seconds is not None:
        data["p2p_seconds"] = profile.p2p_seconds
    if profile.backward_leftover is not None:
        data["backward_leftover"] = profile.backward_leftover
    data["measurements"] = [_measurement_data(m) for m in profile.measurements]
    header = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
    # provenance in block style on unbroken lines (the command is copied as one), the pass
    # times as {F: ..., B: ..., W: ...} mappings
    return (header + yaml.safe_dump(about, sort_keys=False, width=10_000)
            + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def _measurement_data(m: Measurement) -> dict:
    def passes(times: PassTimes, weight: bool) -> dict:
        out = {"F": times.forward, "B": times.backward}
        return {**out, "W": times.weight} if weight or times.weight else out

    data: dict = {"micro_batch_size": m.micro_batch_size, "tensor_parallel": m.tensor_parallel,
                  "layer": passes(m.layer, True)}
    for name in ("head", "embedding"):
        if getattr(m, name) is not None:
            data[name] = passes(getattr(m, name), False)
    if m.activation_bytes_per_layer is not None:
        data["activation_bytes_per_layer"] = m.activation_bytes_per_layer
    return data
