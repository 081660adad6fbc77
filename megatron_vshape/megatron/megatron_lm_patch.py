"""What the plugin changes inside Megatron-LM's training code, from outside.

Two training loops are supported (:data:`SUPPORTED`): the one whose pretrain() parses the flags
(Megatron-LM tags core_v0.16.1 and core_v0.17.1, with megatron-core 0.16 and 0.17), and the one
that takes a config container (core_v0.18.2 and the 0.19-era training code, Megatron-LM main at
54045a5, with megatron-core 0.18 and 0.19.2); :func:`patch_megatron_lm` first refuses another
megatron-core (versions.check_megatron_core_version). Each change below is found by the name it replaces,
not by a version.
:func:`patch_megatron_lm` makes the changes that pretrain()'s arguments cannot express (the
only code here that imports ``megatron.training``; the script calls it before pretrain())::

    validate_args (where it is called from: core_v0.16.1's initialize, 0.19's arguments)
              our checks first (every problem in one error naming its flags; the default
              schedule filled in); a V's stage layout read from megatron's layer-placing
              flags (stage_layout.py) or the hybrid pattern, the flags cleared;
              then Megatron-LM's with the V's
              uneven layer count hidden from its "num_layers % PP" check; then two chunks per
              rank (virtual_pipeline_model_parallel_size = 2), and align_param_gather as the
              user set it (Megatron-LM clears it for what it takes for a one-chunk schedule,
              so --overlap-param-gather would lose its param_sync_func per chunk); then
              installs the schedule's one configuration (install.VShapeConfig, built from
              the checked arguments and the stage layout; everything after reads it through
              install.installed_config, never Megatron-LM's args again) and checks that
              train() and evaluate() will call it (:func:`check_schedule_binding`); names
              the settings only a CPU stand-in proves (arguments.stand_in_notice)
    training.DistributedDataParallelConfig
              delay_wgrad_compute=True, so DDP's hooks wait for W (the model's own
              TransformerConfig must not get it: megatron allows it for MoE only)
    validate_yaml (--yaml-cfg)
              refused: Megatron-LM replaces the command-line flags by the YAML file's and
              validates them without validate_args, so the plugin would never be installed
    training.load_checkpoint
              refuses distributed-optimizer state of another chunk layout (checkpoints.py)
    training.report_theoretical_memory
              the V's activation memory (its simulated peak relative to 1F1B, each stage's
              activations weighted by its layers, VShapeConfig.stage_layers), not the
              interleaved schedule's penalty that virtual_pipeline_model_parallel_size = 2
              would otherwise select; weights of the rank holding the most layers
    get_forward_backward_func
              megatron_vshape.install(): our schedules, losses relayed to the last pipeline
              rank where Megatron-LM's loop logs them
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import sys

from .checkpoints import checked_load_checkpoint
from .hybrid import hybrid_layer_count, hybrid_stage_layers, v_pattern
from .install import ForwardBackwardGetter, OURS, VShapeConfig, installed_config
from ..schedule.names import V_SCHEDULES
from .arguments import check_arguments, stand_in_notice, vshape_config
from .stage_layout import LAYOUT_FLAGS, v_stage_layout
from .step_log import install_step_log
from .touch_points import check_flags

__all__ = ["patch_megatron_lm", "v_activation_ratio", "check_schedule_binding", "SUPPORTED",
           "refuse_yaml_config"]

log = logging.getLogger(__name__)

SUPPORTED = ("Megatron-LM tag core_v0.16.1, core_v0.17.1 or core_v0.18.2 with megatron-core "
             "0.16.x, 0.17.x or 0.18.x, or Megatron-LM's 0.19-era training code (main at "
             "54045a510b80) with megatron-core 0.19.2")
"""The training loops this plugin is tested in (tests/megatron/test_megatron_lm_e2e.py, _019.py;
0.17 and 0.18 in CI's matrix tier, .ci/megatron-versions)."""

_VALIDATE_ARGS_CALLERS = ("megatron.training.initialize", "megatron.training.arguments")
"""Modules whose code calls ``validate_args`` by its module-global name: core_v0.16.1's
initialize_megatron (initialize.py:92) and 0.19's parse_and_validate_args (arguments.py:107)."""

_VALIDATE_YAML_CALLERS = ("megatron.training.yaml_arguments", "megatron.training.initialize")
"""Where Megatron-LM looks up ``validate_yaml`` for --yaml-cfg: core_v0.16.1's initialize.py:90
(imported by name at :36), 0.19's arguments.py:103 (from yaml_arguments when called)."""

_SCHEDULE_CALLERS = ("train", "evaluate")
"""megatron.training.training's functions that pick the schedule by calling
``get_forward_backward_func`` (core_v0.16.1 training.py:2607/3070, 0.19 :3614/:4198)."""


def patch_megatron_lm() -> None:
    """Make Megatron-LM's pretrain() run the plugin's schedules (idempotent; module doc).
    An unsupported megatron-core stops here, before anything is patched (versions.py)."""
    from .touch_points import Side, check_touch_points
    from .versions import check_megatron_core_version

    check_megatron_core_version()
    check_touch_points((Side.CORE, Side.TRAINING))
    from megatron.training import training

    _wrap_validate_args()
    refuse_yaml_config()
    if not getattr(training.DistributedDataParallelConfig, "vshape_delayed", False):
        training.DistributedDataParallelConfig = _delayed_wgrad_ddp_config(
            training.DistributedDataParallelConfig)
    training.load_checkpoint = checked_load_checkpoint(training.load_checkpoint)
    if hasattr(training, "report_theoretical_memory"):
        training.report_theoretical_memory = _v_theoretical_memory(
            training.report_theoretical_memory)
    install_step_log()  # only with $VSHAPE_STEP_LOG (step_log.py)


def _wrap_validate_args() -> None:
    """One wrapper of Megatron-LM's validate_args, bound in every module that calls it."""
    import importlib

    modules = [importlib.import_module(name) for name in _VALIDATE_ARGS_CALLERS]
    bound = [m for m in modules if hasattr(m, "validate_args")]
    if not bound:
        raise ImportError(f"Megatron-LM's validate_args is in none of {_VALIDATE_ARGS_CALLERS}; "
                          f"megatron-vshape supports {SUPPORTED}")
    current = bound[0].validate_args
    wrapper = current if getattr(current, "vshape_original", None) is not None else \
        _validating(current)
    for module in bound:
        module.validate_args = wrapper


def refuse_yaml_config() -> None:
    """--yaml-cfg replaces every command-line flag (--pipeline-schedule too) by the YAML
    file's and validates them with validate_yaml, which the plugin does not wrap: a V run
    would reach the model provider without two chunks per rank, a zb-1p run would run megatron's
    1F1B with W deferred. Refused up front, with the way out."""
    import importlib

    for name in _VALIDATE_YAML_CALLERS:
        module = importlib.import_module(name)
        if hasattr(module, "validate_yaml") and \
                not getattr(module.validate_yaml, "vshape_refused", False):
            module.validate_yaml = _yaml_refused


def _yaml_refused(args, defaults={}):
    raise ValueError("scripts/pretrain_gpt_vshape.py does not support --yaml-cfg: Megatron-LM "
                     "replaces the command-line flags (--pipeline-schedule among them) by the "
                     "YAML file's and validates them without the plugin; pass the flags on the "
                     "command line instead")


_yaml_refused.vshape_refused = True


def check_schedule_binding(config: VShapeConfig) -> None:
    """Fail before training unless Megatron-LM's train() and evaluate() will get their
    forward-backward function from the plugin's installed ``get_forward_backward_func``.

    They look the name up among megatron.training.training's globals when they run; a
    Megatron-LM that binds it elsewhere (a local import, another name, a registry) would run
    megatron's own schedule with the V's two-chunk model, and train wrong silently. 1f1b and
    interleaved-1f1b are megatron's own either way: nothing to check.
    """
    if config.schedule not in OURS:
        return
    training = sys.modules.get("megatron.training.training")
    if training is None:
        raise RuntimeError("megatron.training.training is not imported: call "
                           f"patch_megatron_lm() from a Megatron-LM script ({SUPPORTED})")
    for name in _SCHEDULE_CALLERS:
        problem = _binding_problem(getattr(training, name, None), config)
        if problem is not None:
            raise RuntimeError(
                f"--pipeline-schedule {config.schedule}: Megatron-LM's "
                f"megatron.training.training.{name} {problem}, so it would not run the plugin's "
                f"schedule. megatron-vshape supports {SUPPORTED}; use one of those, or "
                "--pipeline-schedule 1f1b")
    log.info("[vshape] Megatron-LM's %s get their schedule from the plugin's "
             "get_forward_backward_func", " and ".join(f"{n}()" for n in _SCHEDULE_CALLERS))


def _binding_problem(function, config: VShapeConfig) -> str | None:
    """What keeps ``function`` from calling the installed wrapper of ``config``; None if
    nothing does."""
    if function is None:
        return "does not exist"
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None or "get_forward_backward_func" not in code.co_names:
        return "does not call get_forward_backward_func"
    if "get_forward_backward_func" in code.co_varnames:
        return "imports get_forward_backward_func itself (a local binding)"
    found = inspect.unwrap(function).__globals__.get("get_forward_backward_func")
    if not isinstance(found, ForwardBackwardGetter):
        return (f"resolves get_forward_backward_func to {getattr(found, '__module__', '?')}."
                f"{getattr(found, '__qualname__', repr(found))}, not the plugin's wrapper")
    if found.config is not config:
        return (f"resolves get_forward_backward_func to a wrapper of schedule "
                f"{found.config.schedule!r}, not the one installed ({config.schedule!r})")
    return None


def _validating(original):
    def validate_args(args, defaults={}):
        check_flags(args)
        if getattr(args, "hybrid_layer_pattern", None):  # as megatron's validate_args derives
            args.num_layers = hybrid_layer_count(args.hybrid_layer_pattern)  # it, for the checks
        check_arguments(args)
        v = args.pipeline_schedule in V_SCHEDULES
        stage_layers = _place_v_stages(args) if v else None
        layers, align = args.num_layers, getattr(args, "align_param_gather", None)
        if v and layers % args.pipeline_model_parallel_size:
            # Megatron-LM asks num_layers % PP == 0; the V places uneven counts itself
            args.num_layers = -(-layers // args.pipeline_model_parallel_size) * \
                args.pipeline_model_parallel_size
        try:
            result = original(args, defaults)
        finally:
            if v and args.num_layers != layers:
                args.num_layers = layers
                if getattr(args, "encoder_num_layers", None) is not None:
                    args.encoder_num_layers = layers
        if v:
            args.virtual_pipeline_model_parallel_size = 2
            if align is not None:
                args.align_param_gather = align
                log.info("[vshape] %s runs two chunks per rank: align_param_gather=%s again "
                         "(Megatron-LM's warning above is for one-chunk schedules)",
                         args.pipeline_schedule, align)
        import megatron_vshape

        config = megatron_vshape.install(vshape_config(args, stage_layers))
        check_schedule_binding(config)
        log.info("[vshape] pipeline schedule %s installed", args.pipeline_schedule)
        notice = stand_in_notice(args)
        if notice is not None:
            log.info(notice)  # rank 0 only (the script logs INFO there)
        return result
    validate_args.vshape_original = original
    return validate_args


def _place_v_stages(args) -> tuple[int, ...]:
    """A V's stage layout: the layers of each of the 2p stages (stage_layout.py, hybrid.py),
    which the V's model provider builds (VShapeConfig.stage_layers), and the flags that placed
    them cleared: megatron's validate_args and TransformerConfig would read them in their
    interleaved order (a layout's stage s on rank s % p, first/last stage layers split over
    two chunks per rank), and Megatron-LM builds such configs from ``args`` again after
    validation (0.19 pretrain_gpt.py, get_embedding_ranks)."""
    if getattr(args, "hybrid_layer_pattern", None):  # its stages are the pattern's (hybrid.py)
        layers = tuple(hybrid_stage_layers(args.hybrid_layer_pattern,
                                           args.pipeline_model_parallel_size))
        log.info("[vshape] %s hybrid stages %s (layers per V stage: %s)", args.pipeline_schedule,
                 v_pattern(args.hybrid_layer_pattern, args.pipeline_model_parallel_size),
                 ",".join(map(str, layers)))
        return layers
    layout = v_stage_layout(args)
    for name in LAYOUT_FLAGS:
        if hasattr(args, name):
            setattr(args, name, False if name.startswith("account_for") else None)
    log.info("[vshape] %s stage layout %s (layers per V stage: %s)", args.pipeline_schedule,
             layout.megatron_layout(), ",".join(map(str, layout.layers)))
    return tuple(layout.layers)


def _delayed_wgrad_ddp_config(base):
    """DistributedDataParallelConfig whose hooks wait for W when our schedule defers it."""

    @dataclasses.dataclass
    class VShapeDDPConfig(base):
        vshape_delayed = True

        def __post_init__(self):
            config = installed_config()
            if config is not None and config.schedule in OURS:
                self.delay_wgrad_compute = True
            super().__post_init__()

    return VShapeDDPConfig


def v_activation_ratio(schedule_name: str, ranks: int, microbatches: int,
                       stage_layers=None) -> float:
    """Peak activation memory of the schedule that runs, relative to 1F1B's with the layers
    split evenly (megatron's estimate): the plan ``auto`` re-planned to when it has run, else
    the schedule by name. ``stage_layers`` (the layers of each V stage,
    VShapeConfig.stage_layers) weight each stage's activations by its layers, so a rank
    given more layers peaks higher; None (or an even split) is the simulator's own ratio."""
    from megatron.core import pipeline_parallel

    from ..schedule.registry import build_schedule
    from ..schedule.model.simulate import simulate

    running = getattr(pipeline_parallel.get_forward_backward_func(), "last_schedule", None)
    if running is None or (running.ranks, running.microbatches) != (ranks, microbatches):
        running = build_schedule(schedule_name, ranks, microbatches)
    if stage_layers is None:
        return simulate(running).peak_memory_vs_1f1b
    one_f_one_b = sum(stage_layers) / ranks * min(ranks, microbatches)  # rank 0's, in layers
    return max(_layer_weighted_peak(running, stage_layers, r) for r in range(ranks)) \
        / one_f_one_b


def _layer_weighted_peak(schedule, stage_layers, rank: int) -> float:
    """``rank``'s peak activations in layer-microbatches: the simulator's memory model
    (MemoryModel: what F, B and W keep and free), each pass weighted by its stage's layers."""
    import itertools

    from ..schedule.model.costs import MemoryModel

    deltas = MemoryModel().deltas
    steps = (deltas[a.kind] * stage_layers[a.stage] for a in schedule.compute_actions(rank))
    return max(itertools.chain((0.0,), itertools.accumulate(steps)))


def _most_loaded_layers(args, layers) -> int | None:
    """``num_layers`` for megatron's weight formula (it counts num_layers / PP layers and the
    embedding on its most loaded rank): PP times the most layers any rank holds under the V's
    stage layout ``layers``, an upper bound where rank 0, which holds the embedding, holds
    fewer; None without a layout or where megatron's formula reads a per-layer list
    (--moe-layer-freq as a list), which another num_layers would not fit."""
    if not layers or isinstance(getattr(args, "moe_layer_freq", 1), list):
        return None
    p = args.pipeline_model_parallel_size
    return p * max(layers[r] + layers[2 * p - 1 - r] for r in range(p))


def _v_theoretical_memory(original):
    """report_theoretical_memory for V schedules (the installed VShapeConfig's): megatron's
    formulas for 1F1B (the non-interleaved accounting), activations scaled by
    :func:`v_activation_ratio` of the V's stage layers, weights counted for the rank with the
    most layers (:func:`_most_loaded_layers`)."""
    if getattr(original, "vshape_original", None) is not None:
        return original

    @functools.wraps(original)
    def report_theoretical_memory(args, num_microbatches=None, verbose=False):
        config = installed_config()
        if config is None or config.schedule not in V_SCHEDULES:
            return original(args, num_microbatches=num_microbatches, verbose=verbose)
        from megatron.training import theoretical_memory_usage as usage

        one_chunk = copy.copy(args)
        one_chunk.virtual_pipeline_model_parallel_size = None
        most_loaded = copy.copy(one_chunk)
        most_loaded.num_layers = _most_loaded_layers(args, config.stage_layers) or \
            args.num_layers
        mib = usage.NUM_BYTES_IN_MEGABYTE
        weights = usage.compute_weight_and_optimizer_memory(most_loaded) / mib
        activations = (usage.compute_activation_memory if args.sequence_parallel and
                       args.recompute_granularity == "selective" else
                       usage.compute_activation_memory_without_sp)
        ratio = v_activation_ratio(config.schedule, args.pipeline_model_parallel_size,
                                   num_microbatches or args.pipeline_model_parallel_size,
                                   config.stage_layers)
        activation = activations(one_chunk, num_microbatches=num_microbatches) / mib * ratio
        print(f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
              f"activation={activation:.2f} MB, total={weights + activation:.2f} MB "
              f"({config.schedule}: activations {ratio:.2f} x 1F1B's)\n", flush=True)
        return weights, activation, weights + activation

    report_theoretical_memory.vshape_original = original
    return report_theoretical_memory
