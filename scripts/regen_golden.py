"""Regenerate tests/golden (p=4, m=8 of every schedule, the paper's orders):
python scripts/regen_golden.py"""
from pathlib import Path

from megatron_vshape.schedule import SCHEDULES, build_schedule
from megatron_vshape.schedule.io.render_text import render_steps
from megatron_vshape.schedule.io.torch_csv import to_torch_csv

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"

for name in SCHEDULES:
    schedule = build_schedule(name, 4, 8, variant="paper")
    (GOLDEN / f"{name}.txt").write_text(render_steps(schedule) + "\n")
    (GOLDEN / f"{name}.csv").write_text(to_torch_csv(schedule))
print(f"wrote {len(SCHEDULES) * 2} files to {GOLDEN}")
