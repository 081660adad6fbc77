"""``vshape profile``: measure a model's per-layer F, B, W and activation memory for ``--profile``.

Writes the file ``vshape plan --profile`` reads (format: :mod:`..plan.profile_file`, docs/plan.md)
and prints one line per micro batch size. The measuring (:mod:`..harness.profiling`) needs
torch and megatron-core, so it is imported only when the command runs: the rest of the CLI
works without them.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from ..plan.model import load_model_config
from .plan import model_help
from .ui import subcommand
from ..plan.profile_file import format_profile

__all__ = ["register"]

_LAYERS = 4
"""Default stack depth: enough to average the per-call overhead out, few enough that the
largest models' layers fit one GPU."""


def register(sub) -> None:
    """Add ``profile`` to the ``vshape`` parser."""
    p = subcommand(
        sub, "profile", help="measure per-layer F/B/W seconds and activation bytes for plan "
                             "--profile",
        description="Time a stack of the model's megatron-core transformer layers (local spec, "
                    "our B/W split) on this machine, CUDA (bf16) when available, else the CPU "
                    "(fp32), and write the profile file `vshape plan --profile` reads, with the "
                    "bytes a microbatch keeps per layer and the share still kept after B for W "
                    "(docs/plan.md).",
        examples=["vshape profile --model small --layers 2 --iters 5 --warmup 1",
                  "vshape profile --model gpt-9.6b --tensor-parallel 1 2 4 8 "
                  "--micro-batch-sizes 1 2 -o cuda-gpt-9.6b.yaml"])
    p.add_argument("--model", required=True, metavar="NAME|FILE", help=model_help())
    p.add_argument("--seq-length", type=int, metavar="S",
                   help="tokens per sample (default: the model's)")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1], metavar="B",
                   help="micro batch sizes to measure (default 1; the planner scales the others "
                        "from the nearest)")
    p.add_argument("--layers", type=int, metavar="N",
                   help="layers in the timed stack, at most the model's (default 4 or the "
                        "model's, if fewer; times are per layer)")
    p.add_argument("--tensor-parallel", type=int, nargs="+", default=[1], metavar="T",
                   help="TP sizes: measure one TP shard's layer (heads, FFN and vocabulary / T) "
                        "on this one device, no TP communication (default 1)")
    p.add_argument("--iters", type=int, default=5, metavar="N",
                   help="timed iterations per micro batch size; the median is written "
                        "(default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="untimed iterations first (default %(default)s)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default): cuda when torch sees a GPU, else cpu")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads (default 1: one CPU pipeline rank is one single-threaded "
                        "process); ignored on CUDA")
    p.add_argument("--no-head", action="store_true", help="skip the LM head (final norm, "
                                                          "output layer, loss)")
    p.add_argument("--output", "-o", metavar="FILE",
                   help="where to write (default <cpu|cuda>-<model name>.yaml in the current "
                        "folder)")
    p.set_defaults(handler=_profile)


def profile_command(args, seq_length: int, sizes: tuple[int, ...], layers: int, device: str,
                    output: str, tps: tuple[int, ...] = (1,)) -> str:
    """The command line with every setting spelled out: what the file records to re-measure."""
    words = ["vshape", "profile", "--model", args.model, "--seq-length", str(seq_length),
             "--micro-batch-sizes", *map(str, sizes), "--layers", str(layers),
             *(["--tensor-parallel", *map(str, tps)] if tps != (1,) else []),
             "--iters", str(args.iters), "--warmup", str(args.warmup), "--device", device]
    if device == "cpu":
        words += ["--threads", str(args.threads)]
    if args.no_head:
        words.append("--no-head")
    return shlex.join(words + ["--output", output])


def _profile(args) -> int:
    from ..harness.profiling import ProfileRequest, default_device, profile_model

    try:
        model = load_model_config(args.model)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    layers = min(_LAYERS, model.num_layers) if args.layers is None else args.layers
    if layers > model.num_layers:
        raise ValueError(f"--layers {layers}: the model has {model.num_layers} layers; "
                         f"use --layers {model.num_layers} or fewer")
    device = default_device() if args.device == "auto" else args.device
    seq_length = model.seq_length if args.seq_length is None else args.seq_length
    sizes = tuple(sorted(set(args.micro_batch_sizes)))
    output = args.output or f"{device}-{model.name}.yaml"
    tps = tuple(sorted(set(args.tensor_parallel)))
    request = ProfileRequest(model, seq_length, sizes, layers, args.iters, args.warmup,
                             device, args.threads if device == "cpu" else None, not args.no_head,
                             tps)
    command = profile_command(args, seq_length, sizes, layers, device, output, tps)
    profile = profile_model(request, command)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(format_profile(profile, profile_comment(profile)))
    for m in profile.measurements:
        head = f", head F {m.head.forward:.3g} B {m.head.backward:.3g}" if m.head else ""
        print(f"micro batch {m.micro_batch_size}, TP {m.tensor_parallel}: per layer F {m.layer.forward:.3g} s, "
              f"B {m.layer.backward:.3g} s, W {m.layer.weight:.3g} s, "
              f"{m.activation_bytes_per_layer} bytes kept{head}")
    print(f"backward_leftover {profile.backward_leftover:.3g} (share of the bytes B leaves "
          f"for W)")
    print(f"wrote {output}")
    return 0


def profile_comment(profile) -> str:
    machine = profile.machine
    return (f"Measured by `vshape profile` on {machine.device} ({machine.kind}, {machine.dtype}): "
            "per transformer layer, median\nseconds of F, B (input gradient) and W (weight "
            "gradient), the bytes one microbatch's\nforward keeps, and the share of them B "
            "leaves for W. Re-measure with the command below;\n`vshape plan --profile FILE` "
            "reads it (docs/plan.md).")
