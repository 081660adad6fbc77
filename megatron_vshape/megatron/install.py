"""Plug the V schedules into megatron: wrap ``get_forward_backward_func`` where it is bound.

megatron-core has no schedule registry; ``get_forward_backward_func`` is a plain function bound
by name in ``megatron.core.pipeline_parallel.schedules``, ``megatron.core.pipeline_parallel``
and (Megatron-LM) ``megatron.training.training``. :func:`install` replaces it in each with a
wrapper that returns our forward-backward function when the plugin's schedule is one of ours
and pipeline parallelism is on, and megatron's own otherwise. Installing again only changes
the configuration; :func:`uninstall` puts the originals back.

:func:`install` first checks the megatron-core version (versions.py). It also guards megatron's
own schedule functions in ``megatron.core.pipeline_parallel.schedules`` (no pipelining,
1F1B, interleaved 1F1B): a training loop that reaches one of them by a name not wrapped here
(a newer Megatron-LM binding, a direct call) with V-placed chunks (model.py marks them) fails
naming the problem, instead of running the interleaved order on chunks placed as a V, which
trains a different model silently.
"""
from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass

from ..schedule.model.limits import MemoryLimit
from ..schedule.names import PLUGIN_SCHEDULES, REFERENCE
from .forward_backward import VShapeForwardBackward, checked_settings
from .model import is_v_placed
from .touch_points import check_touch_points
from .versions import check_megatron_core_version

__all__ = ["VShapeConfig", "install", "uninstall", "installed_config", "OURS",
           "MEGATRON_SCHEDULES", "VPlacementError", "ForwardBackwardGetter"]

OURS = PLUGIN_SCHEDULES
"""Schedules this plugin runs; 1f1b and interleaved-1f1b stay megatron's own
(schedule/names.py)."""

_NAMESPACES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel",
               "megatron.training.training")

_SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
MEGATRON_SCHEDULES = ("forward_backward_no_pipelining",
                      "forward_backward_pipelining_without_interleaving",
                      "forward_backward_pipelining_with_interleaving")
"""megatron's own schedule functions, guarded against V-placed chunks while installed."""


class VPlacementError(RuntimeError):
    """One of megatron's own schedules was given V-placed model chunks."""


@dataclass(frozen=True)
class VShapeConfig:
    """Which pipeline schedule megatron's training loop runs."""

    schedule: str = REFERENCE
    """One of 1f1b, interleaved-1f1b (megatron's own), zb-1p, v-min, v-half, v-zb, auto."""
    memory_limit: MemoryLimit | str | None = None
    """auto: peak activation memory per rank, a fraction of 1F1B's ("0.5") or bytes ("40GiB")."""
    costs: object = None
    """auto: schedule.Costs of one rank's layer share (None: F = B = W until re-planned)."""
    replan_after: int = 0
    """auto and the memory levels' fastest variant: re-plan from the costs and memory measured
    in this many first iterations."""
    variant: str = "fastest"
    """zb-1p, v-min, v-half, v-zb: ``fastest`` (the fastest order within the name's memory
    bound, re-planned from measured costs) or ``paper`` (the paper's fixed order)."""
    losses_on_last_rank: bool = False
    """Hand the loss dicts to the last pipeline rank, where Megatron-LM's loop logs them."""
    timeout: float = 600.0
    """Seconds a point-to-point wait may take before failing with rank, step and action."""
    stage_layers: tuple[int, ...] | None = None
    """A V's transformer layers in each of its 2p stages, in V order (megatron's layout flags
    or a hybrid pattern, read at argument checking: stage_layout.py, hybrid.py), which the V's
    model provider builds and the memory report weighs; None: the even split."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_limit", checked_settings(
            self.schedule, self.variant, self.replan_after, self.timeout, self.memory_limit))


class ForwardBackwardGetter:
    """The replacement ``get_forward_backward_func`` (keeps the original for delegation)."""

    def __init__(self, original, config: VShapeConfig):
        self.original = original
        self.config = config
        self.ours = (VShapeForwardBackward(
            config.schedule, config.memory_limit, config.costs, config.timeout,
            replan_after=config.replan_after, variant=config.variant, losses_on_last_rank=config.losses_on_last_rank)
            if config.schedule in OURS else None)

    def __call__(self, pp_size=None, vp_size=None, **kwargs):
        """megatron's parameters: (pp_size, vp_size) in 0.16, plus schedule_pg_collection in
        0.19 (Megatron-LM 0.19's loop passes only that one); others are handed on."""
        if self.ours is not None and _pipeline_size(pp_size, kwargs) > 1:
            return self.ours
        return self.original(pp_size, vp_size, **kwargs) if (pp_size or vp_size or kwargs) \
            else self.original()


def _pipeline_size(pp_size, kwargs) -> int:
    """The pipeline size megatron would choose the schedule by: ``pp_size``, else the
    schedule_pg_collection's pipeline group (megatron-core 0.19), else parallel_state's."""
    if pp_size is not None:
        return pp_size
    collection = kwargs.get("schedule_pg_collection")
    if collection is not None:
        if not hasattr(collection, "pp"):  # 0.19's MultiModuleProcessGroupCollection
            raise ValueError(
                f"V and zero-bubble schedules run one model per pipeline; got a "
                f"{type(collection).__name__} (multi-module pipeline): use --pipeline-schedule "
                "1f1b (megatron's own) for multi-module pipelines")
        return collection.pp.size()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def _guarded(function, name: str):
    """megatron's schedule ``function``, refusing V-placed chunks (see module doc)."""

    @functools.wraps(function)
    def guarded(*args, **kwargs):
        model = kwargs.get("model")
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if any(is_v_placed(c) for c in chunks if c is not None):
            raise VPlacementError(
                f"megatron's own {name} was called with V-placed model chunks (built by "
                "megatron_vshape.megatron.model.build_v_chunk): megatron's schedules run the "
                "interleaved placement (stage s on rank s % p), not the V, and would train "
                "another model silently. The training loop reached it through a name "
                "megatron_vshape.install() does not wrap (it wraps get_forward_backward_func in "
                f"{', '.join(_NAMESPACES)}): call get_forward_backward_func from one of those, "
                "or call the function it returns for a V schedule")
        return function(*args, **kwargs)

    guarded.vshape_original = function
    return guarded


def _guard_megatron_schedules(module) -> None:
    """Wrap megatron's own schedule functions in ``module`` (idempotent)."""
    for name in MEGATRON_SCHEDULES:
        current = getattr(module, name, None)
        if current is not None and not hasattr(current, "vshape_original"):
            setattr(module, name, _guarded(current, name))


def _unguard_megatron_schedules(module) -> None:
    for name in MEGATRON_SCHEDULES:
        current = getattr(module, name, None)
        if hasattr(current, "vshape_original"):
            setattr(module, name, current.vshape_original)


def install(config: VShapeConfig = VShapeConfig()) -> VShapeConfig:
    """Route megatron's schedule choice through ``config`` (idempotent; see module doc).

    Checks the megatron-core version first (versions.check_megatron_core_version: an
    unsupported one raises, unless VSHAPE_ALLOW_UNSUPPORTED_MEGATRON=1), then that every
    megatron-core name the plugin relies on is there (touch_points.py)."""
    check_megatron_core_version()
    check_touch_points()
    found = False
    for name in _NAMESPACES:
        module = _module(name)
        if module is None or not hasattr(module, "get_forward_backward_func"):
            continue
        current = module.get_forward_backward_func
        original = current.original if isinstance(current, ForwardBackwardGetter) else current
        module.get_forward_backward_func = ForwardBackwardGetter(original, config)
        found = True
    if not found:
        raise ImportError("megatron-core is not importable: pip install 'megatron-core==0.16.*'")
    _guard_megatron_schedules(sys.modules[_SCHEDULES_MODULE])
    return config


def installed_config() -> VShapeConfig | None:
    """The configuration :func:`install` put in megatron's schedule choice, None before (or
    after :func:`uninstall`): the one object the training script, the DDP config and the
    memory report read the running schedule from, so that it is decided once, from the
    arguments, and never re-read from Megatron-LM's global args."""
    getter = getattr(sys.modules.get(_NAMESPACES[1]), "get_forward_backward_func", None)
    return getter.config if isinstance(getter, ForwardBackwardGetter) else None


def uninstall() -> None:
    """Restore megatron's own ``get_forward_backward_func`` and schedule functions."""
    for name in _NAMESPACES:
        module = sys.modules.get(name)
        current = getattr(module, "get_forward_backward_func", None)
        if isinstance(current, ForwardBackwardGetter):
            module.get_forward_backward_func = current.original
    if _SCHEDULES_MODULE in sys.modules:
        _unguard_megatron_schedules(sys.modules[_SCHEDULES_MODULE])


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
