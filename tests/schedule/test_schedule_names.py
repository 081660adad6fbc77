"""The one table of schedule names (schedule/names.py): its facts agree with what the builders
make, every layer reads its groups from it, and one check guards a schedule choice."""
import argparse

import pytest

from megatron_vshape.schedule import build_schedule, simulate
from megatron_vshape.schedule.names import (MEGATRON_OWN_SCHEDULES, MEMORY_LEVELS,
                                            PLUGIN_SCHEDULES, SCHEDULE_INFO, SCHEDULES,
                                            V_SCHEDULES, schedule_info)
from megatron_vshape.schedule import ScheduleError


@pytest.mark.parametrize("info", SCHEDULE_INFO, ids=lambda i: i.name)
def test_each_names_facts_are_what_its_builder_makes(info):
    schedule = build_schedule(info.name, 4, 8)
    assert schedule.placement.layout is info.layout and schedule.placement.chunks == info.chunks
    if info.level:  # a memory level holds its bound at every p
        result = simulate(schedule)
        assert result.peak_memory_vs_1f1b <= {"zb-1p": 1.0, "v-min": 0.5, "v-half": 0.75,
                                              "v-zb": 1.0}[info.name] + 1e-9


def test_the_groups_come_from_the_table():
    assert SCHEDULES == ("1f1b", "zb-1p", "interleaved-1f1b", "v-min", "v-half", "v-zb", "auto")
    assert set(PLUGIN_SCHEDULES) | set(MEGATRON_OWN_SCHEDULES) == set(SCHEDULES)
    assert not set(PLUGIN_SCHEDULES) & set(MEGATRON_OWN_SCHEDULES)
    assert V_SCHEDULES == ("v-min", "v-half", "v-zb", "auto")
    assert MEMORY_LEVELS == ("zb-1p", "v-min", "v-half", "v-zb")
    with pytest.raises(ScheduleError, match="unknown schedule 'v-quarter'; valid choices: 1f1b"):
        schedule_info("v-quarter")


def test_every_layer_lists_the_same_names():
    from megatron_vshape.experiments.predict import FAMILIES, V_FAMILIES
    from megatron_vshape.harness.demo import DEMO_SCHEDULES
    from megatron_vshape.harness.gpu_check import CHECK_SCHEDULES
    from megatron_vshape.megatron.install import OURS
    from megatron_vshape.megatron.arguments import add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    choices = next(a.choices for a in parser._actions if a.dest == "pipeline_schedule")
    assert tuple(choices) == SCHEDULES
    assert OURS == PLUGIN_SCHEDULES and V_FAMILIES == V_SCHEDULES
    assert DEMO_SCHEDULES == CHECK_SCHEDULES == ("1f1b",) + PLUGIN_SCHEDULES
    assert set(FAMILIES) == set(SCHEDULES) | {"1f1b-r"}


@pytest.mark.parametrize("settings,needle", [
    (dict(schedule="v-third"), "unknown schedule 'v-third'; valid choices: 1f1b"),
    (dict(schedule="v-half", variant="best"), "unknown schedule variant 'best'"),
    (dict(schedule="v-half", timeout=0), "timeout must be > 0"),
    (dict(schedule="v-half", replan_after=-1), "replan_after must be >= 0"),
    (dict(schedule="v-half", variant="paper", replan_after=2), "is a fixed order"),
])
def test_one_check_guards_both_entry_points(settings, needle):
    from megatron_vshape.megatron.forward_backward import VShapeForwardBackward
    from megatron_vshape.megatron.install import VShapeConfig

    messages = []
    for entry in (VShapeConfig, VShapeForwardBackward):
        with pytest.raises(ValueError, match=needle) as err:
            entry(**settings)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
