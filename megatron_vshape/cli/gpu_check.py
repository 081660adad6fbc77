"""``vshape gpu-check``: the plugin checked on one device in one command (docs/gpu-check.md).

A lent GPU is available for minutes at a time, so everything a GPU should confirm runs here in
one call and lands in ``--output``: ``report.json`` and ``report.md`` (the pipeline under every
schedule against 1F1B and the planner, :mod:`..harness.gpu_check`), and on CUDA (not
``--tiny``) per-layer profiles of the paper's models (``cuda-<model>-s<S>.yaml``,
:mod:`.gpu_profiles`). ``--device cpu --tiny`` is the same command on the CPU, run in CI
(tests/harness/test_gpu_check.py), so the GPU path cannot rot between loans.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

from .ui import subcommand

__all__ = ["PIPELINES", "register", "pipeline_runs"]

PIPELINES = ("even", "uneven")


def register(sub) -> None:
    p = subcommand(
        sub, "gpu-check", help="check every schedule on one device (PP 4 processes sharing it) "
                               "against 1F1B and the planner; profile the paper's layers on CUDA",
        examples=["vshape gpu-check --output gpu-check", "vshape gpu-check --device cpu --tiny "
                                                         "--output /tmp/gpu-check"],
        description="Train a megatron-core GPT on 4 gloo processes sharing one device under "
                    "1f1b (our runtime, the reference), zb-1p, v-min, v-half, v-zb and auto; "
                    "write report.json and report.md (losses against the reference, peak "
                    "bytes per rank against the planner's prediction, the machine); then the "
                    "uneven run: a 4x vocabulary and the V schedules on an uneven V stage "
                    "layout, against the planner's per-stage prediction. On CUDA, bf16 (even, "
                    "uneven) then fp32 (even), then per-layer profiles of the paper's models.")
    p.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="folder for report.json, report.md and the profiles")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    p.add_argument("--tiny", action="store_true",
                   help="the bundled tiny GPT (seconds; what CI runs with --device cpu); skips "
                        "the fp32 rerun and the profiles")
    p.add_argument("--no-fp32", action="store_true", help="CUDA: skip the fp32 pipeline run")
    p.add_argument("--pipelines", choices=PIPELINES, nargs="+", default=list(PIPELINES),
                   help="which pipeline runs: even (every schedule, even stages) and uneven "
                        "(4x vocabulary, V schedules on an uneven V stage layout, first dtype "
                        "only: bf16 on CUDA); default both")
    p.add_argument("--no-profile", action="store_true",
                   help="CUDA: skip the per-layer profiles of the paper's models")
    p.add_argument("--profile-budget", type=float, default=180.0, metavar="SECONDS",
                   help="CUDA: stop profiling new shapes after this long (default %(default)s)")
    p.set_defaults(handler=_gpu_check)


def _command(args, device: str) -> str:
    words = ["vshape", "gpu-check", "--output", args.output, "--device", device]
    words += [flag for flag, on in (("--tiny", args.tiny), ("--no-fp32", args.no_fp32),
                                    ("--no-profile", args.no_profile)) if on]
    if tuple(args.pipelines) != PIPELINES:
        words += ["--pipelines", *args.pipelines]
    if device == "cuda" and not (args.tiny or args.no_profile):
        words += ["--profile-budget", f"{args.profile_budget:g}"]
    return shlex.join(words)


def _device(choice: str) -> str:
    try:
        import torch
    except ImportError as err:
        raise ValueError(f"vshape gpu-check needs torch and megatron-core: pip install -e "
                         f"'.[megatron]' ({err})") from None
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    return choice


def dtypes(device: str, tiny: bool, no_fp32: bool) -> list[str]:
    """The pipeline runs, in order: fp32 on the CPU; bf16, then fp32 (unless skipped) on CUDA."""
    if device == "cpu":
        return ["float32"]
    return ["bfloat16"] + ([] if tiny or no_fp32 else ["float32"])


def pipeline_runs(device: str, tiny: bool, no_fp32: bool, pipelines) -> list[tuple[str, str]]:
    """``(pipeline, dtype)`` in the order they run: the even pipeline per dtype, the uneven
    one after the first dtype's (bf16 on CUDA, so the lent GPU's minutes go to it first)."""
    runs = []
    for index, dtype in enumerate(dtypes(device, tiny, no_fp32)):
        runs += [(name, dtype) for name in PIPELINES
                 if name in pipelines and (name == "even" or index == 0)]
    return runs


def _gpu_check(args) -> int:
    from tqdm import tqdm

    from ..harness.gpu_check import check_settings, run_check, uneven_settings
    from ..harness.gpu_report import machine, pipeline_report

    began = time.perf_counter()
    device = _device(args.device)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": _command(args, device), "machine": machine(device),
              "pipelines": [], "profiles": [], "passed": True, "complete": False}
    for pipeline, dtype in pipeline_runs(device, args.tiny, args.no_fp32, args.pipelines):
        settings = (check_settings if pipeline == "even" else uneven_settings)(
            device, args.tiny, dtype)
        start = time.perf_counter()
        with tqdm(total=len(settings.schedules), unit="schedule",
                  desc=f"{device} {dtype} {pipeline} pipeline") as progress:
            runs = run_check(settings, on_done=lambda name: progress.update())
        report["pipelines"].append(pipeline_report(settings, runs, time.perf_counter() - start))
        _write_report(out, report, began)
    if device == "cuda" and not (args.tiny or args.no_profile):
        from .gpu_profiles import profile_paper_layers

        report["profiles"] = profile_paper_layers(out, args.profile_budget)
    report["complete"] = True
    print(_write_report(out, report, began))
    profiles = len(report["profiles"])
    print(f"wrote {out / 'report.json'}, {out / 'report.md'}"
          f"{f' and {profiles} profiles' if profiles else ''}")
    return 0 if report["passed"] else 1


def _write_report(out: Path, report: dict, began: float) -> str:
    """Write report.json and report.md now, so a loan that ends mid-run (a device command is
    killed at its limit) still brings back every pipeline finished so far; ``complete`` says
    whether the profiles ran too. Returns the markdown page."""
    from ..harness.gpu_report import render_markdown

    report["passed"] = all(p["passed"] for p in report["pipelines"])
    report["wall_seconds"] = round(time.perf_counter() - began, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    page = render_markdown(report)
    (out / "report.md").write_text(page)
    return page
