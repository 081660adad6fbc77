"""Pure-Python schedule core, standard library only (no torch, numpy or megatron): it runs on a
laptop. Grouped by job (docs/design.md draws how they fit together)::

    model/      what a schedule is and what it costs: actions, placement, the Schedule value,
                costs and memory model, the dependency rule, simulator, validator, limits, lower
    construct/  orders made from the setting: building blocks, repeat/squeeze (compose) and
                its reorders, the V family, continuous offsets, greedy and wave orders, the
                named (paper) orders
    rewrite/    a finished order made faster: replayed in time, warm-up and cool-down re-laid,
                gaps filled, W passes deferred, the cool-down re-scheduled critical path first
    search/     choosing the best order: the adaptive search under a memory limit, the local
                search over orders, the named memory levels, bounds
    io/         text/SVG/PNG renderers, torch.distributed.pipelining CSV
    registry    schedule names -> schedules (the one place names are looked up)

Imports point down that list: model imports nothing of the others (but io's step renderer for
error messages), construct imports model, rewrite imports construct and model, search all
three, registry all of them.
"""
from .construct.blocks import BlockFamily, BuildingBlock
from .construct.compose import compose, repeat
from .model.actions import Action, PassKind, ScheduleError, parse_action
from .model.costs import Costs, MemoryModel, PassTimes, parse_costs, parse_memory_model
from .model.limits import memory_limit_units
from .model.lower import lower
from .model.placement import Layout, Placement
from .model.problem import Problem
from .model.schedule import Schedule
from .model.simulate import SimResult, simulate
from .model.stage_costs import parse_stage_costs
from .model.validate import ValidationError, validate
from .registry import SCHEDULES, VARIANTS, build_schedule
from .search.adaptive import InfeasibleMemoryError, SearchResult, frontier, search

__all__ = [
    "Action", "PassKind", "ScheduleError", "parse_action", "BuildingBlock", "BlockFamily",
    "compose", "repeat", "Costs", "MemoryModel", "PassTimes", "parse_costs", "parse_stage_costs",
    "parse_memory_model", "lower", "Layout", "Placement",
    "Problem", "SCHEDULES", "VARIANTS", "build_schedule", "Schedule", "SimResult", "simulate", "ValidationError",
    "validate", "InfeasibleMemoryError", "SearchResult", "frontier", "memory_limit_units", "search",
]
