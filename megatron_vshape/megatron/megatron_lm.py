"""Megatron-LM glue (tag core_v0.16.1 and the 0.19-era training code): the flags, their checks,
and a V-aware model provider, batch and forward step for ``scripts/pretrain_gpt_vshape.py``.

Nothing here imports ``megatron.training``: the parts that can be tested on CPU (arguments,
provider, batch, forward step) take plain values. What must change inside Megatron-LM's own
functions is megatron_lm_patch.py's job.

Under a V, pipeline rank 0 holds both ends of the model (embedding and LM head), so it needs
the tokens *and* the labels of every microbatch; the other ranks read no data, except the
documents' boundaries of packed sequences (--sft), which every stage's attention needs.
"""
from __future__ import annotations

import argparse
import inspect
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from ..schedule.model.limits import MemoryLimit
from ..schedule.registry import SCHEDULES, VARIANTS
from ..schedule.names import PLUGIN_SCHEDULES, V_SCHEDULES
from .forward_backward import replans
from .install import VShapeConfig

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "check_arguments", "vshape_config", "VChunkProvider",
           "VBatch", "VForwardStep", "is_v_dataset_rank", "packed_seq_params",
           "deferred_standard_provider", "check_weight_grads_split", "weights_kept_in_b"]



def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the plugin's flags."""
    group = parser.add_argument_group("megatron-vshape", "pipeline schedules (arXiv 2405.15362)")
    group.add_argument("--pipeline-schedule", default="1f1b", choices=SCHEDULES,
                       help="1f1b and interleaved-1f1b are megatron's own; zb-1p, v-min, v-half, "
                            "v-zb and auto (fastest under --pipeline-memory-limit) the plugin's")
    group.add_argument("--pipeline-memory-limit", default=None,
                       help="auto: peak activation memory per GPU, a fraction of 1F1B's (0.5) "
                            "or bytes (40GiB)")
    group.add_argument("--pipeline-replan-after", type=int, default=3,
                       help="auto, zb-1p, v-min, v-half, v-zb: profile this many iterations, then "
                            "re-plan from the measured costs and memory, keeping the schedule's "
                            "memory level (0: never; default 3)")
    group.add_argument("--pipeline-schedule-variant", default="fastest", choices=VARIANTS,
                       help="zb-1p, v-min, v-half, v-zb: fastest (the fastest order within the "
                            "schedule's memory bound for the measured costs) or paper (the "
                            "paper's fixed order, never re-planned); default fastest")
    group.add_argument("--pipeline-p2p-timeout", type=float, default=600.0,
                       help="seconds a pipeline send/receive may wait before failing with rank, "
                            "step and action (default 600)")
    # distributed-optimizer checkpoints that load under any schedule (checkpoints.py)
    parser.set_defaults(dist_ckpt_optim_fully_reshardable=True)
    group.add_argument("--dist-ckpt-optim-dp-reshardable", dest="dist_ckpt_optim_fully_reshardable",
                       action="store_false",
                       help="save distributed-optimizer state in megatron's default dp_reshardable "
                            "format (per gradient bucket: it only loads under a schedule of the "
                            "same chunk layout, and the same TP/PP); the default here is "
                            "--dist-ckpt-optim-fully-reshardable")
    return parser


@dataclass(frozen=True)
class _Refusal:
    """A flag combination the V cannot run: when it applies and what to tell the user."""

    applies: Callable[[Any], bool]
    message: str


_V_REFUSALS = (
    _Refusal(lambda a: a.pipeline_model_parallel_size < 2,
             "needs --pipeline-model-parallel-size >= 2 (there is no pipeline); use "
             "--pipeline-schedule 1f1b"),
    _Refusal(lambda a: (a.num_layers or 0) < 2 * a.pipeline_model_parallel_size,
             "places 2 stages on each rank: --num-layers must be >= 2 x "
             "--pipeline-model-parallel-size"),
    _Refusal(lambda a: a.num_layers_per_virtual_pipeline_stage is not None
             or a.num_virtual_stages_per_pipeline_rank is not None,
             "places two chunks per rank itself: drop --num-layers-per-virtual-pipeline-stage / "
             "--num-virtual-stages-per-pipeline-rank (they select interleaved-1f1b)"),
    _Refusal(lambda a: a.pipeline_model_parallel_layout is not None,
             "cannot be expressed by --pipeline-model-parallel-layout (stage s lives on rank "
             "s %% p there): drop it"),
    _Refusal(lambda a: a.decoder_first_pipeline_num_layers is not None
             or a.decoder_last_pipeline_num_layers is not None
             or a.account_for_embedding_in_pipeline_split or a.account_for_loss_in_pipeline_split,
             "balances rank 0 (embedding and LM head) by giving it fewer layers when --num-layers "
             "is not a multiple of 2 x PP (the paper: num_layers = k x PP - 2): drop "
             "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split"),
    _Refusal(lambda a: bool(getattr(a, "mtp_num_layers", None)),
             "does not support multi-token prediction (--mtp-num-layers) yet: under a V the "
             "MTP block would sit in rank 0's chunk 1 beside the LM head with its own copy of "
             "the word embedding, a third copy of the tied weight that the V's tying "
             "(model.tie_embeddings, sum_tied_embedding_grads) does not keep equal, and no "
             "test covers MTP's loss under the B/W split: drop --mtp-num-layers, or use "
             "--pipeline-schedule 1f1b"),
    _Refusal(lambda a: getattr(a, "save", None) is not None
             and not getattr(a, "untie_embeddings_and_output_weights", False)
             and getattr(a, "ckpt_format", "torch_dist") == "torch_dist"
             and getattr(a, "ckpt_fully_parallel_save", False) and _data_parallel_size(a) > 1,
             "cannot save a checkpoint with tied embeddings under data parallelism with "
             "megatron's fully parallel save: rank 0 holds the embedding (chunk 0) and its "
             "tied copy in the LM head (chunk 1), and the fully parallel save makes both the "
             "main replica on one data-parallel rank, which dist_checkpointing refuses "
             "(\"Invalid access pattern ... embedding.word_embeddings.weight\") at the first "
             "save: add --untie-embeddings-and-output-weights or --no-ckpt-fully-parallel-save"
             " (data parallel > 1 comes with expert parallelism too)"),
)


def _data_parallel_size(args) -> int:
    """Data-parallel size from the world and model-parallel sizes (check_arguments runs before
    Megatron-LM's validate_args computes args.data_parallel_size)."""
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * \
        getattr(args, "context_parallel_size", 1)
    return max(1, getattr(args, "world_size", model) // model)


def _on(args, *names) -> bool:
    """Whether any of these Megatron-LM flags is set (a flag one version lacks is off)."""
    return any(getattr(args, name, None) not in (None, False, 0, "none", [], ()) for name in names)


def _moe(args) -> bool:
    """Whether the model has MoE layers (--num-experts)."""
    return bool(getattr(args, "num_experts", None))


_TESTED_BALANCING = {"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}
"""MoE load-balancing types the real-loop tier runs under the plugin's schedules."""


def _balancing(args) -> list:
    """--moe-router-load-balancing-type as a list (one name, or one per layer group)."""
    value = getattr(args, "moe_router_load_balancing_type", "aux_loss") or "aux_loss"
    return [value] if isinstance(value, str) else list(value)


_PIPELINE_REFUSALS = (
    _Refusal(lambda a: getattr(a, "context_parallel_size", 1) > 1,
             "is not tested with context parallelism (megatron's attention needs Transformer "
             "Engine for it, so no CPU test runs it): use --context-parallel-size 1, or "
             "--pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "hybrid_context_parallel"),
             "does not support --hybrid-context-parallel (packs of varying length over dynamic "
             "context-parallel groups, run by megatron's own schedule): drop it, or use "
             "--pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "use_legacy_models"),
             "runs megatron-core models only: drop --use-legacy-models"),
    _Refusal(lambda a: _on(a, "use_torch_fsdp2", "use_megatron_fsdp"),
             "needs megatron's DistributedDataParallel (its W passes call DDP's gradient hooks): "
             "drop --use-torch-fsdp2 / --use-megatron-fsdp, or use --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "delay_wgrad_compute"),
             "splits B and W itself (--delay-wgrad-compute is megatron's MoE overlap): drop it"),
    _Refusal(lambda a: _on(a, "overlap_moe_expert_parallel_comm", "combined_1f1b",
                           "overlap_dispatch_backward_with_experts_wgrad",
                           "ep_overlap_early_attn_memory_release"),
             "does not run megatron's combined 1F1B for MoE communication overlap (its own "
             "schedule plan): drop --overlap-moe-expert-parallel-comm / --combined-1f1b / "
             "--overlap-dispatch-backward-with-experts-wgrad / "
             "--ep-overlap-early-attn-memory-release, or use --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "defer_embedding_wgrad_compute"),
             "does not support --defer-embedding-wgrad-compute (megatron's own schedules drain "
             "the LM head's deferred weight gradients at the flush; ours never would, and the "
             "LM head would get no gradient): drop it"),
    _Refusal(lambda a: _on(a, "fp8", "fp4"),
             "is not tested with FP8 or FP4 training (--fp8-format / --fp4-format: Transformer "
             "Engine's scaling state and cached low-precision weights under the B/W split run "
             "on GPUs only, untested): drop it, or use --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "tp_comm_overlap"),
             "does not support --tp-comm-overlap (Transformer Engine overlaps the weight-"
             "gradient GEMM with tensor-parallel communication inside the fused backward the "
             "B/W split takes apart): drop it, or use --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph"),
             "does not support CUDA graphs (--cuda-graph-impl, --enable-cuda-graph, "
             "--external-cuda-graph: megatron captures them in its own schedules' pass order): "
             "use --cuda-graph-impl none, or --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "fine_grained_activation_offloading", "cpu_offloading"),
             "does not support activation offloading (--fine-grained-activation-offloading: it "
             "offloads and reloads in megatron's pass order): drop it, or use "
             "--pipeline-schedule 1f1b"),
    _Refusal(lambda a: _on(a, "overlap_param_gather_with_optimizer_step"),
             "starts every chunk's parameter all-gather at the start of a step: drop "
             "--overlap-param-gather-with-optimizer-step (megatron's interleaved schedule's; "
             "--overlap-param-gather works)"),
    _Refusal(lambda a: _on(a, "overlap_p2p_comm_warmup_flush",
                           "microbatch_group_size_per_vp_stage"),
             "runs its own pass order: drop --overlap-p2p-communication-warmup-flush / "
             "--microbatch-group-size-per-virtual-pipeline-stage (megatron's interleaved "
             "schedule's; they would be ignored)"),
    _Refusal(lambda a: _on(a, "use_ring_exchange_p2p", "pipeline_model_parallel_comm_backend"),
             "runs its own point-to-point communication (async sends and receives, one process "
             "group per stream, the default backend): drop --use-ring-exchange-p2p / "
             "--pipeline-model-parallel-comm-backend (they would be ignored)"),
    _Refusal(lambda a: _moe(a) and _on(a, "moe_grouped_gemm")
             and (getattr(a, "transformer_impl", "") != "transformer_engine"
                  or _on(a, "moe_use_legacy_grouped_gemm")),
             "runs grouped-GEMM experts (--moe-grouped-gemm) as Transformer Engine's "
             "GroupedLinear only (--transformer-impl transformer_engine: TEGroupedMLP, whose "
             "weight gradients TE's own split runs in W); megatron's legacy GroupedMLP "
             "(--moe-use-legacy-grouped-gemm, or --transformer-impl local with megatron-core "
             "0.16) computes them inside the grouped_gemm package's GEMM, which no split "
             "covers: use --transformer-impl transformer_engine, or drop --moe-grouped-gemm "
             "(SequentialMLP experts, whose fc1/fc2 weight gradients run in W), or use "
             "--pipeline-schedule 1f1b"),
    _Refusal(lambda a: _moe(a) and getattr(a, "moe_token_dispatcher_type", "allgather")
             not in ("allgather", "alltoall"),
             "is tested with the allgather and alltoall token dispatchers only (the flex "
             "dispatcher's DeepEP / HybridEP kernels run on GPUs only): use "
             "--moe-token-dispatcher-type alltoall, or --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _moe(a) and not set(_balancing(a)) <= _TESTED_BALANCING,
             "is tested with the load-balancing types aux_loss, seq_aux_loss, global_aux_loss "
             "and none (not sinkhorn): choose one of those with "
             "--moe-router-load-balancing-type, or use --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _moe(a) and _on(a, "moe_shared_expert_overlap"),
             "does not support --moe-shared-expert-overlap (it overlaps the shared expert with "
             "the dispatch on a side CUDA stream, untested under the B/W split): drop it, or "
             "use --pipeline-schedule 1f1b"),
    _Refusal(lambda a: _moe(a) and _on(a, "moe_paged_stash"),
             "does not support --moe-paged-stash (megatron-core 0.19: megatron's schedules "
             "reset the stash every step, pipeline_parallel/schedules.py:738; ours do not): "
             "drop it, or use --pipeline-schedule 1f1b"),
)

"""Refused under every schedule of the plugin (V and zb-1p): what changes how megatron's own
schedules run passes or their communication, or is untested under the B/W split."""

_ZB_REFUSALS = ()
"""zb-1p's own (none at present; MoE's are in _PIPELINE_REFUSALS)."""


def check_arguments(args) -> None:
    """Refuse bad flag combinations at argument parsing, naming the flag and what to change."""
    name = args.pipeline_schedule
    if name not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {name!r} is unknown; valid choices: "
                         f"{', '.join(SCHEDULES)}")
    vp = (args.num_layers_per_virtual_pipeline_stage is not None
          or args.num_virtual_stages_per_pipeline_rank is not None
          or args.pipeline_model_parallel_layout is not None)
    if name == "interleaved-1f1b" and not vp:
        raise ValueError("--pipeline-schedule interleaved-1f1b needs "
                         "--num-virtual-stages-per-pipeline-rank (e.g. 2)")
    if name in ("1f1b", "zb-1p") and vp and args.num_virtual_stages_per_pipeline_rank != 1:
        raise ValueError(f"--pipeline-schedule {name} runs one chunk per rank; with virtual "
                         "pipeline stages use --pipeline-schedule interleaved-1f1b")
    if name == "zb-1p" and args.pipeline_model_parallel_size < 2:
        raise ValueError("--pipeline-schedule zb-1p needs --pipeline-model-parallel-size >= 2")
    refusals = (_V_REFUSALS if name in V_SCHEDULES else _ZB_REFUSALS if name == "zb-1p"
                else ()) + (_PIPELINE_REFUSALS if name in PLUGIN_SCHEDULES else ())
    for refusal in refusals:
        if refusal.applies(args):
            raise ValueError(f"--pipeline-schedule {name} " + refusal.message.replace("%%", "%"))
    if args.pipeline_memory_limit is not None:
        if name != "auto":
            raise ValueError("--pipeline-memory-limit applies to --pipeline-schedule auto only "
                             f"(got {name}); fixed schedules have fixed memory")
        MemoryLimit.parse(args.pipeline_memory_limit, "--pipeline-memory-limit")
    if args.pipeline_replan_after < 0:
        raise ValueError(f"--pipeline-replan-after must be >= 0 (0 = never), got "
                         f"{args.pipeline_replan_after}")
    if args.pipeline_p2p_timeout <= 0:
        raise ValueError(f"--pipeline-p2p-timeout must be > 0 seconds, got "
                         f"{args.pipeline_p2p_timeout}")


def vshape_config(args) -> VShapeConfig:
    """The plugin's configuration from checked arguments."""
    auto = args.pipeline_schedule == "auto"
    variant = args.pipeline_schedule_variant
    return VShapeConfig(schedule=args.pipeline_schedule,
                        memory_limit=args.pipeline_memory_limit if auto else None,
                        replan_after=args.pipeline_replan_after
                        if replans(args.pipeline_schedule, variant) else 0,
                        variant=variant,
                        losses_on_last_rank=True, timeout=args.pipeline_p2p_timeout)


# -- model ---------------------------------------------------------------------------------------
class VChunkProvider:
    """Megatron-LM's ``model_provider`` for the V: get_model calls it once per vp stage with
    pre/post flags for megatron's loop order, which are wrong for a V; this builds chunk
    ``vp_stage`` of the V instead (model.build_v_chunk) and, with chunk 1, ties the embeddings
    and defers the weight gradients of both chunks (DDP with delay_wgrad_compute wraps them).

    ``base(pre_process=, post_process=, vp_stage=, config=, pg_collection=)`` builds one GPT
    chunk (Megatron-LM's ``partial(model_provider, gpt_builder)``); ``config_factory()`` gives
    the TransformerConfig (``core_transformer_config_from_args(get_args())``).
    """

    def __init__(self, base: Callable, config_factory: Callable, te_delay_wgrad: bool = False):
        self.base = base
        self.config_factory = config_factory
        self.te_delay_wgrad = te_delay_wgrad
        self._chunk0 = None

    def __call__(self, pre_process=True, post_process=True, vp_stage=None, config=None,
                 pg_collection=None):
        from megatron.core.process_groups_config import ProcessGroupCollection

        from .model import build_v_chunk, finish_v_chunks, v_chunk_config

        if vp_stage not in (0, 1):
            raise ValueError(f"a V chunk is vp stage 0 or 1, got {vp_stage!r}: V schedules need "
                             "virtual_pipeline_model_parallel_size = 2 (patch_megatron_lm)")
        pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        config = v_chunk_config(config or self.config_factory(), pg.pp.size(),
                                self.te_delay_wgrad)
        chunk = build_v_chunk(self._base_provider, config, vp_stage, pg)
        if vp_stage == 0:
            self._chunk0 = chunk
        else:
            finish_v_chunks(self._chunk0, chunk, ddp_delay_wgrad=True)
            for built in (self._chunk0, chunk):
                check_weight_grads_split(built, "v-min/v-half/v-zb/auto")
            self._chunk0 = None
        return chunk

    def _base_provider(self, config, pre_process, post_process, vp_stage, pg_collection):
        return self.base(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                         config=config, pg_collection=pg_collection)


def deferred_standard_provider(base: Callable, config_factory: Callable | None = None,
                               te_delay_wgrad: bool = False) -> Callable:
    """zb-1p: megatron's own placement, weight gradients deferred to W, by the same two
    mechanisms as V chunks: the local spec's parallel linears by our B/W split (wgrad.py),
    Transformer Engine's linears by TE's own (``te_delay_wgrad``: the model is built with
    delay_wgrad_compute on a copy of its config, and W calls their ``backward_dw``).
    ``config_factory()`` gives the TransformerConfig when get_model passes none."""
    from ..runtime.wgrad import WeightGradStore
    from .wgrad import defer_weight_grads, with_te_delay_wgrad

    def provider(*args, **kwargs):
        if te_delay_wgrad:
            config = kwargs.get("config") or config_factory()
            kwargs = dict(kwargs, config=with_te_delay_wgrad(config))
        model = base(*args, **kwargs)
        defer_weight_grads(model, WeightGradStore(), mark_for_ddp=True)
        check_weight_grads_split(model, "zb-1p")
        return model
    return provider


def check_weight_grads_split(chunk, schedule: str) -> None:
    """Refuse a model chunk whose W passes would do nothing (no layer splits its weight
    gradient off B: the schedule would run with 1F1B's bubble, silently), and warn about
    weights whose gradients stay in B (layer types neither split covers)."""
    from .wgrad import te_wgrad_modules

    te = te_wgrad_modules(chunk)
    split = sum(bool(getattr(p, "skip_backward_post_hook", False)) for p in chunk.parameters())
    if not split and not te:
        raise ValueError(
            f"--pipeline-schedule {schedule} computes weight gradients in W passes, but no layer "
            "of this model splits them off B (the split covers megatron's Column/RowParallel"
            "Linear of --transformer-impl local, and Transformer Engine linears built with "
            "delay_wgrad_compute): use megatron's GPT layer specs with --transformer-impl "
            "local or transformer_engine, or --pipeline-schedule 1f1b")
    kept = weights_kept_in_b(chunk, te)
    if kept:
        log.warning("[vshape] %s: these layers compute their weight gradients in B, not W "
                    "(neither the local split nor TE's covers them): %s", schedule,
                    ", ".join(sorted(kept)))


_IN_B_BY_DESIGN = ("Embedding", "Router")
"""Layer types whose weight gradients stay in B on purpose: embeddings (a sparse, cheap
gradient) and MoE routers (TopKRouter's hidden x num_experts gate: its gradient GEMM is
num_experts / (2 x topk x expert FFN size) of the experts' in the same layer, 0.01 % for 8
experts top-2 of FFN size 14336, and megatron computes it inside its own autograd Function,
moe_utils.RouterGatingLinearFunction, which the local split does not reach); the LM head
(``output_layer``) too (wgrad.defer_weight_grads says why). The experts' fc1/fc2
(SequentialMLP, shared experts) are megatron's Column/RowParallelLinear and run their weight
gradients in W."""


def weights_kept_in_b(chunk, te_modules) -> set:
    """Type names of the chunk's layers with matrix weights that neither split defers."""
    head = getattr(chunk, "output_layer", None)
    covered = {id(m) for m in te_modules}
    kept = set()
    for module in chunk.modules():
        if module is head or id(module) in covered or \
                any(name in type(module).__name__ for name in _IN_B_BY_DESIGN):
            continue
        if any(p.dim() >= 2 and p.requires_grad and not getattr(p, "skip_backward_post_hook",
                                                                  False)
               for p in module.parameters(recurse=False)):
            kept.add(type(module).__name__)
    return kept


# -- data ----------------------------------------------------------------------------------------
def is_v_dataset_rank(packed: bool = False) -> bool:
    """Under a V only pipeline rank 0 (both ends of the model) reads data, on TP rank 0; with
    packed sequences (``--sft``) every pipeline rank does, for the documents' boundaries
    (every stage's attention needs them), as Megatron-LM's 0.19-era pretrain_gpt does."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and \
        (packed or ps.get_pipeline_model_parallel_rank() == 0)


def packed_seq_params(cu_seqlens, max_seqlen, cu_seqlens_padded=None, seq_length=None):
    """megatron's PackedSeqParams ("thd") of one microbatch's pack, as pretrain_gpt builds them
    from the data's ``cu_seqlens`` and ``max_seqlen``: 1-D offsets of the documents (a pack is
    one sample, ``--micro-batch-size 1``), the padded offsets where the data has them."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = _one_pack(cu_seqlens)
    if cu_seqlens_padded is not None:
        cu_seqlens_padded = _one_pack(cu_seqlens_padded)
    offsets = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    longest = int(max_seqlen.reshape(-1)[0].item())
    fields = dict(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                  cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                  max_seqlen_q=longest, max_seqlen_kv=longest)
    if seq_length is not None and "tokens_per_sample" in \
            {f.name for f in dataclasses.fields(PackedSeqParams)}:  # megatron-core >= 0.19
        fields["tokens_per_sample"] = seq_length
    return PackedSeqParams(**fields)


@dataclass(frozen=True)
class VBatch:
    """One microbatch, read on TP rank 0 and broadcast over the tensor-parallel group (as
    Megatron-LM's get_batch_on_this_tp_rank does): tokens, labels, loss mask and positions on
    pipeline rank 0 (both ends of the V); with ``packed`` (``--sft``) the pack's document
    boundaries on every pipeline rank, since every stage's attention must keep the documents
    apart (without them they would attend to each other, silently)."""

    seq_length: int
    micro_batch_size: int
    attention_mask: bool = False
    """Whether the data loader makes attention masks (--create-attention-mask-in-dataloader)."""
    packed: bool = False
    """Packed sequences (--sft): the data has cu_seqlens and max_seqlen per microbatch."""

    _KEYS = (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
             ("position_ids", torch.int64))

    def __call__(self, data_iterator):
        """(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params): the
        tensors on pipeline rank 0 (Nones elsewhere), the packed parameters where ``packed``."""
        from megatron.core import parallel_state as ps

        first = ps.get_pipeline_model_parallel_rank() == 0
        if not (first or self.packed):
            return None, None, None, None, None, None
        data = next(data_iterator) if ps.get_tensor_model_parallel_rank() == 0 else None
        batch = self._tensors(data) if first else {}
        packed = self._packed(data) if self.packed else None
        return (batch.get("tokens"), batch.get("labels"), batch.get("loss_mask"),
                batch.get("attention_mask"), batch.get("position_ids"), packed)

    def _tensors(self, data) -> dict:
        """Rank 0's tensors of the microbatch, the same on every TP rank."""
        shape = (self.micro_batch_size, self.seq_length)
        keys = list(self._KEYS) + ([("attention_mask", torch.bool)] if self.attention_mask else [])
        if data is not None:
            batch = {k: data[k].to(_device(), non_blocking=True) for k, _ in keys}
        else:
            batch = {k: torch.empty(shape if k != "attention_mask" else
                                    (shape[0], 1, shape[1], shape[1]), dtype=dtype,
                                    device=_device())
                     for k, dtype in keys}
        for key, _ in keys:
            _tp_broadcast(batch[key])
        return batch

    def _packed(self, data):
        """The pack's PackedSeqParams, the same on every TP rank (offsets of any length)."""
        source = data is not None
        cu_seqlens = _tp_broadcast_offsets(data["cu_seqlens"] if source else None, source)
        padded = _tp_broadcast_offsets(data.get("cu_seqlens_padded") if source else None, source)
        longest = (data["max_seqlen"].to(_device()).reshape(1).to(torch.int32) if source else
                   torch.empty(1, dtype=torch.int32, device=_device()))
        _tp_broadcast(longest)
        return packed_seq_params(cu_seqlens, longest, padded, self.seq_length)


def _one_pack(offsets):
    """A pack's document offsets as 1-D (the data loader stacks them per microbatch)."""
    if offsets.dim() > 1 and offsets.shape[0] != 1:
        raise ValueError(f"packed sequences (--sft) hold one pack per microbatch: use "
                         f"--micro-batch-size 1 (got {offsets.shape[0]})")
    return offsets.reshape(-1)


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def _tp_broadcast(tensor) -> None:
    """Broadcast from TP rank 0 over the tensor-parallel group (nothing to do without TP)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(tensor, ps.get_tensor_model_parallel_src_rank(),
                                    group=ps.get_tensor_model_parallel_group())


def _tp_broadcast_offsets(offsets, source: bool):
    """Document offsets of TP rank 0 (``source``; None there: the data has none) as 1-D int32
    on every TP rank, None where absent: the length goes first, since the number of documents
    varies per pack."""
    if offsets is not None:
        offsets = _one_pack(offsets).to(_device(), torch.int32)
    length = torch.tensor([0 if offsets is None else offsets.numel()], device=_device())
    _tp_broadcast(length)
    if not source:
        offsets = torch.empty(int(length.item()), dtype=torch.int32, device=_device())
    if length.item() == 0:
        return None
    _tp_broadcast(offsets)
    return offsets


class VForwardStep:
    """Megatron-LM's forward_step for the V (pretrain_gpt.forward_step with the V's batch):
    ``loss_func(loss_mask, output_tensor[, model=])`` is pretrain_gpt's loss function."""

    def __init__(self, batch: VBatch, loss_func: Callable, timers: Callable | None = None):
        self.batch = batch
        self.loss_func = loss_func
        self.timers = timers
        self._takes_model = "model" in inspect.signature(loss_func).parameters

    def __call__(self, data_iterator, model):
        if self.timers is not None:
            self.timers("batch-generator", log_level=2).start()
        tokens, labels, loss_mask, attention_mask, position_ids, packed = \
            self.batch(data_iterator)
        if self.timers is not None:
            self.timers("batch-generator").stop()
        output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                       packed_seq_params=packed)
        loss = partial(self.loss_func, loss_mask, model=model) if self._takes_model else \
            partial(self.loss_func, loss_mask)
        return output, loss
