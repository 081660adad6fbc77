"""What the plugin's schedules accept of Megatron-LM's settings, and how each is proven: the one
table the argument checks, the start-up line, ``--pipeline-strict`` and docs/training.md read.

Every row is one setting (a flag, or a flag's value) that changes how a pipeline schedule runs,
with a verdict for each family of the plugin's schedules, the V (v-min, v-half, v-zb, auto) and
zb-1p (megatron's own 1f1b and interleaved-1f1b are not the plugin's, so no row applies to
them). A verdict is a proof level or a refusal:

    real      Megatron-LM's real loop on CPU with megatron's own modules, equal to its own 1f1b
    stand-in  the same loop with a CPU stand-in of a GPU-only library (Transformer Engine's
              linears, attention, grouped linear, FP8): accepted, named in one start-up line,
              refused under --pipeline-strict
    GPU       run on a GPU (``vshape gpu-check``)
    refused   nothing here proves it: the run stops at argument parsing with the reason and
              the way out, every refusal that applies in one error

Pure Python (no torch, no megatron): the CLI prints the table (``vshape features``) and the
rows' predicates read an argument namespace only. Each row names the ``args`` fields it reads
(``reads``); tests/megatron/test_megatron_lm_recipes.py checks that Megatron-LM's parser of
every supported training code has them, so a flag renamed upstream cannot switch a refusal
off silently.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

from ..schedule.names import PLUGIN_SCHEDULES, V_SCHEDULES, ZB_1P
from .hybrid import MTP_SEPARATOR, PIPE, pattern_segments, unsupported_families
from .stage_layout import LAYOUT_FLAGS, layout_flags_set, layout_stage_count

__all__ = ["Verdict", "Family", "Setting", "SETTINGS", "family_of", "refusals",
           "stand_in_settings", "markdown_table", "virtual_stages", "layout_stages",
           "STRICT_FLAG"]

STRICT_FLAG = "--pipeline-strict"


class Verdict(enum.Enum):
    """How a setting is proven under a family of schedules, or that it is refused."""

    REAL = "real"
    STAND_IN = "stand-in"
    GPU = "GPU"
    REFUSED = "refused"
    NOT_APPLICABLE = "n/a"

    @property
    def accepted(self) -> bool:
        return self is not Verdict.REFUSED


class Family(enum.Enum):
    """The plugin's schedules, by what a setting's verdict depends on."""

    V = "V"
    ZB = ZB_1P


def family_of(schedule: str) -> Family | None:
    """The family of a schedule name; None for megatron's own (no row applies)."""
    if schedule in V_SCHEDULES:
        return Family.V
    if schedule in PLUGIN_SCHEDULES:
        return Family.ZB
    return None


@dataclass(frozen=True)
class Setting:
    """One row: a setting, whether a run uses it, and its verdict per family."""

    flags: str
    """The setting as a user writes it (the docs' first column)."""
    reads: tuple[str, ...]
    """The ``args`` fields ``used`` reads (Megatron-LM's dests, checked against its parser)."""
    used: Callable[[Any], bool]
    v: Verdict
    zb: Verdict
    why: str
    """For a refusal: the reason and the way out, after "--pipeline-schedule NAME " (a
    sentence starting with a verb). Otherwise: what proves it, or why it is safe."""
    proven_by: str = ""
    """The test (or command) that proves an accepted verdict."""
    since: str = ""
    """The Megatron-LM release whose parser first has every field of ``reads`` ("0.19"), or
    "modelopt": only where pretrain_gpt.py registers nvidia-modelopt's flags; empty: every
    supported release has them."""
    until: str = ""
    """The last Megatron-LM release whose parser has them ("0.16"); empty: no supported release
    has dropped them."""

    def verdict(self, family: Family) -> Verdict:
        return self.v if family is Family.V else self.zb


def _on(args, *names) -> bool:
    """Whether any of these fields is set; an absent one is off (a release without the flag,
    where ``since`` says so; the checks also run on namespaces that hold only some fields)."""
    return any(getattr(args, name, None) not in (None, False, 0, "none", [], ()) for name in names)


def _cp(args) -> int:
    """--context-parallel-size (1 where a namespace lacks it)."""
    return getattr(args, "context_parallel_size", 1) or 1


def _cp_comm_types(args) -> list:
    """--cp-comm-type as a list (one type, or one per layer)."""
    value = getattr(args, "cp_comm_type", None) or ["p2p"]
    return [value] if isinstance(value, str) else list(value)


def _before_019(args) -> bool:
    """Whether the parser is older than the 0.19-era training code's, which added
    --dataloader-inter-document-masking with the get_batch that splits packs per document
    over CP (0.19 pretrain_gpt.py:167-173): core_v0.16.1, the other supported code (a
    namespace without the field is taken as core_v0.16.1, so a renamed field refuses rather
    than accepts)."""
    return not hasattr(args, "dataloader_inter_document_masking")


def _moe(args) -> bool:
    return bool(getattr(args, "num_experts", None))


def _te(args) -> bool:
    """Transformer Engine layers (Megatron-LM's default --transformer-impl; a namespace
    without the field is taken as local, the plugin's tests' stand-in namespaces)."""
    return getattr(args, "transformer_impl", None) == "transformer_engine"


def _data_parallel_size(args) -> int:
    """Data-parallel size from the world and model-parallel sizes (the checks run before
    Megatron-LM's validate_args computes args.data_parallel_size)."""
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * _cp(args)
    return max(1, getattr(args, "world_size", model) // model)


_PER_TENSOR_FP8 = ("delayed", "tensorwise")
"""The --fp8-recipe values whose TE recipes (DelayedScaling, Float8CurrentScaling) the CPU
stand-in runs."""


def _fp8_recipe(args) -> str:
    """--fp8-recipe as a string (megatron's Fp8Recipe is a str enum; delayed by default)."""
    value = getattr(args, "fp8_recipe", None) or "delayed"
    return getattr(value, "value", value)


def _balancing(args) -> list:
    """--moe-router-load-balancing-type as a list (one name, or one per layer group)."""
    value = getattr(args, "moe_router_load_balancing_type", "aux_loss") or "aux_loss"
    return [value] if isinstance(value, str) else list(value)


_TESTED_BALANCING = {"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}


def _placed(args) -> bool:
    """Whether a flag places the layers (stage_layout.py reads them under a V)."""
    return bool(layout_flags_set(args))


def layout_stages(args) -> int:
    """Stages of --pipeline-model-parallel-layout, counted by megatron-core's own parser."""
    return layout_stage_count(args.pipeline_model_parallel_layout)


def virtual_stages(args) -> int:
    """Model chunks per pipeline rank the flags ask for, as Megatron-LM's validate_args
    derives them (core_v0.16.1 arguments.py:516-545): a layout's stages over PP (counted by
    megatron-core's own parser), --num-virtual-stages-per-pipeline-rank, or the layers per
    rank over --num-layers-per-virtual-pipeline-stage; 1 without any."""
    segments = _hybrid_virtual_stages(args)
    return segments if segments > 1 else _flag_virtual_stages(args)


def _hybrid_virtual_stages(args) -> int:
    """Chunks per rank a --hybrid-layer-pattern's '|' segments ask for (0.19 arguments.py:
    814-832: segments / PP); 1 without '|'."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern or PIPE not in pattern:
        return 1
    return max(1, len(pattern_segments(pattern)) // args.pipeline_model_parallel_size)


def _flag_virtual_stages(args) -> int:
    """Chunks per rank the GPT flags ask for (virtual_stages' doc)."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        return max(1, layout_stages(args) // pp)
    if args.num_virtual_stages_per_pipeline_rank is not None:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is not None:
        return max(1, (args.num_layers or 0) // pp // args.num_layers_per_virtual_pipeline_stage)
    return 1


R, S, G, X, NA = (Verdict.REAL, Verdict.STAND_IN, Verdict.GPU, Verdict.REFUSED,
                  Verdict.NOT_APPLICABLE)
E2E = "tests/megatron/test_megatron_lm_e2e.py"
MOE = "tests/megatron/test_megatron_lm_moe.py"
FLAGS = "tests/megatron/test_megatron_lm_flags.py"
UNEVEN_ZB1P = "test_zb1p_runs_megatrons_own_uneven_stages_like_1f1b (e2e, 0.19)"
LAYOUTS = "tests/megatron/test_megatron_lm_layouts.py"
MTP = "tests/megatron/test_megatron_lm_mtp.py"
TE = "tests/megatron/test_megatron_lm_te.py"
HYBRID = "tests/megatron/test_megatron_lm_hybrid.py"
FP8_TESTS = (TE + " (delayed scaling under v-half and zb-1p; tensorwise under v-zb; either "
             "chunk's first-microbatch flag withheld); tests/megatron/test_te_stand_in.py (the "
             "stand-in's FP8)")

SETTINGS = (
    # -- the shape of the pipeline ---------------------------------------------------------------
    Setting("--pipeline-model-parallel-size 1", ("pipeline_model_parallel_size",),
            lambda a: a.pipeline_model_parallel_size < 2, X, X,
            "needs --pipeline-model-parallel-size >= 2 (there is no pipeline); use "
            "--pipeline-schedule 1f1b"),
    Setting("--num-layers < 2 x PP", ("num_layers", "pipeline_model_parallel_size")
            + LAYOUT_FLAGS,
            lambda a: not _placed(a) and (a.num_layers or 0) < 2 * a.pipeline_model_parallel_size,
            X, NA,
            "places 2 stages on each rank: --num-layers must be >= 2 x "
            "--pipeline-model-parallel-size (or place the layers with "
            "--pipeline-model-parallel-layout, whose end stages may hold none)"),
    Setting("--num-layers not a multiple of PP (k x PP - 2)", ("num_layers",),
            lambda a: False, R, NA,
            "rank 0, which also holds the embedding and the LM head, runs the missing layers",
            E2E + " (14 layers on PP 4)"),
    Setting("--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank",
            ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank"),
            lambda a: a.num_layers_per_virtual_pipeline_stage is not None
            or a.num_virtual_stages_per_pipeline_rank is not None, X, NA,
            "places two chunks per rank itself: drop --num-layers-per-virtual-pipeline-stage / "
            "--num-virtual-stages-per-pipeline-rank (they select megatron's interleaved-1f1b, "
            "which runs when no --pipeline-schedule is given)"),
    Setting("virtual pipelining (more than one stage per rank, or a layout of more than PP "
            "stages)", ("num_layers_per_virtual_pipeline_stage",
                        "num_virtual_stages_per_pipeline_rank", "pipeline_model_parallel_layout",
                        "pipeline_model_parallel_size", "num_layers"),
            lambda a: _flag_virtual_stages(a) > 1, NA, X,
            "runs one chunk per rank; with virtual pipeline stages use --pipeline-schedule "
            "interleaved-1f1b (megatron's own), or drop the virtual-pipeline flags"),
    Setting("--pipeline-model-parallel-layout of other than 2 x PP stages",
            ("pipeline_model_parallel_layout", "pipeline_model_parallel_size"),
            lambda a: a.pipeline_model_parallel_layout is not None
            and layout_stages(a) != 2 * a.pipeline_model_parallel_size, X, NA,
            "reads --pipeline-model-parallel-layout on the V's 2 x PP stages in V order (stage "
            "s on rank s for s < PP, on rank 2 x PP - 1 - s after; docs/training.md, stage "
            "layouts): write 2 x PP stages separated by '|' (a layout of PP stages is 1F1B's: "
            "use --pipeline-schedule zb-1p or 1f1b)"),
    Setting("--pipeline-model-parallel-layout", ("pipeline_model_parallel_layout",),
            lambda a: a.pipeline_model_parallel_layout is not None, R, R,
            "V: 2 x PP stages in V order (stage s on rank s for s < PP, on rank 2 x PP - 1 - s "
            "after), the embedding in stage 0, the loss and MTP in stage 2 x PP - 1 (rank 0), "
            "at least one layer on every other stage and on rank 0; parsed and checked by "
            "megatron-core's own PipelineParallelLayerLayout, layers numbered globally (a "
            "checkpoint loads under any layout). zb-1p: a layout of exactly PP stages, "
            "megatron's own placement",
            LAYOUTS + " (PP 2, 4 stages, the loss stage without layers, also beside an MTP "
            "layer; a 1f1b checkpoint of another layout resumed); " + UNEVEN_ZB1P),
    Setting("--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-"
            "pipeline-split", ("decoder_first_pipeline_num_layers",
                               "decoder_last_pipeline_num_layers",
                               "account_for_embedding_in_pipeline_split",
                               "account_for_loss_in_pipeline_split"),
            lambda a: a.decoder_first_pipeline_num_layers is not None
            or a.decoder_last_pipeline_num_layers is not None
            or a.account_for_embedding_in_pipeline_split or a.account_for_loss_in_pipeline_split,
            R, R,
            "V: first is stage 0, last stage 2 x PP - 1 (both on rank 0; 0 allowed), the other "
            "stages share the rest evenly; --account-for-*: the embedding (loss) counts as a "
            "layer of stage 0 (2 x PP - 1), num_layers + 1 (+ 1) a multiple of 2 x PP, as "
            "megatron splits PP x VP stages. zb-1p: megatron's own 1F1B meaning",
            LAYOUTS + " (v-zb with first/last 0 / 1, zb-1p with last 2 and with the loss "
            "counted, v-half with the "
            "embedding counted resuming 1f1b's checkpoint of another layout); " + UNEVEN_ZB1P),
    # -- model features ------------------------------------------------------------------------
    Setting("--mtp-num-layers, --mtp-loss-scaling-factor", ("mtp_num_layers",),
            lambda a: _on(a, "mtp_num_layers"), R, R,
            "the MTP block sits in rank 0's chunk 1 beside the LM head (stage 2p-1), its "
            "copy of the word embedding kept equal to chunk 0's (copied at build, gradients "
            "summed as megatron's embedding group sums them), its linears' weight gradients "
            "in W; the logged mtp loss equals 1f1b's, checkpoints resume across schedules. "
            "The real loop runs untied embeddings: megatron-core cannot save or load tied ones "
            "with MTP at PP > 1, under its own 1f1b too (0.16 language_module.py:343, 0.19 "
            ":497), so no run could start from a common checkpoint; tied MTP is proven on "
            "megatron-core with weights set by name",
            MTP + " (PP 2 x DP 2 and PP 4 under every V, zb-1p at PP 4, resumes); "
            "tests/megatron/test_megatron_gloo.py (tied, PP 2)"),
    Setting("tied embeddings or --mtp-num-layers, data parallel > 1 and a fully parallel --save",
            ("save", "untie_embeddings_and_output_weights", "mtp_num_layers", "ckpt_format",
             "ckpt_fully_parallel_save", "tensor_model_parallel_size",
             "pipeline_model_parallel_size", "context_parallel_size", "world_size"),
            lambda a: _on(a, "save") and (not _on(a, "untie_embeddings_and_output_weights")
                                          or _on(a, "mtp_num_layers"))
            and getattr(a, "ckpt_format", "torch_dist") == "torch_dist"
            and _on(a, "ckpt_fully_parallel_save") and _data_parallel_size(a) > 1, R, NA,
            "rank 0 holds the word embedding (chunk 0) and its copy (chunk 1: the LM head's "
            "tied weight, the MTP block's embedding) in one data-parallel group, where "
            "megatron's fully parallel save would write both; the copy and its optimizer state "
            "stay what megatron makes the last stage's, a replica loaded from the embedding's "
            "key and never written, and load as tensors of their own (--ckpt-fully-parallel-"
            "load too) (replicas.py): the checkpoint is 1f1b's, for megatron's plain and "
            "distributed optimizers",
            E2E + " and the 0.19 tier (tied, PP 2 x DP 2, plain and distributed optimizer: "
            "resumes V <-> 1f1b, a fully parallel load); " + MTP + " (PP 2 x DP 2)"),
    Setting("--use-distributed-optimizer, --overlap-grad-reduce, --overlap-param-gather",
            ("use_distributed_optimizer",), lambda a: _on(a, "use_distributed_optimizer"), R, R,
            "equal to 1f1b, resumes across schedules (saved fully reshardable)", E2E),
    Setting("--tensor-model-parallel-size, --sequence-parallel",
            ("tensor_model_parallel_size",),
            lambda a: getattr(a, "tensor_model_parallel_size", 1) > 1, R, R,
            "TP 2 x PP 2 with sequence parallelism equal to 1f1b", E2E),
    Setting("--recompute-granularity full / selective", ("recompute_granularity",),
            lambda a: _on(a, "recompute_granularity"), R, R,
            "B re-runs the forward of the recomputed layers; W takes what it saved", FLAGS),
    Setting("--sft (packed sequences)", ("sft",), lambda a: _on(a, "sft"), S, S,
            "every stage gets its pack's packed_seq_params; run with a stand-in of TE's "
            "packed (thd) attention", "tests/megatron/test_megatron_lm_sft.py"),
    Setting("--dataloader-inter-document-masking", ("dataloader_inter_document_masking",),
            lambda a: _on(a, "dataloader_inter_document_masking"), X, NA,
            "does not pass the documents' boundaries of --dataloader-inter-document-masking "
            "(0.19: the dataset's cu_seqlens, which Megatron-LM's get_batch turns into "
            "packed_seq_params, pretrain_gpt.py:106) to its stages: the V's batch reads them "
            "for --sft only, so documents would attend to each other: drop it, or use "
            "--pipeline-schedule zb-1p or 1f1b (megatron's own get_batch)", since="0.19"),
    Setting("--transformer-impl transformer_engine", ("transformer_impl",),
            _te, S, S,
            "TE's own B/W split (delay_wgrad_compute, backward_dw in W), on a CPU stand-in of "
            "TE v2.11 (tests/support/te_stand_in: linears, norms, attention, grouped linear; "
            "dense at PP 4, TP 2 x PP 2 with sequence parallel)", TE),
    Setting("--context-parallel-size > 1, --cp-comm-type p2p / a2a / all_gather",
            ("context_parallel_size", "cp_comm_type"), lambda a: _cp(a) > 1, S, S,
            "each CP rank's V reads its load-balanced slice of every microbatch with megatron's "
            "own get_batch_on_this_cp_rank (zb-1p: megatron's get_batch), messages carry a CP "
            "rank's share of the sequence, losses and gradients are reduced over CP as under "
            "1f1b; on a CPU stand-in of TE v2.11's context-parallel attention (every "
            "communication type gives its result; TE spells it all_gather: megatron's "
            "'allgather' fails in TE's attention, under 1f1b too), CP 2 x PP 2 tied and "
            "untied", TE + " (CP 2 x PP 2: v-half, v-zb, zb-1p; --sft with CP on the 0.19-era "
            "training code, v-min)"),
    Setting("--cp-comm-type a2a+p2p (hierarchical context parallelism)",
            ("context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes"),
            lambda a: _cp(a) > 1 and "a2a+p2p" in _cp_comm_types(a), X, X,
            "is not tested with hierarchical context parallelism (--cp-comm-type a2a+p2p runs "
            "all-to-all and ring communication over two nested groups of "
            "--hierarchical-context-parallel-sizes, which needs CP >= 4 to be hierarchical; "
            "the tests' CPU stand-in of Transformer Engine runs CP 2): use --cp-comm-type p2p, "
            "a2a or all_gather, or --pipeline-schedule 1f1b"),
    Setting("--sft with --context-parallel-size > 1, Megatron-LM core_v0.16.1",
            ("sft", "context_parallel_size"),
            lambda a: _on(a, "sft") and _cp(a) > 1 and _before_019(a), X, X,
            "does not run packed sequences (--sft) with context parallelism on Megatron-LM "
            "core_v0.16.1: its own get_batch cannot split a pack over CP ranks (its "
            "get_batch_on_this_tp_rank reads no cu_seqlens_padded, so pretrain_gpt.py:81-93 "
            "passes None to megatron-core 0.16's get_thd_batch_on_this_cp_rank, which hands it "
            "to Transformer Engine's thd_get_partitioned_indices, utils.py:2070; and its "
            "SFTDataset fails where CP padding overflows a pack, sft_dataset.py:149), so 1f1b "
            "fails too and nothing proves a V: use the 0.19-era training code with "
            "megatron-core 0.19.2, or --context-parallel-size 1"),
    Setting("--bf16", ("bf16",), lambda a: _on(a, "bf16"), R, R,
            "bit-identical to 1f1b in the CPU loop; on GPUs, every schedule gives 1F1B's losses "
            "in bf16 on one H100 and one H200 (megatron-core with local layers)",
            FLAGS + "; vshape gpu-check"),
    Setting("--fp16 (dynamic loss scaling)", ("fp16",), lambda a: _on(a, "fp16"), R, R,
            "equal to 1f1b (V: losses to 1e-5, grad norms to 1e-3: under a V rank 0 sums the "
            "squared gradient norms of other parameters than under 1f1b, so the clipping "
            "coefficient can differ in its last bit, which fp16 weights round to a 2^-11 step)",
            FLAGS),
    # -- hybrid models (megatron-core's HybridModel, scripts/pretrain_hybrid_vshape.py) --------
    Setting("--hybrid-layer-pattern of attention (*), MLP (-) and MoE (E) layers",
            ("hybrid_layer_pattern",), lambda a: _on(a, "hybrid_layer_pattern"), S, S,
            "V: the pattern's 2 x PP '|' segments are the V's stages in V order (stage s on rank "
            "s for s < PP, on rank 2 x PP - 1 - s after), without '|' an even split; layers "
            "numbered globally; the embedding, final norm and loss on rank 0. zb-1p: megatron's "
            "own placement (PP segments, or none). megatron-core's hybrid layer specs are "
            "Transformer Engine's only (the stand-in on CPU); TE's own W split covers their "
            "linears (the MoE layers' router stays in B, as for GPT)",
            HYBRID + " (PP 2 and PP 4: every V and zb-1p; a 1f1b "
            "checkpoint resumed)",
            since="0.17"),
    Setting("--hybrid-layer-pattern with Mamba (M), GDN (G), DSA (D), MLA (+) layers",
            ("hybrid_layer_pattern",), lambda a: bool(unsupported_families(
                getattr(a, "hybrid_layer_pattern", None))), X, X,
            "builds only attention (*), MLP (-) and MoE (E) layers of --hybrid-layer-pattern: "
            "Mamba (M) and gated delta net (G) mixers run GPU-only kernels (mamba-ssm and "
            "causal-conv1d, flash-linear-attention), DeepSeek sparse attention (D) and MLA (+) "
            "kernels no CPU run proves, so neither their W split nor their results under a V "
            "are checked: remove them from the pattern, or use --pipeline-schedule 1f1b",
            since="0.17"),
    Setting("--hybrid-layer-pattern with MTP layers ('/')", ("hybrid_layer_pattern",),
            lambda a: MTP_SEPARATOR in (getattr(a, "hybrid_layer_pattern", None) or ""), X, X,
            "does not run a hybrid model's multi-token prediction layers (megatron-core puts "
            "them on its last pipeline stage by the loop's order, which no test checks under "
            "the plugin's schedules): drop the '/' patterns, or use --pipeline-schedule 1f1b",
            since="0.17"),
    Setting("--hybrid-layer-pattern of more than PP '|' segments",
            ("hybrid_layer_pattern", "pipeline_model_parallel_size"),
            lambda a: _hybrid_virtual_stages(a) > 1, NA, X,
            "runs one chunk per rank; a --hybrid-layer-pattern of more than PP '|' segments asks "
            "megatron for virtual pipeline stages: use --pipeline-schedule interleaved-1f1b "
            "(megatron's own), or write PP segments (or none)", since="0.17"),
    Setting("--hybrid-layer-pattern of other than 2 x PP '|' segments",
            ("hybrid_layer_pattern", "pipeline_model_parallel_size"),
            lambda a: len(pattern_segments(getattr(a, "hybrid_layer_pattern", None) or "")) not in
            (1, 2 * a.pipeline_model_parallel_size), X, NA,
            "reads --hybrid-layer-pattern's '|' segments as the V's 2 x PP stages in V order "
            "(stage s on rank s for s < PP, on rank 2 x PP - 1 - s after): write 2 x PP "
            "segments, or none for an even split (PP segments are 1F1B's: use "
            "--pipeline-schedule zb-1p or 1f1b)", since="0.17"),
    # -- Mixture of Experts ----------------------------------------------------------------------
    Setting("--num-experts (alltoall / allgather dispatcher, --expert-model-parallel-size, aux, "
            "seq, global aux and z losses, shared experts, --moe-layer-freq, capacity)",
            ("num_experts",), _moe, R, R,
            "equal to 1f1b with the logged load-balancing losses; experts' fc1/fc2 run W", MOE),
    Setting("--moe-grouped-gemm with --transformer-impl transformer_engine (TEGroupedMLP)",
            ("num_experts", "moe_grouped_gemm", "transformer_impl"),
            lambda a: _moe(a) and _on(a, "moe_grouped_gemm") and _te(a), S, S,
            "TE's GroupedLinear runs its weight gradients in W through TE's own split "
            "(delay_wgrad_compute, backward_dw), expert gradients over expert data parallel",
            TE + " (PP 2 x EP 2 alltoall, PP 4 allgather, EP 1 over expert data parallel)"),
    Setting("--moe-grouped-gemm, megatron's legacy GroupedMLP",
            ("num_experts", "moe_grouped_gemm", "transformer_impl",
             "moe_use_legacy_grouped_gemm"),
            lambda a: _moe(a) and _on(a, "moe_grouped_gemm")
            and (not _te(a) or _on(a, "moe_use_legacy_grouped_gemm")), X, X,
            "runs grouped-GEMM experts (--moe-grouped-gemm) as Transformer Engine's "
            "GroupedLinear only (--transformer-impl transformer_engine: TEGroupedMLP, whose "
            "weight gradients TE's own split runs in W); megatron's legacy GroupedMLP "
            "(--moe-use-legacy-grouped-gemm, or --transformer-impl local with megatron-core "
            "0.16) computes them inside the grouped_gemm package's GEMM (0.16.1 "
            "moe/experts.py:81, 246-259), which no split covers: use --transformer-impl "
            "transformer_engine, or drop --moe-grouped-gemm (SequentialMLP experts, whose "
            "fc1/fc2 weight gradients run in W), or use --pipeline-schedule 1f1b",
            until="0.16"),
    Setting("--moe-token-dispatcher-type flex", ("num_experts", "moe_token_dispatcher_type"),
            lambda a: _moe(a) and getattr(a, "moe_token_dispatcher_type", "allgather")
            not in ("allgather", "alltoall"),
            X, X,
            "is tested with the allgather and alltoall token dispatchers only (the flex "
            "dispatcher's DeepEP / HybridEP kernels run on GPUs only): use "
            "--moe-token-dispatcher-type alltoall, or --pipeline-schedule 1f1b"),
    Setting("--moe-router-load-balancing-type sinkhorn",
            ("num_experts", "moe_router_load_balancing_type"),
            lambda a: _moe(a) and not set(_balancing(a)) <= _TESTED_BALANCING, X, X,
            "is tested with the load-balancing types aux_loss, seq_aux_loss, global_aux_loss "
            "and none (not sinkhorn): choose one of those with "
            "--moe-router-load-balancing-type, or use --pipeline-schedule 1f1b"),
    Setting("--moe-shared-expert-overlap", ("num_experts", "moe_shared_expert_overlap"),
            lambda a: _moe(a) and _on(a, "moe_shared_expert_overlap"), X, X,
            "does not support --moe-shared-expert-overlap: the shared expert's forward runs on "
            "a side CUDA stream split across the token dispatcher (megatron-core 0.16.1 "
            "moe/shared_experts.py:92-123, token_dispatcher.py:626-847) and its backward order "
            "is steered by autograd sequence numbers (shared_experts.py:281-293); megatron "
            "itself skips the shared expert's delayed weight gradient in that mode "
            "(moe_layer.py:452-457), and a W pass would read side-stream tensors on the "
            "default stream with nothing to synchronise them, a race no CPU test can show: "
            "drop it, or use --pipeline-schedule 1f1b"),
    Setting("--moe-paged-stash", ("num_experts", "moe_paged_stash"),
            lambda a: _moe(a) and _on(a, "moe_paged_stash"), X, X,
            "does not support --moe-paged-stash (megatron-core 0.19: megatron's schedules "
            "reset the stash every step, pipeline_parallel/schedules.py:738; ours do not): "
            "drop it, or use --pipeline-schedule 1f1b", since="0.18"),
    # -- parallelism and precision the schedules do not run yet -------------------------------
    Setting("--hybrid-context-parallel", ("hybrid_context_parallel",),
            lambda a: _on(a, "hybrid_context_parallel"), X, X,
            "does not support --hybrid-context-parallel (packs of varying length over dynamic "
            "context-parallel groups, run by megatron's own schedule; Megatron-LM refuses it "
            "with pipeline parallelism itself, core_v0.16.1 arguments.py:919, 0.19 :1405): "
            "drop it, or use --pipeline-schedule 1f1b"),
    Setting("--fp8-format e4m3 / hybrid with --fp8-recipe delayed or tensorwise (its "
            "--fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo; tensorwise: "
            "--first-last-layers-bf16)", ("fp8", "fp8_recipe"),
            lambda a: _on(a, "fp8") and _fp8_recipe(a) in _PER_TENSOR_FP8, S, S,
            "what megatron's schedules do for Transformer Engine's FP8, for both chunks of a "
            "V: each chunk's first forward of a step (microbatch 0) sets is_first_microbatch, "
            "so TE casts its cached FP8 weights again after the optimizer step; every "
            "forward is its own autocast region (amax reduction and scale update at its "
            "exit, the backward's at the end of B); W runs TE's backward_dw on the FP8 "
            "tensors B saved; the bias gradients TE's FP8 GEMM leaves to B are added in B "
            "order. On a CPU stand-in of TE v2.11's per-tensor FP8 (torch's float8 types; "
            "dense at PP 4, fp32 params, no gradient clipping), losses and validation losses "
            "bit-identical to 1f1b; withholding the flag from either chunk trains on stale "
            "weights and is caught. Delayed scaling with evaluation between steps differs "
            "from 1f1b as megatron's interleaved schedule does (docs/training.md)", FP8_TESTS),
    Setting("--fp8-recipe mxfp8 / blockwise / custom", ("fp8", "fp8_recipe"),
            lambda a: _on(a, "fp8") and _fp8_recipe(a) not in _PER_TENSOR_FP8, X, X,
            "is tested with FP8's per-tensor recipes only (the CPU stand-in of Transformer "
            "Engine quantizes per tensor; MXFP8 and 1x128 / 128x128 block scaling need "
            "Blackwell or CUDA 12.9 GPUs, and a custom recipe's quantizers are the user's: "
            "none runs here): use --fp8-recipe delayed or tensorwise, or --pipeline-schedule "
            "1f1b"),
    Setting("--fp8-param-gather", ("fp8_param_gather",),
            lambda a: _on(a, "fp8_param_gather"), X, X,
            "is not tested with --fp8-param-gather: it builds the model with Transformer "
            "Engine's FP8 weights (fp8_model_init: Float8Tensor parameters, which TE casts "
            "from the distributed optimizer's main parameters after each step and gathers in "
            "FP8), which the CPU stand-in of TE does not imitate: drop --fp8-param-gather "
            "(FP8 compute with high-precision weights, each chunk's cast cached per step), or "
            "use --pipeline-schedule 1f1b"),
    Setting("--fp8-format with --moe-grouped-gemm", ("fp8", "num_experts", "moe_grouped_gemm"),
            lambda a: _on(a, "fp8") and _moe(a) and _on(a, "moe_grouped_gemm"), X, X,
            "is not tested with FP8 grouped-GEMM experts (the CPU stand-in runs Transformer "
            "Engine's GroupedLinear in high precision only): drop --moe-grouped-gemm "
            "(SequentialMLP experts of TE linears run FP8), or use --pipeline-schedule 1f1b"),
    Setting("--fp8-format with --recompute-granularity full", ("fp8", "recompute_granularity"),
            lambda a: _on(a, "fp8") and getattr(a, "recompute_granularity", None) == "full",
            X, X,
            "is not tested with FP8 and --recompute-granularity full (Transformer Engine's "
            "checkpoint recomputes FP8 layers with the scaling state it stashed at the first "
            "forward, TE 2.11 quantization.py:612-668, which the CPU stand-in does not "
            "imitate): use --recompute-granularity selective, or --pipeline-schedule 1f1b"),
    Setting("--fp4-format", ("fp4",), lambda a: _on(a, "fp4"), X, X,
            "is not tested with FP4 training (--fp4-format: NVFP4 block scaling runs on "
            "Blackwell GPUs only, and the CPU stand-in of Transformer Engine imitates "
            "per-tensor FP8 only): drop it, or use --pipeline-schedule 1f1b"),
    Setting("--tp-comm-overlap", ("tp_comm_overlap",), lambda a: _on(a, "tp_comm_overlap"),
            X, X,
            "does not support --tp-comm-overlap: its W passes run Transformer Engine's delayed "
            "weight gradients, whose stored GEMM inputs are Userbuffers views under the "
            "all-gather overlaps (TE 2.11 module/linear.py:660 and layernorm_linear.py:672 put "
            "the gathered input, base.py:1149 the gathered output gradient, into the shared "
            "communication buffer that the next layers overwrite before W), and TE refuses "
            "the bulk weight-gradient overlap with delayed weight gradients outright "
            "(module/_common.py:207, layernorm_linear.py:905); the reduce-scatter overlaps "
            "alone would be safe but run on GPUs only (Userbuffers), so nothing here proves "
            "them: drop --tp-comm-overlap, or use --pipeline-schedule 1f1b"),
    # -- what megatron's own schedules do and ours do not ---------------------------------------
    Setting("nvidia-modelopt: a ModelOpt checkpoint, --export-kd-teacher-load (distillation)",
            ("modelopt_enabled", "export_kd_teacher_load"),
            lambda a: _on(a, "modelopt_enabled", "export_kd_teacher_load"), X, X,
            "does not run ModelOpt models (quantization or distillation from a ModelOpt "
            "checkpoint, --export-kd-teacher-load: their builder and loss are untested under "
            "the plugin's placement and B/W split): use --pipeline-schedule 1f1b",
            since="modelopt"),
    Setting("--use-legacy-models", ("use_legacy_models",),
            lambda a: _on(a, "use_legacy_models"), X, X,
            "runs megatron-core models only: drop --use-legacy-models", until="0.17"),
    Setting("--use-torch-fsdp2, --use-megatron-fsdp", ("use_torch_fsdp2", "use_megatron_fsdp"),
            lambda a: _on(a, "use_torch_fsdp2", "use_megatron_fsdp"), X, X,
            "needs megatron's DistributedDataParallel (its W passes call DDP's gradient hooks): "
            "drop --use-torch-fsdp2 / --use-megatron-fsdp, or use --pipeline-schedule 1f1b"),
    Setting("--delay-wgrad-compute", ("delay_wgrad_compute",),
            lambda a: _on(a, "delay_wgrad_compute"), X, X,
            "splits B and W itself (--delay-wgrad-compute is megatron's MoE overlap): drop it"),
    Setting("--overlap-moe-expert-parallel-comm (megatron's combined 1F1B) and its EP-overlap "
            "options",
            ("overlap_moe_expert_parallel_comm", "overlap_dispatch_backward_with_experts_wgrad",
             "ep_overlap_early_attn_memory_release"),
            lambda a: _on(a, "overlap_moe_expert_parallel_comm",
                          "overlap_dispatch_backward_with_experts_wgrad",
                          "ep_overlap_early_attn_memory_release"), X, X,
            "does not run megatron's combined 1F1B for MoE communication overlap "
            "(--overlap-moe-expert-parallel-comm, its own schedule plan): drop "
            "--overlap-moe-expert-parallel-comm / --overlap-dispatch-backward-with-experts-wgrad"
            " / --ep-overlap-early-attn-memory-release, or use --pipeline-schedule 1f1b",
            since="0.18"),
    Setting("--defer-embedding-wgrad-compute", ("defer_embedding_wgrad_compute",),
            lambda a: _on(a, "defer_embedding_wgrad_compute"), X, X,
            "does not support --defer-embedding-wgrad-compute (megatron's own schedules drain "
            "the LM head's deferred weight gradients at the flush; ours never would, and the "
            "LM head would get no gradient): drop it"),
    Setting("--cuda-graph-impl (not none), --enable-cuda-graph, --external-cuda-graph",
            ("cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph"),
            lambda a: _on(a, "cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph"),
            X, X,
            "does not support CUDA graphs (--cuda-graph-impl, --enable-cuda-graph, "
            "--external-cuda-graph: megatron captures them in its own schedules' pass order): "
            "use --cuda-graph-impl none, or --pipeline-schedule 1f1b"),
    Setting("--fine-grained-activation-offloading, --cpu-offloading-num-layers",
            ("fine_grained_activation_offloading", "cpu_offloading_num_layers"),
            lambda a: _on(a, "fine_grained_activation_offloading", "cpu_offloading_num_layers"),
            X, X,
            "does not support activation offloading (--fine-grained-activation-offloading, "
            "--cpu-offloading-num-layers: it offloads and reloads in megatron's pass order): "
            "drop it, or use --pipeline-schedule 1f1b"),
    Setting("--overlap-param-gather-with-optimizer-step",
            ("overlap_param_gather_with_optimizer_step",),
            lambda a: _on(a, "overlap_param_gather_with_optimizer_step"), X, X,
            "starts every chunk's parameter all-gather at the start of a step: drop "
            "--overlap-param-gather-with-optimizer-step (megatron's interleaved schedule's; "
            "--overlap-param-gather works)"),
    Setting("--overlap-p2p-communication-warmup-flush, "
            "--microbatch-group-size-per-virtual-pipeline-stage",
            ("overlap_p2p_comm_warmup_flush", "microbatch_group_size_per_vp_stage"),
            lambda a: _on(a, "overlap_p2p_comm_warmup_flush",
                          "microbatch_group_size_per_vp_stage"), X, X,
            "runs its own pass order: drop --overlap-p2p-communication-warmup-flush / "
            "--microbatch-group-size-per-virtual-pipeline-stage (megatron's interleaved "
            "schedule's; they would be ignored)"),
    Setting("--use-ring-exchange-p2p, --pipeline-model-parallel-comm-backend",
            ("use_ring_exchange_p2p", "pipeline_model_parallel_comm_backend"),
            lambda a: _on(a, "use_ring_exchange_p2p", "pipeline_model_parallel_comm_backend"),
            X, X,
            "runs its own point-to-point communication (async sends and receives, one process "
            "group per stream, the default backend): drop --use-ring-exchange-p2p / "
            "--pipeline-model-parallel-comm-backend (they would be ignored)"),
    Setting("--no-overlap-p2p-communication", ("overlap_p2p_comm",),
            lambda a: False, R, R,
            "the plugin's sends and receives are asynchronous anyway", E2E),
)
"""Every setting the plugin decided on, in the order docs/training.md lists them."""


def refusals(args, schedule: str) -> list[str]:
    """Every refusal that applies to a run of ``schedule`` with ``args``: one message each,
    "--pipeline-schedule NAME ..." (none for megatron's own schedules)."""
    family = family_of(schedule)
    if family is None:
        return []
    return [f"--pipeline-schedule {schedule} {row.why}" for row in SETTINGS
            if row.verdict(family) is Verdict.REFUSED and row.used(args)]


def stand_in_settings(args, schedule: str) -> list[Setting]:
    """The settings of this run that only a CPU stand-in of a GPU library proves."""
    family = family_of(schedule)
    if family is None:
        return []
    return [row for row in SETTINGS
            if row.verdict(family) is Verdict.STAND_IN and row.used(args)]


def markdown_table(refused_only: bool = False) -> str:
    """The table docs/training.md shows (``vshape features``): setting, verdict under a V and
    under zb-1p, what proves it, and why (or the way out); ``refused_only``: the rows refused
    under either family."""
    lines = ["| setting | V | zb-1p | proven by | why, or the way out |",
             "|---|---|---|---|---|"]
    for row in SETTINGS:
        if refused_only and Verdict.REFUSED not in (row.v, row.zb):
            continue
        lines.append(f"| `{row.flags}` | {row.v.value} | {row.zb.value} | {row.proven_by} | "
                     f"{row.why} |")
    return "\n".join(lines) + "\n"
