"""``vshape trial``: the user's own launch command under each schedule, compared with 1F1B.

Runs the command once per schedule (experiments/trial.py), then writes DIR/trial.json,
DIR/trial.md and DIR/trial.png (experiments/trial_report.py) with the planner's prediction for
the same flags beside the measurements (experiments/trial_predict.py).
"""
from __future__ import annotations

import time
from pathlib import Path

from .ui import subcommand

__all__ = ["register"]


def register(sub) -> None:
    from ..experiments.trial import TRIAL_SCHEDULES

    p = subcommand(
        sub, "trial", help="run your own launch command under each schedule and compare speed, "
                           "memory per rank and losses with 1F1B",
        examples=["vshape trial --output trial -- torchrun --nproc-per-node 8 "
                  "scripts/pretrain_gpt_vshape.py <your flags>",
                  "vshape trial --schedules 1f1b,v-half --output trial -- sbatch --nodes 2 "
                  "scripts/slurm/pretrain_gpt_vshape.sbatch <your flags>",
                  "vshape trial --example tiny --output /tmp/trial"],
        description="Before a production run changes its schedule: the command after -- is run "
                    "once per schedule with the same flags, seed and data, from one initial "
                    "checkpoint (a one-iteration 1f1b run saves it), for --warmup + --iters "
                    "iterations without saving checkpoints. Every rank logs its peak memory "
                    "and waiting time per iteration (VSHAPE_STEP_LOG=1). The report: tokens/s "
                    "per GPU, step time median and p90, peak memory per rank, losses against "
                    "1F1B's, measured bubble per pipeline rank beside the simulator's, the "
                    "planner's prediction, and the settings proven only with CPU stand-ins "
                    "(checked when the losses agree). A schedule that fails is a row with its "
                    "reason; the others still run. With sbatch, one job per schedule, each "
                    "waited for (sbatch --wait); inside an allocation, bash "
                    "scripts/slurm/pretrain_gpt_vshape.sbatch runs them in turn. Exit status 1 when a schedule failed or its "
                    "losses differ from 1F1B's beyond the tolerance.")
    p.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="folder for trial.json, trial.md, trial.png and each run's log")
    p.add_argument("--schedules", default=",".join(TRIAL_SCHEDULES),
                   help="comma-separated, 1f1b included (default %(default)s)")
    p.add_argument("--iters", type=int, default=5, help="measured iterations (default 5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="iterations before the measured ones, at least --pipeline-replan-after "
                        "(default 3)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="a run taking longer is killed and reported as hung (default 1800)")
    p.add_argument("--example", choices=["tiny"],
                   help="tiny: the bundled tiny recipe on 4 CPU processes (a repository "
                        "checkout and Megatron-LM's training code needed; what CI runs)")
    p.add_argument("launch", nargs="*", metavar="-- COMMAND",
                   help="your launch command and its flags, after --")
    p.set_defaults(handler=_trial)


def _settings(args):
    from ..experiments.trial import TrialSettings
    from ..experiments.trial_example import tiny_example

    command, env, cwd = list(args.launch), {}, None
    if args.example:
        if command:
            raise ValueError("give either --example or a launch command after --, not both")
        command, env, cwd = tiny_example()
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    return TrialSettings(tuple(command), Path(args.output), schedules, args.iters, args.warmup,
                         args.timeout, tuple(env.items()), cwd)


def _trial(args) -> int:
    from ..experiments.trial import run_trial
    from ..experiments.trial_predict import predictions
    from ..experiments.trial_report import trial_report, write_report

    settings = _settings(args)
    settings.output.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    init, outcomes = run_trial(settings, progress=lambda name: print(f"trial: {name} ...",
                                                                      flush=True))
    report = trial_report(settings, init, outcomes, wall_seconds=time.monotonic() - start)
    report = predictions(report)
    for path in write_report(report, settings.output):
        print(f"wrote {path}")
    for row in report["schedules"]:
        print(f"{row['schedule']:8s} {row['status']:8s} " + (
            f"{row['tokens_per_s']:.1f} tokens/s/GPU, loss diff {row.get('max_loss_diff')}"
            if row["status"] == "ok" else str(row["reason"])))
    print(f"trial: {report['wall_seconds']} s")
    return 0 if all(r["status"] == "ok" and r.get("loss_ok") for r in report["schedules"]) else 1
