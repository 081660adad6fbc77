"""What one GPU kernel costs, from the GPU's physical limits and the shape of its work.

A pass of a transformer layer is a sequence of kernels (:mod:`.layer_kernels`); each is timed
here on a roofline with the losses small matrices have on a real GPU (docs/plan.md, "The cost
model"):

- **GEMM** ``(M x K) @ (K x N)``, optionally batched: the output is cut into tiles, one tile
  per streaming multiprocessor (SM) at a time, so the work runs in ``ceil(tiles / SMs)`` waves
  and a last partial wave idles the other SMs (wave quantization); a dimension that is not a
  multiple of the tile pads it (tile quantization). Like cuBLAS's heuristics, the cheapest of a
  few tile shapes (large tiles reach a higher fraction of peak) and split-K factors (more tiles
  for thin outputs, at the cost of a reduction) is taken. The time is never below the bytes
  the kernel must move over the memory bandwidth: thin GEMMs (the unfused attention core's
  ``K = head dim`` products) are memory-bound.
- **Streaming** (layernorm, bias, activation, dropout, softmax, casts, copies): bytes moved
  over the achieved bandwidth.
- **Flash attention**: the causal half of the score matrix at the fused kernels' achieved rate,
  with the same wave rule over (batch x heads x query blocks).

Every kernel adds a fixed cost (start-up and tail of a launch on the GPU). The constants of
:class:`GpuSpec` are the GPU's datasheet numbers and the achieved fractions with their sources.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GpuSpec", "Kernel", "gemm", "streaming", "transfer", "flash_attention"]


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's limits and what kernels reach of them (defaults: H100 SXM5, bf16)."""

    peak_tflops: float = 989.0
    """Dense 16-bit tensor-core peak, TFLOP/s (NVIDIA H100 datasheet, SXM5: 989.4)."""
    memory_tbps: float = 3.35
    """HBM bandwidth, TB/s (H100 SXM5 datasheet: 3.35)."""
    sms: int = 132
    """Streaming multiprocessors (H100 SXM5: 132)."""
    gemm_efficiency: float = 0.74
    """Fraction of peak a large GEMM reaches with the largest tile (128 x 256). cuBLAS bf16 on
    H100 SXM reaches 700-750 TFLOP/s on large square GEMMs; the project's H100 measurement of
    megatron-core's weight-gradient GEMMs (W: 0.82 TFLOP in 1.16 ms) is 0.72 of peak."""
    memory_efficiency: float = 0.62
    """Fraction of the bandwidth memory-bound kernels reach: PyTorch's eager elementwise, cast
    and softmax kernels on H100 run at 60-85% of HBM3's 3.35 TB/s (simple copies at the top,
    fp32 softmax rows, broadcast masks and thin batched GEMMs lower). Fitted, with
    ``gemm_efficiency``, to the project's one H100 measurement of megatron-core layers, whose
    time is mostly the unfused fp32 softmax (docs/plan.md)."""
    kernel_overhead_us: float = 4.0
    """Fixed GPU time per kernel (launch, prologue, tail): 2-5 us on H100 for kernels that are
    not CPU-bound."""
    flash_forward_efficiency: float = 0.55
    """Fraction of peak fused causal attention reaches in the forward (FlashAttention-3 paper,
    H100 SXM5 bf16 head dim 128: FA2 about 350, FA3 and cuDNN 500-660 TFLOP/s; Transformer
    Engine runs cuDNN's)."""
    flash_backward_efficiency: float = 0.45
    """The same for the backward (FA2 about 250-300, FA3 and cuDNN 450-550 TFLOP/s)."""

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_tbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"gpu: {name} must be > 0, got {getattr(self, name)!r}")
        if self.kernel_overhead_us < 0:
            raise ValueError(f"gpu: kernel_overhead_us must be >= 0, got "
                             f"{self.kernel_overhead_us!r}")
        if self.sms < 1:
            raise ValueError(f"gpu: sms must be >= 1, got {self.sms!r}")
        for name in ("gemm_efficiency", "memory_efficiency", "flash_forward_efficiency",
                     "flash_backward_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"gpu: {name} must be in (0, 1], got {getattr(self, name)!r}")

    @property
    def flops(self) -> float:
        """Peak FLOP/s."""
        return self.peak_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        """Peak bytes/s."""
        return self.memory_tbps * 1e12


@dataclass(frozen=True)
class Kernel:
    """One kernel of a pass: the work it does and the time the model gives it."""

    name: str
    flops: float
    """FLOPs executed (0 for streaming kernels)."""
    bytes: float
    """Bytes it must move to and from memory at least."""
    seconds: float
    bound: str
    """What limits it: ``compute``, ``memory`` or ``launch``."""

    def fraction_of_peak(self, gpu: GpuSpec) -> float:
        return self.flops / (self.seconds * gpu.flops) if self.seconds else 0.0


# (tile rows, tile columns, fraction of gemm_efficiency): cuBLAS's H100 kernels reach less of
# peak with smaller tiles (fewer operands reused per byte loaded)
_TILES = ((128, 256, 1.0), (128, 128, 0.92), (64, 128, 0.78))
_SPLIT_K = (1, 2, 4)
_MIN_SPLIT_DEPTH = 256
"""Split-K only while each slice keeps at least this many of K (shorter slices starve the
tensor cores' pipeline)."""


def _finish(name: str, flops: float, moved: float, compute: float, gpu: GpuSpec) -> Kernel:
    memory = moved / (gpu.bandwidth * gpu.memory_efficiency)
    launch = gpu.kernel_overhead_us * 1e-6
    busy = max(compute, memory)
    bound = "launch" if launch > busy else ("compute" if compute >= memory else "memory")
    return Kernel(name, flops, moved, busy + launch, bound)


def gemm(name: str, m: int, n: int, k: int, gpu: GpuSpec, element_bytes: int = 2,
         batch: int = 1, output_bytes: int | None = None) -> Kernel:
    """``batch`` products of ``(m x k) @ (k x n)``; ``output_bytes`` per output element
    (default ``element_bytes``; 8 for an fp32 gradient accumulated in place: read and write)."""
    out = element_bytes if output_bytes is None else output_bytes
    flops = 2.0 * m * n * k * batch
    moved = batch * (element_bytes * (m * k + k * n) + out * m * n)
    best = (math.inf, 0.0, 0.0)  # (time, compute time, bytes) of the cheapest choice
    for rows, cols, share in _TILES:
        for split in _SPLIT_K:
            if split > 1 and k // split < _MIN_SPLIT_DEPTH:
                continue
            tiles = batch * math.ceil(m / rows) * math.ceil(n / cols) * split
            waves = math.ceil(tiles / gpu.sms)
            tile_flops = 2.0 * rows * cols * math.ceil(k / split)
            compute = waves * gpu.sms * tile_flops / (gpu.flops * gpu.gemm_efficiency * share)
            # split-K writes fp32 partial sums and reads them back to reduce them
            traffic = moved + (0.0 if split == 1 else batch * m * n * 4 * 2 * split)
            time = max(compute, traffic / (gpu.bandwidth * gpu.memory_efficiency))
            if time < best[0]:
                best = (time, compute, traffic)
    return _finish(name, flops, best[2], best[1], gpu)


def streaming(name: str, moved: float, gpu: GpuSpec) -> Kernel:
    """An elementwise, reduction, cast or copy kernel moving ``moved`` bytes."""
    return _finish(name, 0.0, moved, 0.0, gpu)


def transfer(name: str, moved: float, gbps: float, gpu: GpuSpec) -> Kernel:
    """A collective or all-to-all moving ``moved`` bytes per GPU over a link of ``gbps`` GB/s
    achieved, plus one kernel's fixed cost."""
    return Kernel(name, 0.0, moved, moved / (gbps * 1e9) + gpu.kernel_overhead_us * 1e-6,
                  "memory")


_FLASH_BLOCK = 128
"""Query rows per thread block of the fused attention kernels (FlashAttention 2/3, cuDNN)."""


def flash_attention(name: str, batch_heads: int, seq: int, head_dim: int, gpu: GpuSpec,
                    backward: bool, element_bytes: int = 2, parts: int = 1) -> Kernel:
    """Causal fused attention over ``batch_heads`` (micro batch x heads on this TP rank)
    sequences of ``seq`` tokens: the forward runs QK^T and PV over the causal half of the
    scores (2 x 2 s^2 d / 2 FLOPs per head), the backward five such products (recomputing the
    scores), i.e. 2.5 x the forward. ``parts``: context-parallel ranks, each doing an equal
    1 / parts of that work for its s / parts queries (plan/context_parallel.py)."""
    forward_flops = 2.0 * seq * seq * head_dim * batch_heads / parts  # causal half of 4 s^2 d
    flops = 2.5 * forward_flops if backward else forward_flops
    efficiency = gpu.flash_backward_efficiency if backward else gpu.flash_forward_efficiency
    blocks = batch_heads * math.ceil(seq / parts / _FLASH_BLOCK)
    utilization = blocks / (math.ceil(blocks / gpu.sms) * gpu.sms)
    compute = flops / (gpu.flops * efficiency * utilization)
    tensors = 8 if backward else 4  # q, k, v read, o written (+ o, do read, dq, dk, dv written)
    moved = tensors * batch_heads * seq / parts * head_dim * element_bytes
    return _finish(name, flops, moved, compute, gpu)
