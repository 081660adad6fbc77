"""What the planner is told besides the model: how training runs and on what hardware.

Two configs, each a frozen dataclass checked in ``__post_init__``:

- :class:`TrainingConfig`: sequence length, global batch, precision and the memory-saving
  features (flash attention, sequence parallel, distributed optimizer) that change the byte
  counts of :mod:`.memory`;
- :class:`ClusterConfig`: how many GPUs, their memory, speed and links, which the cost model
  (:mod:`.cost`) and the memory check use.

One parallel layout to evaluate is a :class:`ParallelLayout` (DP x TP x PP, EP for MoE models,
micro batch size, schedule). Error messages name the ``vshape plan`` flag that sets the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from .fp8 import OPERAND_BYTES
from .kernels import GpuSpec

__all__ = ["TrainingConfig", "ClusterConfig", "ParallelLayout", "PRECISIONS", "COST_MODELS",
           "GIB", "KNOWN_GPUS", "gpu_limits"]

GIB = float(2**30)
PRECISIONS = ("bf16", "fp32")
COST_MODELS = ("shapes", "mfu")
"""How pass times are predicted: ``shapes`` times each kernel from its shape on the GPU
(:mod:`.layer_kernels`, :mod:`.kernels`); ``mfu`` divides every pass's FLOPs by one achieved
rate (``gpu_tflops x mfu``)."""

# Bytes per parameter: (weight, main gradient, optimizer state). Mixed-precision Adam keeps an
# fp32 master copy and two fp32 moments (12 bytes); pure fp32 Adam's master is the weight itself.
_PARAMETER_BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}


def _positive(owner: str, flag: str, name: str, value, integer: bool = False) -> None:
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{owner}: {name} ({flag}) must be an integer, got {value!r}")
    if not value > 0:
        raise ValueError(f"{owner}: {name} ({flag}) must be > 0, got {value!r}")


@dataclass(frozen=True)
class TrainingConfig:
    """How one training iteration runs, as far as memory and time depend on it."""

    seq_length: int
    """Tokens per sample (``--seq-length``)."""
    global_batch: int
    """Samples per iteration over all data-parallel replicas (``--global-batch``); a layout
    with DP replicas and micro batch size b runs global_batch / (DP x b) microbatches."""
    precision: str = "bf16"
    """``bf16``: 16-bit activations and weights, fp32 main gradients and Adam state (mixed
    precision); ``fp32``: everything in 32 bits (the CPU tests)."""
    flash_attention: bool = True
    """Fused attention keeps no s x s score or softmax tensors, only a small fp32 softmax
    statistic per row (Korthikanti et al.'s 5as/h term disappears)."""
    sequence_parallel: bool = True
    """With TP > 1, layernorm and dropout activations are split over the TP ranks too, so every
    activation term is divided by TP (Korthikanti et al., section 4.2.2)."""
    distributed_optimizer: bool = True
    """The Adam state (fp32 master weight and moments) is sharded over data-parallel ranks."""
    dropout: bool = True
    """Dropout layers keep masks (Megatron-LM's default hidden and attention dropout 0.1);
    False for dropout 0."""
    dropout_mask_bytes: int = 1
    """Bytes per dropout-mask element: 1 on GPUs (bool masks, as Korthikanti et al. count);
    PyTorch's CPU dropout keeps its mask in the activation dtype (4 in fp32)."""
    fp8: bool = False
    """FP8 linear layers (Transformer Engine, megatron ``--fp8-format hybrid``,
    ``--fp8``): their GEMMs at twice the 16-bit rate, their saved inputs in one byte, an FP8
    copy of their weights (plan/fp8.py). Needs ``precision`` bf16."""
    context_parallel: int = 1
    """Context-parallel ranks (megatron ``--context-parallel-size``, ``--cp``): each holds
    s / CP tokens of every sample, in 2 x CP chunks taken from both ends so the causal mask's
    work is even (megatron's load-balanced split); attention passes the keys and values around
    the CP ring (plan/context_parallel.py). CP takes GPUs: DP = GPUs / (TP x PP x CP)."""
    fp32_softmax_copy: bool = False
    """Without flash attention: megatron's unfused softmax (no apex or Transformer Engine
    kernel, or masked_softmax_fusion off) runs in fp32 (attention_softmax_in_fp32) and keeps its
    fp32 output for backward besides the 16-bit copy the next matmul keeps: 4 more bytes per
    score in bf16 (nothing more in fp32, where both are one tensor). Korthikanti et al. count
    the fused kernel's 16-bit output only. ``vshape gpu-check`` runs that path."""

    def __post_init__(self) -> None:
        _positive("training", "--seq-length", "seq_length", self.seq_length, integer=True)
        _positive("training", "--global-batch", "global_batch", self.global_batch, integer=True)
        if self.dropout_mask_bytes not in (1, 2, 4):
            raise ValueError(f"training: dropout_mask_bytes must be 1, 2 or 4, got "
                             f"{self.dropout_mask_bytes!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"training: precision (--precision) must be one of "
                             f"{', '.join(PRECISIONS)}, got {self.precision!r}")
        _positive("training", "--cp", "context_parallel", self.context_parallel, integer=True)
        if self.seq_length % (2 * self.context_parallel) and self.context_parallel > 1:
            raise ValueError(f"training: --seq-length {self.seq_length} must split into "
                             f"2 x --cp = {2 * self.context_parallel} equal chunks (the "
                             f"load-balanced causal split); use a --seq-length divisible by "
                             f"{2 * self.context_parallel} or another --cp")
        if self.context_parallel > 1 and not self.flash_attention:
            raise ValueError("training: --cp needs flash attention (megatron's context "
                             "parallelism runs Transformer Engine's fused attention); drop "
                             "--no-flash-attention or use --cp 1")
        if not isinstance(self.fp8, bool):
            raise ValueError(f"training: fp8 (--fp8) must be true or false, got {self.fp8!r}")
        if self.fp8 and self.precision != "bf16":
            raise ValueError(f"training: --fp8 runs FP8 GEMMs inside bf16 mixed precision; "
                             f"use --precision bf16 with it (got --precision {self.precision})")

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element."""
        return 2 if self.precision == "bf16" else 4

    @property
    def rank_tokens(self) -> int:
        """Tokens of one sample on one context-parallel rank: s / CP."""
        return self.seq_length // self.context_parallel

    @property
    def linear_input_bytes(self) -> int:
        """Bytes of one element of a linear layer's saved input (FP8: one, plan/fp8.py)."""
        return OPERAND_BYTES if self.fp8 else self.element_bytes

    @property
    def parameter_bytes(self) -> tuple[int, int, int]:
        """(weight, gradient, optimizer state) bytes per parameter, before any sharding."""
        return _PARAMETER_BYTES[self.precision]


_H100 = {"gpu_tflops": GpuSpec.peak_tflops, "memory_tbps": GpuSpec.memory_tbps,
         "sms": GpuSpec.sms}
KNOWN_GPUS = {"H100": _H100, "H200": {**_H100, "memory_tbps": 4.8}}
"""Datasheet limits (SXM parts) of the GPUs whose measured profiles the project holds, as
:class:`ClusterConfig` fields: the H200 is an H100 die with faster, larger HBM3e."""


def gpu_limits(device_name: str) -> dict:
    """The :data:`KNOWN_GPUS` entry whose key ``device_name`` (torch's name, e.g. "NVIDIA
    H200") contains, so an analytic prediction can be made for the GPU a profile ran on."""
    found = [limits for key, limits in KNOWN_GPUS.items() if key in device_name.upper()]
    if len(found) != 1:
        raise ValueError(f"GPU {device_name!r}: no datasheet limits known; known: "
                         f"{', '.join(KNOWN_GPUS)}")
    return dict(found[0])


@dataclass(frozen=True)
class ClusterConfig:
    """The GPUs a plan is for. Speeds are what is achieved, not the datasheet's peaks."""

    gpus: int
    """GPUs in all (``--gpus``) = DP x TP x PP of every layout considered."""
    gpu_memory_gib: float
    """Memory of one GPU in GiB (``--gpu-memory``)."""
    gpus_per_node: int = 8
    """GPUs joined by the fast intra-node link (``--gpus-per-node``); TP stays inside a node."""
    reserved_gib: float = 3.0
    """Memory no tensor of the model can use (``--reserved-memory``): CUDA context, NCCL
    buffers and allocator fragmentation (the passes' own scratch bytes are counted with the
    activations, :class:`.memory.Workspace`)."""
    gpu_tflops: float = 989.0
    """Peak dense 16-bit TFLOP/s of one GPU (``--gpu-tflops``; H100 SXM bf16: 989)."""
    memory_tbps: float = 3.35
    """HBM bandwidth of one GPU, TB/s (``--memory-bandwidth``; H100 SXM: 3.35, H200: 4.8)."""
    sms: int = 132
    """Streaming multiprocessors of one GPU (``--sms``; H100 SXM and H200: 132), over which
    the shape model spreads a kernel's tiles."""
    cost_model: str = "shapes"
    """``shapes`` (default) or ``mfu`` (``--cost-model``; :data:`COST_MODELS`)."""
    mfu: float = 0.45
    """Fraction of ``gpu_tflops`` every pass reaches under ``cost_model="mfu"`` (``--mfu``);
    a measured profile (``--profile``) replaces either model."""
    intra_node_gbps: float = 360.0
    """Achieved collective bus bandwidth inside a node, GB/s (``--intra-node-bandwidth``;
    NVLink 4 with NCCL reaches about 360 of 450 GB/s per direction)."""
    inter_node_gbps: float = 40.0
    """Achieved bandwidth per GPU between nodes, GB/s (``--inter-node-bandwidth``; one
    400 Gb/s InfiniBand NIC per GPU reaches about 40 of 50 GB/s)."""
    p2p_latency_us: float = 20.0
    """Fixed cost of one pipeline send/receive, microseconds (``--p2p-latency``)."""
    overlap_dp_comm: bool = False
    """True when the data-parallel gradient reduction (and parameter all-gather) is hidden
    behind compute (Megatron-LM ``--overlap-grad-reduce --overlap-param-gather``); False adds
    it after the pipeline flush (``--overlap-dp-comm``)."""

    def __post_init__(self) -> None:
        _positive("cluster", "--gpus", "gpus", self.gpus, integer=True)
        _positive("cluster", "--gpus-per-node", "gpus_per_node", self.gpus_per_node, integer=True)
        _positive("cluster", "--sms", "sms", self.sms, integer=True)
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cluster: cost_model (--cost-model) must be one of "
                             f"{', '.join(COST_MODELS)}, got {self.cost_model!r}")
        for flag, name in (("--gpu-memory", "gpu_memory_gib"), ("--gpu-tflops", "gpu_tflops"),
                           ("--memory-bandwidth", "memory_tbps"),
                           ("--intra-node-bandwidth", "intra_node_gbps"),
                           ("--inter-node-bandwidth", "inter_node_gbps")):
            _positive("cluster", flag, name, getattr(self, name))
        if not 0 < self.mfu <= 1:
            raise ValueError(f"cluster: mfu (--mfu) must be in (0, 1], got {self.mfu!r}")
        if self.reserved_gib < 0 or self.p2p_latency_us < 0:
            raise ValueError("cluster: reserved_gib (--reserved-memory) and p2p_latency_us "
                             "(--p2p-latency) must be >= 0")
        if self.reserved_gib >= self.gpu_memory_gib:
            raise ValueError(f"cluster: --reserved-memory {self.reserved_gib:g} GiB leaves "
                             f"nothing of --gpu-memory {self.gpu_memory_gib:g} GiB")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"cluster: --gpus {self.gpus} spans several nodes, so it must be a "
                             f"multiple of --gpus-per-node {self.gpus_per_node}; e.g. "
                             f"{self.gpus // self.gpus_per_node * self.gpus_per_node} or "
                             f"{-(-self.gpus // self.gpus_per_node) * self.gpus_per_node}")

    @property
    def budget_bytes(self) -> float:
        """Bytes a rank's parameters, gradients, optimizer state and activations may take."""
        return (self.gpu_memory_gib - self.reserved_gib) * GIB

    @property
    def flops_per_second(self) -> float:
        """Achieved FLOP/s of one GPU under ``cost_model="mfu"``."""
        return self.gpu_tflops * 1e12 * self.mfu

    @property
    def gpu(self) -> GpuSpec:
        """The GPU's limits for the shape model (its achieved fractions at their defaults)."""
        return GpuSpec(peak_tflops=self.gpu_tflops, memory_tbps=self.memory_tbps, sms=self.sms)


@dataclass(frozen=True)
class ParallelLayout:
    """One point of the search: how the GPUs are split and which schedule runs the pipeline."""

    dp: int
    """Data-parallel replicas."""
    tp: int
    """Tensor-parallel size (inside a node)."""
    pp: int
    """Pipeline ranks (p); 1 means no pipeline."""
    micro_batch_size: int
    """Samples per microbatch (b)."""
    schedule: str
    """A schedule of :data:`megatron_vshape.schedule.SCHEDULES`, or ``none`` when pp is 1."""
    recompute: str = "none"
    """Activation recomputation: none, selective or full (plan/recompute.py)."""
    ep: int = 1
    """Expert-parallel ranks (MoE), taken from the DP x TP ranks of a stage."""

    def __post_init__(self) -> None:
        from .recompute import RECOMPUTE

        if self.recompute not in RECOMPUTE:
            raise ValueError(f"layout: recompute (--recompute) must be one of "
                             f"{', '.join(RECOMPUTE)}, got {self.recompute!r}")
        flags = {"dp": "--gpus", "tp": "--tp", "pp": "--pp",
                 "micro_batch_size": "--micro-batch-sizes", "ep": "--ep"}
        for name, flag in flags.items():
            _positive("layout", flag, name, getattr(self, name), integer=True)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def label(self) -> str:
        """The row's name: the schedule and its recomputation (``1f1b-r``, ``v-half+sel``)."""
        from .recompute import label

        return label(self.schedule, self.recompute)
