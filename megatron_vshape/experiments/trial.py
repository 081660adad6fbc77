"""``vshape trial``: a user's own launch command run once per schedule, measured from its logs.

Before a production run changes its schedule, its team wants numbers from its own recipe,
container and GPUs. A trial takes the command the team launches (``torchrun ...
scripts/pretrain_gpt_vshape.py <flags>``, or ``sbatch scripts/slurm/pretrain_gpt_vshape.sbatch
<flags>``) and runs it once per schedule with only these changes to the flags:

- ``--pipeline-schedule S`` (the command's own is dropped), and, for every schedule but
  ``auto``, no ``--pipeline-memory-limit`` (auto's limit, which the fixed schedules refuse:
  their memory is their name's);
- ``--train-iters K+N`` (warm-up K, measured N), and no checkpoint saves (``--save``,
  ``--save-interval`` dropped; the slurm script's CHECKPOINT_DIR unset);
- one initial checkpoint for all: a one-iteration 1f1b run of the same command saves it and
  every schedule starts from it with ``--load DIR/init --finetune``, as the real-loop tests
  do (Megatron-LM seeds weights per pipeline rank, and a V places layers on other ranks, so
  without one the schedules would train different models). A command with its own ``--load``
  starts every schedule from that checkpoint instead (``--finetune`` added);
- ``VSHAPE_STEP_LOG=1`` in the environment: every rank logs its peaks and waiting time per
  iteration (megatron/step_log.py).

Each run's output goes to ``DIR/<schedule>/train.log`` (sbatch: the script's LOG_DIR/RUN_NAME.log,
set to the same place). Through slurm, either one job per schedule (``sbatch ...``, each
submitted with ``--wait`` in turn) or, inside one allocation (``salloc``), the script run by
``bash`` once per schedule in turn. A run that fails -- a refused flag, out of memory, a hang past
``timeout`` -- becomes a row with its reason and the trial goes on. The report is
trial_report.py's.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..schedule.names import AUTO, REFERENCE, V_HALF, V_ZB, ZB_1P, schedule_info

__all__ = ["TRIAL_SCHEDULES", "TrialSettings", "RunOutcome", "schedule_command", "run_trial",
           "DROPPED_FLAGS"]

log = logging.getLogger(__name__)

TRIAL_SCHEDULES = (REFERENCE, ZB_1P, V_HALF, V_ZB, AUTO)
"""The default comparison: megatron's 1F1B (the reference every loss is compared with), the
plugin's zero-bubble 1F1B, V-Half, V-ZB and ``auto``."""

DROPPED_FLAGS = {"--pipeline-schedule": 1, "--train-iters": 1, "--save": 1,
                 "--save-interval": 1}
"""The command's flags a trial replaces (name: how many values follow)."""
AUTO_ONLY_FLAGS = {"--pipeline-memory-limit": 1}
"""A command's flags that only ``auto`` accepts (arguments.py refuses them for another
schedule): a trial of an ``auto`` recipe runs the other schedules without them."""
_STEP_LOG = "VSHAPE_STEP_LOG"  # megatron/step_log.py's STEP_LOG (that module imports torch)


@dataclass(frozen=True)
class TrialSettings:
    """One trial: the command, the schedules, the iterations, where its files go."""

    command: tuple[str, ...]
    """The user's launch command, flags included."""
    output: Path
    schedules: tuple[str, ...] = TRIAL_SCHEDULES
    iters: int = 5
    """Measured iterations, after the warm-up."""
    warmup: int = 3
    """Iterations left out of the medians (start-up, first allocations, the plugin's profiled
    iterations: keep it at least ``--pipeline-replan-after``)."""
    timeout: float = 1800.0
    """Seconds one schedule's run may take before it counts as hung and is killed."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables added to the runs' environment (the tiny example's Megatron-LM path)."""
    cwd: Path | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("vshape trial needs the launch command after --: vshape trial "
                             "--output DIR -- torchrun ... scripts/pretrain_gpt_vshape.py ...")
        if not self.schedules:
            raise ValueError(f"--schedules: none given; give {REFERENCE} and the schedules to "
                             "compare with it")
        for name in self.schedules:
            schedule_info(name, "--schedules")
        if REFERENCE not in self.schedules:
            raise ValueError(f"--schedules must include {REFERENCE}: every schedule's losses "
                             "are compared with megatron's own 1F1B")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {self.iters} and "
                             f"{self.warmup}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")

    @property
    def slurm_script(self) -> bool:
        """The command runs an sbatch script (scripts/slurm/pretrain_gpt_vshape.sbatch), by
        sbatch or, inside an allocation (salloc), by bash: the schedules then run in turn in
        that allocation."""
        return self.slurm or any(word.endswith(".sbatch") for word in self.command)

    @property
    def slurm(self) -> bool:
        """The command submits a slurm job (one job per schedule, each waited for)."""
        return Path(self.command[0]).name == "sbatch"


@dataclass(frozen=True)
class RunOutcome:
    """How one schedule's run ended."""

    schedule: str
    log: Path
    returncode: int | None
    seconds: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _without(flags: list[str], dropped: dict) -> list[str]:
    """``flags`` without the ``dropped`` flags and their values (``--flag=value`` too)."""
    out, skip = [], 0
    for word in flags:
        if skip:
            skip -= 1
            continue
        name = word.split("=", 1)[0]
        if name in dropped:
            skip = 0 if "=" in word else dropped[name]
            continue
        out.append(word)
    return out


def schedule_command(settings: TrialSettings, schedule: str, start: list[str],
                     iterations: int | None = None) -> list[str]:
    """The command of one schedule's run: the user's, its schedule, iteration count and saves
    replaced (:data:`DROPPED_FLAGS`), ``start`` (the initial checkpoint's flags) added; under
    sbatch, ``--wait`` so the trial sees the job end."""
    command = _without(list(settings.command),
                       DROPPED_FLAGS if schedule_info(schedule).memory_limited
                       else {**DROPPED_FLAGS, **AUTO_ONLY_FLAGS})
    if settings.slurm and "--wait" not in command and "-W" not in command:
        command.insert(1, "--wait")
    return command + ["--pipeline-schedule", schedule, "--train-iters",
                      str(iterations or settings.warmup + settings.iters), *start]


def run_environment(settings: TrialSettings, name: str, log: Path) -> dict:
    """The environment of one run: the caller's, the step log on, the trial's additions;
    for the slurm script, its log file (LOG_DIR/RUN_NAME.log) and no checkpoint dir."""
    env = dict(os.environ)
    env.update(settings.env)
    env[_STEP_LOG] = "1"
    if settings.slurm_script:
        # sbatch: the script's log is the run's log; bash inside an allocation: the trial
        # keeps the output itself, the script's tee goes beside it
        env.update(LOG_DIR=str(log.parent), RUN_NAME=log.stem if settings.slurm else
                   "slurm-script")
        env.pop("CHECKPOINT_DIR", None)  # it would add --save and --load of its own
    return env


def _launch(settings: TrialSettings, name: str, command: list[str]) -> RunOutcome:
    """Run ``command``; its output in ``output/name/train.log`` (the slurm script writes it
    there itself); killed, process group and all, after ``settings.timeout``."""
    folder = settings.output / name
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "train.log"
    (folder / "command.txt").write_text(" ".join(command) + "\n", encoding="utf-8")
    env = run_environment(settings, name, log_path)
    start = time.monotonic()
    with open(folder / ("sbatch.out" if settings.slurm else "train.log"), "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=settings.cwd, start_new_session=True)
        try:
            code = process.wait(timeout=settings.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            code, timed_out = process.wait(), True
    return RunOutcome(name, log_path, code, time.monotonic() - start, timed_out)


def initial_checkpoint(settings: TrialSettings) -> tuple[list[str], RunOutcome | None]:
    """The flags every schedule starts from, and the run that saved them (None where the
    command loads its own checkpoint)."""
    if any(w.split("=", 1)[0] == "--load" for w in settings.command):
        return (["--finetune"] if "--finetune" not in settings.command else []), None
    folder = (settings.output / "init" / "checkpoint").resolve()
    command = schedule_command(settings, REFERENCE, ["--save", str(folder), "--save-interval",
                                                  "1"], iterations=1)
    outcome = _launch(settings, "init", command)
    return ["--load", str(folder), "--finetune"], outcome


def run_trial(settings: TrialSettings, progress=None) -> tuple[RunOutcome | None, list]:
    """Save the initial checkpoint, then run every schedule (``progress(name)`` before each):
    (the initial run's outcome, one :class:`RunOutcome` per schedule). A failed initial run
    leaves every schedule unrun (outcome None)."""
    if progress:
        progress("initial checkpoint")
    start, init = initial_checkpoint(settings)
    if init is not None and not init.ok:
        return init, [None] * len(settings.schedules)
    outcomes = []
    for schedule in settings.schedules:
        if progress:
            progress(schedule)
        outcomes.append(_launch(settings, schedule, schedule_command(settings, schedule, start)))
    return init, outcomes
