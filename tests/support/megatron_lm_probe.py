"""Full-precision records of a Megatron-LM training run, for comparing schedules exactly.

Megatron-LM logs losses with 6 digits; the tier compares at 1e-5 relative and wants to see
bit-equality where there is one. :func:`install_probe` wraps ``train_step`` (each iteration's
reduced loss dict, grad norm, skipped flag) and ``evaluate`` (each evaluation's loss dict) in
``megatron.training.training`` -- train() and evaluate_and_print_results() look them up there
by name -- and appends one JSON line per event to ``$VSHAPE_E2E_RECORD/rank<RANK>.jsonl``.
For MoE models it also records what training_log adds to the logged loss dict for the MoE
metrics (load_balancing_loss, z_loss, ...): core_v0.16.1's training.py:1974 calls
``track_moe_metrics`` (imported by name at :144), the 0.19-era training.py:2782
``get_moe_metrics_tracker().report``; both add the PP-reduced, microbatch-scaled per-layer
sums to ``total_loss_dict``. With multi-token prediction it records what training_log's
``MTPLossLoggingHelper.track_mtp_metrics`` adds there ("mtp_1 loss", ...: the DP-averaged,
microbatch-scaled MTP losses; core_v0.16.1 training.py:1992, 0.19-era :2800).
Without that variable nothing is written. Test support only, like megatron_lm_cpu.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["install_probe", "Records", "read_records"]

RECORD_DIR = "VSHAPE_E2E_RECORD"


def _write(event: dict) -> None:
    folder = os.environ.get(RECORD_DIR)
    if not folder:
        return
    path = Path(folder) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(event) + "\n")


def _floats(loss_dict) -> dict:
    return {key: float(value) for key, value in (loss_dict or {}).items()}


def install_probe() -> None:
    """Wrap train_step, evaluate_and_print_results and evaluate (idempotent)."""
    from megatron.training import get_args, training

    if getattr(training.train_step, "vshape_probe", False):
        return
    train_step, evaluate_and_print = training.train_step, training.evaluate_and_print_results
    evaluate = training.evaluate
    where = {}  # the evaluation being run: its prefix and iteration

    @functools.wraps(train_step)
    def probed_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        loss, skipped, grad_norm = result[0], result[1], result[5]
        _write({"kind": "train", "iteration": get_args().curr_iteration + 1,
                "loss": _floats(loss), "grad_norm": None if grad_norm is None else
                float(grad_norm), "skipped": int(skipped)})
        return result

    @functools.wraps(evaluate_and_print)
    def probed_evaluate_and_print(prefix, *args, **kwargs):
        where.update(prefix=prefix, iteration=args[3] if len(args) > 3 else kwargs["iteration"])
        return evaluate_and_print(prefix, *args, **kwargs)

    @functools.wraps(evaluate)
    def probed_evaluate(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        _write({"kind": "eval", **where, "loss": _floats(result[0])})
        return result

    _probe_moe_metrics(training)
    _probe_mtp_metrics(training)
    probed_train_step.vshape_probe = True
    training.train_step = probed_train_step
    training.evaluate_and_print_results = probed_evaluate_and_print
    training.evaluate = probed_evaluate


def _moe_metrics_recorder(original):
    """``original`` (track_moe_metrics / the tracker's report), recording the values it adds
    to ``total_loss_dict`` for this iteration."""
    @functools.wraps(original)
    def recorded(*args, **kwargs):
        totals = kwargs.get("total_loss_dict")
        before = {k: float(v) for k, v in (totals or {}).items()}
        result = original(*args, **kwargs)
        if totals is not None:
            _write({"kind": "moe", "iteration": kwargs["iteration"],
                    "loss": {k: float(v) - before.get(k, 0.0) for k, v in totals.items()
                             if k in (kwargs.get("track_names") or ())}})
        return result
    return recorded


def _probe_moe_metrics(training) -> None:
    if hasattr(training, "track_moe_metrics"):  # core_v0.16.1
        training.track_moe_metrics = _moe_metrics_recorder(training.track_moe_metrics)
    if hasattr(training, "get_moe_metrics_tracker"):  # the 0.19 era
        tracker = type(training.get_moe_metrics_tracker())
        tracker.report = _moe_metrics_recorder(tracker.report)


def _probe_mtp_metrics(training) -> None:
    """Record what ``track_mtp_metrics(loss_scale, iteration, writer, wandb_writer,
    total_loss_dict)`` adds to ``total_loss_dict`` (both releases call it so, positionally)."""
    helper = getattr(training, "MTPLossLoggingHelper", None)
    if helper is None:
        return
    original = helper.track_mtp_metrics

    @functools.wraps(original)
    def recorded(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        before = {k: float(v) for k, v in (total_loss_dict or {}).items()}
        result = original(loss_scale, iteration, writer, wandb_writer, total_loss_dict)
        added = {k: float(v) - before.get(k, 0.0) for k, v in (total_loss_dict or {}).items()
                 if k.startswith("mtp_")}
        if added:
            _write({"kind": "mtp", "iteration": iteration, "loss": added})
        return result
    helper.track_mtp_metrics = staticmethod(recorded)


@dataclass
class Records:
    """One rank's records: ``train[i]`` = iteration i+1's {'loss', 'grad_norm', ...}."""

    train: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    moe: list = field(default_factory=list)
    """Iterations' MoE metrics as logged ({'iteration', 'loss': {'load_balancing_loss', ..}})."""
    mtp: list = field(default_factory=list)
    """Iterations' MTP losses as logged ({'iteration', 'loss': {'mtp_1 loss', ..}})."""

    def since(self, iteration: int) -> "Records":
        """Training records from ``iteration`` on, and the evaluations run there."""
        return Records(*([e for e in events if e["iteration"] >= iteration]
                         for events in (self.train, self.evals, self.moe, self.mtp)))

    def losses(self, key: str = "lm loss") -> list:
        return [event["loss"][key] for event in self.train]

    def grad_norms(self) -> list:
        return [event["grad_norm"] for event in self.train]

    def iterations(self) -> list:
        return [event["iteration"] for event in self.train]

    def moe_metrics(self, key: str = "load_balancing_loss") -> list:
        """(iteration, value) of a logged MoE metric, one per training iteration."""
        return [(event["iteration"], event["loss"][key]) for event in self.moe]

    def mtp_losses(self, key: str = "mtp_1 loss") -> list:
        """(iteration, value) of a logged MTP loss, one per training iteration."""
        return [(event["iteration"], event["loss"][key]) for event in self.mtp]

    def eval_losses(self, key: str = "lm loss") -> list:
        return [(event["prefix"], event["iteration"], event["loss"][key]) for event in self.evals]


def read_records(folder: str | Path, rank: int) -> Records:
    """The records global rank ``rank`` wrote (the last rank holds the loss in Megatron-LM)."""
    records = Records()
    path = Path(folder) / f"rank{rank}.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        {"train": records.train, "eval": records.evals, "moe": records.moe,
         "mtp": records.mtp}[event["kind"]].append(event)
    return records
