"""The kernels of one microbatch's F, B and W on one tensor-parallel rank, as megatron runs them.

One transformer layer (megatron-core's GPT layer), the LM head with its loss, and the
embedding, each pass listed kernel by kernel with its shape, so :mod:`.kernels` can time it:

    F   layernorm -> QKV GEMM -> attention core -> projection GEMM -> bias/dropout/residual
        -> layernorm -> FC1 GEMM -> activation -> FC2 GEMM -> bias/dropout/residual
    B   the same backwards: each GEMM's input gradient (dX = dY W), the attention core's
        backward, the elementwise backwards, the bias gradients
    W   each GEMM's weight gradient (dW = dY^T X, accumulated into the fp32 main gradient)

Two builds of the elementwise work, matching the memory model's switch
(:attr:`TrainingConfig.fp32_softmax_copy`): fused layers (Transformer Engine or apex: bias in
the GEMM epilogue, fused bias-activation and bias-dropout-add, a fused softmax kernel) and
megatron's local layers without those kernels (separate bias adds, PyTorch's activation and
dropout, the softmax in fp32 with its casts). With flash attention the attention core is one
fused kernel; without it, two batched GEMMs around the softmax over the s x s scores.

Tensor-parallel collectives are timed as :mod:`.cost` always did (the activation's bytes over
the intra-node bandwidth, four per F and B, two in W under sequence parallel), each with one
kernel's fixed cost.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import fp8
from .context_parallel import ring_bytes, ring_kernel
from .kernels import GpuSpec, Kernel, flash_attention, gemm, streaming, transfer
from .model import ModelConfig
from .settings import ClusterConfig, TrainingConfig

__all__ = ["PassKernels", "PartKernels", "part_kernels"]


@dataclass(frozen=True)
class PassKernels:
    """The kernels of F, B and W of one part (a layer, the head or the embedding)."""

    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    weight: tuple[Kernel, ...]

    def seconds(self, kind: str) -> float:
        return sum(k.seconds for k in getattr(self, kind))

    def flops(self, kind: str) -> float:
        return sum(k.flops for k in getattr(self, kind))


@dataclass(frozen=True)
class PartKernels:
    """One microbatch's kernels on one TP rank: a layer, the LM head and loss, the embedding."""

    layer: PassKernels
    head: PassKernels
    embedding: PassKernels
    attention_core: tuple[Kernel, ...]
    """The layer's forward kernels that selective recomputation replays inside B."""
    gpu: GpuSpec


@dataclass(frozen=True)
class _Shape:
    """The sizes one microbatch's kernels are built from."""

    tokens: int          # s b: rows of every GEMM of the layer (the gathered sequence)
    sp_tokens: int       # rows the elementwise work sees (s b / t under sequence parallel)
    hidden: int
    qkv: int             # QKV output features on this rank
    query: int           # query features on this rank: the projection's input
    fc1: int             # FC1 output features on this rank (2 f / t with SwiGLU)
    ffn: int             # f / t
    heads: int           # attention heads on this rank x micro batch (batched products)
    seq: int
    head_dim: int
    vocab: int           # LM head output features on this rank
    e: int               # bytes per activation element
    fused: bool
    flash: bool
    dropout: bool
    swiglu: bool
    moe: _Experts | None
    fp8: bool = False    # the layer's linear GEMMs in FP8 (plan/fp8.py)
    cp: int = 1          # context-parallel ranks (plan/context_parallel.py)
    cp_gbps: float = 0.0  # the CP ring's link


@dataclass(frozen=True)
class _Experts:
    """A MoE layer's MLP on one rank (expert tensor parallel 1)."""

    experts: int         # routed experts in all
    local: int           # routed experts on this rank (experts / EP)
    routed: int          # token copies this rank's experts process (its tokens x top-k)
    fc1: int             # one expert's first-linear width (2 f_e with SwiGLU)
    ffn: int             # f_e
    ep: int


def _shape(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig, tp: int,
           micro_batch: int, ep: int) -> _Shape:
    s, h, d = training.seq_length, model.hidden_size, model.head_dim
    inside = tp * training.context_parallel <= cluster.gpus_per_node  # megatron: TP, then CP
    cp_gbps = cluster.intra_node_gbps if inside else cluster.inter_node_gbps
    tokens = training.rank_tokens * micro_batch  # s b / CP
    sp_tokens = tokens // tp if training.sequence_parallel and tp > 1 else tokens
    wide = 2 if model.swiglu else 1
    # a MoE layer's dense MLP part is its shared experts (width 0: none)
    ffn = (model.shared_ffn if model.moe else model.ffn) // tp
    experts = _Experts(model.num_experts, model.num_experts // ep,
                       sp_tokens * model.moe_router_topk, wide * model.expert_ffn,
                       model.expert_ffn, ep) if model.moe else None
    q = model.query_width
    return _Shape(tokens, sp_tokens, h, (q + 2 * model.query_groups * d) // tp, q // tp,
                  wide * ffn, ffn,
                  micro_batch * model.num_attention_heads // tp, s, d, model.vocab_size // tp,
                  training.element_bytes, not training.fp32_softmax_copy,
                  training.flash_attention, training.dropout, model.swiglu, experts,
                  training.fp8, training.context_parallel, cp_gbps)


def _linear(name: str, x: _Shape, m: int, n: int, k: int, gpu: GpuSpec,
            output_bytes: int | None = None) -> Kernel:
    """A transformer layer's linear GEMM: 16-bit, or FP8 operands at the FP8 rate (plan/fp8.py)
    with 16-bit outputs."""
    if not x.fp8:
        return gemm(name, m, n, k, gpu, x.e, output_bytes=output_bytes)
    faster = dataclasses.replace(gpu, peak_tflops=gpu.peak_tflops * fp8.GEMM_SPEEDUP)
    return gemm(name + " (FP8)", m, n, k, faster, fp8.OPERAND_BYTES,
                output_bytes=x.e if output_bytes is None else output_bytes)


def _casts(name: str, x: _Shape, widths: tuple[int, ...], gpu: GpuSpec) -> list[Kernel]:
    """FP8 casts of each linear's input (F) or output gradient (B): 16-bit read, byte written."""
    if not x.fp8:
        return []
    return [streaming(name, (x.e + fp8.OPERAND_BYTES) * x.tokens * sum(widths), gpu)]


def _collective(name: str, x: _Shape, tp: int, cluster: ClusterConfig,
                gpu: GpuSpec) -> Kernel:
    return transfer(name, (tp - 1) / tp * x.e * x.tokens * x.hidden, cluster.intra_node_gbps,
                    gpu)


def _tp(names: tuple[str, ...], x: _Shape, tp: int, cluster: ClusterConfig,
        gpu: GpuSpec) -> list[Kernel]:
    return [] if tp == 1 else [_collective(n, x, tp, cluster, gpu) for n in names]


def _residual(x: _Shape, gpu: GpuSpec, backward: bool) -> list[Kernel]:
    """Bias, dropout and residual add after the projection or FC2 (on the s b / t tokens of
    sequence parallel), or their backward (the residual's gradient sum, dropout's mask)."""
    act = x.e * x.sp_tokens * x.hidden
    mask = x.sp_tokens * x.hidden if x.dropout else 0.0
    if backward:
        out = [streaming("residual gradient add", 3 * act, gpu)]
        return out + ([streaming("dropout backward", 2 * act + mask, gpu)] if x.dropout else [])
    if x.fused:
        return [streaming("bias-dropout-add (fused)", 3 * act + mask, gpu)]
    out = [streaming("bias add", 2 * act, gpu)]
    if x.dropout:
        out.append(streaming("dropout", 2 * act + mask, gpu))
    return out + [streaming("residual add", 3 * act, gpu)]


def _softmax_bytes(x: _Shape, backward: bool) -> float:
    """Bytes per attention score the softmax moves. A fused kernel reads and writes each score
    once (its backward also reads the saved probabilities). Local layers (megatron's
    FusedScaleMaskSoftmax without its kernel) cast 16-bit scores to fp32, mask in place,
    softmax, and cast back; in fp32 there are no casts."""
    if x.fused:
        return (3 if backward else 2) * x.e
    mask, softmax = 8, (12 if backward else 8)
    casts = 0 if x.e == 4 else 2 * (x.e + 4)
    return casts + mask + softmax


def _attention(x: _Shape, gpu: GpuSpec, backward: bool) -> list[Kernel]:
    """The attention core: one fused kernel, or QK^T, softmax, dropout and PV."""
    if x.flash:
        core = flash_attention("flash attention" + (" backward" if backward else ""), x.heads,
                               x.seq, x.head_dim, gpu, backward, x.e, x.cp)
        moved = ring_bytes(x.cp, x.tokens, x.qkv - x.query, x.e, backward)
        return [core] + ring_kernel("CP ring K/V exchange (exposed)", moved, x.cp_gbps,
                                    core.seconds, gpu)
    assert x.cp == 1, "TrainingConfig refuses context parallelism without flash attention"
    s, d, e, batch = x.seq, x.head_dim, x.e, x.heads
    scores = batch * s * s
    drop = [streaming("attention dropout" + (" backward" if backward else ""),
                      (2 * e + 1) * scores, gpu)] if x.dropout else []
    copy = [] if x.fused else [streaming("context layout copy", 2 * e * s * batch * d, gpu)]
    softmax = streaming("softmax" + (" backward" if backward else "")
                        + ("" if x.fused else " (fp32, with casts)"),
                        _softmax_bytes(x, backward) * scores, gpu)
    if not backward:
        return ([gemm("scores QK^T", s, s, d, gpu, e, batch), softmax] + drop
                + [gemm("context PV", s, d, s, gpu, e, batch)] + copy)
    return (copy + [gemm("dP = dO V^T", s, s, d, gpu, e, batch),
                    gemm("dV = P^T dO", s, d, s, gpu, e, batch)] + drop
            + [softmax, gemm("dQ = dS K", s, d, s, gpu, e, batch),
               gemm("dK = dS^T Q", s, d, s, gpu, e, batch)])


def _activation(x: _Shape, gpu: GpuSpec, backward: bool) -> list[Kernel]:
    """FC1's bias and GeLU (or SwiGLU), or their backward."""
    big, out = x.e * x.tokens * x.fc1, x.e * x.tokens * x.ffn
    name = "swiglu" if x.swiglu else "gelu"
    if backward:
        return [streaming(f"{name} backward", 2 * big + out, gpu)]
    if x.fused:
        return [streaming(f"bias-{name} (fused)", big + out, gpu)]
    return [streaming("bias add", 2 * big, gpu), streaming(name, big + out, gpu)]


def _layer(x: _Shape, tp: int, cluster: ClusterConfig, gpu: GpuSpec) -> PassKernels:
    attention = _attention_half(x, tp, cluster, gpu)
    mlp = _dense_mlp(x, tp, cluster, gpu) if x.ffn else PassKernels((), (), ())
    if x.moe is not None:
        routed = _routed_experts(x, x.moe, cluster, gpu)
        mlp = PassKernels(routed.forward + mlp.forward, mlp.backward + routed.backward,
                          routed.weight + mlp.weight)
    e, t, h = x.e, x.tokens, x.hidden
    norm = 2 * e * x.sp_tokens * h
    mlp_forward = (streaming("layernorm", norm, gpu),) + mlp.forward + tuple(
        _residual(x, gpu, False))
    mlp_backward = (tuple(_residual(x, gpu, True)) + mlp.backward
                    + (streaming("layernorm backward", 1.5 * norm, gpu),))
    # B sums each linear's output gradient into its bias gradient (the runtime's B/W split,
    # megatron_vshape/megatron/wgrad.py, keeps biases in B); routed experts have no biases
    biases = streaming("bias gradients", e * t * (x.qkv + x.fc1) + e * t * h
                       + (e * t * h if x.ffn else 0), gpu)
    return PassKernels(attention.forward + mlp_forward,
                       mlp_backward + attention.backward + (biases,),
                       attention.weight + mlp.weight)


def _gathered(x: _Shape, tp: int, cluster: ClusterConfig, gpu: GpuSpec,
              kind: str) -> list[Kernel]:
    """The TP collective before a column-parallel linear (``gather``) or after a row-parallel
    one (``scatter``): an all-gather / reduce-scatter under sequence parallel, else nothing /
    an all-reduce (two hops)."""
    sp = x.sp_tokens < x.tokens
    if kind == "gather":
        return _tp(("all-gather",) if sp else (), x, tp, cluster, gpu)
    return _tp(("reduce-scatter",) if sp else ("all-reduce",) * 2, x, tp, cluster, gpu)


def _attention_half(x: _Shape, tp: int, cluster: ClusterConfig, gpu: GpuSpec) -> PassKernels:
    """Layernorm, QKV, the attention core, the projection and its residual; W: their weights
    (re-gathering the QKV input under sequence parallel)."""
    t, e, h = x.tokens, x.e, x.hidden
    norm = 2 * e * x.sp_tokens * h
    qkv_bias = [] if x.fused else [streaming("qkv bias add", 2 * e * t * x.qkv, gpu)]
    forward = ([streaming("layernorm", norm, gpu)] + _gathered(x, tp, cluster, gpu, "gather")
               + _casts("FP8 casts (QKV, projection inputs)", x, (h, x.query), gpu)
               + [_linear("QKV GEMM", x, t, x.qkv, h, gpu)] + qkv_bias + _attention(x, gpu, False)
               + [_linear("projection GEMM", x, t, h, x.query, gpu)]
               + _gathered(x, tp, cluster, gpu, "scatter") + _residual(x, gpu, False))
    backward = (_residual(x, gpu, True) + _gathered(x, tp, cluster, gpu, "gather")
                + _casts("FP8 casts (QKV, projection output gradients)", x, (x.qkv, h), gpu)
                + [_linear("projection input gradient", x, t, x.query, h, gpu)]
                + _attention(x, gpu, True) + [_linear("QKV input gradient", x, t, h, x.qkv, gpu)]
                + _gathered(x, tp, cluster, gpu, "scatter")
                + [streaming("layernorm backward", 1.5 * norm, gpu)])
    main_grad = 8 if e == 2 else None  # the fp32 main gradient, read and written
    sp_gather = ("all-gather (W input)",) if x.sp_tokens < t else ()
    weight = (_tp(sp_gather, x, tp, cluster, gpu)
              + [_linear("QKV weight gradient", x, x.qkv, h, t, gpu, output_bytes=main_grad),
                 _linear("projection weight gradient", x, h, x.query, t, gpu,
                         output_bytes=main_grad)])
    return PassKernels(tuple(forward), tuple(backward), tuple(weight))


def _dense_mlp(x: _Shape, tp: int, cluster: ClusterConfig, gpu: GpuSpec) -> PassKernels:
    """FC1, the activation, FC2 (a MoE layer's shared experts), with their TP collectives."""
    t, e, h = x.tokens, x.e, x.hidden
    forward = (_gathered(x, tp, cluster, gpu, "gather")
               + _casts("FP8 casts (FC1, FC2 inputs)", x, (h, x.ffn), gpu)
               + [_linear("FC1 GEMM", x, t, x.fc1, h, gpu)] + _activation(x, gpu, False)
               + [_linear("FC2 GEMM", x, t, h, x.ffn, gpu)]
               + _gathered(x, tp, cluster, gpu, "scatter"))
    backward = (_gathered(x, tp, cluster, gpu, "gather")
                + _casts("FP8 casts (FC1, FC2 output gradients)", x, (x.fc1, h), gpu)
                + [_linear("FC2 input gradient", x, t, x.ffn, h, gpu)]
                + _activation(x, gpu, True)
                + [_linear("FC1 input gradient", x, t, h, x.fc1, gpu)]
                + _gathered(x, tp, cluster, gpu, "scatter"))
    main_grad = 8 if e == 2 else None
    sp_gather = ("all-gather (W input)",) if x.sp_tokens < t else ()
    weight = (_tp(sp_gather, x, tp, cluster, gpu)
              + [_linear("FC1 weight gradient", x, x.fc1, h, t, gpu, output_bytes=main_grad),
                 _linear("FC2 weight gradient", x, h, x.ffn, t, gpu, output_bytes=main_grad)])
    return PassKernels(tuple(forward), tuple(backward), tuple(weight))


def _all_to_all(name: str, x: _Shape, moe: _Experts, cluster: ClusterConfig,
                gpu: GpuSpec) -> list[Kernel]:
    """One token dispatch or combine over the EP ranks: each rank sends (EP-1)/EP of its
    routed copies, over NVLink inside a node, else over the inter-node links."""
    if moe.ep == 1:
        return []
    moved = (moe.ep - 1) / moe.ep * x.e * moe.routed * x.hidden
    bandwidth = cluster.inter_node_gbps if moe.ep > cluster.gpus_per_node else \
        cluster.intra_node_gbps
    return [transfer(name, moved, bandwidth, gpu)]


def _routed_experts(x: _Shape, moe: _Experts, cluster: ClusterConfig,
                    gpu: GpuSpec) -> PassKernels:
    """Router, permutation, all-to-all dispatch, the local experts' GEMMs (grouped: one
    product per expert, its share of the routed copies as rows), all-to-all combine and the
    weighted un-permutation. Routing is taken as balanced."""
    e, h = x.e, x.hidden
    rows = max(1, -(-moe.routed // moe.local))  # copies per local expert
    scores = 4 * x.sp_tokens * moe.experts       # fp32 router logits
    copies = e * moe.routed * h
    swiglu = "swiglu" if x.swiglu else "gelu"
    forward = ([gemm("router GEMM", x.sp_tokens, moe.experts, h, gpu, e),
                streaming("router softmax and top-k (fp32)", 3 * scores, gpu),
                streaming("token permutation", 2 * copies, gpu)]
               + _all_to_all("all-to-all dispatch", x, moe, cluster, gpu)
               + [gemm("expert FC1 GEMMs", rows, moe.fc1, h, gpu, e, batch=moe.local),
                  streaming(f"expert {swiglu}", e * moe.routed * (moe.fc1 + moe.ffn), gpu),
                  gemm("expert FC2 GEMMs", rows, h, moe.ffn, gpu, e, batch=moe.local)]
               + _all_to_all("all-to-all combine", x, moe, cluster, gpu)
               + [streaming("un-permutation and weighting", 3 * copies, gpu)])
    backward = ([streaming("un-permutation backward", 3 * copies, gpu)]
                + _all_to_all("all-to-all (combine backward)", x, moe, cluster, gpu)
                + [gemm("expert FC2 input gradients", rows, moe.ffn, h, gpu, e,
                        batch=moe.local),
                   streaming(f"expert {swiglu} backward", e * moe.routed * (2 * moe.fc1
                                                                          + moe.ffn), gpu),
                   gemm("expert FC1 input gradients", rows, h, moe.fc1, gpu, e,
                        batch=moe.local)]
                + _all_to_all("all-to-all (dispatch backward)", x, moe, cluster, gpu)
                + [streaming("permutation backward", 2 * copies, gpu),
                   streaming("router softmax backward", 3 * scores, gpu),
                   gemm("router input gradient", x.sp_tokens, h, moe.experts, gpu, e)])
    main_grad = 8 if e == 2 else None
    weight = [gemm("expert FC1 weight gradients", moe.fc1, h, rows, gpu, e, batch=moe.local,
                   output_bytes=main_grad),
              gemm("expert FC2 weight gradients", h, moe.ffn, rows, gpu, e, batch=moe.local,
                   output_bytes=main_grad),
              gemm("router weight gradient", moe.experts, h, x.sp_tokens, gpu, e,
                   output_bytes=main_grad)]
    return PassKernels(tuple(forward), tuple(backward), tuple(weight))


def _head(x: _Shape, tp: int, cluster: ClusterConfig, gpu: GpuSpec) -> PassKernels:
    """Final layernorm, the logits GEMM and the vocab-parallel cross entropy in fp32 (a cast,
    max, exp, sum and the loss: about five fp32 passes over the logits); its weight gradient
    is computed in B (the LM head's W is not deferred)."""
    t, e, h = x.tokens, x.e, x.hidden
    logits = t * x.vocab
    gather = _tp(("all-gather",) if x.sp_tokens < t else (), x, tp, cluster, gpu)
    forward = ([streaming("final layernorm", 2 * e * x.sp_tokens * h, gpu)] + gather
               + [gemm("logits GEMM", t, x.vocab, h, gpu, e),
                  streaming("cross entropy (fp32)", (e + 4 * 5) * logits, gpu)])
    backward = ([streaming("cross entropy backward", (4 + 4 + e) * logits, gpu),
                 gemm("logits input gradient", t, h, x.vocab, gpu, e),
                 gemm("LM head weight gradient", x.vocab, h, t, gpu, e,
                      output_bytes=8 if e == 2 else None)]
                + _tp(("reduce-scatter",) if x.sp_tokens < t else ("all-reduce",) * 2,
                      x, tp, cluster, gpu)
                + [streaming("final layernorm backward", 3 * e * x.sp_tokens * h, gpu)])
    return PassKernels(tuple(forward), tuple(backward), ())


def _embedding(x: _Shape, tp: int, cluster: ClusterConfig, gpu: GpuSpec) -> PassKernels:
    """Word and position lookup (then its TP reduction); backward: the scatter-add into the
    embedding's fp32 gradient."""
    rows = x.e * x.tokens * x.hidden
    forward = ([streaming("embedding lookup", 3 * rows, gpu)]
               + _tp(("reduce-scatter",) if x.sp_tokens < x.tokens else ("all-reduce",) * 2,
                     x, tp, cluster, gpu))
    backward = (_tp(("all-gather",) if x.sp_tokens < x.tokens else (), x, tp, cluster, gpu)
                + [streaming("embedding gradient scatter-add", rows + 8 * x.tokens * x.hidden,
                             gpu)])
    return PassKernels(tuple(forward), tuple(backward), ())


def part_kernels(model: ModelConfig, training: TrainingConfig, cluster: ClusterConfig, tp: int,
                 micro_batch_size: int, ep: int = 1) -> PartKernels:
    """The kernels of one microbatch's passes on one TP rank of ``tp`` (a MoE model's experts
    over ``ep`` ranks)."""
    gpu = cluster.gpu
    x = _shape(model, training, cluster, tp, micro_batch_size, ep)
    return PartKernels(_layer(x, tp, cluster, gpu), _head(x, tp, cluster, gpu),
                       _embedding(x, tp, cluster, gpu), tuple(_attention(x, gpu, False)), gpu)
