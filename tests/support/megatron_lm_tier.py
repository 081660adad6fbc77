"""The real-loop tiers' shared parts: the tiny GPT's flags, runs launched once per session,
and the comparison of a run with a reference run (tests/megatron/test_megatron_lm_e2e.py for Megatron-LM
core_v0.16.1, tests/megatron/test_megatron_lm_019.py for the 0.19-era training code).

Megatron-LM seeds weight initialisation with seed + 100 x pipeline rank, and a V places layers
on other ranks than 1F1B, so every comparison starts from one initial checkpoint (a 1F1B run of
one iteration) loaded with --finetune: the same weights, a fresh optimizer, iteration 0.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.megatron_lm_launch import REPO, Launcher, RunResult, megatron_lm_env
from support.megatron_lm_probe import Records, read_records

__all__ = ["SCRIPT", "REL", "ITERS", "TINY_GPT", "PP4", "MOE_CASES", "MTP_CASES", "Run", "Runs",
           "assert_same_training", "assert_same_moe_metrics", "assert_same_mtp_losses",
           "schedule_flags", "initial_checkpoint", "trained", "resumed", "under_torchrun",
           "uneven_runs", "uneven_zb1p_runs"]

SCRIPT = REPO / "scripts" / "pretrain_gpt_vshape.py"
REL = 1e-5
"""fp32: the schedules run the same arithmetic per microbatch; only the order of gradient
accumulation across microbatches may differ (a few ulps over 8 microbatches)."""
ITERS = 4

TINY_GPT = (
    "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 16 "
    "--lr 1e-3 --min-lr 1e-4 --seed 1234 --attention-dropout 0 --hidden-dropout 0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 98,1,1 "
    "--transformer-impl local --no-gradient-accumulation-fusion --use-cpu-initialization "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --distributed-backend gloo --log-interval 1 "
    "--eval-interval 2 --eval-iters 1 --num-workers 0 --log-throughput").split()
"""A tiny GPT Megatron-LM trains in seconds on CPU; dropout off (its random streams follow
each rank's pass order, which is what differs between schedules)."""


@dataclass(frozen=True)
class Run:
    result: RunResult
    records: Records
    folder: Path

    def log(self, rank: int = 0) -> str:
        return self.result.log(rank)


class Runs:
    """Runs by name, each launched once per session (cases share their 1f1b references);
    ``script``: the training script of runs that name none (scripts/pretrain_gpt_vshape.py,
    or scripts/pretrain_hybrid_vshape.py for a tier of hybrid models)."""

    def __init__(self, launcher: Launcher, root: Path, script: Path = SCRIPT):
        self.launcher, self.root, self.script, self._done = launcher, root, script, {}

    def get(self, name: str, flags: list, nproc: int = 4, script: Path | None = None,
            env=None) -> Run:
        """The run ``name`` of ``script`` (the training script, or a runner around it such as
        support/sft_run.py; None: the runs' own) with ``flags`` and ``env`` added to its
        processes' environment, launched on first use."""
        script = script or self.script
        if name not in self._done:
            folder = self.root / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            result = self.launcher.run(script, flags, nproc, folder / "logs",
                                       env={**(env or {}), "VSHAPE_E2E_RECORD": str(folder)})
            assert result.ok, f"run {name!r} failed:\n{result.failure()}"
            self._done[name] = Run(result, read_records(folder, nproc - 1), folder)
        return self._done[name]

    def attempt(self, name: str, flags: list, nproc: int = 4, env=None,
                script: Path | None = None) -> RunResult:
        """A run expected to fail: its result, whatever it is (not cached)."""
        script = script or self.script
        folder = self.root / name
        shutil.rmtree(folder, ignore_errors=True)
        return self.launcher.run(script, flags, nproc, folder / "logs", env=env)

    def path(self, name: str) -> Path:
        return self.root / name


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def assert_same_training(run: Run, reference: Run, label: str, first: int = 1) -> dict:
    """Iterations ``first``..ITERS of ``run`` have the lm loss and grad norm of the same
    iterations of ``reference``, and its validation losses from there on too (REL)."""
    got, want = run.records, reference.records.since(first)
    assert got.iterations() == want.iterations() == list(range(first, ITERS + 1)), \
        f"{label}: iterations {got.iterations()} vs {want.iterations()}"
    assert all(event["skipped"] == 0 for event in got.train)
    loss = max(_rel(a, b) for a, b in zip(got.losses(), want.losses()))
    norm = max(_rel(a, b) for a, b in zip(got.grad_norms(), want.grad_norms()))
    assert [e[:2] for e in got.eval_losses()] == [e[:2] for e in want.eval_losses()]
    assert got.eval_losses(), f"{label}: no validation loss was recorded"
    valid = max(_rel(a[2], b[2]) for a, b in zip(got.eval_losses(), want.eval_losses()))
    report = {"case": label, "iterations": len(got.train), "loss": loss, "grad_norm": norm,
              "valid": valid, "seconds": round(run.result.seconds, 1)}
    print(report)
    assert loss <= REL and norm <= REL and valid <= REL, report
    assert all(math.isfinite(x) for x in got.losses() + got.grad_norms())
    return report


def _assert_same_logged(run: Run, reference: Run, label: str, first: int, kind: str,
                        series: str) -> tuple[list, dict]:
    """Each metric the reference logged of ``kind`` (Records.moe / .mtp), read by its
    ``series`` method (Records.moe_metrics / .mtp_losses): logged for iterations
    ``first``..ITERS and equal to the reference's (REL). The names and the report."""
    got, want = run.records.since(first), reference.records.since(first)
    logged = getattr(want, kind)
    names = sorted(logged[0]["loss"]) if logged else []
    report = {"case": label}
    for name in names:
        mine, theirs = getattr(got, series)(name), getattr(want, series)(name)
        assert [i for i, _ in mine] == list(range(first, ITERS + 1)), \
            f"{label}: {name} logged for iterations {[i for i, _ in mine]}"
        report[name] = max(_rel(a, b) for (_, a), (_, b) in zip(mine, theirs))
    print(report)
    assert all(report[name] <= REL for name in names), report
    return names, report


def assert_same_moe_metrics(run: Run, reference: Run, label: str, first: int = 1) -> dict:
    """The MoE metrics Megatron-LM logs (load_balancing_loss, z_loss: PP-reduced sums over
    layers and microbatches) of iterations ``first``..ITERS equal the reference's (REL)."""
    names, report = _assert_same_logged(run, reference, label, first, "moe", "moe_metrics")
    assert "load_balancing_loss" in names, f"{label}: the reference logged no MoE metrics"
    return report


def assert_same_mtp_losses(run: Run, reference: Run, label: str, first: int = 1) -> dict:
    """The MTP losses Megatron-LM logs ("mtp_1 loss", ...: averaged over data parallel ranks,
    scaled by 1 / microbatches) of iterations ``first``..ITERS equal the reference's (REL)."""
    names, report = _assert_same_logged(run, reference, label, first, "mtp", "mtp_losses")
    assert names, f"{label}: the reference logged no MTP loss"
    return report


PP4 = ["--pipeline-model-parallel-size", "4"]

_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
        "--moe-router-load-balancing-type", "aux_loss"]
MOE_CASES = {
    "moe-ep": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
               "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer",
               "--untie-embeddings-and-output-weights", "--moe-expert-capacity-factor", "1.0",
               "--moe-pad-expert-input-to-capacity"] + _MOE,
    "moe-pp4": ["--pipeline-model-parallel-size", "4", "--moe-token-dispatcher-type",
                "allgather", "--disable-bias-linear", "--moe-z-loss-coeff", "1e-3",
                "--moe-shared-expert-intermediate-size", "64"] + _MOE
               + ["--moe-router-load-balancing-type", "global_aux_loss"],
    "moe-edp": ["--pipeline-model-parallel-size", "2", "--moe-token-dispatcher-type",
                "allgather", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                "--use-distributed-optimizer", "--overlap-grad-reduce",
                "--overlap-param-gather"] + _MOE
               + ["--moe-router-load-balancing-type", "seq_aux_loss",
                  "--moe-layer-freq", "([0]+[1]*3)*2"],
}
"""The MoE tiers' models (4 experts, top-2) on top of TINY_GPT: moe-ep, PP 2 x EP 2 (DP 2) with
the alltoall dispatcher, the aux loss, the distributed optimizer and expert capacity with
padding (token dropping); moe-pp4, PP 4 with the allgather dispatcher, the global aux loss,
z-loss and a shared expert; moe-edp, PP 2 x DP 2 with EP 1 (every expert's gradient reduced
over the expert-data-parallel group, in DDP's expert buckets, overlapped) with the distributed
optimizer, the sequence aux loss, and dense and MoE layers mixed (--moe-layer-freq: a dense
layer, then three MoE ones). moe-ep and moe-edp untie the embeddings (the dense tiers save tied
ones at DP 2). moe-pp4 and
moe-edp have no linear biases: megatron-core 0.16's experts add their bias in place to the
output of a RowParallelLinear that returns its input as a view with EP 1
(core/transformer/mlp.py:247), which autograd refuses under every schedule, 1f1b included."""


_MTP = ["--position-embedding-type", "rope", "--no-rope-fusion",
        "--untie-embeddings-and-output-weights"]
MTP_CASES = {
    "mtp-pp2": ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1",
                "--use-distributed-optimizer"] + _MTP,
    "mtp-pp4": PP4 + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"] + _MTP,
}
"""The multi-token prediction tiers' models on top of TINY_GPT (rope: Megatron-LM allows MTP with
rope or no position embeddings only): mtp-pp2, PP 2 x DP 2 with one MTP layer (the logged loss
averaged over DP) and the distributed optimizer (the embedding and the V's copy of it each in a
bucket of their own, sharded alike, as megatron's DDP does for a shared embedding), saved with
megatron's fully parallel save (the V's copy a replica written once: replicas.py); mtp-pp4, two
MTP layers and a loss scaling factor of 0.3. Both untie the embeddings:
megatron-core cannot save or load an MTP model with tied ones at PP > 1, under its own 1f1b too
(its MTP stage builds an ``output_layer.weight`` the tied state dict refuses: 0.16
language_module.py:343, 0.19 :497), so no comparison could start from a common checkpoint;
tests/megatron/test_megatron_gloo.py proves tied MTP on megatron-core alone."""


def schedule_flags(schedule: str) -> list:
    flags = ["--pipeline-schedule", schedule]
    if schedule == "auto":  # re-planned inside the loop from the first iteration's costs
        flags += ["--pipeline-memory-limit", "0.75", "--pipeline-replan-after", "1"]
    return flags


def initial_checkpoint(runs: Runs, key: str, model: list, nproc: int = 4) -> list:
    """Flags that start a run from the weights of a one-iteration 1f1b run of ``model``."""
    folder = runs.path(f"init-{key}") / "checkpoint"
    runs.get(f"init-{key}", TINY_GPT + model + ["--pipeline-schedule", "1f1b", "--train-iters",
                                                 "1", "--save", str(folder), "--save-interval",
                                                 "1"], nproc)
    return ["--load", str(folder), "--finetune"]


UNEVEN_FIRST_STAGE = ["--decoder-first-pipeline-num-layers", "2"]
"""14 layers on PP 4: megatron's 1f1b lays them out 2,4,4,4; the V runs 1,2,2,2,2,2,2,1."""


def uneven_runs(runs: Runs, key: str, model: list) -> tuple[Run, Run]:
    """(1f1b, v-half) of ``model`` (14 layers on PP 4) from one initial checkpoint: megatron's
    1f1b with its own uneven layout (:data:`UNEVEN_FIRST_STAGE`), v-half with the V's."""
    start = initial_checkpoint(runs, key, model + UNEVEN_FIRST_STAGE)
    reference = runs.get(f"{key}-1f1b", TINY_GPT + model + start + UNEVEN_FIRST_STAGE
                         + ["--train-iters", str(ITERS)])
    got = runs.get(f"{key}-v-half", TINY_GPT + model + start
                   + ["--pipeline-schedule", "v-half", "--train-iters", str(ITERS)])
    return reference, got


UNEVEN_LAYOUT = ["--pipeline-model-parallel-layout", "Ett|tttt|tttt|ttttL"]
"""The same 2,4,4,4 stages as :data:`UNEVEN_FIRST_STAGE`, written as a layout of PP stages."""


def uneven_zb1p_runs(runs: Runs, key: str, model: list) -> tuple[Run, Run]:
    """zb-1p on megatron's own uneven stages, from :func:`uneven_runs`' checkpoint: one run
    with --decoder-first-pipeline-num-layers, one with the same stages as a
    --pipeline-model-parallel-layout of PP stages (one chunk per rank, not interleaving)."""
    start = initial_checkpoint(runs, key, model + UNEVEN_FIRST_STAGE)
    zb = ["--pipeline-schedule", "zb-1p", "--train-iters", str(ITERS)]
    first = runs.get(f"{key}-zb-1p-first", TINY_GPT + model + start + UNEVEN_FIRST_STAGE + zb)
    layout = runs.get(f"{key}-zb-1p-layout", TINY_GPT + model + start + UNEVEN_LAYOUT + zb)
    return first, layout


def trained(runs: Runs, key: str, model: list, schedule: str, extra=(), nproc: int = 4,
            save: bool = True, start_from: tuple | None = None, env=None,
            name: str = "") -> Run:
    """``schedule`` trains ITERS iterations of ``model`` from its initial checkpoint (saving a
    checkpoint at iteration 2 and 4 for :func:`resumed`, unless ``save`` is False).
    ``start_from``: (key, model) of another model's initial checkpoint to start from (the
    same weights under other parallel sizes: megatron's distributed checkpoints reshard);
    ``env`` for its processes, ``name`` for a run that differs from ``{key}-{schedule}`` by
    them."""
    start = initial_checkpoint(runs, *(start_from or (key, model)), nproc)
    name = name or f"{key}-{schedule}"
    save = ["--save", str(runs.path(name) / "checkpoint"), "--save-interval", "2"] \
        if save else []
    return runs.get(name, TINY_GPT + model + start + schedule_flags(schedule) + save +
                    ["--train-iters", str(ITERS), *extra], nproc, env=env)


def resumed(runs: Runs, key: str, model: list, saved_by: str, schedule: str,
            nproc: int = 4, extra=()) -> Run:
    """``schedule`` resumes at iteration 2 from the checkpoint ``saved_by``'s run wrote
    (``extra``: flags of the resuming run alone)."""
    trained(runs, key, model, saved_by, nproc=nproc)
    folder = runs.path(f"{key}-{saved_by}") / "checkpoint"
    return runs.get(f"{key}-{saved_by}-to-{schedule}{''.join(extra)}",
                    TINY_GPT + model + schedule_flags(schedule) + [
                        "--load", str(folder), "--ckpt-step", "2", "--train-iters", str(ITERS),
                        *extra], nproc)


def under_torchrun(flags: list, record_dir: Path, nproc: int = 4) -> Records:
    """The script under a real ``torchrun`` (the CPU patches and the probe applied by
    support/mlm_site's sitecustomize in every process): the last rank's records."""
    env = megatron_lm_env([Path(__file__).parent / "mlm_site"])
    env["VSHAPE_E2E_RECORD"] = str(record_dir)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), str(SCRIPT), *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_records(record_dir, nproc - 1)
