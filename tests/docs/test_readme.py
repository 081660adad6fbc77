"""The example outputs of the schedule commands in README.md and docs/schedules.md are what
those commands print now.

A new user runs them literally and compares; a better search (126.9 -> 126.4 here) or a
tighter floor left the printed example behind once already. Only the search's wall time
(``search_seconds``) is allowed to differ. ``vshape demo``'s example is not compared: it trains
for a minute and prints timings, which vary by nature (tests/harness/test_demo.py runs a small demo).
"""
import re
import shlex
from pathlib import Path

import pytest

from megatron_vshape.cli import main

_ROOT = Path(__file__).resolve().parents[2]
_PAGES = (_ROOT / "README.md", _ROOT / "docs" / "schedules.md")
_VARIES = ("search_seconds",)


def _examples(command: str) -> list[tuple[str, list[str]]]:
    """(command line, printed lines) of every fenced block run as ``$ vshape command`` in the
    pages."""
    found = []
    text = "\n".join(page.read_text() for page in _PAGES)
    for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
        head, *printed = block.rstrip("\n").split("\n")
        if head.startswith(f"$ vshape {command} "):
            found.append((head[2:], printed))
    return found


def _kept(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines if not line.startswith(_VARIES)]


@pytest.mark.parametrize("command", ["compare", "search"])
def test_readme_example_prints_what_the_command_prints(command, capsys):
    examples = _examples(command)
    assert examples, f"README.md and docs/schedules.md show no `$ vshape {command}` example"
    for line, printed in examples:
        assert main(shlex.split(line)[1:]) == 0
        assert _kept(capsys.readouterr().out.splitlines()) == _kept(printed), line
