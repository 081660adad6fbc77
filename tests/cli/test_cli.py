"""The ``vshape`` command as a new user meets it: errors, help, progress, warnings, words.

Pure Python (the demo's warning filter is checked on a plain child interpreter, the slurm
launcher with a torchrun that prints its environment): seconds, no torch, no GPU.
"""
import argparse
import io
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_vshape import __version__
from megatron_vshape.cli import build_parser, demo, main, ui
from megatron_vshape.configs import CONFIG_DIR
from megatron_vshape.experiments import expand, load_grid
from megatron_vshape.experiments.grid import PLAN_RULE, prune
from megatron_vshape.schedule import SCHEDULES
from support.fake_checkout import fake_checkout

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
JARGON = ("block", "offset", "replayed", "window", "units", "re-laid", "polished", "slack")
"""Words of the technical descriptions that a user's description must not need."""


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


class _Terminal(io.StringIO):
    """Standard error as a terminal: where progress is drawn."""

    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> _Terminal:
    """A terminal on standard error, and progress shown at once (no 1 s delay). Called in the
    test itself: pytest puts its own standard error back between a fixture and the test."""
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(ui, "DELAY_S", 0.0)
    monkeypatch.setattr(ui, "REFRESH_S", 0.01)
    return stream


# -- unwritable outputs ----------------------------------------------------------------------
_WRITERS = {
    "render": ["render", "--schedule", "v-half", "-p", "4", "-m", "8", "-o", "{}/v.txt"],
    "render-png": ["render", "--schedule", "v-half", "-p", "4", "-m", "8", "-o", "{}/v.png"],
    "export": ["export", "--schedule", "v-min", "-p", "2", "-m", "2", "-o", "{}/v.csv"],
    "frontier": ["frontier", "-p", "4", "-m", "4", "-o", "{}/f.png"],
    "compare": ["compare", "-p", "4", "-m", "4", "--plot", "{}/c.png"],
    "plan": ["plan", "--model", "tiny", "--gpus", "4", "--gpu-memory", "80",
             "--schedules", "1f1b", "--csv", "{}/plan.csv"],
    "grid": ["grid", "gpt-9.6b", "-o", "{}/grid"],
    "paper": ["paper", "gpt-9.6b", "--seq-lengths", "1024", "--auto-candidates", "0",
              "-o", "{}/paper.md"],
}


def _one_error_line(capsys, path) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"vshape: error: cannot write {path}"), err
    return err


@pytest.mark.parametrize("name", ["render", "render-png", "export", "plan"])
def test_missing_output_folder_is_one_line_and_exit_2(name, tmp_path, capsys):
    """The parent folder does not exist: the write itself fails, main words it."""
    if name == "render-png":
        pytest.importorskip("matplotlib")
    folder = tmp_path / "missing"
    argv = [a.format(folder) for a in _WRITERS[name]]
    assert main(argv) == 2
    path = next(a for a in argv if str(folder) in a)
    assert _one_error_line(capsys, path).endswith("No such file or directory")


@pytest.mark.parametrize("name", sorted(_WRITERS))
def test_output_under_a_file_fails_before_the_work(name, tmp_path, capsys, monkeypatch):
    """A path under a file cannot be written: said before the subcommand runs (plan and paper
    may plan for minutes first), for every subcommand that writes."""
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [a.format(afile) for a in _WRITERS[name]]
    ran = []
    parser = build_parser()
    handler = parser.parse_args(argv).handler
    monkeypatch.setattr("megatron_vshape.cli.build_parser", lambda: _with_handler(
        parser, lambda args: ran.append(handler)))
    assert main(argv) == 2
    assert ran == []
    path = next(a for a in argv if str(afile) in a)
    assert _one_error_line(capsys, path).endswith(f"{afile} is a file, not a folder")


def _with_handler(parser, handler):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(handler=handler)
    return parser


def test_other_path_errors_do_not_say_cannot_write(tmp_path, capsys, monkeypatch):
    """An OSError about a path, raised by the subcommand, is one line: ``cannot write`` only
    where the path is the output or under it."""
    out = str(tmp_path / "x.png")
    argv = ["render", "--schedule", "v-half", "-p", "4", "-m", "8", "-o", out]
    for error, said in [
            (OSError(2, "No such file or directory", out),
             f"cannot write {out}: No such file or directory"),
            (OSError(13, "Permission denied", "/etc/shadow"), "/etc/shadow: Permission denied"),
            (OSError(28, "No space left on device", f"{out}/part"),
             f"cannot write {out}/part: No space left on device")]:
        def fail(args, error=error):
            raise error

        parser = _with_handler(build_parser(), fail)
        monkeypatch.setattr("megatron_vshape.cli.build_parser", lambda: parser)
        assert main(argv) == 2
        assert capsys.readouterr().err == f"vshape: error: {said}\n"


def test_output_cut_short_by_a_closed_pipe_is_no_traceback():
    """``vshape grid NAME --dry-run | head``: the reader goes away; nothing is printed."""
    run = subprocess.run(f"{shlex.quote(sys.executable)} -m megatron_vshape grid gpt-9.6b "
                         f"--dry-run | head -n 1", shell=True, capture_output=True, text=True,
                         cwd=ROOT)
    assert run.stdout.startswith("grid gpt-9.6b")
    assert run.stderr == ""


# -- help --------------------------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"vshape {__version__}"


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_every_subcommand_has_a_description_and_examples_that_parse(name):
    sub = _subcommands()[name]
    assert sub.description and len(sub.description) > 60, name
    text = sub.format_help()
    assert "\nexamples:\n" in text
    examples = [line.strip() for line in text.split("\nexamples:\n", 1)[1].splitlines()
                if line.strip()]
    assert examples and all(e.startswith(f"vshape {name} ") or e == f"vshape {name}"
                            for e in examples), examples
    for example in examples:
        args = build_parser().parse_args(shlex.split(example)[1:])
        assert args.command == name


# -- progress ----------------------------------------------------------------------------------
def test_compare_shows_progress_on_a_terminal_only(monkeypatch):
    terminal = _terminal(monkeypatch)
    assert main(["compare", "-p", "4", "-m", "8"]) == 0
    drawn = terminal.getvalue()
    assert f"simulating:   0%|          | 0/{len(SCHEDULES)}" in drawn
    assert drawn.endswith("\r"), "the bar is cleared when the work ends"
    terminal.seek(0)
    terminal.truncate()
    assert main(["compare", "-p", "4", "-m", "8", "--no-progress"]) == 0
    assert terminal.getvalue() == ""


def test_no_progress_when_standard_error_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(ui, "DELAY_S", 0.0)
    assert main(["search", "-p", "4", "-m", "8", "--memory-limit", "0.5"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, desc", [
    (["search", "-p", "4", "-m", "8", "--memory-limit", "0.5"], "searching: 00:0"),
    (["frontier", "-p", "4", "-m", "8"], "searching the frontier: 00:0"),
    (["collect", str(ROOT / "tests" / "data" / "logs")], "reading logs: 00:0"),
])
def test_long_commands_show_elapsed_time(argv, desc, monkeypatch):
    terminal = _terminal(monkeypatch)
    assert main(argv) == 0
    drawn = terminal.getvalue()
    assert desc in drawn
    assert drawn.endswith("\r"), "the line is cleared when the work ends"


def test_progress_waits_before_it_shows(monkeypatch):
    """Quick commands print nothing extra: progress appears only after DELAY_S."""
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    args = argparse.Namespace(no_progress=False)
    assert list(ui.progress(range(3), args, "x", "step")) == [0, 1, 2]
    with ui.working(args, "y"):
        pass
    assert stream.getvalue() == ""


# -- fewer microbatches than ranks -------------------------------------------------------------
def test_simulate_warns_when_microbatches_are_fewer_than_ranks(capsys):
    assert main(["simulate", "--schedule", "1f1b", "-p", "4", "-m", "2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("vshape: warning: 2 microbatches < 4 ranks: the pipeline never fills")
    assert "--microbatches 4 or more" in err and len(err.splitlines()) == 1
    bubble = re.search(r"\((\d+)% of the step here\)", err)
    assert bubble and int(bubble.group(1)) > 50
    assert main(["simulate", "--schedule", "1f1b", "-p", "4", "-m", "4"]) == 0
    assert capsys.readouterr().err == ""


# -- schedule descriptions ---------------------------------------------------------------------
def test_auto_is_described_in_user_words_details_under_verbose(capsys):
    argv = ["simulate", "--schedule", "auto", "-p", "8", "-m", "16", "--memory-limit", "0.5",
            "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    words = record["description"]
    assert "V-shape" in words and "2 model chunks per rank" in words
    assert "0.50 x 1F1B's" in words and f"bubble {record['bubble_rate']:.1%}" in words
    assert not any(w in words for w in JARGON), words
    assert "details" not in record
    assert main(argv + ["--verbose"]) == 0
    verbose = json.loads(capsys.readouterr().out)
    assert verbose["description"] == words
    assert "block" in verbose["details"] and verbose["details"].startswith("auto:")


def test_every_schedule_has_user_words(capsys):
    assert main(["compare", "-p", "4", "-m", "8", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["schedule"] for r in records] == list(SCHEDULES)
    words = {r["schedule"]: r["description"] for r in records}
    assert len(set(words.values())) == len(SCHEDULES)
    assert all(not any(w in d for w in JARGON) for d in words.values()), words
    assert "1 model chunk per rank" in words["1f1b"]
    assert "2 model chunks per rank" in words["v-min"]
    assert "peak activation memory 0.50 x 1F1B's" in words["v-min"]


def test_frontier_rows_in_user_words_details_under_verbose(capsys):
    assert main(["frontier", "-p", "4", "-m", "8", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all("V-shape" in r["description"] and "details" not in r for r in rows)
    assert main(["frontier", "-p", "4", "-m", "8", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "auto: v-min block" in text


# -- compare --plot ----------------------------------------------------------------------------
def test_compare_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "compare.png"
    assert main(["compare", "-p", "4", "-m", "8", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}")
    assert main(["compare", "-p", "4", "-m", "8", "--plot", str(tmp_path / "c.svg")]) == 2
    assert "--plot must end in .png" in capsys.readouterr().err


# -- demo: megatron-core's missing-backend warnings --------------------------------------------
_TE = "Transformer Engine and Apex are not installed. Falling back to local implementations"
_APEX = "Apex is not installed. Falling back to Torch Norm"


def test_demo_hides_missing_backend_warnings_here(recwarn):
    with demo.missing_backend_warnings_hidden():
        warnings.warn(_TE, UserWarning)
        warnings.warn(_APEX, UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in recwarn] == ["something else"]
    warnings.warn(_APEX, UserWarning)
    assert len(recwarn) == 2, "the filter ends with the context"


def test_demo_hides_missing_backend_warnings_in_spawned_ranks():
    """multiprocessing's spawn starts each rank with the -W flags of sys.warnoptions
    (subprocess._args_from_interpreter_flags): a child started the same way stays quiet."""
    code = (f"import warnings; warnings.warn({_TE!r}, UserWarning); "
            f"warnings.warn({_APEX!r}, UserWarning); warnings.warn('kept', UserWarning)")
    saved = list(sys.warnoptions)
    with demo.missing_backend_warnings_hidden():
        flags = subprocess._args_from_interpreter_flags()
    assert sys.warnoptions == saved
    quiet = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True)
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "not installed" in loud.stderr
    assert "not installed" not in quiet.stderr and "kept" in quiet.stderr


def test_demo_names_the_missing_backends(monkeypatch):
    import importlib.util

    present = {"apex"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name in present else None)
    with demo.missing_backend_warnings_hidden() as missing:
        assert missing == ["Transformer Engine"]
    present.clear()
    with demo.missing_backend_warnings_hidden() as missing:
        assert missing == ["Transformer Engine", "Apex"]


# -- grid --prune ------------------------------------------------------------------------------
PRUNE_GRID = f"""\
name: prune
model: {CONFIG_DIR / 'models/gpt-9.6b.yaml'}
gpus: {{nodes: 2, per_node: 8}}
seq_lengths: [3072]
global_batch: 128
tp: [1]
pp: [1, 2, 4]
mbs: [1, 4]
schedules: [1f1b, v-half, auto]
gpu_memory_gib: 80
extra_args: [--use-distributed-optimizer, --sequence-parallel, --attention-backend flash, --bf16]
"""


def test_prune_drops_what_the_planner_says_cannot_fit(tmp_path):
    path = tmp_path / "prune.yaml"
    path.write_text(PRUNE_GRID)
    full = expand(load_grid(str(path)))
    pruned = prune(full)
    dropped = {(s.pp, s.mbs, s.label) for s in pruned.skipped if s.rule == PLAN_RULE}
    # 9.6B at s 3072 on 80 GB: micro batch 4 without a pipeline (123 GiB), on 2 stages under
    # 1F1B or V-Half, or on 4 under 1F1B (77.8 GiB with its backward's workspace) does not
    # fit; micro batch 1, and V-Half on 4 stages, do
    assert dropped == {(1, 4, "1f1b"), (2, 4, "1f1b"), (2, 4, "v-half"), (4, 4, "1f1b")}
    assert all("GiB" in s.reason for s in pruned.skipped if s.rule == PLAN_RULE)
    kept = {(p.pp, p.mbs, p.choice.name) for p in pruned.points}
    assert (2, 4, "auto") in kept, "auto fits where V-Min does"
    assert kept | dropped == {(p.pp, p.mbs, p.choice.name) for p in full.points}
    assert [p.index for p in pruned.points] == list(range(len(pruned.points)))


def test_cli_grid_prune_writes_only_the_points_that_fit(tmp_path, capsys):
    path = tmp_path / "prune.yaml"
    path.write_text(PRUNE_GRID)
    out = tmp_path / "runs"
    assert main(["grid", str(path), "--prune", "--format", "slurm", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--prune: 4 of 14 points dropped" in printed
    assert f"{PLAN_RULE}" in printed
    assert len((out / "commands.txt").read_text().splitlines()) == 10
    assert "--array=0-9" in (out / "grid.sbatch").read_text()
    assert f"vshape grid {path} --prune --format slurm" in (out / "grid.sbatch").read_text()


def test_prune_needs_the_gpu_memory(tmp_path, capsys):
    path = tmp_path / "prune.yaml"
    path.write_text(PRUNE_GRID.replace("gpu_memory_gib: 80\n", ""))
    assert main(["grid", str(path), "--prune", "--dry-run"]) == 2
    assert "gpu_memory_gib" in capsys.readouterr().err


# -- slurm launcher: NCCL and network ----------------------------------------------------------
_EXPORTED = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def test_launcher_sets_nccl_defaults_and_keeps_the_users(tmp_path):
    fake = fake_checkout(tmp_path)
    (tmp_path / "bin" / "torchrun").write_text(
        "#!/bin/bash\n" + "".join(f'echo "ENV {k}=${{{k}:-unset}}"\n' for k in _EXPORTED))
    script = str(fake["repo"] / "scripts/slurm/pretrain_gpt_vshape.sbatch")
    env = {k: v for k, v in fake["env"].items() if k not in _EXPORTED}

    def launched(**extra) -> dict:
        run = subprocess.run(["bash", script], capture_output=True, text=True, cwd=tmp_path,
                             env=dict(env, RUN_NAME="nccl", **extra))
        assert run.returncode == 0, run.stderr
        log = (tmp_path / "logs" / "nccl.log").read_text()
        return dict(line[4:].split("=", 1) for line in log.splitlines() if line.startswith("ENV "))

    assert launched() == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "WARN",
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert launched(NCCL_DEBUG="INFO")["NCCL_DEBUG"] == "INFO"


def test_slurm_readme_explains_every_network_variable_of_the_launcher():
    script = (SLURM / "pretrain_gpt_vshape.sbatch").read_text()
    named = set(re.findall(r"^#? ?export ((?:NCCL|TORCH_NCCL|GLOO|CUDA)_[A-Z_]+)=", script,
                           flags=re.M))
    assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", *_EXPORTED} <= named
    readme = (SLURM / "README.md").read_text()
    assert "## NCCL and network" in readme
    assert not [v for v in named if f"`{v}`" not in readme]


# -- per-stage costs ---------------------------------------------------------------------------
HEAVY_HEAD = "1,1,1/1,1,1/1,1,1/2,2,2"
"""p = 2 under a V: stage 3 (rank 0's chunk 1, the LM head and loss) twice as heavy."""


def test_stage_costs_inline_and_file_time_the_heavy_stage(tmp_path, capsys):
    argv = ["simulate", "--schedule", "v-half", "-p", "2", "-m", "4", "--json"]
    assert main(argv + ["--costs", "3,3,3"]) == 0  # rank 0's work spread evenly over its chunks
    even = json.loads(capsys.readouterr().out)
    assert main(argv + ["--stage-costs", HEAVY_HEAD]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert staged["costs"][4] == [[1, 1, 1], [1, 1, 1], [1, 1, 1], [2, 2, 2]]
    assert staged["costs"][:4] == [[3.0, 2.0], [3.0, 2.0], [3.0, 2.0], 0.0]
    assert staged["makespan"] != even["makespan"]
    path = tmp_path / "stages.json"
    path.write_text(json.dumps({"forward": [1, 1, 1, 2], "backward": [1, 1, 1, 2],
                                "weight": [1, 1, 1, 2]}))
    assert main(argv + ["--stage-costs", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == staged


@pytest.mark.parametrize("spec, said", [
    ("1,1,1/1,1,1/2,2,2", "gives 3 stages, the schedule has 4 (2 ranks x 2 chunks, v layout)"),
    ("1,1,1/1,1,1/1,1,1/0,2,2", "every forward (F) time must be a finite number > 0"),
    ("nothere.json", "cannot read the file"),
])
def test_bad_stage_costs_are_one_line_naming_the_option_and_forms(spec, said, capsys,
                                                                   monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("built a schedule from bad costs")

    monkeypatch.setattr("megatron_vshape.cli.schedules.build_schedule", no_work)
    assert main(["simulate", "--schedule", "v-half", "-p", "2", "-m", "4",
                 "--stage-costs", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vshape: error: --stage-costs {spec!r}: ") and said in err, err
    assert "valid forms: F,B,W/F,B,W/..." in err and "FILE.json" in err
    assert len(err.splitlines()) == 1


def test_stage_costs_and_costs_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--schedule", "v-half", "-p", "2", "-m", "4", "--costs", "1,1,1",
              "--stage-costs", HEAVY_HEAD])
    assert "not allowed with argument" in capsys.readouterr().err


def test_compare_with_stage_costs_keeps_the_schedules_that_can_read_them(capsys):
    """2p stages: every schedule (1F1B's stage k sums stages 2k and 2k + 1); p stages: only
    the one-chunk schedules, the others named as skipped."""
    assert main(["compare", "-p", "2", "-m", "4", "--json", "--stage-costs", HEAVY_HEAD]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["schedule"] for line in out.splitlines()] == list(SCHEDULES)
    assert err == ""
    assert main(["compare", "-p", "2", "-m", "4", "--json", "--stage-costs", "2,2,2/3,3,3"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["schedule"] for line in out.splitlines()] == ["1f1b", "zb-1p"]
    assert "skipping interleaved-1f1b, v-min, v-half, v-zb, auto" in err


def _no_work(*args, **kwargs):
    raise AssertionError("did work before refusing the input")


@pytest.mark.parametrize("argv, said", [
    # the schedule's size: -p 100000 -m 8 ran past two minutes; refused before any work
    (["search", "-p", "100000", "-m", "8"], "--ranks 100000 --microbatches 8 is too large: "
     "at most --ranks 128 and --ranks x --microbatches 16,384 (here 800,000)"),
    (["search", "-p", "129", "-m", "8"], "at most --ranks 128"),
    (["frontier", "-p", "8", "-m", "2049"], "(here 16,392)"),
    (["compare", "-p", "16", "-m", "1025"], "is too large"),
    (["simulate", "--schedule", "1f1b", "-p", "20000", "-m", "8"], "is too large"),
    (["render", "--schedule", "v-half", "-p", "4", "-m", "8192", "-o", "x.txt"], "too large"),
    (["export", "--schedule", "v-zb", "-p", "256", "-m", "2"], "too large"),
    # -p / -m below a pipeline: the ranks are named before the costs are read for them
    (["search", "-p", "-3", "-m", "8"], "--ranks must be >= 2, got -3"),
    (["simulate", "--schedule", "v-half", "-p", "1", "-m", "8"], "--ranks must be >= 2, got 1"),
    (["frontier", "-p", "4", "-m", "0"], "--microbatches must be >= 1, got 0"),
    # costs and memory that are not finite
    (["search", "-p", "4", "-m", "8", "--costs", "inf,1,1"],
     "--costs 'inf,1,1': costs: every forward (F) time must be a finite number > 0"),
    (["compare", "-p", "4", "-m", "8", "--costs", "1,1,1,nan"],
     "comm must be a finite number >= 0, got nan"),
    (["search", "-p", "4", "-m", "8", "--memory-limit", "inf"],
     "--memory-limit must be a fraction of 1F1B's peak, a finite number > 0 (e.g. 0.5), or "
     "bytes with a unit (e.g. 40GiB), got 'inf'"),
    (["search", "-p", "4", "-m", "8", "--memory-limit", "-0.5"], "got '-0.5'"),
    (["search", "-p", "4", "-m", "8", "--memory-limit", "4GiB", "--activation-bytes=-1GiB"],
     "--activation-bytes must be a finite number of bytes > 0, got '-1GiB'"),
    (["search", "-p", "4", "-m", "8", "--memory-model", "nan,0,-nan"],
     "--memory-model 'nan,0,-nan': memory: forward, backward and weight deltas must be finite"),
    # 0 is a value, not "use the default"
    (["plan", "--model", "tiny", "--gpus", "8", "--gpu-memory", "80", "--seq-length", "0"],
     "seq_length (--seq-length) must be > 0, got 0"),
    (["profile", "--model", "tiny", "--seq-length", "0", "--device", "cpu"],
     "--seq-length must be >= 1, got 0"),
    (["collect", os.devnull], "is neither a file nor a folder of *.log files"),
])
def test_bad_input_is_one_line_naming_the_setting_before_any_work(argv, said, capsys,
                                                                 monkeypatch, tmp_path):
    for name in ("search", "frontier", "build_schedule", "simulate"):
        monkeypatch.setattr(f"megatron_vshape.cli.schedules.{name}", _no_work)
    monkeypatch.setattr("megatron_vshape.cli.plan.plan", _no_work)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vshape: error: ") and said in err, err
    assert len(err.splitlines()) == 1


def test_the_size_bound_lets_the_largest_measured_sizes_through(capsys):
    """The bound's corners (p = 128 with m = 128, p = 2 with m = 8192) are accepted, and a
    command runs at the bound (a fixed order here, to stay fast)."""
    from megatron_vshape.schedule.model.size import MAX_RANKS, MAX_SIZE, check_size

    for ranks, microbatches in ((MAX_RANKS, MAX_SIZE // MAX_RANKS), (2, MAX_SIZE // 2)):
        check_size(ranks, microbatches)
    assert main(["simulate", "--schedule", "1f1b", "-p", "8", "-m", "2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["microbatches"] == 2048
