"""Reading a Megatron-LM training log (core_v0.16.1 formats) and our run names.

The lines read, as Megatron-LM prints them (``megatron/training``):

* the argument dump (``arguments.py:_print_args``, rank 0)::

      ------------------------ arguments ------------------------
        tensor_model_parallel_size ...................... 2
      -------------------- end of arguments ---------------------

* the iteration line (``training.py:training_log``, last rank), ``key: value |`` fields::

      [2025-05-01 10:00:00.000000] iteration       10/      30 | consumed samples: 1280 |
      elapsed time per iteration (ms): 2861.4 | throughput per GPU (TFLOP/s/GPU): 402.3 | ...
      lm loss: 9.172134E+00 | loss scale: 1.0 | ...

* the memory report (``utils.py:report_memory``, data-parallel rank 0 of every TP x PP rank)::

      [Rank 0] (after 10 iterations) memory (MB) | allocated: ... | max allocated: ... |
      reserved: ... | max reserved: ...

* the plugin's plan line (``megatron/forward_backward.py``, whenever it builds a schedule: at
  start and after each re-plan), ``key=value`` fields and the description last::

      [vshape] schedule=v-half ranks=4 microbatches=32 peak_memory_vs_1f1b=0.625
      bubble_rate=0.09 memory_limit=none description=...

* the plugin's per-iteration line of every rank, and each rank's pass order under the plugin's
  schedules (``megatron/step_log.py``, with ``VSHAPE_STEP_LOG=1``; ``vshape trial`` sets it)::

      [vshape] iteration=5 rank=2 pp_rank=2 start=... end=... step_s=0.2 busy_s=0.15
      wait_s=0.03 ... activation_peak=... grad_norm=1.23 loss=6.12
      [vshape] order pp_rank=0 ranks=4 microbatches=8 layout=v schedule=v-half actions=0F0,...

* the plugin's start-up line naming settings proven only with CPU stand-ins
  (``megatron/arguments.py`` stand_in_notice)::

      [vshape] v-half: proven on CPU with stand-ins of GPU libraries only, not yet on a GPU: ...

* the launcher's last line (``scripts/slurm/pretrain_gpt_vshape.sbatch``)::

      [launcher] run NAME exit status 0

Launcher prefixes (srun ``--label`` "0: ", torchrun ``--tee`` "[default0]:") are tolerated. A
log holding several runs (a requeued job appending) is read from its last argument dump.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["IterationLog", "MemoryReport", "PlanLine", "StepLine", "RunLog", "parse_log",
           "parse_run_name"]

_PREFIX = r"(?:\d+:\s|\[(?:default|rank)\d+\]:)?"
_ARGS_BEGIN = re.compile(r"-{8,} arguments -{8,}")
_ARGS_END = re.compile(r"-{8,} end of arguments -{8,}")
_ARG = re.compile(_PREFIX + r"\s+([A-Za-z_]\w*) \.*(?: (.*))?$")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|(.*)$")
_MEMORY = re.compile(r"\[Rank (\d+)\] (.*?)\s*memory \(MB\)(.*)$")
_AFTER = re.compile(r"after (\d+) iterations")
_PLAN = re.compile(r"\[vshape\] (schedule=.*)$")
_STEP = re.compile(r"\[vshape\] ((?:iteration|order)=?.*)$")
_STAND_IN = re.compile(r"\[vshape\] \S+: proven on CPU with stand-ins of GPU libraries only, "
                       r"not yet on a GPU: (.*?)\. Before")
_EXIT = re.compile(r"\[launcher\] run \S+ exit status (\d+)")
_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")
_ERROR = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$")
_RUN_NAME = re.compile(r"^(?P<grid>.+)-s(?P<seq_length>\d+)-gb(?P<global_batch>\d+)"
                       r"-dp(?P<dp>\d+)-tp(?P<tp>\d+)-pp(?P<pp>\d+)-mbs(?P<mbs>\d+)"
                       r"-(?P<label>[A-Za-z0-9][A-Za-z0-9._-]*)$")


def _number(text: str | None) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class IterationLog:
    """One ``iteration N/M |`` line."""

    iteration: int
    train_iters: int
    fields: dict[str, str]
    """Every ``key: value`` of the line, keys as printed (``lm loss``, ``global batch size``)."""

    @property
    def elapsed_ms(self) -> float | None:
        """Mean time per iteration since the previous logged one."""
        return _number(self.fields.get("elapsed time per iteration (ms)"))

    @property
    def tflops_per_gpu(self) -> float | None:
        """Present when the run had ``--log-throughput``."""
        return _number(self.fields.get("throughput per GPU (TFLOP/s/GPU)"))

    @property
    def lm_loss(self) -> float | None:
        return _number(self.fields.get("lm loss"))

    @property
    def global_batch(self) -> int | None:
        value = _number(self.fields.get("global batch size"))
        return None if value is None else int(value)


@dataclass(frozen=True)
class MemoryReport:
    """One ``[Rank N] ... memory (MB)`` line (MB as Megatron-LM prints them: 2**20 bytes)."""

    rank: int
    after_iterations: int | None
    allocated_mb: float | None
    max_allocated_mb: float | None
    reserved_mb: float | None
    max_reserved_mb: float | None


@dataclass(frozen=True)
class PlanLine:
    """One ``[vshape]`` line: the schedule the plugin runs (again after every re-plan)."""

    fields: dict[str, str]
    """``key=value`` pairs; ``description`` is the rest of the line."""

    @property
    def schedule(self) -> str | None:
        return self.fields.get("schedule")

    @property
    def description(self) -> str | None:
        return self.fields.get("description")

    def number(self, key: str) -> float | None:
        return _number(self.fields.get(key))


@dataclass(frozen=True)
class StepLine:
    """One rank's ``[vshape] iteration=...`` line (or, ``order`` set, its ``[vshape] order``
    line): ``key=value`` fields as printed."""

    fields: dict[str, str]
    order: bool = False

    def number(self, key: str) -> float | None:
        return _number(self.fields.get(key))

    def integer(self, key: str) -> int | None:
        value = self.number(key)
        return None if value is None else int(value)


@dataclass
class RunLog:
    """What one log file says about one run."""

    arguments: dict[str, str] = field(default_factory=dict)
    """Megatron-LM's argument dump, values as printed (``None`` stays the text ``None``)."""
    iterations: list[IterationLog] = field(default_factory=list)
    memory: list[MemoryReport] = field(default_factory=list)
    plans: list[PlanLine] = field(default_factory=list)
    steps: list[StepLine] = field(default_factory=list)
    """Every rank's per-iteration lines (step_log.py), in log order."""
    orders: list[StepLine] = field(default_factory=list)
    """Every rank's pass-order lines (step_log.py)."""
    stand_in_settings: str | None = None
    """The settings the start-up line names as proven only with CPU stand-ins."""
    oom: bool = False
    """A CUDA out-of-memory error was logged."""
    traceback: bool = False
    """A Python traceback was logged."""
    error: str | None = None
    """The first ``SomethingError: message`` line after a traceback, if any (before one, such
    lines are usually warnings about optional packages)."""
    exit_status: int | None = None
    """From the launcher's last line; None when it is missing (still running, or killed)."""


def _fields(text: str, separator: str) -> dict[str, str]:
    pairs = {}
    for part in text.split("|"):
        key, found, value = part.partition(separator)
        if found and key.strip():
            pairs[key.strip()] = value.strip()
    return pairs


def _plan(text: str) -> PlanLine:
    head, _, description = text.partition("description=")
    pairs = dict(word.split("=", 1) for word in head.split() if "=" in word)
    if description:
        pairs["description"] = description.strip()
    return PlanLine(pairs)


def _memory(match: re.Match) -> MemoryReport:
    values = _fields(match.group(3), ":")
    after = _AFTER.search(match.group(2))
    return MemoryReport(int(match.group(1)), None if after is None else int(after.group(1)),
                        *(_number(values.get(k)) for k in ("allocated", "max allocated",
                                                            "reserved", "max reserved")))


def _line(log: RunLog, line: str) -> None:
    """Take what one line (outside the argument dump) says into ``log``."""
    if match := _ITERATION.search(line):
        log.iterations.append(IterationLog(int(match.group(1)), int(match.group(2)),
                                           _fields(match.group(3), ":")))
    elif match := _MEMORY.search(line):
        log.memory.append(_memory(match))
    elif match := _PLAN.search(line):
        log.plans.append(_plan(match.group(1)))
    elif match := _STEP.search(line):
        order = match.group(1).startswith("order ")
        text = match.group(1)[len("order "):] if order else match.group(1)
        step = StepLine(dict(word.split("=", 1) for word in text.split() if "=" in word), order)
        (log.orders if order else log.steps).append(step)
    elif match := _STAND_IN.search(line):
        log.stand_in_settings = match.group(1)
    elif match := _EXIT.search(line):
        log.exit_status = int(match.group(1))
    else:
        if _OOM.search(line):
            log.oom = True
        if "Traceback (most recent call last)" in line:
            log.traceback = True
        elif log.traceback and log.error is None and (match := _ERROR.search(line)):
            log.error = f"{match.group(1)}: {match.group(2)}"[:200]


def parse_log(lines: Iterable[str]) -> RunLog:
    """Read a log, line by line (a file object will do)."""
    log = RunLog()
    in_arguments = False
    for raw in lines:
        line = raw.rstrip("\n")
        if _ARGS_END.search(line):
            in_arguments = False
        elif _ARGS_BEGIN.search(line):
            log, in_arguments = RunLog(), True
        elif in_arguments:
            if match := _ARG.match(line):
                log.arguments[match.group(1)] = (match.group(2) or "").strip()
        else:
            _line(log, line)
    return log


def parse_run_name(name: str) -> dict[str, str | int] | None:
    """The fields of a run name that ``vshape grid`` made (``grid``, ``seq_length``,
    ``global_batch``, ``dp``, ``tp``, ``pp``, ``mbs``, ``label``); None for any other name."""
    match = _RUN_NAME.match(name)
    if match is None:
        return None
    return {k: (v if k in ("grid", "label") else int(v)) for k, v in match.groupdict().items()}
