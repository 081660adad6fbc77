"""The one table of schedule names (schedule/names.py): its facts agree with what the builders
make, every layer reads its groups from it, and one check guards a schedule choice."""
import argparse
import ast
import re
from pathlib import Path

import pytest

import megatron_vshape
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


# -- no name or description written twice --------------------------------------------------------

_PACKAGE = Path(megatron_vshape.__file__).parent
_DEVICE = "the --device choice auto (cuda when torch sees a GPU, else cpu), not a schedule"
_ALLOWED = {("cli/gpu_check.py", "auto"): _DEVICE, ("cli/profile.py", "auto"): _DEVICE}
"""(module, literal) written outside names.py, each with why it is not a schedule name."""


def _modules():
    for path in sorted(_PACKAGE.rglob("*.py")):
        yield path.relative_to(_PACKAGE).as_posix(), ast.parse(path.read_text())


def _schedule_name_literals() -> list[tuple[str, int, str]]:
    """Every str constant of the package outside schedule/names.py that is a schedule name, or
    a comma-separated list of them ("1f1b,zb-1p"): (module, line, literal)."""
    found = []
    for module, tree in _modules():
        if module == "schedule/names.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts = [part.strip() for part in node.value.split(",")]
                if all(part in SCHEDULES for part in parts):
                    found.append((module, node.lineno, node.value))
    return found


def test_no_schedule_name_is_written_outside_the_table():
    """Names and facts come from schedule/names.py (102 literals before it was the one place,
    6 after: the --device choice, which is no schedule)."""
    found = _schedule_name_literals()
    assert [f for f in found if (f[0], f[2]) not in _ALLOWED] == []
    assert {(module, literal) for module, _, literal in found} == set(_ALLOWED), \
        "an allowed literal is gone: drop it from _ALLOWED"


def test_no_code_reads_a_description_back():
    """Provenance is data (model/provenance.py): no substring test on a description, nor on
    the steps of a provenance (``"re-laid" in step`` for step in provenance)."""
    bad = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                     for op in node.ops):
                if any("description" in ast.unparse(c) for c in node.comparators):
                    bad.append((module, node.lineno, ast.unparse(node)))
            if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp)):
                for loop in node.generators:
                    if "provenance" not in ast.unparse(loop.iter):
                        continue
                    target = ast.unparse(loop.target)
                    bad += [(module, c.lineno, ast.unparse(c)) for c in ast.walk(node.elt)
                            if isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.In)
                            and ast.unparse(c.comparators[0]) == target]
    assert bad == []


@pytest.mark.parametrize("call,needle", [
    (lambda: build_schedule("v-third", 4, 8), "unknown schedule 'v-third'; valid choices: 1f1b"),
    (lambda: schedule_info("v-third", "--schedules", PLUGIN_SCHEDULES),
     "--schedules: unknown schedule 'v-third'; valid choices: zb-1p, v-min"),
    (lambda: schedule_info("1f1b", "memory level", MEMORY_LEVELS),
     "memory level: unknown schedule '1f1b'; valid choices: zb-1p, v-min, v-half, v-zb"),
])
def test_one_check_one_message(call, needle):
    with pytest.raises(ScheduleError, match=re.escape(needle)):
        call()
