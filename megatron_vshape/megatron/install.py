"""Plug the V schedules into megatron: wrap ``get_forward_backward_func`` where it is bound.

megatron-core has no schedule registry; ``get_forward_backward_func`` is a plain function bound
by name in ``megatron.core.pipeline_parallel.schedules``, ``megatron.core.pipeline_parallel``
and (Megatron-LM) ``megatron.training.training``. :func:`install` replaces it in each with a
wrapper that returns our forward-backward function when the plugin's schedule is one of ours
and pipeline parallelism is on, and megatron's own otherwise. Installing again only changes
the configuration; :func:`uninstall` puts the originals back.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from ..schedule.model.limits import MemoryLimit
from ..schedule.registry import SCHEDULES, VARIANTS
from .forward_backward import VShapeForwardBackward, replans

__all__ = ["VShapeConfig", "install", "uninstall", "OURS"]

OURS = ("zb-1p", "v-min", "v-half", "v-zb", "auto")
"""Schedules this plugin runs; 1f1b and interleaved-1f1b stay megatron's own."""

_NAMESPACES = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel",
               "megatron.training.training")


@dataclass(frozen=True)
class VShapeConfig:
    """Which pipeline schedule megatron's training loop runs."""

    schedule: str = "1f1b"
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

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r} is unknown; valid choices: "
                             f"{', '.join(SCHEDULES)}")
        if self.timeout <= 0:
            raise ValueError(f"VShapeConfig.timeout must be > 0 seconds, got {self.timeout}")
        if isinstance(self.memory_limit, str):
            object.__setattr__(self, "memory_limit",
                               MemoryLimit.parse(self.memory_limit, "memory_limit"))
        if self.replan_after < 0:
            raise ValueError(f"VShapeConfig.replan_after must be >= 0, got {self.replan_after}")
        if self.variant not in VARIANTS:
            raise ValueError(f"VShapeConfig.variant {self.variant!r} is unknown; valid choices: "
                             f"{', '.join(VARIANTS)}")
        if self.replan_after and not replans(self.schedule, self.variant):
            raise ValueError(f"replan_after re-plans auto and the fastest variant of zb-1p, v-min, "
                             f"v-half and v-zb, not {self.schedule!r} ({self.variant})")


class _Wrapper:
    """The replacement ``get_forward_backward_func`` (keeps the original for delegation)."""

    def __init__(self, original, config: VShapeConfig):
        self.original = original
        self.config = config
        self.ours = (VShapeForwardBackward(
            config.schedule, config.memory_limit, config.costs, config.timeout,
            replan_after=config.replan_after, variant=config.variant, losses_on_last_rank=config.losses_on_last_rank)
            if config.schedule in OURS else None)

    def __call__(self, pp_size=None, vp_size=None, **kwargs):
        if self.ours is not None and _pipeline_size(pp_size) > 1:
            return self.ours
        return self.original(pp_size, vp_size, **kwargs) if (pp_size or vp_size or kwargs) \
            else self.original()


def _pipeline_size(pp_size):
    if pp_size is not None:
        return pp_size
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def install(config: VShapeConfig = VShapeConfig()) -> VShapeConfig:
    """Route megatron's schedule choice through ``config`` (idempotent; see module doc)."""
    found = False
    for name in _NAMESPACES:
        module = _module(name)
        if module is None or not hasattr(module, "get_forward_backward_func"):
            continue
        current = module.get_forward_backward_func
        original = current.original if isinstance(current, _Wrapper) else current
        module.get_forward_backward_func = _Wrapper(original, config)
        found = True
    if not found:
        raise ImportError("megatron-core is not importable: pip install 'megatron-core==0.16.*'")
    return config


def uninstall() -> None:
    """Restore megatron's own ``get_forward_backward_func`` everywhere."""
    for name in _NAMESPACES:
        module = sys.modules.get(name)
        current = getattr(module, "get_forward_backward_func", None)
        if isinstance(current, _Wrapper):
            module.get_forward_backward_func = current.original


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
