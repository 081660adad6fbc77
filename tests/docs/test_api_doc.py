"""docs/api.md documents what is there: every name it gives imports, every field of
VShapeConfig it lists exists, and its examples marked ``<!-- runs -->`` run (the others have
their imports checked)."""
import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TEXT = PAGE.read_text()
_DOTTED = re.compile(r"\bmegatron_vshape(?:\.[A-Za-z_]\w*)+")
_BLOCK = re.compile(r"(<!-- runs -->\n)?```python\n(.*?)```", re.S)
_SECTIONS = {"## Schedules": "megatron_vshape.schedule", "## Planning": "megatron_vshape.plan",
             "## The plugin in Megatron-LM": "megatron_vshape.megatron",
             "## The torch runtime": "megatron_vshape.runtime"}


def resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _sections() -> dict[str, str]:
    """Each level-2 heading's text, by heading line."""
    parts = re.split(r"^(## .*)$", TEXT, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _table_names(body: str) -> list[str]:
    """The leading dotted name of every code span in the tables' first column."""
    names = []
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        names += re.findall(r"`([A-Za-z_][\w.]*)", first)
    return names


def test_every_dotted_name_imports():
    names = sorted(set(_DOTTED.findall(TEXT)))
    assert len(names) > 20
    for name in names:
        resolve(name)


@pytest.mark.parametrize("heading", list(_SECTIONS))
def test_every_name_in_a_section_table_is_there(heading):
    [(title, body)] = [(t, b) for t, b in _sections().items() if t.startswith(heading)]
    names = _table_names(body)
    assert names, title
    for name in names:
        base = "" if name.startswith("megatron_vshape") else _SECTIONS[heading] + "."
        resolve(base + name)


def test_the_install_fields_are_vshape_config_fields():
    from megatron_vshape.megatron.install import VShapeConfig

    body = next(b for t, b in _sections().items() if t.startswith("## The plugin in your own"))
    table = body.split("| field | meaning |", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert listed == [f.name for f in dataclasses.fields(VShapeConfig)]


def test_the_examples_import_and_the_marked_ones_run(capsys):
    blocks = _BLOCK.findall(TEXT)
    assert sum(bool(runs) for runs, _ in blocks) == 2 and len(blocks) > 2
    for runs, code in blocks:
        if runs:
            exec(compile(code, str(PAGE), "exec"), {})
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or resolve(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
    printed = capsys.readouterr().out
    assert "v-half makespan" in printed and "tokens/s per GPU" in printed
