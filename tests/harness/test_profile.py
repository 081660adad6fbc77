"""Measured cost profiles: ``vshape profile`` writes what ``vshape plan --profile`` reads.

One CPU measurement of the bundled tiny model through the CLI (a spawned gloo process,
megatron-core layers with our B/W split; about 10 s, most of it importing megatron-core), the
committed profiles read by the planner, and the loader's errors for the fields the profiler
adds (memory facts, provenance). A CUDA variant runs in the GPU tier.
"""
import csv
import dataclasses
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from megatron_vshape.cli import build_parser, main
from megatron_vshape.configs import CONFIG_DIR
from megatron_vshape.plan.profile_file import format_profile, load_profile
from megatron_vshape.schedule.model.costs import MemoryModel

TINY = CONFIG_DIR / "models" / "tiny.yaml"
PROFILES = CONFIG_DIR / "profiles"


def _measure_tiny(tmp_path, device: str):
    out = tmp_path / "tiny.yaml"
    code = main(["profile", "--model", str(TINY), "--layers", "2", "--iters", "2", "--warmup",
                 "1", "--micro-batch-sizes", "1", "2", "--device", device, "--output", str(out)])
    assert code == 0
    return out, load_profile(out)


def _body(path: Path) -> str:
    """The file without its comment lines."""
    return "".join(line for line in path.read_text().splitlines(keepends=True)
                   if not line.startswith("#"))


@pytest.mark.gloo
def test_profile_cli_writes_what_plan_reads(tmp_path, capsys):
    out, profile = _measure_tiny(tmp_path, "cpu")
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and printed.count("micro batch") == 2
    assert profile.seq_length == 32 and [m.micro_batch_size for m in profile.measurements] == [1, 2]
    for m in profile.measurements:
        assert m.tensor_parallel == 1
        assert min(m.layer.forward, m.layer.backward, m.layer.weight) > 0
        assert m.head.forward > 0 and m.head.backward > 0 and m.head.weight == 0
        assert m.activation_bytes_per_layer > 0
    # activations are linear in the micro batch size (fp32, no dropout: exact up to the
    # per-microbatch scalars, a few bytes)
    one, two = (m.activation_bytes_per_layer for m in profile.measurements)
    assert abs(two - 2 * one) <= 0.01 * two
    assert 0 < profile.backward_leftover < 1
    assert profile.memory_model() == MemoryModel(1.0, profile.backward_leftover - 1.0,
                                                 -profile.backward_leftover)
    assert profile.machine.kind == "cpu" and profile.machine.dtype == "float32"
    assert profile.machine.threads == 1 and profile.machine.torch == str(torch.__version__)
    # read back exactly what was written: formatting the loaded profile gives the same text
    assert _body(out) == format_profile(profile)
    assert dataclasses.replace(load_profile(out), path="") == dataclasses.replace(profile, path="")
    # the recorded command is a valid vshape command that measures the same thing again
    words = shlex.split(profile.command)
    again = build_parser().parse_args(words[1:])
    assert words[:2] == ["vshape", "profile"] and again.output == str(out)
    assert (again.model, again.seq_length, again.micro_batch_sizes, again.layers, again.iters,
            again.device) == (str(TINY), 32, [1, 2], 2, 2, "cpu")


@pytest.mark.parametrize("flags,needle", [
    (["--layers", "9"], "--layers 8 or fewer"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--micro-batch-sizes", "0"], "--micro-batch-sizes must be >= 1"),
])
def test_profile_cli_refuses_bad_settings_before_measuring(tmp_path, capsys, flags, needle):
    out = tmp_path / "never.yaml"
    assert main(["profile", "--model", str(TINY), "--output", str(out), *flags]) == 2
    assert needle in capsys.readouterr().err and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_profile_cli_refuses_cuda_without_a_gpu(tmp_path, capsys):
    assert main(["profile", "--model", str(TINY), "--device", "cuda", "--output",
                 str(tmp_path / "x.yaml")]) == 2
    assert "--device cpu" in capsys.readouterr().err


# -- the committed profiles --------------------------------------------------------------------
COMMITTED = sorted(PROFILES.glob("*.yaml"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.stem for p in COMMITTED])
def test_committed_profiles_carry_their_provenance(path):
    profile = load_profile(path)
    words = shlex.split(profile.command)
    args = build_parser().parse_args(words[1:])
    assert words[:2] == ["vshape", "profile"]
    assert args.output == f"configs/profiles/{path.name}"
    assert args.seq_length == profile.seq_length
    assert sorted(args.micro_batch_sizes) == sorted({m.micro_batch_size
                                                     for m in profile.measurements})
    assert sorted(args.tensor_parallel) == sorted({m.tensor_parallel
                                                   for m in profile.measurements})
    assert profile.machine.kind == args.device and profile.machine.device
    assert 0 < profile.backward_leftover < 1 and profile.memory_model() is not None
    assert all(m.activation_bytes_per_layer > 0 and m.head for m in profile.measurements)


def test_plan_uses_the_committed_tiny_profile(tmp_path, capsys):
    path = PROFILES / "cpu-tiny.yaml"
    profile = load_profile(path)
    out_csv = tmp_path / "plan.csv"
    code = main(["plan", "--model", str(TINY), "--gpus", "4", "--gpu-memory", "1",
                 "--reserved-memory", "0.5", "--profile", str(path), "--seq-length",
                 str(profile.seq_length), "--schedules", "1f1b", "v-half", "--recompute", "none",
                 "--micro-batch-sizes", "1", "2", "--csv", str(out_csv)])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"costs: profile {path}" in printed
    rows = list(csv.DictReader(out_csv.open()))
    assert rows and all(r["costs"].startswith("profile cpu-tiny.yaml b=") for r in rows)
    assert any(r["costs"] == "profile cpu-tiny.yaml b=1 t=1" for r in rows)


def test_a_profiles_leftover_sets_what_w_keeps_in_the_plan():
    """The planner and auto use the profile's memory model: W keeps the measured share of a
    layer's bytes (the formula's share without a leftover)."""
    from megatron_vshape.plan import load_model_config
    from megatron_vshape.plan.candidates import GridPoint
    from megatron_vshape.plan.evaluate import Evaluator
    from megatron_vshape.plan.memory import activation_sizes
    from megatron_vshape.plan.settings import ClusterConfig, TrainingConfig

    profile = load_profile(PROFILES / "cpu-small.yaml")
    model = load_model_config("small")
    training = TrainingConfig(profile.seq_length, 8, flash_attention=False)
    point, cluster = GridPoint(1, 1, 4, 1, 8), ClusterConfig(4, 80.0)
    layer = activation_sizes(model, training, 1, 1).layer
    with_profile = Evaluator(model, training, cluster, profile)
    shares = _v_shares(model)
    ranks = with_profile.rank_memory(point, shares, single=False)
    for rank, rank_shares in zip(ranks.chunks, shares):
        for chunk, share in zip(rank, rank_shares):
            assert chunk.wgrad == pytest.approx(share.layers * profile.backward_leftover * layer)
    analytic = Evaluator(model, training, cluster).rank_memory(point, shares, single=False)
    assert analytic.chunks[1][0].wgrad != pytest.approx(ranks.chunks[1][0].wgrad)
    assert with_profile.evaluate_auto(point).feasible


def _v_shares(model):
    from megatron_vshape.plan.shares import rank_shares
    from megatron_vshape.schedule import Layout, Placement

    return rank_shares(model, Placement(4, Layout.V))


# -- the loader's new fields -------------------------------------------------------------------
BASE = {"seq_length": 32, "measurements": [
    {"micro_batch_size": 1, "tensor_parallel": 1, "layer": {"F": 0.002, "B": 0.0015, "W": 0.0003},
     "activation_bytes_per_layer": 148992}],
    "backward_leftover": 0.25, "command": "vshape profile --model tiny.yaml",
    "machine": {"kind": "cpu", "device": "AMD EPYC", "dtype": "float32", "threads": 1}}


def _write(tmp_path, data) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_loader_reads_the_new_fields_and_builds_the_memory_model(tmp_path):
    profile = load_profile(_write(tmp_path, BASE))
    assert profile.measurements[0].activation_bytes_per_layer == 148992
    assert profile.memory_model() == MemoryModel(1.0, -0.75, -0.25)
    assert profile.command == "vshape profile --model tiny.yaml"
    assert profile.machine.device == "AMD EPYC" and profile.machine.threads == 1
    bare = {k: v for k, v in BASE.items() if k in ("seq_length", "measurements")}
    assert load_profile(_write(tmp_path, bare)).memory_model() is None


def _changed(top=None, entry=None, machine=None) -> dict:
    data = {**BASE, **(top or {})}
    data["measurements"] = [{**BASE["measurements"][0], **(entry or {})}]
    if machine is not None:
        data["machine"] = machine
    return data


@pytest.mark.parametrize("data,needle", [
    (_changed(entry={"activation_bytes_per_layer": -5}),
     r"measurements\[0\].activation_bytes_per_layer must be a whole number of bytes > 0, got -5"),
    (_changed(entry={"activation_bytes_per_layer": 1.5}), "activation_bytes_per_layer must be"),
    (_changed(entry={"activation_bytes": 10}),
     r"measurements\[0\]: unknown keys \['activation_bytes'\]; valid keys: "
     "activation_bytes_per_layer, embedding"),
    (_changed(top={"backward_leftover": 1.5}),
     "backward_leftover must be a fraction between 0 and 1"),
    (_changed(top={"backward_leftover": "half"}), "backward_leftover must be a fraction"),
    (_changed(top={"leftover": 0.2}),
     r"unknown keys \['leftover'\]; valid keys: backward_leftover, command, machine, measurements"),
    (_changed(top={"command": ["vshape", "profile"]}), "command must be text"),
    (_changed(machine="cpu"), "machine must be a mapping with kind"),
    (_changed(machine={"kind": "tpu"}), "machine.kind must be one of cpu, cuda, got 'tpu'"),
    (_changed(machine={"kind": "cpu", "gpu": "x"}),
     r"machine: unknown keys \['gpu'\]; valid keys: device, dtype, kind, megatron_core"),
    (_changed(machine={"kind": "cpu", "threads": "one"}), "machine.threads must be a whole number"),
    # a time is a finite number, > 0 for a layer's passes, >= 0 for a hop and the head's parts
    (_changed(entry={"layer": {"F": float("nan"), "B": 1, "W": 1}}),
     r"measurements\[0\].layer.F \(seconds\) must be a finite number > 0, got nan"),
    (_changed(entry={"layer": {"F": 1, "B": float("inf"), "W": 1}}),
     r"layer.B \(seconds\) must be a finite number > 0, got inf"),
    (_changed(entry={"layer": {"F": 1, "B": 1, "W": 0}}), r"layer.W \(seconds\) must be a finite"),
    (_changed(entry={"layer": {"F": "1", "B": 1, "W": 1}}),
     r"layer.F \(seconds\) must be a finite"),
    (_changed(entry={"head": {"F": float("inf"), "B": 1}}),
     r"head.F \(seconds\) must be a finite number >= 0, got inf"),
    (_changed(top={"p2p_seconds": float("nan")}), "p2p_seconds must be a finite number >= 0"),
    (_changed(top={"p2p_seconds": -1}), "p2p_seconds must be a finite number >= 0, got -1"),
])
def test_loader_errors_name_the_bad_field(tmp_path, data, needle):
    with pytest.raises(ValueError, match=needle) as err:
        load_profile(_write(tmp_path, data))
    assert "profile.yaml" in str(err.value) and "\n" not in str(err.value)


def test_a_head_pass_may_take_no_time_and_a_hop_none(tmp_path):
    profile = load_profile(_write(tmp_path, _changed(top={"p2p_seconds": 0},
                                                     entry={"head": {"F": 1, "B": 2, "W": 0}})))
    assert profile.p2p_seconds == 0.0 and profile.measurements[0].head.weight == 0.0


# -- GPU tier ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_cli_on_cuda_measures_bf16(tmp_path):
    _, profile = _measure_tiny(tmp_path, "cuda")
    assert profile.machine.kind == "cuda" and profile.machine.dtype == "bfloat16"
    assert profile.machine.device == torch.cuda.get_device_name()
    assert all(min(m.layer.forward, m.layer.backward, m.layer.weight) > 0
               for m in profile.measurements)
    assert 0 < profile.backward_leftover < 1
