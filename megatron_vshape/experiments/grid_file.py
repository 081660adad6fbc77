"""Reading a grid YAML (a path, or a bundled grid's bare name: ``configs/grid/NAME.yaml``)
into a :class:`.grid.GridConfig`.

The YAML is checked field by field so that a typo fails with the field's name and the valid
keys or choices, before anything is expanded or written (configs/grid/README.md is the schema).
"""
from __future__ import annotations

import shlex
from pathlib import Path

from ..configs import find_config
from ..plan.model import load_model_config
from .grid import GridConfig, Gpus, ScheduleChoice, SlurmOptions

__all__ = ["load_grid", "GRID_KEYS"]

GRID_KEYS = ("name", "model", "gpus", "global_batch", "seq_lengths", "tp", "pp", "mbs",
             "schedules", "train_iters", "log_interval", "extra_args", "gpu_memory_gib", "slurm")
"""Every key a grid file may have."""
_REQUIRED = ("model", "gpus", "global_batch", "seq_lengths", "tp", "pp", "mbs", "schedules")
_SCHEDULE_KEYS = ("schedule", "label", "memory_limit", "replan_after", "extra_args")
_SLURM_KEYS = ("time", "partition", "account", "max_parallel", "directives")
_GPU_KEYS = ("nodes", "per_node")


def _mapping(value, where: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping with keys {', '.join(keys)}, got {value!r}")
    unknown = sorted(str(k) for k in set(value) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(keys)}")
    return value


def _int(value, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    return value


def _ints(value, where: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(_int(v, where) for v in values)


def _args(value, where: str) -> tuple[str, ...]:
    """A list of flags; each item may hold several words (``--lr 1e-4``), split like a shell."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, (str, int, float)) for i in items):
        raise ValueError(f"{where} must be a list of flags (strings), got {value!r}")
    return tuple(word for item in items for word in shlex.split(str(item)))


def _schedule(entry, index: int) -> ScheduleChoice:
    where = f"schedules[{index}]"
    if isinstance(entry, str):
        return ScheduleChoice(entry)
    entry = _mapping(entry, where, _SCHEDULE_KEYS)
    if "schedule" not in entry:
        raise ValueError(f"{where} needs a 'schedule' key (one of the schedule names)")
    limit = entry.get("memory_limit")
    replan = entry.get("replan_after")
    return ScheduleChoice(
        schedule=str(entry["schedule"]), label=entry.get("label"),
        memory_limit=None if limit is None else str(limit),
        replan_after=None if replan is None else _int(replan, f"{where}.replan_after"),
        extra_args=_args(entry.get("extra_args"), f"{where}.extra_args"))


def _global_batch(value, seq_lengths: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    if isinstance(value, dict):
        return tuple((_int(k, "global_batch (a sequence length)"),
                      _int(v, f"global_batch[{k}]")) for k, v in value.items())
    batch = _int(value, "global_batch")
    return tuple((seq, batch) for seq in seq_lengths)


def _slurm(value) -> SlurmOptions:
    if value is None:
        return SlurmOptions()
    value = _mapping(value, "slurm", _SLURM_KEYS)
    plain = {k: (None if value[k] is None else str(value[k]))
             for k in ("time", "partition", "account") if k in value}
    limit = value.get("max_parallel")
    return SlurmOptions(**plain,
                        max_parallel=None if limit is None else _int(limit, "slurm.max_parallel"),
                        directives=_args(value.get("directives"), "slurm.directives"))


def _model(value, grid_path: Path):
    if not isinstance(value, str):
        raise ValueError(f"model must be a model YAML's path or a bundled model's name, "
                         f"got {value!r}")
    try:
        return load_model_config(find_config("models", value, base=grid_path.parent))
    except ValueError as err:
        raise ValueError(f"model: {err} (model paths are relative to the grid file)") from None


def _build(data: dict, path: Path) -> GridConfig:
    seq_lengths = _ints(data["seq_lengths"], "seq_lengths")
    schedules = data["schedules"]
    if not isinstance(schedules, list):
        raise ValueError(f"schedules must be a list, got {schedules!r}")
    gpus = _mapping(data["gpus"], "gpus", _GPU_KEYS)
    memory = data.get("gpu_memory_gib")
    if memory is not None and (not isinstance(memory, (int, float)) or memory <= 0):
        raise ValueError(f"gpu_memory_gib must be a positive number, got {memory!r}")
    return GridConfig(
        name=str(data.get("name", path.stem)), model=_model(data["model"], path),
        model_file=data["model"],
        gpus=Gpus(**{k: _int(gpus.get(k), f"gpus.{k}") for k in _GPU_KEYS}),
        seq_lengths=seq_lengths, global_batch=_global_batch(data["global_batch"], seq_lengths),
        tp=_ints(data["tp"], "tp"), pp=_ints(data["pp"], "pp"), mbs=_ints(data["mbs"], "mbs"),
        schedules=tuple(_schedule(e, i) for i, e in enumerate(schedules)),
        train_iters=_int(data.get("train_iters", 30), "train_iters"),
        log_interval=_int(data.get("log_interval", 1), "log_interval"),
        extra_args=_args(data.get("extra_args"), "extra_args"),
        gpu_memory_gib=memory, slurm=_slurm(data.get("slurm")))


def load_grid(path: str | Path) -> GridConfig:
    """Read and check a grid file (a path or a bundled grid's name, ``gpt-9.6b``); errors name
    the file and the field."""
    import yaml

    path = find_config("grid", path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"grid {path}: not valid YAML: {err}") from None
    try:
        data = _mapping(data, "the grid", GRID_KEYS)
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"missing keys {missing} (required: {', '.join(_REQUIRED)})")
        return _build(data, path)
    except ValueError as err:
        raise ValueError(f"grid {path}: {err}") from None
