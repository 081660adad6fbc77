"""Pure-Python schedule core: actions, building blocks, compose, search, simulate, validate, render.

Standard library only (no torch, numpy or megatron), so it runs on a laptop.
"""
from .actions import Action, PassKind, ScheduleError, parse_action
from .blocks import BuildingBlock, BlockFamily
from .compose import compose, repeat
from .costs import Costs, MemoryModel, parse_costs
from .lower import lower
from .placement import Layout, Placement
from .registry import SCHEDULES, build_schedule
from .schedule import Schedule
from .search import InfeasibleMemoryError, SearchResult, frontier, memory_limit_units, search
from .simulate import SimResult, simulate
from .validate import ValidationError, validate

__all__ = [
    "Action", "PassKind", "ScheduleError", "parse_action", "BuildingBlock", "BlockFamily",
    "compose", "repeat", "Costs", "MemoryModel", "parse_costs", "lower", "Layout", "Placement",
    "SCHEDULES", "build_schedule", "Schedule", "SimResult", "simulate", "ValidationError",
    "validate", "InfeasibleMemoryError", "SearchResult", "frontier", "memory_limit_units", "search",
]
