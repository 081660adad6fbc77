"""The inventory of megatron names the plugin relies on (megatron/touch_points.py).

Three kinds of test:

- complete (no megatron needed): the glue's source, read with ``ast``, uses no megatron-core or
  Megatron-LM name the inventory leaves out (imports, attributes of names bound to megatron
  modules, ``getattr``/``hasattr``/``setattr`` with a constant name, module paths written as
  strings), and the inventory lists nothing the glue no longer uses;
- the verifier (no megatron needed): a fake megatron package tree in a temporary folder, with
  one listed name removed, renamed or changed, makes :func:`check_touch_points` fail naming it;
- the inventory holds (``megatron_versions``, run in every megatron-core environment): every
  row's name is found exactly where its ``versions`` say, the start-up checks pass, and
  ``install()`` refuses a megatron that lacks a listed name before it wraps anything.
"""
from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_vshape.megatron import touch_points as tp
from megatron_vshape.megatron.touch_points import (Kind, Side, TOUCH_POINTS, TouchPoint,
                                                   TouchPointError, check_touch_points)
from megatron_vshape.megatron.versions import supported_description

REPO = Path(__file__).resolve().parents[2]
GLUE = sorted(p for p in (REPO / "megatron_vshape").rglob("*.py")
              if "schedule" not in p.relative_to(REPO).parts and p.name != "touch_points.py") \
    + [REPO / "scripts" / "pretrain_gpt_vshape.py", REPO / "scripts" / "pretrain_hybrid_vshape.py"]
"""The plugin's code that may touch megatron (schedule/ is pure Python, tested elsewhere; the
inventory itself is not a use)."""

MEGATRON_LM_MODULES = ("pretrain_gpt", "gpt_builders", "model_provider", "pretrain_hybrid",
                       "hybrid_builders")
"""Megatron-LM's top-level modules (its repository root), as the script imports them."""

_MODULE_STRING = re.compile(r"^megatron(\.[A-Za-z_]\w*)+$")


# -- reading the glue --------------------------------------------------------------------------
def _is_megatron(module: str) -> bool:
    return module.split(".")[0] in ("megatron",) + MEGATRON_LM_MODULES


def _chain(node) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"] (None for anything but names and attributes)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


class GlueUse:
    """What one file of the glue takes from megatron."""

    def __init__(self, path: Path):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        self.names: set[str] = set()
        """Dotted megatron names used: imports, attributes, constant get/has/setattr."""
        self.module_strings: set[str] = set()
        """Module paths written as strings (the rebinding loops, feature probes)."""
        self.words: set[str] = set()
        """Every attribute name, string constant, name and keyword (what rows set or read on
        megatron's objects)."""
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_megatron(alias.name):
                        self.names.add(alias.name)
                        top = alias.name if alias.asname else alias.name.split(".")[0]
                        bound[alias.asname or top] = top
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    _is_megatron(node.module):
                for alias in node.names:
                    self.names.add(f"{node.module}.{alias.name}")
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.words.add(node.value)
                if _MODULE_STRING.match(node.value):
                    self.module_strings.add(node.value)
            elif isinstance(node, ast.Attribute):
                self.words.add(node.attr)
            elif isinstance(node, ast.Name):
                self.words.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:
                self.words.add(node.arg)
        for node in ast.walk(tree):
            chain = None
            if isinstance(node, ast.Attribute):
                chain = _chain(node)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant):
                chain = _chain(node.args[0])
                chain = None if chain is None else chain + [node.args[1].value]
            if chain and chain[0] in bound and not chain[-1].startswith("vshape_"):
                self.names.add(".".join([bound[chain[0]]] + chain[1:]))  # the plugin's marks


@pytest.fixture(scope="module")
def glue():
    return {path.relative_to(REPO).as_posix(): GlueUse(path) for path in GLUE}


def _path(row: TouchPoint) -> str:
    """The dotted name a row stands for (the module for SOURCE, FLAG and module rows)."""
    if row.kind in (Kind.SOURCE, Kind.FLAG) or not row.name:
        return row.module
    return f"{row.module}.{row.name}"


def _covers(path: str, used: str) -> bool:
    return path == used or path.startswith(used + ".")


def test_every_megatron_name_the_glue_uses_is_listed(glue):
    """A name the glue imports or reaches through a megatron module, and every module path it
    writes as a string, is a row of the inventory (or a package or class above one)."""
    paths = {_path(row) for row in TOUCH_POINTS}
    unlisted = sorted({f"{used}  ({file})" for file, use in glue.items()
                       for used in use.names | use.module_strings
                       if not any(_covers(path, used) for path in paths)})
    assert not unlisted, "megatron names the glue uses that touch_points.py does not list " \
                         "(add a row):\n" + "\n".join(unlisted)


def test_every_listed_name_is_still_used(glue):
    """Each row is something the glue still uses: its name reached through an import; for a
    name the glue binds by a module path in a string, that path and the name in the glue's
    source; for attributes of megatron's objects (fields, methods, what megatron's code reads),
    the attribute's name in the glue's source."""
    names = set().union(*(use.names for use in glue.values()))
    modules = set().union(*(use.module_strings for use in glue.values()))
    words = set().union(*(use.words for use in glue.values()))
    stale = []
    for row in TOUCH_POINTS:
        path = _path(row)
        if any(_covers(used, path) for used in names) and \
                row.kind not in (Kind.SOURCE, Kind.FLAG, Kind.FIELD):
            continue
        word = re.split(r"[.]", row.name)[-1] if row.name else ""
        on_objects = row.kind in (Kind.SOURCE, Kind.FLAG, Kind.FIELD) or "." in row.name
        module_named = on_objects or row.module in modules or \
            any(_covers(used, row.module) for used in names)
        if module_named and (not word or word in words):
            continue
        stale.append(row.label)
    assert not stale, "rows of touch_points.py the glue no longer uses (remove them):\n" + \
        "\n".join(stale)


def test_the_scan_sees_each_way_of_touching_megatron(tmp_path):
    """The reader itself: imports, aliases, attribute chains, constant getattr and module
    strings are found; the plugin's own ``vshape_`` marks are not megatron names."""
    path = tmp_path / "glue.py"
    path.write_text(textwrap.dedent('''
        import megatron.core.models.gpt
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import layers
        import pretrain_gpt
        _NAMES = ("megatron.training.training", "not a megatron.module")
        def f():
            ps.get_pipeline_model_parallel_rank()
            getattr(layers, "fused_kernel", None)
            layers.Linear.vshape_base
            pretrain_gpt.is_dataset_built_on_rank = None
    '''), encoding="utf-8")
    use = GlueUse(path)
    assert use.names == {
        "megatron.core.models.gpt", "megatron.core.parallel_state",
        "megatron.core.parallel_state.get_pipeline_model_parallel_rank",
        "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.layers.Linear",
        "megatron.core.tensor_parallel.layers.fused_kernel", "pretrain_gpt",
        "pretrain_gpt.is_dataset_built_on_rank"}
    assert use.module_strings == {"megatron.training.training"}


def test_rows_are_one_per_name_and_side():
    """No row twice (a name bound in several modules is one row per module)."""
    keys = [(row.label, row.side) for row in TOUCH_POINTS]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    assert {row.side for row in TOUCH_POINTS} == set(Side)


# -- the verifier, on a fake megatron ----------------------------------------------------------
_FAKE = {
    "fakemeg/__init__.py": "",
    "fakemeg/schedules.py": '''
        def get_forward_backward_func(pp_size=None, vp_size=None):
            return None

        def forward_step(func, data, model, *, vp_stage=None, is_last_stage=None):
            return None
    ''',
    "fakemeg/layers.py": '''
        import dataclasses

        class Linear:
            @staticmethod
            def backward(ctx, grad):
                return ctx.sequence_parallel

        @dataclasses.dataclass
        class Config:
            delay_wgrad_compute: bool = False
    ''',
}


def _fake_rows():
    rows = [("fakemeg.schedules", "get_forward_backward_func", Kind.CALLABLE, ()),
            ("fakemeg.schedules", "forward_step", Kind.CALLABLE, ("vp_stage", "is_last_stage")),
            ("fakemeg.schedules", "forward_step", Kind.CALLABLE, None),
            ("fakemeg.layers", "Linear", Kind.CLASS, ()),
            ("fakemeg.layers", "Linear.backward", Kind.CALLABLE, ()),
            ("fakemeg.layers", "Config.delay_wgrad_compute", Kind.FIELD, ()),
            ("fakemeg.layers", "ctx.sequence_parallel", Kind.SOURCE, ()),
            ("fakemeg.layers", "", Kind.MODULE, ()),
            ("fakemeg.gpu_only", "", Kind.SPEC, ())]
    return [TouchPoint(module, name, "a test's use", "tests/", kind, params=params or (),
                       leading=("func", "data", "model") if params is None else ())
            for module, name, kind, params in rows]


@pytest.fixture
def fake_megatron(tmp_path, monkeypatch):
    """Writes the fake package (``fake_megatron(changes)`` edits files first) and puts it on
    sys.path; its modules are forgotten again after the test."""
    def write(changes=None):
        files = dict(_FAKE, **{"fakemeg/gpu_only.py": "raise ImportError('needs a GPU')"})
        files.update(changes or {})
        for name, text in files.items():
            target = tmp_path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if text is None:
                target.unlink(missing_ok=True)
            else:
                target.write_text(textwrap.dedent(text), encoding="utf-8")
        for name in [m for m in sys.modules if m == "fakemeg" or m.startswith("fakemeg.")]:
            monkeypatch.delitem(sys.modules, name)
        return _fake_rows()

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in [m for m in sys.modules if m == "fakemeg" or m.startswith("fakemeg.")]:
        del sys.modules[name]


def test_all_names_present_passes(fake_megatron):
    rows = fake_megatron()
    check_touch_points((Side.CORE,), rows)
    assert tp.touch_point_problems((Side.CORE,), rows) == []


@pytest.mark.parametrize("changes, named, problem", [
    ({"fakemeg/schedules.py": "def get_forward_backward_func(): pass\n"},
     "fakemeg.schedules.forward_step", "missing"),
    ({"fakemeg/schedules.py": _FAKE["fakemeg/schedules.py"].replace(
        "is_last_stage=None", "last=None")},
     "fakemeg.schedules.forward_step", "takes no is_last_stage"),
    ({"fakemeg/schedules.py": _FAKE["fakemeg/schedules.py"].replace("data, model", "model, data")},
     "fakemeg.schedules.forward_step", "its parameters start (func, model, data), not (func, "
                                       "data, model)"),
    ({"fakemeg/layers.py": _FAKE["fakemeg/layers.py"].replace("class Linear:",
                                                              "Linear = 1\n        class Old:")},
     "fakemeg.layers.Linear", "not a class"),
    ({"fakemeg/layers.py": _FAKE["fakemeg/layers.py"].replace("delay_wgrad_compute",
                                                              "delay_wgrad")},
     "fakemeg.layers.Config.delay_wgrad_compute", "not a dataclass field"),
    ({"fakemeg/layers.py": _FAKE["fakemeg/layers.py"].replace("ctx.sequence_parallel",
                                                              "ctx.sp")},
     "fakemeg.layers [ctx.sequence_parallel]", "not in its source"),
    ({"fakemeg/gpu_only.py": None}, "fakemeg.gpu_only", "module not found"),
    ({"fakemeg/layers.py": "raise ImportError('renamed upstream')"}, "fakemeg.layers",
     "module does not import"),
])
def test_a_removed_or_changed_name_fails_naming_it(fake_megatron, changes, named, problem):
    """One message naming the name, what is wrong, what the plugin uses it for, the installed
    megatron-core version and the supported ones."""
    rows = fake_megatron(changes)
    with pytest.raises(TouchPointError) as err:
        check_touch_points((Side.CORE,), rows)
    message = str(err.value)
    assert f"  {named}: {problem}" in message
    assert "used for: a test's use" in message
    assert f"supported: {supported_description()} releases" in message
    assert re.search(r"megatron-core (\d+\.\d+\.\d+|None);", message)


def test_every_problem_is_in_one_message(fake_megatron):
    rows = fake_megatron({"fakemeg/schedules.py": "x = 1\n"})
    with pytest.raises(TouchPointError, match=r"relies on 3 name\(s\)") as err:
        check_touch_points((Side.CORE,), rows)
    assert "get_forward_backward_func: missing" in str(err.value)
    assert "forward_step: missing" in str(err.value)


def test_probed_rows_and_other_sides_are_no_error(fake_megatron):
    """A name the glue probes for may be missing; rows of a side not asked for are not
    checked (Megatron-LM's at install(), where megatron.training may not import)."""
    rows = fake_megatron({"fakemeg/schedules.py": "def get_forward_backward_func(): pass\n"})
    step = next(r for r in rows if r.name == "forward_step")
    others = [r for r in rows if r.name != "forward_step"]
    probed = others + [TouchPoint(step.module, step.name, step.use, step.where, step.kind,
                                  probed=True)]
    check_touch_points((Side.CORE,), probed)
    training = others + [TouchPoint(step.module, step.name, step.use, step.where, step.kind,
                                    side=Side.TRAINING)]
    check_touch_points((Side.CORE,), training)
    with pytest.raises(TouchPointError, match="forward_step: missing"):
        check_touch_points((Side.CORE, Side.TRAINING), training)


def test_flags_are_checked_on_the_parsed_namespace():
    """FLAG rows: the dests Megatron-LM's parser returned (check_flags, from validate_args)."""
    import argparse

    rows = [TouchPoint("megatron.training.arguments", "align_param_gather", "a test's use",
                       "tests/", Kind.FLAG, Side.TRAINING)]
    tp.check_flags(argparse.Namespace(align_param_gather=False), rows)
    check_touch_points((Side.TRAINING,), rows)  # no namespace: FLAG rows wait for one
    with pytest.raises(TouchPointError, match=r"align_param_gather\]: not in Megatron-LM's "
                                              "parsed arguments"):
        tp.check_flags(argparse.Namespace(align_param_gather_renamed=False), rows)


def test_row_fields_are_checked():
    with pytest.raises(ValueError, match="versions"):
        TouchPoint("m", "x", "use", "where", versions=("0.15",))
    with pytest.raises(ValueError, match="no name"):
        TouchPoint("m", "", "use", "where", Kind.CALLABLE)


# -- the inventory against the installed megatron ----------------------------------------------
def _series() -> str | None:
    from megatron_vshape.megatron.versions import installed_megatron_core_version

    version = installed_megatron_core_version()
    return None if version is None else ".".join(version.split(".")[:2])


def _import_megatron():
    from support.megatron_cpu import importorskip_megatron

    importorskip_megatron()


def _training_code_on_path(monkeypatch):
    """Megatron-LM's training code of this megatron-core (tests/support) importable here."""
    from support.megatron_lm_launch import MEGATRON_LM

    if not (MEGATRON_LM / "pretrain_gpt.py").is_file():
        pytest.skip(f"no Megatron-LM training code at {MEGATRON_LM}")
    monkeypatch.syspath_prepend(str(MEGATRON_LM))


@pytest.mark.megatron_versions
@pytest.mark.megatron_matrix
def test_each_row_holds_exactly_where_its_versions_say(monkeypatch):
    """The ``versions`` column, measured: on this megatron-core (and the Megatron-LM training
    code the tests pair with it) a row's name is found iff the row lists this series."""
    _import_megatron()
    _training_code_on_path(monkeypatch)
    series = _series()
    assert series in tp.SERIES, f"megatron-core {series} is not a series the inventory knows"
    rows = [r for r in TOUCH_POINTS if r.kind is not Kind.FLAG]
    broken = {row.label for row, _ in tp.touch_point_problems(tuple(Side), rows)}
    wrong = sorted(f"{row.label} ({row.side.name}): "
                   f"{'missing' if row.label in broken else 'found'} on {series}, versions "
                   f"say {row.versions}" for row in rows
                   if (row.label in broken) == (series in row.versions))
    assert not wrong, "\n".join(wrong)


@pytest.mark.megatron_versions
@pytest.mark.megatron_matrix
def test_flag_rows_are_in_megatron_lms_parser(monkeypatch):
    """The FLAG rows against the namespace Megatron-LM's own parse_args returns here."""
    _import_megatron()
    _training_code_on_path(monkeypatch)
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    args = parse_args(ignore_unknown_args=True)
    tp.check_flags(args)


@pytest.mark.megatron_versions
@pytest.mark.megatron_matrix
def test_the_start_up_checks_pass_on_a_supported_release(monkeypatch):
    _import_megatron()
    _training_code_on_path(monkeypatch)
    if _series() not in ("0.16", "0.19", "0.20"):
        pytest.skip(f"megatron-core {_series()} is not supported")
    check_touch_points(tuple(Side))


@pytest.mark.megatron_versions
def test_install_refuses_a_megatron_without_a_listed_name(monkeypatch):
    """install() checks the inventory after the version and before wrapping anything: a
    renamed megatron-core function fails there, naming it, instead of mid-run."""
    _import_megatron()
    import megatron_vshape
    from megatron.core.pipeline_parallel import schedules

    from megatron_vshape.megatron.versions import OVERRIDE_ENV

    monkeypatch.setenv(OVERRIDE_ENV, "1")  # on an unsupported release too: the names decide
    before = schedules.get_forward_backward_func
    monkeypatch.delattr(schedules, "get_tensor_shapes")
    with pytest.raises(TouchPointError) as err:
        megatron_vshape.install(schedule="v-half")
    assert "megatron.core.pipeline_parallel.schedules.get_tensor_shapes: missing" in \
        str(err.value)
    assert schedules.get_forward_backward_func is before


@pytest.mark.megatron_versions
def test_the_check_sees_megatrons_own_names_under_the_plugins_patches(monkeypatch):
    """install() may run again after the plugin replaced some listed names (the linear
    Function, the placement functions, the schedule bindings): the check reads megatron's own
    behind them (``vshape_base``, ``vshape_original``) and still passes."""
    _import_megatron()
    import megatron_vshape
    from megatron.core.tensor_parallel import layers
    from megatron_vshape.megatron.layers import patch_layer_placement
    from megatron_vshape.megatron.versions import OVERRIDE_ENV
    from megatron_vshape.megatron.wgrad import patch_linear, unpatch_linear

    monkeypatch.setenv(OVERRIDE_ENV, "1")
    patch_linear()
    patch_layer_placement()
    try:
        assert hasattr(layers.LinearWithGradAccumulationAndAsyncCommunication, "vshape_base")
        megatron_vshape.install(schedule="v-half")
        megatron_vshape.install(schedule="v-min")
        check_touch_points((Side.CORE,))
    finally:
        megatron_vshape.uninstall()
        unpatch_linear()
