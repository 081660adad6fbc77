"""Checkpoints that survive a change of pipeline schedule (Megatron-LM, torch_dist format).

Model weights are keyed by global layer number, so any schedule loads any other's weights.
The distributed optimizer's state is the exception: megatron's default ``dp_reshardable``
format stores it per gradient bucket, and buckets follow the model chunks of the layout that
saved it::

    layout   schedules                       chunks per rank      DDP buckets
    single   1f1b, zb-1p                     1 (layers r*L/p..)    one set
    v        v-min, v-half, v-zb, auto       2 (stages r, 2p-1-r)  one set per chunk
    loop     interleaved-1f1b                vp (stages r, r+p..)  one set per chunk

Loading such a checkpoint into another layout fails deep inside dist_checkpointing ("Global
shape mismatch ... bucket_idx_0.param"). megatron's ``fully_reshardable`` format keys the
state by parameter and loads into any layout (as it does across TP/PP changes), so
``pretrain_gpt_vshape.py`` saves in it by default (``--dist-ckpt-optim-fully-reshardable``;
``--dist-ckpt-optim-dp-reshardable`` restores megatron's default), and
:func:`checked_load_checkpoint` stops a ``dp_reshardable`` checkpoint of another layout before
any work, saying how to proceed.
"""
from __future__ import annotations

import functools
from typing import Callable

from ..schedule.model.placement import Layout
from ..schedule.names import megatrons_own, schedule_info
from .install import installed_config

__all__ = ["layout_of", "check_optimizer_layout", "checked_load_checkpoint"]


def layout_of(args) -> str:
    """The chunk layout a Megatron-LM argument namespace runs (or a checkpoint was saved with):
    'v', 'loop' or 'single'. Checkpoints without --pipeline-schedule come from Megatron-LM's own
    scripts: interleaved with virtual stages, else 1F1B."""
    return _layout(getattr(args, "pipeline_schedule", None),
                   getattr(args, "virtual_pipeline_model_parallel_size", None))


def _layout(schedule: str | None, virtual_stages: int | None) -> str:
    """'v', 'loop' or 'single' of ``schedule``; None: megatron's own by its virtual stages."""
    if schedule is None:
        schedule = megatrons_own(Layout.LOOP if (virtual_stages or 1) > 1 else Layout.SINGLE)
    return schedule_info(schedule).layout.value


def check_optimizer_layout(ckpt_args, sharding_type: str | None, schedule: str,
                           where: str) -> None:
    """Raise ValueError when ``where``'s distributed-optimizer state cannot load into the chunk
    layout of ``schedule`` (this run's, as installed: install.installed_config; module doc);
    say which schedule saved it and the two ways out."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if sharding_type is None or sharding_type in \
            DistributedOptimizer.checkpoint_fully_reshardable_formats:
        return
    saved, running = layout_of(ckpt_args), _layout(schedule, None)
    if saved == running:
        return
    saved_by = getattr(ckpt_args, "pipeline_schedule", None) or megatrons_own(Layout(saved))
    raise ValueError(
        f"checkpoint {where} holds distributed-optimizer state in megatron's {sharding_type} "
        f"format, laid out by the gradient buckets of --pipeline-schedule {saved_by} ({saved} "
        f"layout); --pipeline-schedule {schedule} builds other buckets ({running} "
        f"layout). Resume it once under --pipeline-schedule {saved_by} with "
        "--dist-ckpt-optim-fully-reshardable (pretrain_gpt_vshape.py's default), which saves "
        "optimizer state that loads under any schedule, or start this run from its weights "
        "alone with --no-load-optim.")


def checked_load_checkpoint(original: Callable) -> Callable:
    """Megatron-LM's load_checkpoint, preceded by :func:`check_optimizer_layout` when a
    torch_dist checkpoint's distributed-optimizer state is about to be loaded."""
    if getattr(original, "vshape_checked", False):
        return original

    @functools.wraps(original)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *rest, **kw):
        from megatron.training import get_args

        args = get_args()
        if args.use_distributed_optimizer and optimizer is not None and not args.finetune \
                and not args.no_load_optim and args.ckpt_format == "torch_dist":
            _check_saved_layout(getattr(args, load_arg), args)
        return original(ddp_model, optimizer, opt_param_scheduler, load_arg, *rest, **kw)

    load_checkpoint.vshape_checked = True
    return load_checkpoint


def _check_saved_layout(load_dir, args) -> None:
    """Read the checkpoint's common state (its arguments and content metadata; small) the way
    load_checkpoint is about to, and check it."""
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing

    if load_dir is None:
        return
    state, name, release, kind = checkpointing._load_base_checkpoint(load_dir, args, rank0=True)
    if state is None or release or kind != checkpointing.CheckpointType.GLOBAL or \
            getattr(state.get("args"), "no_save_optim", False):
        return
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=state) or {}
    check_optimizer_layout(state.get("args"), metadata.get("distrib_optim_sharding_type"),
                           installed_config().schedule, name)
