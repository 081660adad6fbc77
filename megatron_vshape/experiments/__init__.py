"""Experiments at cluster scale: grid expansion, launch commands, log collection.

Pure Python (PyYAML; matplotlib only inside the plot function), no torch: grids are expanded
and logs collected on a login node or a laptop.

* :mod:`.grid`: the grid schema, its rules and :func:`expand`; :mod:`.grid_file` reads the YAML.
* :mod:`.commands`: points -> commands.txt, points.csv, a slurm array job.
* :mod:`.logs`: reading Megatron-LM logs; :mod:`.collect`: one summary row per run, CSV, plot.
"""
from .collect import H100_BF16_TFLOPS, RunSummary, collect, plot_throughput_vs_memory, write_csv
from .commands import command_line, point_args, write_array_job, write_commands, write_manifest
from .grid import Expansion, GridConfig, Point, ScheduleChoice, Skip, expand
from .grid_file import load_grid
from .logs import RunLog, parse_log, parse_run_name

__all__ = [
    "H100_BF16_TFLOPS", "RunSummary", "collect", "plot_throughput_vs_memory", "write_csv",
    "command_line", "point_args", "write_array_job", "write_commands", "write_manifest",
    "Expansion", "GridConfig", "Point", "ScheduleChoice", "Skip", "expand", "load_grid",
    "RunLog", "parse_log", "parse_run_name",
]
