"""The planner's prediction for a trial's own flags, beside what the trial measured.

Users read ``vshape plan``'s numbers before they have run anything; a trial shows how far to
trust them on their hardware. The model, batch and layout come from Megatron-LM's argument dump
in the 1F1B run's log (the same flags ran every schedule); each schedule is predicted at that
layout: activation bytes per pipeline rank for the order that ran (on a GPU with the
passes' scratch bytes, as the allocator's peak counts them; on the CPU the bytes kept for
backward, as the trial's tracker counts them), and tokens/s per GPU on a GPU (the default
cluster's H100 figures: ``vshape plan``'s defaults; none on the CPU, where a GPU's speed says
nothing).
"""
from __future__ import annotations

from ..plan.candidates import GridPoint
from ..plan.evaluate import Evaluator
from ..plan.model import ModelConfig
from ..plan.settings import ClusterConfig, TrainingConfig
from ..schedule.names import REFERENCE, schedule_info
from .logs import parse_log
from .trial_report import loss_tolerance, ran_order

__all__ = ["predictions", "model_from_arguments"]


def _int(arguments: dict, key: str, default=None):
    try:
        return int(arguments.get(key))
    except (TypeError, ValueError):
        return default


def _true(arguments: dict, key: str) -> bool:
    return arguments.get(key) == "True"


def model_from_arguments(arguments: dict) -> ModelConfig:
    """The planner's model of a Megatron-LM argument dump (dense GPT fields)."""
    heads = _int(arguments, "num_attention_heads")
    return ModelConfig(
        name="trial", num_layers=_int(arguments, "num_layers"),
        hidden_size=_int(arguments, "hidden_size"), num_attention_heads=heads,
        ffn_hidden_size=_int(arguments, "ffn_hidden_size"),
        num_query_groups=(_int(arguments, "num_query_groups") if
                          _true(arguments, "group_query_attention") else None),
        kv_channels=_int(arguments, "kv_channels"),
        vocab_size=_int(arguments, "padded_vocab_size") or _int(arguments, "vocab_size"),
        seq_length=_int(arguments, "seq_length"),
        max_position_embeddings=_int(arguments, "max_position_embeddings"),
        untie_embeddings_and_output_weights=_true(arguments,
                                                   "untie_embeddings_and_output_weights"),
        swiglu=_true(arguments, "swiglu"))


def _training(arguments: dict, on_gpu: bool) -> TrainingConfig:
    precision, _ = loss_tolerance(arguments)
    dropout = any(float(arguments.get(k) or 0) > 0 for k in ("hidden_dropout",
                                                              "attention_dropout"))
    return TrainingConfig(
        seq_length=_int(arguments, "seq_length"),
        global_batch=_int(arguments, "global_batch_size"),
        precision="fp32" if precision == "fp32" else "bf16",
        flash_attention=arguments.get("attention_backend", "").endswith("flash") or
        _true(arguments, "use_flash_attn"),
        sequence_parallel=_true(arguments, "sequence_parallel"),
        distributed_optimizer=_true(arguments, "use_distributed_optimizer"),
        dropout=dropout, dropout_mask_bytes=1 if on_gpu else 4, fp8=precision == "fp8")


def _ran(row: dict, point: GridPoint):
    """The order the row's run executed (its logged order lines; megatron's own: the
    registry's), so the memory prediction is for what ran, not for what was asked."""
    with open(row["log"], errors="replace") as handle:
        return ran_order(parse_log(handle), row["schedule"], point.pp, point.microbatches)


def _predict(evaluator: Evaluator, point: GridPoint, row: dict, on_gpu: bool) -> dict:
    name, schedule = row["schedule"], _ran(row, point)
    activations = evaluator.activation_bytes(point, schedule, workspace=on_gpu)
    prediction = evaluator.evaluate_auto(point) if schedule_info(name).memory_limited else \
        evaluator.evaluate(point, name)
    return {"activation_bytes": [round(b) for b in activations],
            "peak_bytes": round(prediction.peak_bytes) if on_gpu else None,
            "tokens_per_s": round(prediction.tokens_per_second_per_gpu, 1) if on_gpu else None}


def predictions(report: dict) -> dict:
    """``report`` with a ``predicted`` entry in each ran schedule's row (``{"error": ...}``
    where the planner cannot model the flags)."""
    rows = report["schedules"]
    reference = next((r for r in rows if r["schedule"] == REFERENCE and r["status"] == "ok"), None)
    if reference is None:
        return report
    with open(reference["log"], errors="replace") as handle:
        arguments = parse_log(handle).arguments
    on_gpu = reference["peak_bytes"]["allocated"] is not None
    try:
        model = model_from_arguments(arguments)
        dp, tp = _int(arguments, "data_parallel_size", 1), _int(arguments,
                                                               "tensor_model_parallel_size", 1)
        point = GridPoint(dp, tp, reference["pipeline_ranks"],
                          _int(arguments, "micro_batch_size"), reference["microbatches"])
        evaluator = Evaluator(model, _training(arguments, on_gpu),
                              ClusterConfig(reference["ranks"], 80.0,
                                            gpus_per_node=min(8, reference["ranks"])))
    except (TypeError, ValueError) as err:
        return {**report, "schedules": [{**r, "predicted": {"error": str(err)}} for r in rows]}
    out = []
    for row in rows:
        if row["status"] == "ok":
            try:
                row = {**row, "predicted": _predict(evaluator, point, row, on_gpu)}
            except (TypeError, ValueError) as err:
                row = {**row, "predicted": {"error": f"the planner cannot model it: {err}"}}
        out.append(row)
    return {**report, "schedules": out}
