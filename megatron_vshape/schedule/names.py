"""Every schedule name and its facts: the one table the rest of the package reads.

Which names place two model chunks per rank as a V, which are megatron-core's own (the plugin
hands them back to megatron), which are memory levels (the fastest order found within the
name's bound, schedule/search/levels.py), and in a few words how much activation memory each
keeps. The groups the code needs (:data:`V_SCHEDULES`, :data:`PLUGIN_SCHEDULES`, ...) are
derived here, never written out again elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model.actions import ScheduleError
from .model.placement import Layout

__all__ = ["ScheduleInfo", "SCHEDULE_INFO", "SCHEDULES", "PLUGIN_SCHEDULES",
           "MEGATRON_OWN_SCHEDULES", "V_SCHEDULES", "MEMORY_LEVELS", "schedule_info"]


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule name's facts."""

    name: str
    layout: Layout
    """SINGLE: one chunk per rank; V: two, stage r and 2p-1-r on rank r; LOOP: two, megatron's
    interleaved placement."""
    megatrons_own: bool
    """megatron-core runs it (1f1b, interleaved-1f1b); the plugin runs the others."""
    level: bool
    """A memory level: the name is a memory bound, and the plugin runs the fastest order it
    finds within it for the measured costs (unless the paper's fixed order is asked for)."""
    memory: str
    """Peak activation memory, in a user's words, against 1F1B's."""

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return self.layout.chunks


SCHEDULE_INFO = (
    ScheduleInfo("1f1b", Layout.SINGLE, True, False, "1F1B's: p microbatches in flight"),
    ScheduleInfo("zb-1p", Layout.SINGLE, False, True, "1F1B's, with W split from B"),
    ScheduleInfo("interleaved-1f1b", Layout.LOOP, True, False, "about 1.5 x 1F1B's"),
    ScheduleInfo("v-min", Layout.V, False, True, "about 1/3 of 1F1B's"),
    ScheduleInfo("v-half", Layout.V, False, True, "about 1/2 of 1F1B's"),
    ScheduleInfo("v-zb", Layout.V, False, True, "1F1B's, near-zero bubble"),
    ScheduleInfo("auto", Layout.V, False, False, "what the memory limit allows"),
)
"""In the order the CLI and tables list them."""

SCHEDULES = tuple(i.name for i in SCHEDULE_INFO)
"""Every schedule name; ``auto`` is the adaptive search (search/adaptive.py) under a memory
limit."""
PLUGIN_SCHEDULES = tuple(i.name for i in SCHEDULE_INFO if not i.megatrons_own)
"""The schedules the plugin runs."""
MEGATRON_OWN_SCHEDULES = tuple(i.name for i in SCHEDULE_INFO if i.megatrons_own)
"""The schedules megatron-core runs itself."""
V_SCHEDULES = tuple(i.name for i in SCHEDULE_INFO if i.layout is Layout.V)
"""The schedules that place two chunks per rank as a V."""
MEMORY_LEVELS = tuple(i.name for i in SCHEDULE_INFO if i.level)
"""The names that are memory bounds (search/levels.py)."""


def schedule_info(name: str) -> ScheduleInfo:
    """The facts of ``name``; an unknown name is an error listing the valid ones."""
    for info in SCHEDULE_INFO:
        if info.name == name:
            return info
    raise ScheduleError(f"unknown schedule {name!r}; valid choices: {', '.join(SCHEDULES)}")
