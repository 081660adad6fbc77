"""Measured F, B, W and activation memory of megatron-core transformer layers (``vshape profile``).

The planner (``vshape plan --profile FILE``, :mod:`..plan.profile_file`) takes a layer's pass
times from a file instead of its FLOP model; this module measures them on the machine it runs
on, the way the runtime splits a backward (paper, section 2)::

    F   model(input)            a stack of transformer layers (GPTModel, local spec, no
                                embedding or LM head; input set with set_input_tensor)
    B   output.backward(dY)     input gradients; the linears queue their weight gradients
                                (:mod:`.wgrad`) in a :class:`..runtime.wgrad.WeightGradStore`
    W   store.run(microbatch)   the deferred weight gradients

Each time is the median over ``iters`` iterations after ``warmup``, divided by the stack's
layer count. An :class:`..runtime.memory.ActivationTracker` counts what the forward keeps for
backward (per layer: ``activation_bytes_per_layer``) and what is still kept after B for W
(``backward_leftover``, the share of the first; the runtime measures the same per chunk,
:func:`..runtime.memory.backward_leftover`). Optionally the LM head (final norm, output layer,
cross entropy): F and a fused backward, as the V placement runs it (its W is not deferred).

CUDA when available (bf16, timed with CUDA events), else the CPU (fp32, megatron's CUDA
assumptions removed by :func:`.cpu.install_cpu_shims`); always one process, TP = PP = 1, spawned
(:func:`..runtime.launch.run_gloo`) so that megatron's parallel state and the CPU shims stay
out of the caller's process. ``scripts/bench/bw_split_gpu.py`` uses the same pieces in its own
process to compare the split with megatron's fused backward.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..plan.cost import PassTimes
from ..plan.model import ModelConfig
from ..plan.profile_file import Machine, MeasuredProfile, Measurement

__all__ = ["ProfileRequest", "StackResult", "LayerStack", "default_device", "build_stack",
           "time_stack", "build_head", "time_head", "profile_model", "profile_models", "shard",
           "cpu_name"]

logger = logging.getLogger(__name__)

_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
_DIGITS = 4
"""Significant digits written for times and the leftover: CPU timings vary by more."""


@dataclass(frozen=True)
class ProfileRequest:
    """What ``vshape profile`` measures."""

    model: ModelConfig
    seq_length: int
    micro_batch_sizes: tuple[int, ...] = (1,)
    layers: int = 4
    """Layers in the measured stack (times are per layer): enough to average the per-call
    overhead out, few enough that the largest models' layers fit one GPU."""
    iters: int = 5
    """Timed iterations per micro batch size (the median is written)."""
    warmup: int = 2
    """Untimed iterations first (allocator, kernel selection)."""
    device: str = "cpu"
    """``cpu`` (fp32) or ``cuda`` (bf16); :func:`default_device` picks."""
    threads: int | None = 1
    """torch's CPU threads in the measuring process (None: as spawned, 1; unused on CUDA). 1
    by default: each rank of a CPU pipeline (``vshape demo``) is one single-threaded process."""
    head: bool = True
    """Also measure the LM head's F and B."""
    tensor_parallel: tuple[int, ...] = (1,)
    """TP sizes whose one-shard shapes are measured on this one device: heads, query groups,
    FFN width and vocabulary divided by TP, head size kept (megatron's ``kv_channels``); no TP
    communication and no sequence parallelism, so the times are a shard's compute only."""

    def __post_init__(self) -> None:
        at_least = {"--seq-length": (self.seq_length, 1), "--layers": (self.layers, 1),
                    "--iters": (self.iters, 1), "--warmup": (self.warmup, 0),
                    "--micro-batch-sizes": (min(self.micro_batch_sizes, default=0), 1),
                    "--threads": (1 if self.threads is None else self.threads, 1),
                    "--tensor-parallel": (min(self.tensor_parallel, default=0), 1)}
        for flag, (value, least) in at_least.items():
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        if self.device not in _DTYPES:
            raise ValueError(f"--device must be one of {', '.join(_DTYPES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
        m = self.model
        for tp in self.tensor_parallel:
            if m.num_attention_heads % tp or m.query_groups % tp or m.ffn % tp:
                raise ValueError(f"--tensor-parallel {tp}: {m.name}'s attention heads "
                                 f"({m.num_attention_heads}), query groups and FFN width "
                                 f"({m.ffn}) must be multiples of it")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.device]


@dataclass(frozen=True)
class StackResult:
    """Per layer: median seconds per pass kind, and bytes kept for backward by one microbatch."""

    seconds: dict[str, float]
    """``F`` and ``B``, ``W`` (split) or ``BW`` (megatron's fused backward)."""
    saved_bytes: int
    """What the forward keeps for backward."""
    kept_after_b: int | None
    """What is still kept after B, for W (None for a fused backward)."""


@dataclass(frozen=True)
class LayerStack:
    """A GPTModel of only transformer layers and, with the B/W split, its W store."""

    module: torch.nn.Module
    store: object
    """The :class:`..runtime.wgrad.WeightGradStore` W runs (unused for a fused backward)."""
    split: bool
    layers: int
    hidden_size: int
    te_modules: tuple = ()
    """Transformer Engine linears whose ``backward_dw`` W calls (GPU, ``te=True``)."""


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def shard(model: ModelConfig, tp: int) -> ModelConfig:
    """One TP rank's shapes as a model of its own (see ProfileRequest.tensor_parallel): its
    layers keep the head size through ``kv_channels`` (:func:`_config`)."""
    if tp == 1:
        return model
    return model.with_overrides(
        num_attention_heads=model.num_attention_heads // tp, ffn_hidden_size=model.ffn // tp,
        num_query_groups=None if model.num_query_groups is None else model.num_query_groups // tp,
        vocab_size=model.vocab_size // tp)


def _config(model: ModelConfig, layers: int, dtype: torch.dtype, device: str,
            kv_channels: int | None = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu} \
        if model.swiglu else {}
    if kv_channels is not None:
        extra["kv_channels"] = kv_channels
    return TransformerConfig(
        num_layers=layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16, params_dtype=dtype,
        pipeline_dtype=dtype, use_cpu_initialization=device == "cpu", **extra)


def build_stack(model: ModelConfig, seq_length: int, layers: int, dtype: torch.dtype,
                device: str, split: bool = True, te: bool = False,
                kv_channels: int | None = None) -> LayerStack:
    """``layers`` transformer layers of ``model`` (megatron's parallel state must be set up);
    with ``split`` the linears' weight gradients go through a W store, else megatron's own
    fused backward runs. ``te``: Transformer Engine layers (GPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from ..runtime.wgrad import WeightGradStore
    from ..megatron.te_wgrad import te_wgrad_modules, with_te_delay_wgrad
    from ..megatron.wgrad import defer_weight_grads

    config = _config(model, layers, dtype, device, kv_channels)
    spec = specs.get_gpt_layer_with_transformer_engine_spec() if te else \
        specs.get_gpt_layer_local_spec()
    if te and split:
        config = with_te_delay_wgrad(config)
    module = GPTModel(config, spec, vocab_size=model.vocab_size, max_sequence_length=seq_length,
                      pre_process=False, post_process=False).to(device=device, dtype=dtype)
    store = WeightGradStore()
    if split and not te:
        defer_weight_grads(module, store)
    return LayerStack(module, store, split, layers, model.hidden_size,
                      tuple(te_wgrad_modules(module)) if split and te else ())


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Seconds ``fn()`` takes: CUDA events on the GPU (kernels run asynchronously)."""
    if device != "cuda":
        def seconds(fn):
            begin = time.perf_counter()
            fn()
            return time.perf_counter() - begin
        return seconds

    def cuda_seconds(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000
    return cuda_seconds


def time_stack(stack: LayerStack, seq_length: int, micro_batch_size: int, iters: int,
               warmup: int, device: str, dtype: torch.dtype) -> StackResult:
    """Run F, B, W (or F, BW) ``warmup + iters`` times on random inputs; medians per layer."""
    from ..runtime.memory import ActivationTracker

    tracker = ActivationTracker(list(stack.module.parameters()))
    stack.store.tracker = tracker
    timer = _timer(device)
    kinds = ("F", "B", "W") if stack.split else ("F", "BW")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    saved = kept = None
    for i in range(warmup + iters):
        before = tracker.live  # 0 unless a pass keeps something past its W (then not counted)
        x = torch.randn(seq_length, micro_batch_size, stack.hidden_size, device=device,
                        dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        stack.module.set_input_tensor(x)
        out = []
        with tracker.saved_tensors_hooks():
            seconds = {"F": timer(lambda: out.append(stack.module(None, None, None)))}
        saved = tracker.live - before
        if stack.split:
            seconds["B"] = timer(lambda: _b_pass(stack, out[0], dy, i))
            del out[:]
            kept = tracker.live - before
            seconds["W"] = timer(lambda: stack.store.run(i))
        else:
            seconds["BW"] = timer(lambda: out[0].backward(dy))
        del out[:], x, dy
        if tracker.live != before:
            logger.warning("%d activation bytes outlived iteration %d", tracker.live - before, i)
        for p in stack.module.parameters():
            p.grad = None
        if i >= warmup:
            for kind, value in seconds.items():
                times[kind].append(value)
    return StackResult({k: statistics.median(v) / stack.layers for k, v in times.items()},
                       saved // stack.layers, None if kept is None else kept // stack.layers)


def _b_pass(stack: LayerStack, output: torch.Tensor, dy: torch.Tensor, microbatch: int) -> None:
    with stack.store.collecting(microbatch):
        output.backward(dy)
        for module in stack.te_modules:
            stack.store.defer(module.backward_dw)


def build_head(model: ModelConfig, seq_length: int, dtype: torch.dtype, device: str,
               kv_channels: int | None = None):
    """The final norm, LM head and loss of ``model`` (a GPTModel's post-process part; its one
    transformer layer is built but never run). Untied: the head's passes cost the same."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(_config(model, 1, dtype, device, kv_channels), get_gpt_layer_local_spec(),
                    vocab_size=model.vocab_size, max_sequence_length=seq_length,
                    pre_process=False, post_process=True,
                    share_embeddings_and_output_weights=False).to(device=device, dtype=dtype)


def time_head(head, seq_length: int, micro_batch_size: int, iters: int, warmup: int,
              device: str, dtype: torch.dtype) -> dict[str, float]:
    """Median seconds of the head's F (norm, logits, cross entropy) and fused backward B."""
    timer = _timer(device)
    times: dict[str, list[float]] = {"F": [], "B": []}
    for i in range(warmup + iters):
        x = torch.randn(seq_length, micro_batch_size, head.config.hidden_size, device=device,
                        dtype=dtype, requires_grad=True)
        labels = torch.randint(0, head.vocab_size, (micro_batch_size, seq_length), device=device)
        loss = []

        def forward():
            logits, _ = head.output_layer(head.decoder.final_layernorm(x))
            loss.append(head.compute_language_model_loss(labels, logits).float().mean())
        forward_seconds = timer(forward)
        backward_seconds = timer(lambda: loss.pop().backward())
        for p in head.parameters():
            p.grad = None
        if i >= warmup:
            times["F"].append(forward_seconds)
            times["B"].append(backward_seconds)
    return {k: statistics.median(v) for k, v in times.items()}


# -- in the spawned process --------------------------------------------------------------------
def _measure(rank: int, world: int, request: ProfileRequest) -> dict:
    """Every micro batch size of ``request`` in this (fresh) process: plain numbers back."""
    _setup(request)
    out = _measure_one(request)
    _teardown()
    return out


def _measure_many(rank: int, world: int, requests, budget: float) -> list[dict]:
    """The requests in order in this one process (spawning and imports cost seconds each),
    until ``budget`` seconds have passed (the first runs regardless): the results of those
    finished."""
    began = time.perf_counter()
    _setup(requests[0])
    out = []
    for request in requests:
        if out and time.perf_counter() - began > budget:  # the first always runs
            logger.warning("profile budget of %g s spent: %d of %d shapes measured", budget,
                           len(out), len(requests))
            break
        out.append(_measure_one(request))
        if request.device == "cuda":
            torch.cuda.empty_cache()
    _teardown()
    return out


def _setup(request: ProfileRequest) -> None:
    if request.device == "cpu":
        from .cpu import prepare_cpu_imports

        prepare_cpu_imports()
    import megatron.core.models.gpt  # noqa: F401  (before the CPU shims rebind megatron's RNG)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if request.device == "cpu":
        from .cpu import install_cpu_shims

        install_cpu_shims()
    else:
        torch.cuda.set_device(0)
    if request.threads is not None:
        torch.set_num_threads(request.threads)
    ps.initialize_model_parallel()
    mrandom.model_parallel_cuda_manual_seed(1234)


def _teardown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def _measure_one(request: ProfileRequest) -> dict:
    """Per TP size and micro batch size, the stack's and the head's times and bytes."""
    dtype = request.dtype
    kv = request.model.head_dim if request.tensor_parallel != (1,) else None
    results = []
    for tp in request.tensor_parallel:
        model = shard(request.model, tp)
        stack = build_stack(model, request.seq_length, request.layers, dtype, request.device,
                            kv_channels=kv)
        head = build_head(model, request.seq_length, dtype, request.device, kv) \
            if request.head else None
        for b in request.micro_batch_sizes:
            layer = time_stack(stack, request.seq_length, b, request.iters, request.warmup,
                               request.device, dtype)
            results.append({"micro_batch_size": b, "tp": tp, "layer": layer,
                            "head": None if head is None else
                            time_head(head, request.seq_length, b, request.iters,
                                      request.warmup, request.device, dtype)})
        del stack, head
    return {"results": results, "machine": _machine(request)}


def _machine(request: ProfileRequest) -> Machine:
    import megatron.core

    device = torch.cuda.get_device_name() if request.device == "cuda" else cpu_name()
    return Machine(request.device, device, str(request.dtype).removeprefix("torch."),
                   torch.get_num_threads() if request.device == "cpu" else None,
                   str(torch.__version__), str(getattr(megatron.core, "__version__", "")))


def cpu_name() -> str:
    """The CPU model (/proc/cpuinfo), else what platform knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- in the caller's process -------------------------------------------------------------------
def profile_model(request: ProfileRequest, command: str | None = None,
                  timeout: float = 3600.0) -> MeasuredProfile:
    """Measure ``request`` in a spawned process; the profile file's contents (``command``: how
    it was measured, recorded in the file)."""
    from ..runtime.launch import run_gloo

    (outcome,) = run_gloo(_measure, 1, request, timeout=timeout)
    if not outcome.ok:
        raise RuntimeError(f"vshape profile: the measuring process failed: {outcome.error}")
    return _profile(request, outcome.value, command)


def profile_models(requests, commands, budget: float, timeout: float = 3600.0
                   ) -> list[MeasuredProfile]:
    """Measure several requests in one spawned process, stopping at ``budget`` seconds: the
    profiles of those finished, in order (``commands[i]`` is recorded in the i-th)."""
    from ..runtime.launch import run_gloo

    (outcome,) = run_gloo(_measure_many, 1, tuple(requests), budget, timeout=timeout)
    if not outcome.ok:
        raise RuntimeError(f"vshape profile: the measuring process failed: {outcome.error}")
    return [_profile(r, v, c) for r, v, c in zip(requests, outcome.value, commands)]


def _profile(request: ProfileRequest, value: dict, command: str | None) -> MeasuredProfile:
    results = value["results"]
    measurements = tuple(_measurement(r) for r in results)
    saved = sum(r["layer"].saved_bytes for r in results)
    # the output gradients W keeps are new bytes, so more than F kept is possible; 1 at most,
    # as the runtime's backward_leftover
    leftover = min(1.0, sum(r["layer"].kept_after_b for r in results) / saved)
    for m in measurements:
        logger.info("micro batch %d, TP %d: F %.3g s, B %.3g s, W %.3g s per layer, %d bytes "
                    "kept", m.micro_batch_size, m.tensor_parallel, m.layer.forward,
                    m.layer.backward, m.layer.weight, m.activation_bytes_per_layer)
    return MeasuredProfile(request.seq_length, measurements, backward_leftover=_round(leftover),
                           command=command, machine=value["machine"])


def _measurement(result: dict) -> Measurement:
    seconds = result["layer"].seconds
    head = result["head"]
    return Measurement(
        result["micro_batch_size"], result.get("tp", 1),
        PassTimes(_round(seconds["F"]), _round(seconds["B"]), _round(seconds["W"])),
        head=None if head is None else PassTimes(_round(head["F"]), _round(head["B"]), 0.0),
        activation_bytes_per_layer=result["layer"].saved_bytes)


def _round(value: float) -> float:
    return float(f"{value:.{_DIGITS}g}")

