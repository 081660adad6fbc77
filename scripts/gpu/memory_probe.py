"""Where a pass's transient bytes come from: the CUDA allocator's peak during one layer stack's
F, B, W (or fused BW) and the LM head's F and B, above the bytes live when the pass began.

``vshape gpu-check`` compares each rank's CUDA peak with the planner, which counts the bytes
kept for backward; this probe measures what a pass allocates on top of them, per pass kind,
dtype and layer count, at gpu-check's model shapes (or another model's), so the planner's
transient terms can be checked against the allocator. CUDA only; one process; a minute.

    python scripts/gpu/memory_probe.py --output probe.json [--model gpu-check] [--snapshot DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _measure(rank: int, world: int, model_name: str, layers: int, snapshot: str | None,
             device: str) -> list[dict]:
    import torch

    from megatron_vshape.harness.gpu_check import GPU_MODEL
    from megatron_vshape.harness.profiling import (
        ProfileRequest, _setup, _teardown, build_head, build_stack)
    from megatron_vshape.plan.model import load_model_config

    model = GPU_MODEL if model_name == "gpu-check" else load_model_config(model_name)
    _setup(ProfileRequest(model, model.seq_length, (1,), device=device))
    s, h = model.seq_length, model.hidden_size
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for split in (True, False):
            stack = build_stack(model, s, layers, dtype, device, split=split)
            for i in range(2):  # the first builds megatron's global buffers
                record = i == 1 and snapshot and dtype is torch.bfloat16 and device == "cuda"
                if record:
                    torch.cuda.memory._record_memory_history(max_entries=200000)
                row = _passes(stack, s, h, dtype, split, i, device)
                if record:
                    path = Path(snapshot) / f"snapshot-{'split' if split else 'fused'}.pickle"
                    torch.cuda.memory._dump_snapshot(str(path))
                    torch.cuda.memory._record_memory_history(enabled=None)
            rows.append({"dtype": str(dtype), "split": split, "layers": layers, **row})
            del stack
            torch.cuda.empty_cache()
        head = build_head(model, s, dtype, device)
        for i in range(2):
            row = _head_passes(head, s, h, model.vocab_size, dtype, device)
        rows.append({"dtype": str(dtype), "head": True, **row})
        del head
        torch.cuda.empty_cache()
    _teardown()
    return rows


def _pass(fn) -> tuple[int, int]:
    """(peak above the start, live change) of ``fn()``, in bytes (zeros off CUDA: the CPU
    run only checks that the probe runs)."""
    import torch

    if not torch.cuda.is_available():
        fn()
        return 0, 0

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base


def _passes(stack, s, h, dtype, split, microbatch, device) -> dict:
    import torch

    x = torch.randn(s, 1, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    stack.module.set_input_tensor(x)
    out = []
    row = {"F": _pass(lambda: out.append(stack.module(None, None, None)))}
    if split:
        from megatron_vshape.harness.profiling import _b_pass

        row["B"] = _pass(lambda: _b_pass(stack, out[0], dy, microbatch))
        out.clear()
        row["W"] = _pass(lambda: stack.store.run(microbatch))
    else:
        row["BW"] = _pass(lambda: out.pop().backward(dy))
    return _in_mib(row, stack.module)


def _head_passes(head, s, h, vocab, dtype, device) -> dict:
    import torch

    x = torch.randn(s, 1, h, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (1, s), device=device)
    loss = []

    def forward():
        logits, _ = head.output_layer(head.decoder.final_layernorm(x))
        loss.append(head.compute_language_model_loss(labels, logits).float().mean())
    row = {"F": _pass(forward), "B": _pass(lambda: loss.pop().backward())}
    return _in_mib(row, head)


def _in_mib(row: dict, module) -> dict:
    """The pass rows in MiB; ``module``'s gradients dropped, so each iteration allocates them
    afresh (a fused backward's and W's rows include that allocation)."""
    for p in module.parameters():
        p.grad = None
    return {k: {"peak_MiB": round(a / 2**20, 1), "kept_MiB": round(b / 2**20, 1)}
            for k, (a, b) in row.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSON file for the rows")
    parser.add_argument("--model", default="gpu-check",
                        help="gpu-check (default) or a bundled model name")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: only checks that the probe runs (no allocator statistics)")
    parser.add_argument("--snapshot", help="folder for torch.cuda.memory snapshots (bf16)")
    args = parser.parse_args(argv)
    from megatron_vshape.runtime.launch import run_gloo

    rows = []
    for layers in args.layers:
        outcome, = run_gloo(_measure, 1, args.model, layers,
                            args.snapshot if layers == args.layers[0] else None, args.device,
                            timeout=600)
        if not outcome.ok:
            print(outcome, file=sys.stderr)
            return 1
        rows += outcome.value
    Path(args.output).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
