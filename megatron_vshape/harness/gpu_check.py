"""``vshape gpu-check``'s pipeline: one model, every schedule, PP = 4 processes on one device.

The check a lent GPU runs in one call (docs/gpu-check.md): a megatron-core GPT (local spec)
trains a few SGD iterations under the 1F1B order run by our runtime (the reference) and under
zb-1p, v-min, v-half, v-zb and auto, on 4 gloo processes that share the device. What comes back
per schedule and rank: the losses (against the reference), the peak activation bytes measured
and the planner's prediction for the same model, schedule and settings
(:meth:`..plan.evaluate.Evaluator.activation_bytes`).

CPU and CUDA run the same code; only device, dtype and sizes differ (:func:`check_settings`):

- CUDA: NCCL refuses two ranks on one GPU and gloo cannot send CUDA tensors, so messages go
  through host memory (the runtime's ``TensorSpec.wire = "cpu"``, chosen by
  :class:`.forward_backward.VShapeForwardBackward` when the group is gloo and the device is
  not). Peak bytes are the CUDA caching allocator's peak allocated during a step minus what was
  allocated when it began (weights and their preallocated gradients), per process.
- CPU: :func:`.cpu.install_cpu_shims`; peak bytes are the runtime's
  :class:`..runtime.memory.ActivationTracker` (what tests/plan/test_plan_memory.py and ``vshape demo``
  measure). The tracker runs on CUDA too and is reported beside the allocator's peak.

The uneven-stage run (:func:`uneven_settings`, issue 48): the same shape with a 4x vocabulary,
so rank 0's LM head weighs several layers, and the V schedules on a V stage layout that gives
rank 0 fewer layers (:data:`UNEVEN_STAGE_LAYERS`)::

    stage   0  1  2  3  4  5  6  7        rank    0        1    2    3
    layers  1  2  2  3  3  2  2  1        holds   1+1+head 2+2  2+2  3+3

The 1F1B reference runs megatron's even one-chunk split: the model is the same, only its
placement differs, so the losses still compare; the planner predicts each V rank's bytes
for that layout (per stage, :meth:`..plan.evaluate.Evaluator.activation_bytes`).

The reference is our runtime's 1F1B, not megatron's own: megatron's p2p would need NCCL here.
Embeddings are untied, so no gradient crosses ranks (gloo's all-reduce of a CUDA tensor is one
more thing that could differ by torch build).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

from ..plan.model import ModelConfig, load_model_config
from ..schedule.names import MEMORY_LEVELS, PLUGIN_SCHEDULES, REFERENCE, V_SCHEDULES, schedule_info
from ..plan.settings import TrainingConfig
from .pipeline_world import (forward_progress, model_parallel, no_gc_pauses, placed_chunks,
                             two_chunks)
from .tiny_gpt import TinyGPT

__all__ = ["CHECK_SCHEDULES", "DEVICES", "DTYPES", "UNEVEN_SCHEDULES", "UNEVEN_STAGE_LAYERS",
           "CheckSettings", "ScheduleCheck", "check_settings", "uneven_settings", "run_check",
           "loss_tolerance"]

CHECK_SCHEDULES = (REFERENCE,) + PLUGIN_SCHEDULES
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
UNEVEN_STAGE_LAYERS = (1, 2, 2, 3, 3, 2, 2, 1)
"""The uneven run's layers per V stage (PP 4, 16 layers): rank 0 keeps 2 layers beside the
embedding and the heavy LM head, rank 3 takes 6 (a layout the planner's search gives a head
of about 4 layers, the GPU model's at a 131072 vocabulary)."""
UNEVEN_SCHEDULES = (REFERENCE,) + tuple(n for n in V_SCHEDULES if n in MEMORY_LEVELS)
"""The uneven run: the reference and the fixed V schedules (auto and zb-1p need no second
look: auto re-plans the same V orders, zb-1p holds one chunk per rank)."""

GPU_MODEL = ModelConfig(
    name="gpu-check", num_layers=16, hidden_size=2048, num_attention_heads=16,
    ffn_hidden_size=8192, vocab_size=32768, seq_length=2048,
    untie_embeddings_and_output_weights=True,
    description="gpu-check's model: a layer's F takes about 0.6 ms on an H100 in bf16, so a "
                "rank's 4-layer share takes several ms; 0.94B parameters")
"""The CUDA model: big enough that passes take milliseconds (the runtime's host work between
passes is then small), small enough that four processes' weights, gradients and activations fit
one 80 GB H100 with room to spare: the planner predicts 8.0 GiB of activations on 1F1B's rank 0
(bf16, whose unfused fp32 softmax output makes it as large as fp32's), 4.3 under V-Min; weights
and gradients 3.8 GB in bf16 (7.6 in fp32) over all ranks."""

_FUSIONS_OFF = dict(masked_softmax_fusion=False, bias_activation_fusion=False,
                    bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                    persist_layer_norm=False)
"""The lent GPU has no apex or Transformer Engine kernels: megatron's unfused paths, on CPU and
CUDA alike (what the planner's memory formulas count)."""

_LOSS_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
"""Largest |loss - reference loss| accepted. fp32: the schedules run the same operations on the
same values, so losses agree to the last bits (the CPU runs are bit-identical). bf16: the first
step agrees as closely, but weight gradients are accumulated in bf16 in the order each
schedule's W passes run, a rounding of 2^-8 relative per addition; after an SGD step the losses
(about 10.4 = ln 32768) drift by a few 1e-3. 2e-2 is 0.2% of the loss."""

_LR = 0.01


def loss_tolerance(dtype: str) -> float:
    """The largest loss difference from the reference accepted for ``dtype``."""
    return _LOSS_TOLERANCE[dtype]


@dataclass(frozen=True)
class CheckSettings:
    """What one pipeline check runs (``vshape gpu-check`` builds it with :func:`check_settings`)."""

    model: ModelConfig
    device: str = "cpu"
    """``cpu`` or ``cuda`` (every rank on the one GPU, ``cuda:0``)."""
    dtype: str = "float32"
    """``float32`` or ``bfloat16``. The CLI runs bf16 on CUDA only; bf16 on the CPU checks the
    GPU's dtype path without a GPU (tests/harness/test_gpu_check.py)."""
    ranks: int = 4
    microbatches: int = 8
    micro_batch_size: int = 2
    steps: int = 3
    """SGD iterations per schedule (auto profiles the first, then re-plans)."""
    memory_limit: str = "0.75"
    """auto's limit: a fraction of 1F1B's activation memory, or bytes."""
    schedules: tuple[str, ...] = CHECK_SCHEDULES
    """Run in this order; the first must be ``1f1b`` (the reference)."""
    timeout: float = 300.0
    """Seconds any point-to-point wait may take."""
    stage_layers: tuple[int, ...] | None = None
    """Layers per V stage (2 x ranks, stage order) for the V schedules; None: the even split.
    One-chunk schedules (1f1b, zb-1p) always run megatron's even split."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.ranks < 2 or self.model.num_layers < 2 * self.ranks:
            raise ValueError(f"a V on {self.ranks} ranks needs ranks >= 2 and >= "
                             f"{2 * self.ranks} layers; the model has {self.model.num_layers}")
        if self.steps < 1 or self.microbatches < 1:
            raise ValueError(f"steps and microbatches must be >= 1, got {self.steps}, "
                             f"{self.microbatches}")
        for schedule in self.schedules:
            schedule_info(schedule, "schedules", CHECK_SCHEDULES)
        if self.schedules[:1] != (REFERENCE,):
            raise ValueError(f"schedules must start with {REFERENCE} (the reference); got "
                             f"{self.schedules}")
        if self.stage_layers is not None:
            self._check_stage_layers()

    def _check_stage_layers(self) -> None:
        layers = self.stage_layers
        if len(layers) != 2 * self.ranks or sum(layers) != self.model.num_layers \
                or min(layers) < 1:
            raise ValueError(f"stage_layers {tuple(layers)} must give each of the V's "
                             f"2 x {self.ranks} stages at least one layer, "
                             f"{self.model.num_layers} in all")
        if any(schedule_info(s).memory_limited for s in self.schedules):
            raise ValueError("stage_layers: auto re-plans on the even layout; run the fixed "
                             "V schedules (v-min, v-half, v-zb) on an uneven one")

    def layers_of(self, schedule: str):
        """The stage layout ``schedule`` runs: ``stage_layers`` for a V, None (even) else."""
        from .pipeline_world import two_chunks

        return self.stage_layers if two_chunks(schedule) else None

    @property
    def tiny(self) -> TinyGPT:
        return TinyGPT.from_model(self.model, self.micro_batch_size)

    @property
    def tied(self) -> bool:
        return not self.model.untie_embeddings_and_output_weights

    @property
    def memory_measure(self) -> str:
        """What ``peak_bytes`` is (see the module doc)."""
        return "cuda_max_memory_allocated" if self.device == "cuda" else "activation_tracker"

    def training(self) -> TrainingConfig:
        """The planner's settings for what this check runs: no flash attention (local spec,
        megatron's unfused fp32 softmax), no sequence parallelism or distributed optimizer, no
        dropout."""
        return TrainingConfig(self.model.seq_length, self.micro_batch_size * self.microbatches,
                              precision="bf16" if self.dtype == "bfloat16" else "fp32",
                              flash_attention=False, sequence_parallel=False,
                              distributed_optimizer=False, dropout=False,
                              fp32_softmax_copy=True)

    def transformer_config(self):
        """megatron's TransformerConfig on this device and dtype (unfused, see _FUSIONS_OFF)."""
        import torch

        dtype = getattr(torch, self.dtype)
        return self.tiny.transformer_config(
            self.ranks, use_cpu_initialization=self.device == "cpu", params_dtype=dtype,
            pipeline_dtype=dtype, bf16=dtype is torch.bfloat16, **_FUSIONS_OFF)


def check_settings(device: str, tiny: bool, dtype: str | None = None, **overrides
                   ) -> CheckSettings:
    """The sizes gpu-check runs: ``tiny`` (bundled tiny GPT, untied, micro batch 2: seconds on
    two CPU cores) or, on CUDA, :data:`GPU_MODEL` at micro batch 1; the full CPU check runs the
    bundled ``small`` model at sequence length 256. Always PP = 4 and 8 microbatches."""
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    if tiny:
        model, mbs = load_model_config("tiny"), 2
    elif device == "cuda":
        model, mbs = GPU_MODEL, 1
    else:
        model, mbs = load_model_config("small").with_overrides(seq_length=256), 1
    model = model.with_overrides(untie_embeddings_and_output_weights=True)
    return CheckSettings(model, device, dtype, micro_batch_size=mbs, **overrides)


def uneven_settings(device: str, tiny: bool, dtype: str | None = None, **overrides
                    ) -> CheckSettings:
    """The uneven-stage run (module doc): :func:`check_settings`' model at 16 layers and 4x its
    vocabulary (GPU: 131072; tiny: 1024), :data:`UNEVEN_SCHEDULES` with the V schedules on
    :data:`UNEVEN_STAGE_LAYERS`."""
    even = check_settings(device, tiny, dtype)
    model = even.model.with_overrides(
        name=f"{even.model.name}-uneven", num_layers=sum(UNEVEN_STAGE_LAYERS),
        vocab_size=4 * even.model.vocab_size)
    overrides = {"schedules": UNEVEN_SCHEDULES, "stage_layers": UNEVEN_STAGE_LAYERS,
                 **overrides}
    return dataclasses.replace(even, model=model, **overrides)


@dataclass
class ScheduleCheck:
    """One schedule's results, merged over ranks (index = pipeline rank)."""

    schedule: str
    losses: list
    """Per step, the microbatch losses (from the rank that computes them)."""
    peak_bytes: list
    """Per rank, the largest over the steps of the last plan after the first step (see
    CheckSettings.memory_measure)."""
    tracked_bytes: list
    """Per rank, the ActivationTracker's peak (the CPU's measure, also taken on CUDA)."""
    step_seconds: float
    """Median over the steps after the first, slowest rank."""
    ran: object = None
    """The schedule that ran last (auto: what it re-planned to)."""
    plans: list = field(default_factory=list)


def run_check(settings: CheckSettings, on_done=None) -> dict[str, ScheduleCheck]:
    """Train every schedule of ``settings`` on one world of ``settings.ranks`` gloo processes;
    ``on_done(name)`` as each finishes (progress)."""
    import torch.multiprocessing as mp

    from ..runtime.launch import run_gloo

    if settings.device == "cpu":
        from .cpu import prepare_cpu_imports

        prepare_cpu_imports()  # as the ranks do, before anything imports megatron here
    done = mp.get_context("spawn").Queue()
    with forward_progress(done, on_done, len(settings.schedules)):
        outcomes = run_gloo(_worker, settings.ranks, settings, done,
                            timeout=settings.timeout * 4)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"gpu-check: rank {failed[0].rank} failed: {failed[0].error}")
    return {name: _merge(name, [o.value[name] for o in outcomes]) for name in settings.schedules}


def _merge(name: str, values: list) -> ScheduleCheck:
    steps = len(values[0]["losses"])
    seconds = [max(v["seconds"][s] for v in values) for s in range(steps)]
    # the last plan's steps, never the first step: it allocates what then stays for the whole
    # run (megatron's global attention-score buffer, cuBLAS workspaces), memory of the kind
    # of weights, not of the schedule
    start = max(values[0]["plans"][-1][0] if values[0]["plans"] else 0, 1 if steps > 1 else 0)
    return ScheduleCheck(
        schedule=name,
        losses=[[x for v in values for x in v["losses"][s]] for s in range(steps)],
        peak_bytes=[max(v["peaks"][start:]) for v in values],
        tracked_bytes=[max(v["tracked"][start:]) for v in values],
        step_seconds=statistics.median(seconds[1:] or seconds),
        ran=values[0]["schedule"], plans=values[0]["plans"])


# -- in every spawned rank ---------------------------------------------------------------------
def _worker(rank: int, world: int, settings: CheckSettings, done) -> dict:
    import torch

    if settings.device == "cpu":
        from .cpu import prepare_cpu_imports

        prepare_cpu_imports()
    import megatron.core.models.gpt  # noqa: F401  (before the shims rebind megatron's RNG)
    from megatron.core import parallel_state as ps

    if settings.device == "cpu":
        from .cpu import install_cpu_shims

        install_cpu_shims()
    else:
        torch.cuda.set_device(0)  # every rank shares the one GPU
    out, layout, groups = {}, None, {}
    for schedule in settings.schedules:
        layout = model_parallel(settings.ranks, two_chunks(schedule), layout)
        out[schedule] = _train(settings, *_build(settings, schedule, groups))
        if rank == 0:
            done.put(schedule)
    ps.destroy_model_parallel()
    return out


def _build(settings: CheckSettings, schedule: str, groups: dict):
    """This rank's chunks under ``schedule``'s placement, weights by global name, and our
    forward-backward function (1f1b too: the reference is our runtime's 1F1B order)."""
    from ..megatron.forward_backward import VShapeForwardBackward
    from .tiny_gpt import init_by_name

    config = settings.transformer_config()
    chunks = placed_chunks(settings.tiny.provider(settings.tied), config, schedule,
                           settings.ranks, settings.layers_of(schedule))
    # every parameter in the run's dtype, norms too, as megatron's Float16Module does (keeps
    # the Parameter objects, so the W stores and hooks stay attached)
    chunks = [c.to(device=_device(settings), dtype=config.params_dtype) for c in chunks]
    init_by_name(chunks, settings.tied)
    auto = schedule_info(schedule).memory_limited
    return chunks, VShapeForwardBackward(
        schedule, timeout=settings.timeout, memory_limit=settings.memory_limit if auto else None,
        replan_after=1 if auto else 0, stream_groups=groups)


def _device(settings: CheckSettings):
    import torch

    return torch.device("cuda", 0) if settings.device == "cuda" else torch.device("cpu")


def _train(settings: CheckSettings, chunks, fb) -> dict:
    """``settings.steps`` SGD iterations; per step the losses, both peak measures, seconds."""
    import torch

    from ..runtime.memory import ActivationTracker
    from .tiny_gpt import forward_step
    from ..megatron.wgrad import store_of

    params = [p for c in chunks for p in c.parameters()]
    tracker = ActivationTracker(params)
    for store in (store_of(c) for c in chunks):
        store.tracker = tracker
    for p in params:  # allocated before the first step, so no step counts them as activations
        p.grad = torch.zeros_like(p)
    peak = _PeakBytes(settings.device)
    out = {"losses": [], "peaks": [], "tracked": [], "seconds": []}
    for step in range(settings.steps):
        data = [_on_device(settings, step) for _ in chunks]
        tracker.reset_peak()
        peak.start()
        with no_gc_pauses(), tracker.saved_tensors_hooks():
            begin = _synchronized(settings, time.perf_counter)
            losses = fb(forward_step_func=forward_step, data_iterator=data if len(chunks) > 1
                        else data[0], model=chunks, num_microbatches=settings.microbatches,
                        seq_length=settings.model.seq_length,
                        micro_batch_size=settings.micro_batch_size)
            out["seconds"].append(_synchronized(settings, time.perf_counter) - begin)
        out["peaks"].append(peak.bytes(tracker))
        out["tracked"].append(tracker.peak)
        out["losses"].append([d["lm loss"].item() for d in losses])
        with torch.no_grad():  # plain SGD, so later iterations check updated weights too
            for p in params:
                p -= _LR * p.grad
                p.grad.zero_()
    out.update(schedule=fb.last_schedule, plans=list(fb.plans))
    return out


def _on_device(settings: CheckSettings, step: int):
    """The step's microbatches (a function of the step only), moved to the device."""
    from .tiny_gpt import batches

    device = _device(settings)
    return iter([{k: v.to(device) for k, v in b.items()}
                 for b in batches(settings.tiny, settings.microbatches, step)])


def _synchronized(settings: CheckSettings, clock):
    if settings.device == "cuda":
        import torch

        torch.cuda.synchronize()
    return clock()


class _PeakBytes:
    """Peak bytes of one step: the CUDA allocator's (above what the step began with) on CUDA,
    the tracker's on the CPU (which has no allocator statistics)."""

    def __init__(self, device: str):
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def bytes(self, tracker) -> int:
        if self.device != "cuda":
            return tracker.peak
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base
