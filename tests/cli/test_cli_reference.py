"""docs/cli.md is what scripts/gen_cli_reference.py writes from the parsers now: a new flag,
description or example makes it stale until regenerated."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_cli_reference",
                                              ROOT / "scripts" / "gen_cli_reference.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def _page_python() -> str:
    return re.search(r"parsers \(Python (\d+\.\d+)\)", gen.PAGE.read_text()).group(1)


def test_cli_reference_is_current():
    if _page_python() != gen.python_version():
        pytest.skip(f"docs/cli.md shows Python {_page_python()}'s argparse layout, this is "
                    f"{gen.python_version()}")
    assert gen.PAGE.read_text() == gen.render(), \
        "docs/cli.md is stale: run python scripts/gen_cli_reference.py"


def test_every_subcommand_has_its_section_with_usage_and_examples():
    from megatron_vshape.cli import build_parser

    text = gen.render()
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name in sub.choices:
        section = text.split(f"## `vshape {name}`\n", 1)[1].split("\n## ", 1)[0]
        assert f"usage: vshape {name}" in section and "examples:" in section, name
