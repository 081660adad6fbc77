"""The layers import only downwards (docs/design.md, "Layers"): read from every module's import
statements, so a new import that breaks the rule fails here before it tangles the packages."""
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


def _imported_layers(path: Path, layer: str, root: Path = PACKAGE) -> set[str]:
    """The package's top-level subpackages a module imports (absolute or relative)."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(root).parts) - 1  # folders below megatron_vshape/
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").startswith("megatron_vshape."):
                found.add(node.module.split(".")[1])
            elif node.level > depth and node.module:  # climbs out of its layer
                found.add(node.module.split(".")[0])
            elif node.level > depth:  # `from .. import x`
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron_vshape."):
                    found.add(alias.name.split(".")[1])
    return found - {layer}


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
