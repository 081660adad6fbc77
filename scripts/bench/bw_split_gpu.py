"""Benchmark (GPU): the cost of splitting a backward into B and W on megatron-core layers.

    python scripts/bench/bw_split_gpu.py [--layers 4] [--hidden 4096] [--seq 2048] [--mbs 1]
        [--dtype bf16] [--iters 10]

Builds a stack of megatron-core transformer layers (GPTModel local spec, no embedding or LM
head, one GPU, TP = PP = 1) twice: once with megatron's own backward, once with our B/W split
(megatron_vshape.megatron.wgrad). Times per layer, median over ``--iters`` after warm-up:
forward (F), fused backward (BW), input-gradient backward (B) and the deferred weight
gradients (W), and prints one JSON line per case with ``split_overhead`` = (B + W) / BW - 1.
It also measures with our ActivationTracker what a forward keeps for backward and what W still
keeps after B (the linear layers' inputs and output gradients): the fraction B frees is why a
V schedule's real memory lands below the paper's model (which frees at W). With Transformer
Engine installed, ``--te`` runs the same on TE layers through their ``backward_dw``.
The F, B, W per layer are the costs ``vshape search --costs`` and the planner take.
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def _init() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)


def _stack(args, te: bool, split: bool):
    """A GPTModel of only transformer layers (input set with set_input_tensor)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vshape.megatron.wgrad import defer_weight_grads, with_te_delay_wgrad
    from megatron_vshape.runtime import WeightGradStore

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16, params_dtype=dtype,
        pipeline_dtype=dtype)
    spec = specs.get_gpt_layer_with_transformer_engine_spec() if te else \
        specs.get_gpt_layer_local_spec()
    if te and split:
        config = with_te_delay_wgrad(config)
    model = GPTModel(config, spec, vocab_size=128, max_sequence_length=args.seq,
                     pre_process=False, post_process=False).cuda().to(dtype)  # as Float16Module
    store = WeightGradStore()
    if split and not te:
        defer_weight_grads(model, store)
    return model, store, dtype


def _time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _measure(args, te: bool, split: bool) -> dict:
    from megatron_vshape.megatron.wgrad import te_wgrad_modules
    from megatron_vshape.runtime.memory import ActivationTracker

    model, store, dtype = _stack(args, te, split)
    tracker = ActivationTracker(list(model.parameters()))
    store.tracker = tracker
    te_modules = te_wgrad_modules(model) if split and te else []
    times = {"F": [], "B": [], "W": [], "BW": []}
    kept = {}
    for i in range(args.warmup + args.iters):
        x = torch.randn(args.seq, args.mbs, args.hidden, device="cuda", dtype=dtype,
                        requires_grad=True)
        dy = torch.randn_like(x)
        model.set_input_tensor(x)
        out = []
        tracker.reset_peak()
        with tracker.saved_tensors_hooks():
            times["F"].append(_time(lambda: out.append(model(None, None, None))))
        kept["after_forward"] = tracker.live
        if not split:
            times["BW"].append(_time(lambda: out[0].backward(dy)))
        else:
            def b_pass():
                with store.collecting(i):
                    out[0].backward(dy)
                    for m in te_modules:
                        store.defer(m.backward_dw)
            times["B"].append(_time(b_pass))
            del out[:]
            kept["after_b"] = tracker.live
            times["W"].append(_time(lambda: store.run(i)))
        for p in model.parameters():
            p.grad = None
        if i < args.warmup:
            for v in times.values():
                v.clear()
    per_layer = {k: statistics.median(v) / args.layers for k, v in times.items() if v}
    return {"per_layer_ms": per_layer, "kept_bytes": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--te", action="store_true", help="Transformer Engine layers")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bw_split_gpu.py needs a CUDA GPU")
    _init()
    fused = _measure(args, args.te, split=False)
    split = _measure(args, args.te, split=True)
    f, bw = fused["per_layer_ms"]["F"], fused["per_layer_ms"]["BW"]
    b, w = split["per_layer_ms"]["B"], split["per_layer_ms"]["W"]
    print(json.dumps({
        "device": torch.cuda.get_device_name(), "te": args.te, "layers": args.layers,
        "hidden": args.hidden, "seq": args.seq, "mbs": args.mbs, "dtype": args.dtype,
        "forward_ms": round(f, 4), "fused_backward_ms": round(bw, 4), "b_ms": round(b, 4),
        "w_ms": round(w, 4), "split_overhead": round((b + w) / bw - 1, 4),
        "costs_F_B_W": [1.0, round(b / f, 3), round(w / f, 3)],
        "saved_bytes_after_forward": split["kept_bytes"]["after_forward"],
        "kept_bytes_after_b": split["kept_bytes"]["after_b"],
        "fraction_b_frees": round(1 - split["kept_bytes"]["after_b"]
                                  / split["kept_bytes"]["after_forward"], 4),
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
