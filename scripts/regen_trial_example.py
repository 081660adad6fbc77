"""Regenerate README.md's report of ``vshape trial --example tiny`` (never typed by hand).

    python scripts/regen_trial_example.py

Runs ``vshape trial --example tiny`` (4 CPU processes through Megatron-LM's own loop, about two
minutes on 2 cores) into a temporary folder and writes its trial.md's tables between README's
marks::

    <!-- report of: vshape trial --example tiny (scripts/regen_trial_example.py) -->
    ...
    <!-- end of report -->

Timings differ from run to run, so no test compares the block with a new run; the e2e test
(tests/experiments/test_trial.py) holds what the report must show.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"(<!-- report of: vshape trial --example tiny \(scripts/regen_trial_example\.py\) -->\n)"
                  r"(.*?)(<!-- end of report -->)", re.S)


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "megatron_vshape", "trial", "--example", "tiny",
                        "--output", folder], cwd=ROOT, check=True)
        report = (Path(folder) / "trial.md").read_text(encoding="utf-8")
    tables = report[report.index("| schedule |"):]
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    if not MARK.search(text):
        raise SystemExit("README.md has no trial report mark (see this script's doc)")
    readme.write_text(MARK.sub(lambda m: m.group(1) + tables + m.group(3), text),
                      encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
