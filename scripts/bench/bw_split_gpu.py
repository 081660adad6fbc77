"""Benchmark (GPU): the cost of splitting a backward into B and W on megatron-core layers.

    python scripts/bench/bw_split_gpu.py [--layers 4] [--hidden 4096] [--seq 2048] [--mbs 1]
        [--dtype bf16] [--iters 10]

Builds a stack of megatron-core transformer layers (GPTModel local spec, no embedding or LM
head, one GPU, TP = PP = 1) twice: once with megatron's own backward, once with our B/W split
(megatron_vshape.megatron.wgrad). Times per layer, median over ``--iters`` after warm-up:
forward (F), fused backward (BW), input-gradient backward (B) and the deferred weight
gradients (W), and prints one JSON line per case with ``split_overhead`` = (B + W) / BW - 1.
It also measures with our ActivationTracker what a forward keeps for backward and what W still
keeps after B (the linear layers' inputs and output gradients), per layer: the fraction B frees
is why a V schedule's real memory lands below the paper's model (which frees at W). The stack
and its timing are megatron_vshape.harness.profiling's; ``vshape profile`` writes the same
split measurement (on CPU too) as a profile file for ``vshape plan --profile``. With Transformer
Engine installed, ``--te`` runs the same on TE layers through their ``backward_dw``.
The F, B, W per layer are the costs ``vshape search --costs`` and the planner take.
"""
import argparse
import json
import os

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


def _measure(args, te: bool, split: bool):
    """The library's layer stack and timing (megatron_vshape.harness.profiling, what
    ``vshape profile`` runs), in this process."""
    from megatron_vshape.harness.profiling import build_stack, time_stack
    from megatron_vshape.plan.model import ModelConfig

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = ModelConfig("bench", num_layers=args.layers, hidden_size=args.hidden,
                        num_attention_heads=args.heads, vocab_size=128, seq_length=args.seq)
    stack = build_stack(model, args.seq, args.layers, dtype, "cuda", split=split, te=te)
    return time_stack(stack, args.seq, args.mbs, args.iters, args.warmup, "cuda", dtype)


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
    f, bw = 1e3 * fused.seconds["F"], 1e3 * fused.seconds["BW"]
    b, w = 1e3 * split.seconds["B"], 1e3 * split.seconds["W"]
    print(json.dumps({
        "device": torch.cuda.get_device_name(), "te": args.te, "layers": args.layers,
        "hidden": args.hidden, "seq": args.seq, "mbs": args.mbs, "dtype": args.dtype,
        "forward_ms": round(f, 4), "fused_backward_ms": round(bw, 4), "b_ms": round(b, 4),
        "w_ms": round(w, 4), "split_overhead": round((b + w) / bw - 1, 4),
        "costs_F_B_W": [1.0, round(b / f, 3), round(w / f, 3)],
        "saved_bytes_per_layer": split.saved_bytes,
        "kept_bytes_after_b_per_layer": split.kept_after_b,
        "fraction_b_frees": round(1 - split.kept_after_b / split.saved_bytes, 4),
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
