"""Bytes per GPU: activations kept for backward, parameters, gradients, optimizer state.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (section 4), term by term so that GQA, SwiGLU, fp32, dropout 0 and flash
attention change exactly the terms they touch. Per layer and microbatch (s tokens, b samples,
h hidden, f MLP width, a heads, e bytes per element, TP t, sp = t with sequence parallel else 1)::

    e sb (q + kv)/t   query, key, value (kv = key+value width; 2h without GQA; q = h but
                      where kv_channels sets the head width apart: Gemma-2)
    e sb q/t          attention-projection input
    e sb f/t x 2      MLP: activation-function input and second linear's input (SwiGLU 3f/t)
    e sb 4h/sp        two layernorm inputs, the QKV and first MLP linear inputs
    sb 2h/sp          two dropout masks, one byte each (dropout > 0; CPU torch: e bytes)
    e a s^2 b/t       softmax output; with dropout also its mask (1 byte) and output
                      flash attention instead: 4 a s b/t (fp32 softmax statistics);
                      megatron's unfused fp32 softmax in bf16 adds 4 a s^2 b/t (its fp32
                      output, TrainingConfig.fp32_softmax_copy)

which is sbh(34 + 5as/h)/t in bf16 with f = 4h, dropout, sequence parallel and no flash
attention. A MoE layer replaces the MLP terms (:func:`_mlp_bytes`): per token of the rank, k
routed copies of the expert input, first-linear output and second-linear input, the router's
fp32 logits and probabilities, and the shared experts as a dense MLP. Stage 0 adds the token and position ids (and the embedding dropout mask); the last
stage the final layernorm and LM head inputs and the loss's fp32 softmax, 4 sbV/t bytes.

With a B/W split (paper, section 2) W needs each linear layer's input and output gradient:
after B a chunk keeps those (:func:`activation_sizes`' ``wgrad``), after W nothing. The LM
head's weight gradient is computed in B (the plugin does not defer it), so the last stage
keeps nothing for W. A rank's peak is found by walking its schedule in order
(:func:`peak_activation_bytes`): F adds a chunk's activations, B replaces them by what W
needs, W frees that, a fused BW frees everything.

Each pass also allocates scratch bytes that it frees again (:class:`Workspace`): the
walk adds one layer's on top of the level while that pass runs, so the peak is what the CUDA
allocator sees, not only what saved-tensor hooks see (``vshape gpu-check`` measures both on a
GPU: docs/plan.md, "Workspace").

FP8 (``TrainingConfig.fp8``, :mod:`.fp8`): the linear layers keep their inputs (the QKV, FC1,
projection and FC2 inputs) in one byte, not e, and each layer adds its linears' FP8 weight
copies and amax histories to the static bytes.

Recomputation (:mod:`.recompute`): ``selective`` drops the attention term (softmax output,
its dropout mask and output; flash attention's statistics), ``full`` keeps only each layer's
input, e sb h/sp; either way B replays what was dropped, so while a B runs, one layer's
dropped bytes exist on top of the rank's level (``transient``), less what that backward has
freed before the replay: the LM head's bytes on the last stage, and under selective the
layer's bytes after the attention core (its MLP half; with small s they outweigh the scores
and the transient vanishes).

Parameters: mixed-precision Adam needs 2 (bf16 weight) + 4 (fp32 main gradient) + 12 (fp32
master weight and two moments) bytes per parameter; the distributed optimizer divides the 12
by DP (a MoE model's routed experts: by DP x TP / EP, their expert-data-parallel group). Column- and row-parallel matrices, column biases and the vocabulary are divided by TP;
layernorms, row-parallel biases and position embeddings are replicated.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from ..schedule.model.actions import PassKind
from ..schedule.model.schedule import Schedule
from . import fp8
from .model import ModelConfig
from .settings import TrainingConfig
from .shares import ChunkShare

__all__ = ["ActivationSizes", "ChunkBytes", "Workspace", "StaticMemory", "activation_sizes", "chunk_bytes",
           "peak_activation_bytes", "static_memory", "chunk_parameters"]


@dataclass(frozen=True)
class Workspace:
    """Bytes a pass allocates and frees again on top of what the rank keeps: invisible to the
    activations' level, visible to the allocator's peak (``vshape gpu-check`` measures both).
    Each is relative to the level at its moment: ``forward`` above the level after the layer's
    F, the others above the level when the pass begins."""

    forward: float = 0.0
    """A layer's F: the attention scores and the fp32 softmax input, alive until the softmax
    output exists, less what the layer keeps after its attention core."""
    backward: float = 0.0
    """A layer's fused BW: the softmax backward's gradients (or, with flash attention, the
    attention's and the MLP's input gradients), less what the MLP's backward freed first."""
    backward_split: float = 0.0
    """A layer's B under the B/W split: as ``backward``, but the MLP's backward keeps its
    linear inputs and adds their output gradients for W."""
    weight: float = 0.0
    """A layer's W: one weight-gradient GEMM's output before it is added to the main gradient
    (the largest linear's; they run one at a time)."""
    head_forward: float = 0.0
    """The LM head's F: its 16-bit logits before the loss's fp32 copy (nothing in fp32)."""
    head_backward: float = 0.0
    """The LM head's B, above the level when it begins (the head's bytes still in it): in 16
    bits the logits' gradient cast from the loss's fp32 one (e sbV/t), then the head's weight
    gradient (e hV/t, computed in B) beside it once the fp32 one is freed; in fp32 the loss's
    gradient reuses its softmax buffer, so only the weight gradient (4 hV/t). The probe
    measured 128 MiB (bf16) and 272 MiB (fp32) at gpu-check's V = 32768, s = h = 2048
    (docs/results/gpu-check/memory-probe.jsonl, ``"head": true``); below a layer's backward
    scratch there, it sets the last stage's B peak once the vocabulary is large."""


@dataclass(frozen=True)
class ActivationSizes:
    """Bytes one microbatch keeps for backward, per part of the model, on one TP rank."""

    layer: float
    """One transformer layer, from its forward to its backward."""
    wgrad: float
    """One transformer layer, from B to W: linear inputs and output gradients."""
    embedding: float
    head: float
    """Final layernorm, LM head and loss."""
    transient: float = 0.0
    """Recomputation: one layer's replayed bytes, alive while its fused backward runs, less
    what that backward freed before the replay."""
    transient_split: float = 0.0
    """The same for B under the B/W split, which keeps the linear layers' inputs and output
    gradients instead of freeing them."""
    workspace: Workspace = field(default_factory=Workspace)
    """What one layer's passes allocate and free again."""


@dataclass(frozen=True)
class ChunkBytes:
    """One chunk's activation bytes for one microbatch."""

    forward: float
    """Kept from F until B (or BW)."""
    wgrad: float
    """Kept from B until W."""
    transient: float = 0.0
    """Alive only while BW runs, on top of the level (recomputation)."""
    transient_split: float = 0.0
    """Alive only while B runs (B/W split), on top of the level."""
    workspace: Workspace = field(default_factory=Workspace)
    """The chunk's passes' workspace, relative to the chunk's level (F: above the level after
    the chunk's F; B and BW: after the LM head's backward freed the head's bytes)."""


@dataclass(frozen=True)
class StaticMemory:
    """Bytes that do not depend on the schedule, on one rank."""

    parameters: float
    """Parameters held (count, not bytes), routed experts included."""
    weights: float
    gradients: float
    optimizer: float
    expert_parameters: float = 0.0
    """Of ``parameters``, the routed experts' (reduced over the expert-data-parallel group)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class _MlpBytes:
    """What one layer's MLP keeps, per microbatch on one rank (dense or MoE)."""

    kept: float
    """From F to B, beyond the MLP input (counted with the layernorms)."""
    activation_input: float
    """The activation function's input (selective recomputation frees it early)."""
    w_inputs: float
    """What W needs besides the first linear's input: the second linear's input."""
    output_grads: float
    """The linears' output gradients W needs."""


def _mlp_bytes(model: ModelConfig, training: TrainingConfig, tokens: int, tp: int,
               sp: int) -> _MlpBytes:
    """Dense: the first linear's output and the second's input, split by TP. MoE (expert
    tensor parallel 1): each of the s b / sp tokens of this rank is routed to k experts, whose
    inputs, first-linear outputs and second-linear inputs are kept per copy (balanced routing
    brings as many tokens to a rank's experts as it sends), plus the router's fp32 logits and
    probabilities; shared experts are a dense MLP of their width, split by TP."""
    e, h = training.element_bytes, model.hidden_size
    wide = 2 if model.swiglu else 1
    if not model.moe:
        f, lin = model.ffn, training.linear_input_bytes  # FC2's input: FP8 under --fp8
        return _MlpBytes(tokens * (e * wide * f + lin * f) / tp, e * tokens * wide * f / tp,
                         lin * tokens * f / tp, e * tokens * (wide * f / tp + h))
    routed = tokens / sp * model.moe_router_topk
    fe, fs = model.expert_ffn, model.shared_ffn
    router = 4 * tokens / sp * model.num_experts
    shared = e * tokens * (wide * fs + fs) / tp
    return _MlpBytes(
        e * routed * (h + wide * fe + fe) + 2 * router + shared,
        e * routed * wide * fe + e * tokens * wide * fs / tp,
        e * routed * (h + fe) + e * tokens * fs / tp,
        e * routed * (wide * fe + h) + router + (e * tokens * (wide * fs / tp + h) if fs else 0))


def activation_sizes(model: ModelConfig, training: TrainingConfig, tp: int,
                     micro_batch_size: int, recompute: str = "none") -> ActivationSizes:
    """The Korthikanti et al. terms of the module docstring, for one microbatch, under
    ``recompute`` (none, selective or full)."""
    e, s, b = training.element_bytes, training.seq_length, micro_batch_size
    h, a, q = model.hidden_size, model.num_attention_heads, model.query_width
    kv = 2 * model.query_groups * model.head_dim
    sp = tp if training.sequence_parallel and tp > 1 else 1
    tokens = training.rank_tokens * b  # s b / CP: context parallelism splits every term
    mlp = _mlp_bytes(model, training, tokens, tp, sp)
    lin = training.linear_input_bytes  # a linear's saved input: one byte under FP8
    split = tokens * (e * (q + kv) + lin * q) / tp + mlp.kept
    replicated = (2 * e + 2 * lin) * tokens * h / sp  # layernorm inputs, QKV and FC1 inputs
    mask = training.dropout_mask_bytes if training.dropout else 0
    masks = 2 * mask * tokens * h / sp
    if training.flash_attention:
        attention = 4 * a * tokens / tp
    else:
        scores = a * s * tokens / tp
        attention = e * scores + ((mask + e) * scores if training.dropout else 0.0)
        if training.fp32_softmax_copy and e < 4:
            attention += 4 * scores
    inputs = lin * tokens * (2 * h / sp + q / tp) + mlp.w_inputs
    output_grads = e * tokens * ((q + kv) / tp + h) + mlp.output_grads
    ids = 2 * 8 * tokens  # int64 token and position ids
    embedding = ids + mask * tokens * h / sp
    head = 2 * e * tokens * h / sp + 4 * tokens * model.vocab_size / tp + 9 * tokens
    layer = split + replicated + masks + attention
    wgrad = inputs + output_grads
    # what the layer keeps after its attention core: the projection's input, the second
    # layernorm's and the first MLP linear's inputs, the MLP, both dropout masks
    after_core = lin * tokens * q / tp + (e + lin) * tokens * h / sp + mlp.kept + masks
    attention_scratch, workspace = _layer_workspace(model, training, tokens, tp, mlp)

    def forward_dropping(dropped: float) -> Workspace:
        # at the softmax the layer holds what recomputation then drops and the scratch bytes,
        # but not yet what it keeps after the attention core
        forward = max(0.0, attention_scratch + dropped - after_core)
        return dataclasses.replace(workspace, forward=forward)

    if recompute == "selective":
        # the replay runs after B went through the layer's MLP half: a fused backward has
        # freed that half by then; a split B keeps its linear inputs and adds their output
        # gradients (and the attention projection's) for W
        freed = mlp.activation_input + e * tokens * h / sp + masks
        after = freed + lin * tokens * q / tp + mlp.w_inputs + lin * tokens * h / sp
        kept = mlp.output_grads + e * tokens * h
        return ActivationSizes(layer - attention, wgrad, embedding, head,
                               transient=max(0.0, attention - after),
                               transient_split=max(0.0, attention - freed + kept),
                               workspace=forward_dropping(attention))
    if recompute == "full":
        kept = e * tokens * h / sp
        return ActivationSizes(kept, wgrad, embedding, head, transient=layer - kept,
                               transient_split=layer - kept,
                               workspace=forward_dropping(layer - kept))
    return ActivationSizes(layer, wgrad, embedding, head,
                           workspace=forward_dropping(0.0))


def _layer_workspace(model: ModelConfig, training: TrainingConfig, tokens: int, tp: int,
                     mlp: _MlpBytes) -> tuple[float, Workspace]:
    """Scratch bytes of one layer's passes and of the LM head's forward (see :class:`Workspace`):
    the attention's forward scratch (before what the layer keeps is taken off it) and the
    :class:`Workspace` of every other pass.

    Measured by the CUDA allocator on megatron's unfused attention (``vshape gpu-check``, whose
    ``scripts/gpu/memory_probe.py`` measures one layer's passes): its F holds the scores (e bytes)
    and, in bf16, their fp32 copy (4) until the softmax output exists; its backward holds
    three fp32-or-e-byte score-sized gradients at once (the probabilities' gradient, the
    softmax's and the mask's input gradients) after the 16-bit probabilities were freed.
    Before that, the MLP's backward holds two activation-width gradients. Flash attention
    keeps no score-sized tensor: its backward holds the query, key and value gradients and an
    fp32 query-gradient accumulator (derived from its algorithm, not measured here)."""
    e, s = training.element_bytes, training.seq_length
    h, a, q = model.hidden_size, model.num_attention_heads, model.query_width
    kv = 2 * model.query_groups * model.head_dim
    mlp_backward = 2 * mlp.activation_input
    if training.flash_attention:
        attention_forward = 0.0
        attention_backward = e * tokens * (q + kv) / tp + 4 * tokens * q / tp
    else:
        scores = a * s * tokens / tp
        copy = training.fp32_softmax_copy and e < 4
        softmax = 4 if copy else e
        attention_forward = e * scores + (4 * scores if copy else 0.0)
        attention_backward = 3 * softmax * scores - (e * scores if copy else 0.0)
    backward = max(mlp_backward, attention_backward - mlp.kept)
    backward_split = max(mlp_backward,
                         attention_backward - mlp.activation_input + mlp.output_grads)
    f = model.expert_ffn if model.moe else model.ffn
    wide = 2 if model.swiglu else 1
    weight = e * max(h * (q + kv), h * wide * f, h * f) / tp  # the largest linear's
    vocab = model.vocab_size / tp
    head_forward = e * tokens * vocab if e < 4 else 0.0
    head_backward = max(e * tokens * vocab, e * (tokens + h) * vocab - 4 * tokens * vocab) \
        if e < 4 else 4 * h * vocab
    return attention_forward, Workspace(0.0, backward, backward_split, weight, head_forward,
                                        head_backward)


def chunk_bytes(share: ChunkShare, sizes: ActivationSizes) -> ChunkBytes:
    """One chunk's bytes; its B replays the last layer after the LM head's backward has freed
    the head's bytes."""
    forward = (share.layers * sizes.layer + share.embedding * sizes.embedding
               + share.head * sizes.head)
    head = share.head * sizes.head
    ws = sizes.workspace
    head_forward = share.head * ws.head_forward
    head_backward = share.head * ws.head_backward
    if not share.layers:
        return ChunkBytes(forward, 0.0, workspace=Workspace(
            forward=head_forward, backward=head_backward, backward_split=head_backward))
    # the last layer's F peaks before the head adds its bytes; its backward runs after the
    # head's backward freed them
    workspace = Workspace(max(ws.forward - head, head_forward),
                          max(0.0, ws.backward - head, head_backward),
                          max(0.0, ws.backward_split - head, head_backward), ws.weight)
    return ChunkBytes(forward, share.layers * sizes.wgrad, max(0.0, sizes.transient - head),
                      max(0.0, sizes.transient_split - head), workspace)


def peak_activation_bytes(schedule: Schedule, chunks: Sequence[Sequence[ChunkBytes]],
                          workspace: bool = True) -> tuple[float, ...]:
    """Per rank, the most activation bytes alive at once while running its order.

    ``chunks[rank][chunk]``: that chunk's :class:`ChunkBytes`. B can also grow memory (with
    large TP the gathered output gradients W keeps outweigh what B frees); under
    recomputation a B (or BW) briefly holds one layer's replayed bytes on top of the level.
    ``workspace``: add each pass's scratch bytes (:class:`Workspace`), what the allocator's
    peak sees; without, the bytes kept for backward only (what saved-tensor hooks see).
    """
    peaks, none = [], Workspace()
    for rank in range(schedule.ranks):
        level = peak = 0.0
        for action in schedule.compute_actions(rank):
            chunk = chunks[rank][schedule.placement.locate(action.stage)[1]]
            ws = chunk.workspace if workspace else none
            if action.kind is PassKind.B:
                peak = max(peak, level + chunk.transient_split + ws.backward_split)
            elif action.kind is PassKind.BW:
                peak = max(peak, level + chunk.transient + ws.backward)
            elif action.kind is PassKind.W:
                peak = max(peak, level + ws.weight)
            if action.kind is PassKind.F:
                level += chunk.forward
                peak = max(peak, level + ws.forward)
            elif action.kind is PassKind.B:
                level += chunk.wgrad - chunk.forward
            elif action.kind is PassKind.W:
                level -= chunk.wgrad
            else:  # BW
                level -= chunk.forward
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def _layer_parameters(model: ModelConfig, tp: int) -> float:
    """One layer's parameters on one TP rank but its routed experts (with them, sums to
    ``model.layer_parameters()`` at TP 1)."""
    h, f, q = model.hidden_size, model.ffn, model.query_width
    kv = 2 * model.query_groups * model.head_dim
    if model.moe:  # router (replicated), shared experts (TP-split, no biases)
        fs = model.shared_ffn
        attention = (h * (q + kv) + (q + kv) + q * h) / tp + h + 4 * h
        return attention + h * model.num_experts + (3 if model.swiglu else 2) * h * fs / tp
    mlp_in = 2 * f if model.swiglu else f
    column = h * (q + kv) + (q + kv) + h * mlp_in + mlp_in  # QKV and first MLP linear
    row = q * h + f * h                                      # their weights only
    replicated = 2 * h + 4 * h                               # row biases, two layernorms
    return (column + row) / tp + replicated


def chunk_parameters(model: ModelConfig, share: ChunkShare, tp: int, seq_length: int,
                     single_chunk_model: bool = False) -> float:
    """Parameters of one chunk on one TP rank.

    The LM head holds its own copy of the word embedding unless embeddings are tied and the
    whole model is one chunk (with a pipeline, megatron keeps a tied copy on the last stage,
    and the V keeps two Parameters on rank 0).
    """
    h, vocab = model.hidden_size, model.vocab_size
    count = share.layers * _layer_parameters(model, tp)
    if share.embedding:
        positions = max(seq_length, model.max_position_embeddings or 0)
        count += vocab * h / tp + positions * h
    if share.head:
        count += 2 * h
        tied_here = share.embedding and not model.untie_embeddings_and_output_weights
        if not (tied_here and single_chunk_model):
            count += vocab * h / tp
    return count


def static_memory(model: ModelConfig, training: TrainingConfig, chunks: Sequence[ChunkShare],
                  tp: int, dp: int, single_chunk_model: bool = False,
                  ep: int = 1) -> StaticMemory:
    """Weights, main gradients and optimizer state of one rank's chunks. Routed experts are
    split over ``ep`` ranks (not TP), and the distributed optimizer shards their state over
    the expert-data-parallel group, DP x TP / EP ranks."""
    dense = sum(chunk_parameters(model, c, tp, training.seq_length, single_chunk_model)
                for c in chunks)
    experts = sum(c.layers for c in chunks) * model.expert_parameters() / ep
    weight, grad, optimizer = training.parameter_bytes
    state = optimizer * (dense + experts)
    if training.distributed_optimizer:
        state = optimizer * (dense / dp + experts / (dp * tp / ep))
    count = dense + experts
    copies = 0.0
    if training.fp8:  # the FP8 weight copies and amax histories of the layers' linears
        layers = sum(c.layers for c in chunks)
        copies = layers * (fp8.WEIGHT_COPY_BYTES * _linear_weights(model) / tp
                           + fp8.LINEARS_PER_LAYER * fp8.AMAX_BYTES_PER_LINEAR)
    return StaticMemory(count, count * weight + copies, count * grad, state, experts)


def _linear_weights(model: ModelConfig) -> int:
    """One layer's FP8-cast linear weights (no TP): QKV, projection and the dense MLP (a MoE
    layer's shared experts; its routed experts stay 16-bit here)."""
    h, q = model.hidden_size, model.query_width
    kv = 2 * model.query_groups * model.head_dim
    f = model.shared_ffn if model.moe else model.ffn
    return h * (q + kv) + q * h + (3 if model.swiglu else 2) * h * f
