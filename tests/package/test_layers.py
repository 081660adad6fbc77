"""The layers import only downwards (docs/design.md, "Layers"): read from every module's import
statements, so a new import that breaks the rule fails here before it tangles the packages. Two
levels: the package's top-level layers, and the folders inside ``schedule/``."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_vshape"

ALLOWED = {
    "schedule": set(),
    "runtime": {"schedule"},
    "plan": {"schedule", "configs"},
    "experiments": {"plan", "schedule", "configs"},
    "megatron": {"runtime", "schedule"},
    "harness": {"megatron", "runtime", "plan", "schedule", "configs"},
    "configs": set(),
}
"""What each layer may import of the package besides itself (cli imports every layer)."""


SCHEDULE_ORDER = {
    "model": set(),
    "names": {"model"},
    "construct": {"model", "names"},
    "rewrite": {"model", "names", "construct"},
    "search": {"model", "names", "construct", "rewrite"},
    "registry": {"model", "names", "construct", "rewrite", "search"},
    "io": {"model"},
}
"""What each folder (or top-level module) of ``schedule/`` may import of ``schedule/`` besides
itself (its ``__init__.py``, the public facade, imports every one). model/ is at the bottom,
construct/ and rewrite/ above it, search/ above them; io/ stands aside: it reads the model (a
``Schedule``, its actions and placement) and nothing that makes or searches schedules, and no
folder that makes or searches schedules imports it (today io/ reads model.actions,
model.schedule and model.placement; megatron_layout.py reads nothing)."""
MODEL_MAY_IMPORT = {"io.render_text"}
"""The one exception, module by module: model/validate.py's errors carry the rendered steps
with the failing one marked (STYLE.md 15), and io/render_text.py itself imports only model/."""


def _imports(path: Path, root: Path = PACKAGE) -> set[tuple[str, ...]]:
    """The package's modules (or names) a module imports, absolute or relative, each as its
    dotted path below megatron_vshape/ split into parts: ``from ..model.actions import A`` in
    schedule/search/x.py is ``("schedule", "model", "actions")``, ``from .. import schedule`` in
    megatron/x.py is ``("schedule",)``."""
    here = path.relative_to(root).parts[:-1]  # the module's package, below megatron_vshape/
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level - 1 > len(here):
                continue  # climbs out of megatron_vshape/: not the package's
            base = here[:len(here) - (node.level - 1)]
            if node.module:
                found.add((*base, *node.module.split(".")))
            else:
                found.update((*base, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").startswith("megatron_vshape."):
                found.add(tuple(node.module.split(".")[1:]))
        elif isinstance(node, ast.Import):
            found.update(tuple(alias.name.split(".")[1:]) for alias in node.names
                         if alias.name.startswith("megatron_vshape."))
    return found


def _imported_layers(path: Path, layer: str, root: Path = PACKAGE) -> set[str]:
    """The package's top-level subpackages a module imports (absolute or relative)."""
    return {target[0] for target in _imports(path, root)} - {layer}


def _schedule_unit(parts: tuple[str, ...]) -> str:
    """The folder (or top-level module) of schedule/ that ``("schedule", ...)`` parts name."""
    first = parts[1]
    return first[:-3] if first.endswith(".py") else first


def _schedule_violations(root: Path = PACKAGE) -> dict[str, list[str]]:
    """{module: the schedule/ modules it may not import} over schedule/ (its facade aside)."""
    wrong = {}
    for path in sorted((root / "schedule").rglob("*.py")):
        where = path.relative_to(root).parts
        if where == ("schedule", "__init__.py"):
            continue
        unit = _schedule_unit(where)
        allowed = SCHEDULE_ORDER.get(unit, set())
        bad = sorted(".".join(target[1:]) for target in _imports(path, root)
                     if target[:1] == ("schedule",) and len(target) > 1
                     and (other := target[1]) != unit and other not in allowed
                     and not (unit == "model" and ".".join(target[1:]) in MODEL_MAY_IMPORT))
        if bad:
            wrong["/".join(where)] = bad
    return wrong


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    wrong = {}
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        bad = _imported_layers(path, layer) - ALLOWED[layer] - {"__version__"}
        if bad:
            wrong[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not wrong, f"{layer}/ may import only {sorted(ALLOWED[layer])}: {wrong}"


def test_the_check_sees_a_wrong_import(tmp_path):
    fake = tmp_path / "megatron_vshape"
    (fake / "megatron").mkdir(parents=True)
    (fake / "megatron" / "x.py").write_text(
        "from ..harness.demo import run\nfrom .model import y\n"
        "from megatron_vshape.plan import plan\nfrom .. import schedule\n")
    assert _imported_layers(fake / "megatron" / "x.py", "megatron", fake) == {
        "harness", "plan", "schedule"}


def _schedule_units(root: Path = PACKAGE) -> set[str]:
    return {_schedule_unit(path.relative_to(root).parts)
            for path in (root / "schedule").glob("*") if path.name != "__init__.py"
            and (path.suffix == ".py" or (path / "__init__.py").is_file())}


def test_every_folder_of_schedule_has_its_place():
    """A new folder or module of schedule/ gets a row in SCHEDULE_ORDER (and docs/design.md's
    table); a removed one loses its row."""
    assert _schedule_units() == set(SCHEDULE_ORDER)


def test_schedule_folders_import_only_those_below_them():
    wrong = _schedule_violations()
    assert not wrong, (f"schedule/ folders import only those below them (SCHEDULE_ORDER, "
                       f"docs/design.md's table): {wrong}")


def test_the_schedule_check_sees_a_wrong_import(tmp_path):
    """model/ importing search/ or io/ beyond the step renderer, construct/ importing rewrite/,
    io/ importing search/ or names.py: each is caught, the allowed imports are not."""
    fake = tmp_path / "megatron_vshape" / "schedule"
    sources = {
        "model/simulate.py": "from ..search.adaptive import search\nfrom .actions import A\n",
        "model/validate.py": "from ..io.render_text import render_steps\n"
                             "from ..io.render_image import render\n",
        "construct/greedy.py": "from ..rewrite import replay\nfrom ..model.actions import A\n",
        "rewrite/replay.py": "from megatron_vshape.schedule.construct.blocks import V_MIN\n",
        "io/render_text.py": "from ..search import levels\nfrom ..names import SCHEDULES\n",
        "search/levels.py": "from .. import registry\nfrom ..rewrite.gap_fill import fill\n",
    }
    for name, text in sources.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    assert _schedule_violations(fake.parent) == {
        "schedule/construct/greedy.py": ["rewrite"],
        "schedule/io/render_text.py": ["names", "search"],
        "schedule/model/simulate.py": ["search.adaptive"],
        "schedule/model/validate.py": ["io.render_image"],
        "schedule/search/levels.py": ["registry"],
    }
