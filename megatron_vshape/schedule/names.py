"""Every schedule name and its facts: the one table the rest of the package reads.

Which names place two model chunks per rank as a V, which are megatron-core's own (the plugin
hands them back to megatron), which are memory levels (the fastest order found within the
name's bound, schedule/search/levels.py), which split W from B, which take a memory limit, and
in a few words what each is and how much activation memory it keeps. The names themselves
(:data:`AUTO`, :data:`REFERENCE`, ...), the groups the code needs (:data:`V_SCHEDULES`,
:data:`PLUGIN_SCHEDULES`, ...) and the one check of a name (:func:`schedule_info`) are here,
never written out again elsewhere (tests/schedule/test_schedule_names.py counts the literals).
"""
from __future__ import annotations

from dataclasses import dataclass

from .model.actions import ScheduleError
from .model.placement import Layout

__all__ = ["ScheduleInfo", "SCHEDULE_INFO", "SCHEDULES", "PLUGIN_SCHEDULES",
           "MEGATRON_OWN_SCHEDULES", "V_SCHEDULES", "MEMORY_LEVELS", "schedule_info",
           "megatrons_own", "ONE_F_ONE_B", "ZB_1P", "INTERLEAVED_1F1B", "V_MIN", "V_HALF", "V_ZB",
           "AUTO", "REFERENCE"]

ONE_F_ONE_B = "1f1b"
ZB_1P = "zb-1p"
INTERLEAVED_1F1B = "interleaved-1f1b"
V_MIN = "v-min"
V_HALF = "v-half"
V_ZB = "v-zb"
AUTO = "auto"
"""The adaptive search (search/adaptive.py): the fastest V order under a memory limit."""
REFERENCE = ONE_F_ONE_B
"""megatron's default 1F1B: what every speed-up, memory ratio and loss is compared against."""


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
    memory_limited: bool
    """The name takes a memory limit (``--pipeline-memory-limit``): the adaptive search under
    it (``auto``); the others keep a fixed bound."""
    splits_w: bool
    """The backward runs as B (input gradient) and a later W (weight gradient); megatron's own
    run one fused BW."""
    memory: str
    """Peak activation memory, in a user's words, against 1F1B's."""
    what: str
    """What the schedule is, in a user's words (the CLI's ``description``, cli/schedules.py)."""

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return self.layout.chunks


SCHEDULE_INFO = (
    #            name              layout         own    level  limit  W split
    ScheduleInfo(ONE_F_ONE_B,      Layout.SINGLE, True,  False, False, False,
                 "1F1B's: p microbatches in flight",
                 "1F1B, megatron's default order: one forward, one backward"),
    ScheduleInfo(ZB_1P,            Layout.SINGLE, False, True,  False, True,
                 "1F1B's, with W split from B",
                 "zero bubble (ZB-1P): the backward split into input and weight gradient, "
                 "weight gradients fill the waits"),
    ScheduleInfo(INTERLEAVED_1F1B, Layout.LOOP,   True,  False, False, False,
                 "about 1.5 x 1F1B's",
                 "megatron's interleaved 1F1B"),
    ScheduleInfo(V_MIN,            Layout.V,      False, True,  False, True,
                 "about 1/3 of 1F1B's",
                 "V-shape at V-Min's memory (about 1/3 of 1F1B's)"),
    ScheduleInfo(V_HALF,           Layout.V,      False, True,  False, True,
                 "about 1/2 of 1F1B's",
                 "V-shape at V-Half's memory (about 1/2 of 1F1B's)"),
    ScheduleInfo(V_ZB,             Layout.V,      False, True,  False, True,
                 "1F1B's, near-zero bubble",
                 "V-shape zero bubble (V-ZB) at 1F1B's memory"),
    ScheduleInfo(AUTO,             Layout.V,      False, False, True,  True,
                 "what the memory limit allows",
                 "the fastest V-shape order found under the memory limit"),
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


def schedule_info(name: str, setting: str | None = None,
                  choices: tuple[str, ...] = SCHEDULES) -> ScheduleInfo:
    """The facts of ``name``: the one check of a schedule name. A name outside ``choices``
    (default every name; a command that runs fewer passes its own) is an error naming
    ``setting`` (the flag or key it came from) and the valid choices."""
    if name not in choices:
        where = f"{setting}: " if setting else ""
        raise ScheduleError(f"{where}unknown schedule {name!r}; valid choices: "
                            f"{', '.join(choices)}")
    return next(info for info in SCHEDULE_INFO if info.name == name)


def megatrons_own(layout: Layout) -> str:
    """megatron-core's own schedule for a chunk layout: 1F1B for one chunk per rank, the
    interleaved 1F1B for its loop of virtual stages."""
    return next(i.name for i in SCHEDULE_INFO if i.megatrons_own and i.layout is layout)
