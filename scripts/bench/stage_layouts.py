"""Benchmark: the planner's layouts of whole layers per stage, one JSON line per case.

    python scripts/bench/stage_layouts.py [--models llama-3-8b ...] [--pp 4 8 16]
        [--seq-length 8192] [--global-batch 64] [--micro-batch 1] [--gpu-memory 80]

For each bundled model and PP, on PP x TP GPUs (DP 1; TP the smallest of 1, 2, 4, 8 at which
some V fits the memory), every pipeline schedule twice under the shape cost model (H100 SXM,
bf16, flash attention): with the plugin's even layout and with the layout the planner
chooses (plan/layout_search.py). Per case: both predictions (seconds, TFLOP/s per GPU), the
chosen layout's megatron flag, and plan/bounds.py's bounds: ``busiest_s`` (the least
busiest-rank work whole layers allow, a true lower bound), ``whole_layer_s`` (that plus the
schedule's bubble when balanced) and ``balanced_s`` (all work over p plus that bubble: what
vocabulary parallelism could reach). Pure Python, deterministic.
"""
import argparse
import json

from megatron_vshape.plan import ClusterConfig, TrainingConfig, load_model_config
from megatron_vshape.plan.bounds import pipeline_bounds
from megatron_vshape.plan.candidates import GridPoint
from megatron_vshape.plan.evaluate import Evaluator
from megatron_vshape.schedule.io.megatron_layout import layout_of_counts

MODELS = ("llama-3-8b", "qwen2.5-7b", "gemma-2-9b", "llama-3-70b", "qwen2.5-72b")
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-1p", "v-min", "v-half", "v-zb")
_V = ("v-min", "v-half", "v-zb")


def _setting(model, pp: int, tp: int, args) -> tuple:
    """(point, evaluator choosing layouts) on PP x TP GPUs, DP 1."""
    training = TrainingConfig(args.seq_length, args.global_batch)
    cluster = ClusterConfig(gpus=pp * tp, gpu_memory_gib=args.gpu_memory)
    point = GridPoint(1, tp, pp, args.micro_batch, args.global_batch // args.micro_batch)
    return point, Evaluator(model, training, cluster, stage_layouts="best")


def _case(model, pp: int, args) -> list[dict]:
    """At the smallest TP where a V fits; where none can, where any schedule fits; else TP 1."""
    tps = [t for t in (1, 2, 4, 8)
           if model.num_attention_heads % t == 0 and model.query_groups % t == 0]
    settings = {tp: _setting(model, pp, tp, args) for tp in tps}

    def fits(tp: int, names) -> bool:
        point, evaluator = settings[tp]
        return any(evaluator.evaluate(point, name).feasible for name in names)

    tp = next((t for t in tps if fits(t, _V)), None) or \
        next((t for t in tps if fits(t, SCHEDULES)), tps[0])
    point, best = settings[tp]
    even = Evaluator(model, best.training, best.cluster, stage_layouts="even")
    rows = []
    for name in SCHEDULES:
        ours, theirs = best.evaluate(point, name), even.evaluate(point, name)
        row = {"model": model.name, "pp": pp, "tp": tp, "schedule": name,
               "microbatches": point.microbatches, "seq_length": args.seq_length,
               "feasible": ours.feasible, "even_feasible": theirs.feasible,
               "reason": "" if ours.feasible else ours.reason[:160]}
        if theirs.feasible:
            row.update(even_s=round(theirs.iteration_seconds, 4),
                       even_tflops=round(theirs.tflops_per_gpu, 1))
        if ours.feasible:
            bounds = pipeline_bounds(best, point, name)
            row.update(best_s=round(ours.iteration_seconds, 4),
                       best_tflops=round(ours.tflops_per_gpu, 1),
                       layout=layout_of_counts(ours.stage_layers),
                       peak_gib=round(ours.peak_bytes / 2**30, 2),
                       busiest_s=round(bounds.busiest, 4),
                       whole_layer_s=round(bounds.whole_layer, 4),
                       balanced_s=round(bounds.balanced, 4))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    args = parser.parse_args()
    for name in args.models:
        model = load_model_config(name)
        for pp in args.pp:
            for row in _case(model, pp, args):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
