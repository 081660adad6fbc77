"""The command outputs the documents show are what the commands print now
(scripts/regen_doc_outputs.py regenerates them)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the planner several times (about 20 s)

ROOT = Path(__file__).parents[2]


def test_marked_outputs_in_the_docs_are_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "regen_doc_outputs.py"),
                           "--check"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, ("stale document outputs; run python "
                                  "scripts/regen_doc_outputs.py:\n" + done.stderr)
    for doc in ("plan.md", "moe.md"):  # the script found their blocks
        assert "<!-- output of: vshape plan" in (ROOT / "docs" / doc).read_text()


def test_a_stale_block_is_found(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- output of: vshape plan --model tiny --gpus 2 --gpu-memory 80 "
                   "--top 1 --flags 0 -->\n```\nnot what it prints\n```\n")
    script = str(ROOT / "scripts" / "regen_doc_outputs.py")
    check = subprocess.run([sys.executable, script, "--check", str(doc)], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
    assert check.returncode == 1 and "stale" in check.stderr
    assert subprocess.run([sys.executable, script, str(doc)], timeout=300, cwd=ROOT).returncode == 0
    assert "tiny:" in doc.read_text() and "not what it prints" not in doc.read_text()
    again = subprocess.run([sys.executable, script, "--check", str(doc)], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0, again.stderr
