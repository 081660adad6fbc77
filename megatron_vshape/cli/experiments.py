"""``vshape grid | collect | paper``: run the paper's grid search on a cluster, read back the
results, and predict them beforehand.

Output contracts: ``grid`` writes ``commands.txt`` (line i = point i = slurm array task i),
``points.csv`` (columns ``experiments.commands.MANIFEST_COLUMNS``) and, with ``--format slurm``,
``grid.sbatch``; ``collect --csv`` writes the columns ``experiments.collect.COLUMNS``.
"""
from __future__ import annotations

from pathlib import Path

from ..configs import config_names
from ..experiments.collect import (H100_BF16_TFLOPS, collect, plot_throughput_vs_memory,
                                   write_csv)
from ..experiments.commands import (command_line, write_array_job, write_commands,
                                    write_manifest)
from ..experiments.grid import PLAN_RULE, Expansion, expand, prune
from ..experiments.grid_file import load_grid
from ..plan.recompute import REFERENCE_RECOMPUTED
from ..schedule.names import REFERENCE
from .ui import add_progress_argument, counting, progress, subcommand, working

__all__ = ["register"]

_PLOT_SUFFIXES = (".png", ".svg", ".pdf")
_PAPER_GRIDS = ("gpt-9.6b", "gpt-21b", "gpt-38.5b", "gpt-98.5b")
"""The paper's four models on their GPU counts: bundled grids (configs/grid/)."""
_MAX_ARRAY = 1000
"""Array task ids a default slurm accepts (MaxArraySize 1001 allows 0..1000; we split at 1000)."""


def register(sub) -> None:
    """Add this module's subcommands to the ``vshape`` parser."""
    grid = subcommand(
        sub, "grid", help="expand a grid YAML into launch commands or a slurm array",
        description="Cross a grid file's sequence lengths, TP, PP, micro batch sizes and "
                    "schedules into Megatron-LM runs (one command per point, or a slurm array "
                    "job with one task per point), skipping, with the reason, every point "
                    "Megatron-LM would reject or whose weights cannot fit. --prune also drops "
                    "the points the planner (vshape plan) predicts cannot fit the GPU's memory.",
        examples=["vshape grid gpt-9.6b --dry-run",
                  "vshape grid gpt-9.6b --format slurm --prune -o runs/gpt-9.6b"])
    grid.add_argument("grid", metavar="GRID", help="a bundled grid's name (%s) or a grid file's "
                      "path (schema: configs/grid/README.md)"
                      % ", ".join(config_names("grid")))
    grid.add_argument("--output-dir", "-o",
                      help="where commands.txt, points.csv (and grid.sbatch) go "
                           "(default: runs/<grid name>)")
    grid.add_argument("--format", choices=["commands", "slurm"], default="commands",
                      help="commands: commands.txt and points.csv; slurm: also grid.sbatch, "
                           "an array job with one task per point")
    grid.add_argument("--dry-run", action="store_true",
                      help="list every point and every skipped one with its reason; write nothing")
    grid.add_argument("--prune", action="store_true",
                      help="drop the points whose weights, optimizer state and activations "
                           "the planner predicts cannot fit gpu_memory_gib (seconds)")
    add_progress_argument(grid)
    grid.set_defaults(handler=_grid)
    col = subcommand(
        sub, "collect", help="Megatron-LM training logs -> throughput/memory table",
        description="Read Megatron-LM training logs (the grid's runs, or any run with "
                    "--log-throughput and --log-memory-to-tensorboard style iteration lines) "
                    "and print one row per run: status, schedule, parallel sizes, median "
                    "iteration time, TFLOP/s, MFU, tokens per second per GPU and peak memory.",
        examples=["vshape collect runs/gpt-9.6b/logs",
                  "vshape collect logs/ --csv results.csv --plot results.png"])
    col.add_argument("log_dirs", nargs="+", metavar="LOG_DIR",
                     help="folders searched for *.log (recursively), or log files")
    col.add_argument("--csv", help="write one row per run to this CSV file")
    col.add_argument("--plot", help="plot throughput vs peak memory per schedule (.png/.svg/.pdf)")
    col.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS,
                     help="the GPU's peak TFLOP/s for MFU (default %(default)g: H100 bf16 dense)")
    col.add_argument("--warmup", type=int, default=3,
                     help="leave iterations 1..N out of the medians (default %(default)s)")
    add_progress_argument(col)
    col.set_defaults(handler=_collect)
    paper = subcommand(
        sub, "paper", help="predict the paper's grid search (docs/paper-reproduction.md)",
        description="Plan every grid file at each of its sequence lengths and write the best "
                    "configuration of each schedule family, the best V's speed-up over 1F1B "
                    "and 1F1B-R, and the pure-pipeline comparison as markdown.",
        examples=["vshape paper", "vshape paper gpt-9.6b --seq-lengths 1024 -o /tmp/9.6b.md"])
    paper.add_argument("grids", nargs="*", metavar="GRID", default=list(_PAPER_GRIDS),
                       help="bundled grids' names or grid files' paths (default: the paper's "
                            "four models, %(default)s)")
    paper.add_argument("--seq-lengths", type=int, nargs="+", metavar="S",
                       help="only these sequence lengths (default: each grid's)")
    paper.add_argument("--auto-candidates", type=int, default=3, metavar="K",
                       help="search auto at the K best points (default %(default)s)")
    paper.add_argument("--profiles", metavar="DIR",
                       help="where gpu-check's cuda-<model>-s<S>.yaml profiles are looked for "
                            "(default: the bundled configs/profiles); a case "
                            "with one gets a calibrated column")
    paper.add_argument("--output", "-o", default="docs/paper-reproduction.md",
                       help="the markdown file to write (default %(default)s)")
    add_progress_argument(paper)
    paper.set_defaults(handler=_paper)


def _summary(expansion: Expansion, source: str) -> None:
    grid = expansion.grid
    model = grid.model
    crossed = (len(grid.seq_lengths), len(grid.tp), len(grid.pp), len(grid.mbs),
               len(grid.schedules))
    print(f"grid {grid.name} ({source}): model {model.name} ({model.num_layers} layers, "
          f"{model.num_attention_heads} heads), {grid.gpus.total} GPUs = {grid.gpus.nodes} "
          f"nodes x {grid.gpus.per_node}")
    total = crossed[0] * crossed[1] * crossed[2] * crossed[3] * crossed[4]
    print(f"crossed {' x '.join(map(str, crossed))} (seq x tp x pp x mbs x schedule) = {total}: "
          f"{len(expansion.points)} points, {len(expansion.skipped)} skipped")
    groups = expansion.skipped_by_rule()
    if groups:
        print("skipped, by rule (count, first example):")
        width = max(len(rule) for rule in groups)
        for rule, skips in sorted(groups.items(), key=lambda item: -len(item[1])):
            print(f"  {len(skips):>5}  {rule:<{width}}  {skips[0].describe()}")
    counts: dict[str, int] = {}
    for point in expansion.points:
        counts[point.choice.name] = counts.get(point.choice.name, 0) + 1
    if counts:
        print("points by schedule: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        print(f"point 0: {command_line(grid, expansion.points[0])}")


def _pruned(expansion: Expansion, args) -> Expansion:
    with counting(args, len(expansion.points), "planning memory", "point") as done:
        pruned = prune(expansion, on_point=done)
    dropped = len(expansion.points) - len(pruned.points)
    print(f"--prune: {dropped} of {len(expansion.points)} points dropped, the planner predicts "
          f"they cannot fit {expansion.grid.gpu_memory_gib:g} GiB (rule {PLAN_RULE})")
    return pruned


def _dry_run(expansion: Expansion) -> None:
    print("points:")
    for point in expansion.points:
        print(f"  {point.index:>5}  {point.name}  (microbatches {point.microbatches})")
    print("skipped:")
    for skip in expansion.skipped:
        print(f"  [{skip.rule}] {skip.describe()}")


def _grid(args) -> int:
    grid = load_grid(args.grid)
    expansion = expand(grid)
    if args.prune:
        expansion = _pruned(expansion, args)
    _summary(expansion, args.grid)
    if args.dry_run:
        _dry_run(expansion)
        return 0
    if not expansion.points:
        raise ValueError(f"grid {args.grid}: no valid point (see the rules above); widen tp, pp "
                         f"or mbs, or change global_batch")
    out = Path(args.output_dir) if args.output_dir else Path("runs") / grid.name
    if args.format == "slurm" and any(c in str(out.resolve()) for c in " \t\"'$`\\"):
        raise ValueError(f"--output-dir {str(out)!r}: #SBATCH lines cannot quote, so the folder "
                         f"for --format slurm must have no spaces, quotes, '$', '`' or '\\'")
    out.mkdir(parents=True, exist_ok=True)
    commands = write_commands(expansion, out / "commands.txt")
    print(f"wrote {commands} ({len(expansion.points)} commands, line i = point i)")
    print(f"wrote {write_manifest(expansion, out / 'points.csv')}")
    if args.format == "slurm":
        write_array_job(expansion, commands, out, args.grid + (" --prune" if args.prune else ""))
        job = out / "grid.sbatch"
        count = len(expansion.points)
        print(f"wrote {job} (array 0-{count - 1}); from the repository root, with the "
              f"environment of scripts/slurm/README.md set: sbatch {job}")
        if count > _MAX_ARRAY:
            print(f"note: {count} points; clusters with slurm's default MaxArraySize "
                  f"({_MAX_ARRAY + 1}) take task ids up to {_MAX_ARRAY} only: submit in parts, "
                  f"sbatch --array=0-{_MAX_ARRAY - 1} {job}, then POINT_OFFSET={_MAX_ARRAY} "
                  f"sbatch --array=0-{min(count, 2 * _MAX_ARRAY) - _MAX_ARRAY - 1} {job}, ...")
    return 0


def _table(rows) -> None:
    width = max(len("run"), *(len(r.run) for r in rows))
    head = (f"{'run':<{width}}  {'status':<10} {'schedule':<16} {'dp':>3} {'tp':>3} {'pp':>3} "
            f"{'mbs':>3} {'seq':>6} {'ms/iter':>9} {'TFLOP/s':>8} {'MFU':>6} {'tok/s/GPU':>10} "
            f"{'peak GiB':>9} {'loss':>7}")
    print(head)
    print("-" * len(head))

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        peak = None if r.max_allocated_mb is None else r.max_allocated_mb / 1024
        print(f"{r.run:<{width}}  {r.status:<10} {r.label or '-':<16} {fmt(r.dp, '>3')} "
              f"{fmt(r.tp, '>3')} {fmt(r.pp, '>3')} {fmt(r.mbs, '>3')} {fmt(r.seq_length, '>6')} "
              f"{fmt(r.iteration_ms, '>9.1f')} {fmt(r.tflops_per_gpu, '>8.1f')} "
              f"{fmt(r.mfu, '>6.1%')} {fmt(r.tokens_per_s_per_gpu, '>10.0f')} "
              f"{fmt(peak, '>9.2f')} {fmt(r.lm_loss, '>7.3f')}")


def _collect(args) -> int:
    if args.peak_tflops <= 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops:g}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.plot and Path(args.plot).suffix.lower() not in _PLOT_SUFFIXES:
        raise ValueError(f"--plot must end in {', '.join(_PLOT_SUFFIXES)}, got {args.plot!r}")
    with working(args, "reading logs"):
        rows = collect(args.log_dirs, args.peak_tflops, args.warmup)
    if not rows:
        raise ValueError(f"no Megatron-LM log (*.log with an argument dump or iteration lines) "
                         f"under {', '.join(args.log_dirs)}")
    _table(rows)
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv} ({len(rows)} runs)")
    if args.plot:
        drawn = plot_throughput_vs_memory(rows, args.plot)
        print(f"wrote {args.plot} ({drawn} runs with throughput and memory)")
    return 0


def _paper(args) -> int:
    import shlex

    from ..experiments.calibrate import PROFILE_DIR, calibrate, render_calibrated
    from ..experiments.predict import predict_case, render

    grids = [load_grid(path) for path in args.grids]
    for grid in grids:
        bad = sorted(set(args.seq_lengths or ()) - set(grid.seq_lengths))
        if bad:
            raise ValueError(f"--seq-lengths {bad}: grid {grid.name} has only "
                             f"{', '.join(map(str, grid.seq_lengths))}")
    cases = [(g, s) for g in grids for s in g.seq_lengths
             if not args.seq_lengths or s in args.seq_lengths]
    results = [predict_case(g, s, args.auto_candidates)
               for g, s in progress(cases, args, desc="planning", unit="case")]
    calibrations = [c for c in (calibrate(case, Path(args.profiles or PROFILE_DIR),
                                          args.auto_candidates) for case in results) if c]
    command = " ".join(["vshape", "paper", *map(shlex.quote, args.grids)]
                       + (["--seq-lengths", *map(str, args.seq_lengths)] if args.seq_lengths
                          else [])
                       + (["--profiles", shlex.quote(args.profiles)] if args.profiles else [])
                       + ["--output", shlex.quote(args.output)])
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, command, render_calibrated(calibrations)))
    for case in results:
        gains = [f"x{g:.3f} over the best {name}" for name, g in
                 (("1F1B", case.gain_over(REFERENCE)),
                  ("1F1B-R", case.gain_over(REFERENCE_RECOMPUTED)))
                 if g is not None]
        print(f"{case.grid.model.name} seq {case.seq_length}: best V "
              + (", ".join(gains) or "- (V or both baselines fit nowhere)"))
    for c in calibrations:
        print(f"{c.analytic.grid.model.name} seq {c.analytic.seq_length}: calibrated from "
              f"{c.profile.path}: measured / analytic layer time "
              + ", ".join(f"TP{tp} {r:.2f}" for tp, r in c.time_ratio.items()))
    print(f"wrote {out}")
    return 0
