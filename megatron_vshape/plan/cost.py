"""Pass times: the shape model or the one-MFU FLOP model, communication, per-rank costs.

By default (``ClusterConfig.cost_model == "shapes"``) a pass's time is the sum of its kernels'
times, each from its shape on the GPU (:mod:`.layer_kernels`, :mod:`.kernels`, docs/plan.md).
The one-MFU model (``"mfu"``) counts FLOPs instead, one microbatch of b samples, s tokens, on
one TP rank of t::

    F_layer = [2sb h (q + kv) + 2sb q h + 2sb h f' + 2sb f h + 4 b s^2 q] / t   FLOPs
            = (24 b s h^2 + 4 b s^2 h) / t for f = 4h, no GQA (f' = 2f with SwiGLU)
                                          (q = heads x head width: h unless kv_channels)
    B_layer = linear FLOPs + 2 x attention-core FLOPs    (input gradients; the core has no weights)
    W_layer = linear FLOPs                               (weight gradients), so B + W = 2F
    F_head  = 2 sb h V / t,  B_head = 2 F_head,  W_head = 0  (the LM head's W is not deferred)

divided by the achieved FLOP/s (``gpu_tflops x mfu``). Tensor parallelism adds its collectives,
not overlapped: per layer four all-gathers/reduce-scatters of the s b h activation in F (two
all-reduces without sequence parallel), four in B, and in W the two all-gathers that re-gather
the inputs of the column-parallel linears under sequence parallel. Each moves
(t-1)/t x e s b h bytes at the intra-node bandwidth.

Recomputation (:mod:`.recompute`) replays forward work inside B, so for the simulator it is
part of B's pass time: full adds the layer's F to B, selective the attention core's share of F
(:func:`replay_share`), with measured profiles as with the models.

Pipeline hop: ``p2p_latency + e s b h / sp`` bytes at the inter-node bandwidth when the
pipeline spans nodes (megatron orders ranks TP, then DP, then PP, so with more GPUs than a node
some hop crosses), else at the intra-node bandwidth.

Data parallel: per iteration a reduce-scatter of the fp32 gradients and an all-gather of the
weights (distributed optimizer), or an all-reduce of the gradients, over the DP group, exposed
unless ``overlap_dp_comm``. The optimizer step itself is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..schedule.model.costs import Costs
from ..schedule.model.placement import Placement
from .model import ModelConfig
from .layer_kernels import part_kernels
from .settings import ClusterConfig, TrainingConfig
from .shares import ChunkShare, StageShares

__all__ = ["PassTimes", "PartTimes", "analytic_times", "with_recompute", "attention_share",
           "replay_share", "layer_flops", "head_flops", "p2p_seconds", "dp_seconds", "rank_costs",
           "model_flops_per_sample", "stage_times", "stage_costs"]


@dataclass(frozen=True)
class PassTimes:
    """Seconds of F, B (input gradient) and W (weight gradient) for one microbatch."""

    forward: float
    backward: float
    weight: float

    def __post_init__(self) -> None:
        if min(self.forward, self.backward, self.weight) < 0:
            raise ValueError(f"pass times must be >= 0, got {self}")

    def scaled(self, factor: float) -> "PassTimes":
        return PassTimes(self.forward * factor, self.backward * factor, self.weight * factor)


@dataclass(frozen=True)
class PartTimes:
    """Pass times of the model's parts for one microbatch on one TP rank."""

    layer: PassTimes
    embedding: PassTimes
    head: PassTimes
    source: str
    """Where they come from (``analytic, MFU 0.45`` or the profile file)."""


def layer_flops(model: ModelConfig, seq_length: int, micro_batch_size: int) -> tuple[float, float]:
    """(linear, attention-core) forward FLOPs of one layer, one microbatch, no TP. A MoE layer
    counts what a token runs: the router, its k experts and the shared experts."""
    s, b, h, f = seq_length, micro_batch_size, model.hidden_size, model.ffn
    q, kv = model.query_width, 2 * model.query_groups * model.head_dim
    wide = 2 if model.swiglu else 1
    if model.moe:
        fe, fs = model.expert_ffn, model.shared_ffn
        mlp = model.num_experts + model.moe_router_topk * (wide * fe + fe) + wide * fs + fs
    else:
        mlp = wide * f + f
    linear = 2 * s * b * h * ((q + kv) + q + mlp)
    return linear, 4 * b * s * s * q


def head_flops(model: ModelConfig, seq_length: int, micro_batch_size: int) -> float:
    """Forward FLOPs of the LM head (logits), one microbatch, no TP."""
    return 2 * seq_length * micro_batch_size * model.hidden_size * model.vocab_size


def model_flops_per_sample(model: ModelConfig, seq_length: int) -> float:
    """F + B + W FLOPs of one sample through the whole model (3 x forward)."""
    linear, attention = layer_flops(model, seq_length, 1)
    return 3 * (model.num_layers * (linear + attention) + head_flops(model, seq_length, 1))


def _tp_collective(training: TrainingConfig, cluster: ClusterConfig, tp: int,
                   micro_batch_size: int, hidden: int) -> float:
    """Seconds of one all-gather or reduce-scatter of the s b h activation over TP."""
    if tp == 1:
        return 0.0
    size = training.element_bytes * training.rank_tokens * micro_batch_size * hidden
    return (tp - 1) / tp * size / (cluster.intra_node_gbps * 1e9)


def analytic_times(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig,
                   tp: int, micro_batch_size: int, ep: int = 1) -> PartTimes:
    """Pass times without a measured profile: the shape model (``cluster.cost_model ==
    "shapes"``, :mod:`.layer_kernels`) or the one-MFU FLOP model of the module docstring."""
    if cluster.cost_model == "mfu":
        return mfu_times(model, training, cluster, tp, micro_batch_size)
    kernels = part_kernels(model, training, cluster, tp, micro_batch_size, ep)
    gpu = kernels.gpu

    def passes(part) -> PassTimes:
        return PassTimes(*(part.seconds(k) for k in ("forward", "backward", "weight")))

    return PartTimes(passes(kernels.layer), passes(kernels.embedding), passes(kernels.head),
                     f"shapes, {gpu.peak_tflops:g} TFLOP/s, {gpu.memory_tbps:g} TB/s, "
                     f"{gpu.sms} SMs")


def mfu_times(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig,
              tp: int, micro_batch_size: int) -> PartTimes:
    """The one-MFU FLOP model of the module docstring."""
    rate = cluster.flops_per_second * training.context_parallel  # each CP rank does 1 / CP
    linear, attention = layer_flops(model, training.seq_length, micro_batch_size)
    hop = _tp_collective(training, cluster, tp, micro_batch_size, model.hidden_size)
    sp = training.sequence_parallel
    layer = PassTimes(
        (linear + attention) / tp / rate + 4 * hop,
        (linear + 2 * attention) / tp / rate + 4 * hop,
        linear / tp / rate + (2 * hop if sp else 0.0),
    )
    logits = head_flops(model, training.seq_length, micro_batch_size) / tp / rate
    head = PassTimes(logits + (hop if sp else 0.0), 2 * logits + (hop if sp else 2 * hop), 0.0)
    embedding = PassTimes(hop if sp else 2 * hop, hop if sp else 0.0, 0.0)
    return PartTimes(layer, embedding, head,
                     f"analytic, {cluster.gpu_tflops:g} TFLOP/s x MFU {cluster.mfu:g}")


def attention_share(model: ModelConfig, seq_length: int) -> float:
    """The attention core's share of a layer's forward FLOPs (what selective recomputation
    replays, under the one-MFU model)."""
    linear, attention = layer_flops(model, seq_length, 1)
    return attention / (linear + attention)


def replay_share(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig, tp: int,
                 micro_batch_size: int, ep: int = 1) -> float:
    """The attention core's share of a layer's forward time: what selective recomputation adds
    to B (its FLOP share under the one-MFU model, its kernels' time under the shape model)."""
    if cluster.cost_model == "mfu":
        return attention_share(model, training.seq_length)
    kernels = part_kernels(model, training, cluster, tp, micro_batch_size, ep)
    return sum(k.seconds for k in kernels.attention_core) / kernels.layer.seconds("forward")


def with_recompute(times: PartTimes, recompute: str, share: float) -> PartTimes:
    """``times`` with the replayed forward added to the layers' B: all of F under ``full``,
    ``share`` of it (:func:`attention_share`) under ``selective``."""
    replay = {"none": 0.0, "selective": share, "full": 1.0}[recompute]
    if not replay:
        return times
    layer = times.layer
    return PartTimes(PassTimes(layer.forward, layer.backward + replay * layer.forward,
                               layer.weight),
                     times.embedding, times.head, f"{times.source}, {recompute} recomputation")


def p2p_seconds(training: TrainingConfig, cluster: ClusterConfig, hidden: int, tp: int,
                pp: int, micro_batch_size: int) -> float:
    """One pipeline hop of one microbatch's activation (or its gradient)."""
    if pp == 1:
        return 0.0
    sp = tp if training.sequence_parallel and tp > 1 else 1
    size = training.element_bytes * training.rank_tokens * micro_batch_size * hidden / sp
    across = cluster.gpus > cluster.gpus_per_node
    bandwidth = cluster.inter_node_gbps if across else cluster.intra_node_gbps
    return cluster.p2p_latency_us * 1e-6 + size / (bandwidth * 1e9)


def dp_seconds(training: TrainingConfig, cluster: ClusterConfig, parameters: float, tp: int,
               dp: int) -> float:
    """Exposed data-parallel communication per iteration for ``parameters`` on one rank."""
    if dp == 1 or cluster.overlap_dp_comm:
        return 0.0
    weight, grad, _ = training.parameter_bytes
    per_parameter = grad + weight if training.distributed_optimizer else 2 * grad
    across = tp * dp > cluster.gpus_per_node
    bandwidth = cluster.inter_node_gbps if across else cluster.intra_node_gbps
    return (dp - 1) / dp * per_parameter * parameters / (bandwidth * 1e9)


def _chunk_time(share: ChunkShare, times: PartTimes) -> PassTimes:
    """One stage's passes: its layers', plus the embedding's and the head's where it holds
    them (the head's logits GEMMs and cross entropy over the vocabulary, :mod:`.layer_kernels`)."""
    parts = [(share.layers, times.layer), (share.embedding, times.embedding),
             (share.head, times.head)]
    return PassTimes(*(sum(n * getattr(t, k) for n, t in parts)
                       for k in ("forward", "backward", "weight")))


def rank_costs(shares: Sequence[Sequence[ChunkShare]], times: PartTimes, comm: float) -> Costs:
    """Simulator costs: each rank's whole share (the simulator gives each chunk half)."""
    per_rank = [[_chunk_time(c, times) for c in chunks] for chunks in shares]
    return Costs.build(len(shares),
                       [sum(t.forward for t in r) for r in per_rank],
                       [sum(t.backward for t in r) for r in per_rank],
                       [sum(t.weight for t in r) for r in per_rank], comm=comm)


def stage_times(stages: StageShares, times: PartTimes) -> tuple[PassTimes, ...]:
    """Per global stage (a layout, :mod:`.shares`), the F, B and W of one microbatch through
    it: what makes rank 0 of a V, holding the embedding and the LM head, the slow one."""
    return tuple(_chunk_time(share, times) for share in stages)


_FLOOR = 1e-9
"""Seconds given a pass that does no work (the W of a stage holding only the embedding or
the LM head, whose weight gradients are not deferred): the simulator takes positive times."""


def stage_costs(placement: Placement, stages: StageShares, times: PartTimes,
                comm: float) -> Costs:
    """Simulator costs per global stage (one pass of that stage, not a rank's share)."""
    per_stage = stage_times(stages, times)
    return Costs.for_stages(placement,
                            *[[max(getattr(t, kind), _FLOOR) for t in per_stage]
                              for kind in ("forward", "backward", "weight")], comm=comm)
