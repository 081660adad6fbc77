"""The plugin's Megatron-LM flags and their checks, for ``scripts/pretrain_gpt_vshape.py``.

:func:`add_arguments` is the ``extra_args_provider``; :func:`check_arguments` runs first in
Megatron-LM's validate_args (megatron_lm_patch.py) and stops a run at argument parsing with
every problem found, in one error: each refused setting of features.py's table, and the
plugin's own flags' misuse. Without ``--pipeline-schedule`` the script runs what stock
``pretrain_gpt.py`` runs: megatron's interleaved schedule where the flags ask for virtual
pipeline stages, else its 1F1B.
"""
from __future__ import annotations

import argparse
import logging

from ..schedule.model.limits import MemoryLimit
from ..schedule.model.placement import Layout
from ..schedule.registry import SCHEDULES, VARIANTS
from ..schedule.names import V_SCHEDULES, megatrons_own, schedule_info
from .features import STRICT_FLAG, layout_stages, refusals, stand_in_settings, virtual_stages
from .forward_backward import replans
from .install import VShapeConfig
from .stage_layout import layout_flags_set, v_stage_layout

__all__ = ["add_arguments", "check_arguments", "recheck_arguments", "vshape_config",
           "stand_in_notice", "default_schedule"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the plugin's flags."""
    group = parser.add_argument_group("megatron-vshape", "pipeline schedules (arXiv 2405.15362)")
    group.add_argument("--pipeline-schedule", default=None, choices=SCHEDULES,
                       help="1f1b and interleaved-1f1b are megatron's own; zb-1p, v-min, v-half, "
                            "v-zb and auto (fastest under --pipeline-memory-limit) the plugin's "
                            "(default: megatron's own choice, interleaved-1f1b with virtual "
                            "pipeline stages, else 1f1b)")
    group.add_argument("--pipeline-memory-limit", default=None,
                       help="auto: peak activation memory per GPU, a fraction of 1F1B's (0.5) "
                            "or bytes (40GiB)")
    group.add_argument("--pipeline-replan-after", type=int, default=3,
                       help="auto, zb-1p, v-min, v-half, v-zb: profile this many iterations, then "
                            "re-plan from the measured costs and memory, keeping the schedule's "
                            "memory level (0: never; default 3)")
    group.add_argument("--pipeline-schedule-variant", default="fastest", choices=VARIANTS,
                       help="zb-1p, v-min, v-half, v-zb: fastest (the fastest order within the "
                            "schedule's memory bound for the measured costs) or paper (the "
                            "paper's fixed order, never re-planned); default fastest")
    group.add_argument("--pipeline-p2p-timeout", type=float, default=600.0,
                       help="seconds a pipeline send/receive may wait before failing with rank, "
                            "step and action (default 600)")
    group.add_argument(STRICT_FLAG, action="store_true",
                       help="refuse the settings proven only on CPU with a stand-in of a GPU "
                            "library (Transformer Engine), instead of naming them at start-up "
                            "(vshape features lists them)")
    # distributed-optimizer checkpoints that load under any schedule (checkpoints.py)
    parser.set_defaults(dist_ckpt_optim_fully_reshardable=True)
    group.add_argument("--dist-ckpt-optim-dp-reshardable", dest="dist_ckpt_optim_fully_reshardable",
                       action="store_false",
                       help="save distributed-optimizer state in megatron's default dp_reshardable "
                            "format (per gradient bucket: it only loads under a schedule of the "
                            "same chunk layout, and the same TP/PP); the default here is "
                            "--dist-ckpt-optim-fully-reshardable")
    return parser


def default_schedule(args) -> str:
    """What stock pretrain_gpt.py runs for these flags: megatron's interleaved schedule with
    virtual pipeline stages (more than one per rank), else its 1F1B."""
    return megatrons_own(Layout.LOOP if virtual_stages(args) > 1 else Layout.SINGLE)


def check_arguments(args) -> None:
    """Fill in the default schedule, then refuse bad combinations at argument parsing: one
    ValueError listing every problem, each naming the flag and what to change."""
    if args.pipeline_schedule is None:
        args.pipeline_schedule = default_schedule(args)
    problems = _schedule_problems(args) + refusals(args, args.pipeline_schedule) + \
        _layout_problems(args) + _strict_problems(args) + _flag_problems(args)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} settings stop this run (change each, or use "
                         "--pipeline-schedule 1f1b):\n" + "\n".join(f"- {p}" for p in problems))


def recheck_arguments(args) -> None:
    """The refusals again when the model is built: Megatron-LM sets a few fields after
    validate_args (core_v0.16.1 training.py:1168-1177, get_model: ``modelopt_enabled`` for a
    ModelOpt checkpoint or a distillation teacher)."""
    problems = refusals(args, args.pipeline_schedule)
    if problems:
        raise ValueError("\n".join(problems))


def _schedule_problems(args) -> list[str]:
    """megatron's own schedules asked for against what the flags set up."""
    name, fits = args.pipeline_schedule, default_schedule(args)
    if not schedule_info(name).megatrons_own or name == fits:
        return []
    if schedule_info(name).layout is Layout.LOOP:
        return [f"--pipeline-schedule {name} needs virtual pipeline stages "
                "(--num-virtual-stages-per-pipeline-rank 2, or a --pipeline-model-parallel-layout "
                "of more than PP stages)"]
    return [f"--pipeline-schedule {name} runs one chunk per rank; with virtual pipeline "
            f"stages use --pipeline-schedule {fits} (or leave --pipeline-schedule "
            "out: megatron's own choice)"]


def _layout_problems(args) -> list[str]:
    """Under a V: the layer-placing flags read on the V's stages (stage_layout.py), where
    features.py's rows leave them to check (two stages per rank, a layout of 2 x PP stages)."""
    if args.pipeline_schedule not in V_SCHEDULES or not layout_flags_set(args) or \
            args.pipeline_model_parallel_size < 2:
        return []
    if args.pipeline_model_parallel_layout is not None and \
            layout_stages(args) != 2 * args.pipeline_model_parallel_size:
        return []  # features.py's row says so
    try:
        v_stage_layout(args)
    except ValueError as err:
        return [f"--pipeline-schedule {args.pipeline_schedule}: {err}"]
    return []


def _strict_problems(args) -> list[str]:
    if not getattr(args, "pipeline_strict", False):
        return []
    return [f"--pipeline-schedule {args.pipeline_schedule} with {STRICT_FLAG}: {row.flags} is "
            f"proven only on CPU with a stand-in of a GPU library ({row.why}; "
            f"{row.proven_by}): drop it, or drop {STRICT_FLAG}"
            for row in stand_in_settings(args, args.pipeline_schedule)]


def _flag_problems(args) -> list[str]:
    """The plugin's own flags."""
    problems = []
    if args.pipeline_memory_limit is not None:
        if not schedule_info(args.pipeline_schedule).memory_limited:
            problems.append("--pipeline-memory-limit applies to --pipeline-schedule auto only "
                            f"(got {args.pipeline_schedule}); fixed schedules have fixed memory")
        else:
            try:
                MemoryLimit.parse(args.pipeline_memory_limit, "--pipeline-memory-limit")
            except ValueError as err:
                problems.append(str(err))
    if args.pipeline_replan_after < 0:
        problems.append(f"--pipeline-replan-after must be >= 0 (0 = never), got "
                        f"{args.pipeline_replan_after}")
    if args.pipeline_p2p_timeout <= 0:
        problems.append(f"--pipeline-p2p-timeout must be > 0 seconds, got "
                        f"{args.pipeline_p2p_timeout}")
    return problems


def stand_in_notice(args) -> str | None:
    """The start-up line naming this run's settings that only a CPU stand-in of a GPU library
    proves (None when there are none)."""
    rows = stand_in_settings(args, args.pipeline_schedule)
    if not rows:
        return None
    return (f"[vshape] {args.pipeline_schedule}: proven on CPU with stand-ins of GPU libraries "
            f"only, not yet on a GPU: {'; '.join(row.flags for row in rows)}. Before a "
            "production run, train a few iterations of this recipe under --pipeline-schedule "
            "1f1b and under this schedule from one checkpoint on your GPUs and compare the "
            f"losses (docs/training.md); {STRICT_FLAG} refuses them instead")


def vshape_config(args, stage_layers=None) -> VShapeConfig:
    """The plugin's one configuration, from checked arguments and a V's ``stage_layers``
    (megatron_lm_patch reads them from the layout flags or the hybrid pattern)."""
    auto = schedule_info(args.pipeline_schedule).memory_limited
    variant = args.pipeline_schedule_variant
    return VShapeConfig(schedule=args.pipeline_schedule,
                        memory_limit=args.pipeline_memory_limit if auto else None,
                        replan_after=args.pipeline_replan_after
                        if replans(args.pipeline_schedule, variant) else 0,
                        variant=variant,
                        losses_on_last_rank=True, timeout=args.pipeline_p2p_timeout,
                        stage_layers=stage_layers)
