"""Every megatron-core and Megatron-LM name the plugin relies on beyond the documented API.

The glue imports megatron's internals, wraps or replaces module attributes (the
``get_forward_backward_func`` bindings, the layer-placement functions, the linear layers'
autograd Function, Megatron-LM's ``validate_args`` and training.py functions), and sets or reads
attributes that megatron's own code reads (DDP's delayed weight-gradient hooks, the linear
Function's saved fields, the MTP logging tracker). A release that renames one of them would
surface as an AttributeError mid-run, or, for a rebinding that no longer takes effect, as a run
that trains another model silently. :data:`TOUCH_POINTS` lists them in one place, one
:class:`TouchPoint` row each, and :func:`check_touch_points` checks them at start-up: megatron-core
rows (:attr:`Side.CORE`) in ``megatron_vshape.install()``, Megatron-LM rows (:attr:`Side.TRAINING`)
in ``patch_megatron_lm()``, the script path where ``megatron.training`` is importable; rows only
the CPU demo, profiler and test harness use (:attr:`Side.HARNESS`) are checked by the tests.

The Megatron-LM flags that ``features.py``'s rows read are listed there (``SETTINGS`` rows'
``reads``) and checked against the real parsers by tests/megatron/test_megatron_lm_recipes.py;
the flags read anywhere else in the glue are the :attr:`Kind.FLAG` rows here.

``versions`` says on which megatron-core series a row's name was found (Megatron-LM rows: the
training code paired with that series), measured by running :func:`check_touch_points`
against each (tests/megatron/test_touch_points.py checks the column in every environment the
tier runs in):

    0.16  megatron-core 0.16.1, Megatron-LM core_v0.16.1      supported
    0.17  megatron-core 0.17.1, Megatron-LM core_v0.17.1      supported
    0.18  megatron-core 0.18.2, Megatron-LM core_v0.18.2      supported
    0.19  megatron-core 0.19.2, Megatron-LM main 54045a5      supported
    0.20  Megatron-LM main d98e8a6 (megatron-core 0.20.0 in development)

A row whose absence the glue handles itself (a feature probe: ``getattr(..., None)``,
``hasattr``, a signature check) is ``probed``; its absence is no error.
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import inspect
from dataclasses import dataclass

__all__ = ["Side", "Kind", "TouchPoint", "TOUCH_POINTS", "SERIES", "TouchPointError",
           "touch_point_problems", "check_touch_points", "check_flags"]

SERIES = ("0.16", "0.17", "0.18", "0.19", "0.20")
"""The megatron-core series the inventory was measured on (module doc)."""

ALL = SERIES


class Side(enum.Enum):
    """Where a row is checked at start-up."""

    CORE = "megatron-core, checked by megatron_vshape.install()"
    TRAINING = "Megatron-LM's training code, checked by patch_megatron_lm()"
    HARNESS = "the CPU demo, profiler and test harness only, checked by the tests"


class Kind(enum.Enum):
    """What :func:`check_touch_points` checks of a row's ``name``."""

    MODULE = "the module imports (name is empty)"
    SPEC = "the module is found, not imported (name is empty): importing it needs a GPU stack"
    ATTRIBUTE = "the module has the (dotted) attribute"
    CALLABLE = ("the attribute is callable, with the ``leading`` positional and keyword "
                "``params`` the plugin passes")
    CLASS = "the attribute is a class"
    FIELD = "``Class.field`` is a dataclass field of that class"
    SOURCE = "the module's source text mentions the name (attributes megatron's code reads)"
    FLAG = ("a Megatron-LM argument (dest) the glue reads outside features.py, checked on the "
            "namespace Megatron-LM's parser returned (:func:`check_flags`)")


class TouchPointError(ImportError):
    """Names the plugin relies on are missing or changed in the installed megatron."""


@dataclass(frozen=True)
class TouchPoint:
    """One megatron name the plugin relies on."""

    module: str
    """The module that defines or binds it (``megatron.core.parallel_state``)."""
    name: str
    """The attribute, dotted for class members; for SOURCE and FLAG rows the text looked for;
    empty for MODULE and SPEC rows."""
    use: str
    """What the plugin uses it for (and, for a rebinding, which plugin function replaces it)."""
    where: str
    """The plugin module that uses it (``megatron/model.py``)."""
    kind: Kind = Kind.ATTRIBUTE
    side: Side = Side.CORE
    versions: tuple[str, ...] = ALL
    """The series where it was found (module doc)."""
    probed: bool = False
    """The glue copes with its absence (a feature probe), so missing it is no error."""
    params: tuple[str, ...] = ()
    """CALLABLE rows: keyword parameters the plugin passes (checked against the signature)."""
    leading: tuple[str, ...] = ()
    """CALLABLE rows: the first parameters, in order, where the plugin passes them by
    position (checked against the signature)."""

    def __post_init__(self) -> None:
        if not set(self.versions) <= set(SERIES):
            raise ValueError(f"{self.label}: versions {self.versions} not among {SERIES}")
        if (self.kind in (Kind.MODULE, Kind.SPEC)) != (self.name == ""):
            raise ValueError(f"{self.label}: MODULE and SPEC rows (only) have no name")

    @property
    def label(self) -> str:
        """``module.name`` (``module [text]`` for SOURCE and FLAG rows)."""
        if self.kind in (Kind.SOURCE, Kind.FLAG):
            return f"{self.module} [{self.name}]"
        return f"{self.module}.{self.name}" if self.name else self.module


def _rows(module: str, where: str, side: Side = Side.CORE, **shared):
    """The rows of one megatron module used by one plugin file: ``_rows(module, where, side,
    kind=...)(entries)``, each entry ``(name, use)`` or ``(name, use, {field: value})``, with
    ``shared`` fields given to every entry unless it sets them itself."""
    def build(*entries):
        out = []
        for name, use, *extra in entries:
            fields = dict(shared, **(extra[0] if extra else {}))
            out.append(TouchPoint(module, name, use, where, side=side, **fields))
        return out
    return build


_C = Kind.CALLABLE
_PS = "megatron.core.parallel_state"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_LAYERS = "megatron.core.tensor_parallel.layers"
_TRAINING = "megatron.training.training"
_RANDOM = "megatron.core.tensor_parallel.random"

TOUCH_POINTS: tuple[TouchPoint, ...] = tuple(
    # -- schedule registration (install.py) ---------------------------------------------------
    _rows(_SCHED, "megatron/install.py")(
        ("get_forward_backward_func", "rebound: install() puts a ForwardBackwardGetter here",
         {"kind": _C}),
        ("forward_backward_no_pipelining", "rebound: install() guards it against V chunks",
         {"kind": _C}),
        ("forward_backward_pipelining_without_interleaving",
         "rebound: install() guards it against V chunks", {"kind": _C}),
        ("forward_backward_pipelining_with_interleaving",
         "rebound: install() guards it against V chunks", {"kind": _C}),
    ) + _rows("megatron.core.pipeline_parallel", "megatron/install.py")(
        ("get_forward_backward_func", "rebound: install() puts a ForwardBackwardGetter here; "
         "megatron_lm_patch.v_activation_ratio reads the running schedule through it",
         {"kind": _C}),
    ) + _rows(_TRAINING, "megatron/install.py", Side.TRAINING)(
        ("get_forward_backward_func", "rebound: install() puts a ForwardBackwardGetter here",
         {"kind": _C}),
    ) + _rows(_PS, "megatron/install.py")(
        ("get_pipeline_model_parallel_world_size", "the pipeline size when the getter is "
         "called without one", {"kind": _C}),
    ) + _rows("megatron.core.package_info", "megatron/versions.py", kind=Kind.SPEC)(
        ("", "the version, read from its MAJOR/MINOR/PATCH without importing"),
    )
    # -- the passes (compute.py, forward_backward.py) -----------------------------------------
    + _rows(_SCHED, "megatron/compute.py")(
        ("forward_step", "F: megatron's own forward step with the V's vp stage and last stage",
         {"kind": _C, "params": ("collect_non_loss_data", "is_first_microbatch",
                                 "current_microbatch", "vp_stage", "is_last_stage"),
          "leading": ("forward_step_func", "data_iterator", "model", "num_microbatches",
                      "input_tensor", "forward_data_store", "config", "cp_group_size")}),
    ) + _rows(_SCHED, "megatron/forward_backward.py")(
        ("get_tensor_shapes", "the pipeline message's shape",
         {"kind": _C, "params": ("seq_length", "micro_batch_size", "decoder_seq_length",
                                 "config", "tp_group", "cp_group")}),
    ) + _rows("megatron.core.process_groups_config", "megatron/forward_backward.py")(
        ("ProcessGroupCollection", "the pipeline, TP and CP groups", {"kind": Kind.CLASS}),
        ("ProcessGroupCollection.use_mpu_process_groups", "the groups parallel_state set up",
         {"kind": _C}),
        *((f"ProcessGroupCollection.{group}", "the pipeline, TP and CP groups",
           {"kind": Kind.FIELD}) for group in ("pp", "tp", "cp")),
    ) + _rows("megatron.core.utils", "megatron/forward_backward.py")(
        ("get_model_config", "the chunks' config (timers, sync hooks, grad scale)",
         {"kind": _C}),
        ("unwrap_model", "the chunks under DDP / Float16Module (model.py)", {"kind": _C}),
    ) + _rows("megatron.core.model_parallel_config", "megatron/forward_backward.py",
              kind=Kind.FIELD)(
        *((f"ModelParallelConfig.{field}", "the forward-backward contract's config hook")
          for field in ("timers", "no_sync_func", "param_sync_func", "grad_sync_func",
                        "grad_scale_func", "finalize_model_grads_func",
                        "deallocate_pipeline_outputs", "variable_seq_lengths",
                        "pipeline_dtype", "barrier_with_L1_time",
                        "virtual_pipeline_model_parallel_size",
                        "pipeline_model_parallel_size")),
        ("ModelParallelConfig.sequence_parallel", "the message shape's rule for fixed lengths, "
         "asked under variable_seq_lengths (get_tensor_shapes reads it)"),
    ) + _rows("megatron.core.transformer.transformer_config", "megatron/forward_backward.py",
              kind=Kind.FIELD)(
        ("TransformerConfig.hidden_size", "the message shape's rule for fixed lengths, asked "
         "under variable_seq_lengths (get_tensor_shapes reads it)"),
    ) + _rows("megatron.core.transformer.transformer_config", "megatron/model.py",
              kind=Kind.FIELD)(
        ("TransformerConfig.num_layers_in_first_pipeline_stage", "refused under a V"),
        ("TransformerConfig.num_layers_in_last_pipeline_stage", "refused under a V"),
        ("TransformerConfig.pipeline_model_parallel_layout", "refused under a V"),
        ("TransformerConfig.delay_wgrad_compute", "set on a copy: TE's own B/W split "
         "(te_wgrad.py)"),
        ("TransformerConfig.mtp_num_layers", "relay the MTP losses (forward_backward.py)"),
        ("TransformerConfig.calculate_per_token_loss", "broadcast the token count "
         "(forward_backward.py)"),
    ) + _rows("megatron.core.distributed.param_and_grad_buffer", "megatron/forward_backward.py",
              kind=Kind.SOURCE)(
        ("is_first_batch", "set: bucket groups re-learn their gradient-ready counts after a "
         "re-plan"),
        ("golden_per_param_grad_ready_counts", "cleared: as is_first_batch"),
    ) + _rows("megatron.core.distributed.distributed_data_parallel",
              "megatron/forward_backward.py", kind=Kind.SOURCE)(
        ("bucket_groups", "read: the bucket groups to reset after a re-plan"),
        ("expert_parallel_bucket_groups", "read: as bucket_groups"),
        ("register_wgrad_accumulation_and_reduce_hooks", "set on each linear: DDP registers "
         "its gradient hook through it, W calls it (wgrad.py)"),
        ("skip_backward_post_hook", "set on deferred weights: DDP leaves their hook to W "
         "(wgrad.py, te_wgrad.py)"),
        ("grad_added_to_main_grad", "set by W after accumulating into main_grad (wgrad.py)"),
        ("main_grad", "W accumulates the weight gradient there (wgrad.py, te_wgrad.py)"),
    ) + _rows("megatron.core.distributed.distributed_data_parallel_config",
              "megatron/megatron_lm_patch.py", kind=Kind.FIELD)(
        ("DistributedDataParallelConfig.delay_wgrad_compute", "set: DDP's hooks wait for W"),
    ) + _rows("megatron.core.distributed.distributed_data_parallel_config",
              "megatron/megatron_lm_patch.py")(
        ("DistributedDataParallelConfig.__post_init__", "called by the plugin's subclass",
         {"kind": _C}),
    )
    # -- the local linears' B/W split (wgrad.py) ----------------------------------------------
    + _rows(_LAYERS, "megatron/wgrad.py")(
        ("LinearWithGradAccumulationAndAsyncCommunication", "replaced by patch_linear() with a "
         "subclass whose backward splits B and W", {"kind": Kind.CLASS}),
        ("LinearWithGradAccumulationAndAsyncCommunication.forward", "called by the subclass "
         "with (input, weight, *the rest), whose count sets backward's",
         {"kind": _C, "leading": ("ctx", "input", "weight")}),
        ("ColumnParallelLinear", "the layers whose weights W computes", {"kind": Kind.CLASS}),
        ("RowParallelLinear", "the layers whose weights W computes", {"kind": Kind.CLASS}),
        ("custom_bwd", "the backward's autocast decorator, as megatron's", {"kind": _C}),
        ("dist_all_gather_func", "W: gather the input under sequence parallel", {"kind": _C}),
        ("dist_reduce_scatter_func", "B: reduce-scatter the input gradient under sequence "
         "parallel", {"kind": _C}),
        ("fused_weight_gradient_mlp_cuda", "W: the fused fp32 main_grad GEMM where apex built "
         "it (GPU; absent in the CPU environments measured)",
         {"probed": True, "versions": ()}),
    ) + _rows(_LAYERS, "megatron/wgrad.py", kind=Kind.SOURCE)(
        *((f"ctx.{field}", "read in the split backward: saved by megatron's forward")
          for field in ("grad_output_buffer", "sequence_parallel",
                        "gradient_accumulation_fusion", "tp_group", "use_bias",
                        "allreduce_dgrad")),
        ("ctx.gtp_remat_size", "GTP re-materialisation: megatron's own backward where > 1",
         {"probed": True, "versions": ("0.19", "0.20")}),
        ("ctx.input_dtype", "the dtype the split backward casts dY to, as megatron's (its "
         "forward may output another: output_dtype)", {"probed": True, "versions": ("0.20",)}),
    ) + _rows("megatron.core.extensions.transformer_engine", "megatron/te_wgrad.py",
              kind=Kind.SPEC)(
        ("", "the TE wrappers' module name: which modules get TE's backward_dw in W"),
    )
    # -- V placement (model.py, layers.py) ----------------------------------------------------
    + _rows(_PS, "megatron/model.py")(
        ("_MPU_PIPELINE_MODEL_PARALLEL_RANK", "read: the rank setter's own value, put back "
         "after building chunk 1", {"probed": True}),
        ("get_virtual_pipeline_model_parallel_world_size", "saved and put back", {"kind": _C}),
        ("set_pipeline_model_parallel_rank", "chunk 1 is built reporting the mirrored rank",
         {"kind": _C}),
        ("set_virtual_pipeline_model_parallel_world_size", "two chunks per rank while building",
         {"kind": _C}),
        ("get_pipeline_model_parallel_rank", "the V stage of callers that pass no pp_rank "
         "(layers.py), the data rank (batch.py)", {"kind": _C}),
        ("get_pipeline_model_parallel_group", "the MTP layer's real pipeline rank (layers.py)",
         {"kind": _C}),
    ) + [TouchPoint(module, function, "rebound: patch_layer_placement() wraps it with the V's "
                    "(uneven) stage layers", "megatron/layers.py", Kind.CALLABLE,
                    probed=probed, versions=versions)
         for function, module, probed, versions in (
             ("get_transformer_layer_offset", "megatron.core.transformer.transformer_layer",
              False, ALL),
             ("get_transformer_layer_offset", "megatron.core.transformer.transformer_block",
              False, ALL),
             ("get_transformer_layer_offset", "megatron.core.models.gpt.gpt_layer_specs",
              False, ALL),
             ("get_transformer_layer_offset",
              "megatron.core.transformer.multi_token_prediction", True, ("0.16",)),
             ("get_transformer_layer_offset",
              "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs", True, ALL),
             ("get_transformer_layer_offset",
              "megatron.core.models.gpt.experimental_attention_variant_module_specs", True,
              ALL),
             ("get_num_layers_to_build", "megatron.core.transformer.transformer_block",
              False, ALL),
             ("get_num_layers_to_build", "megatron.core.models.gpt.gpt_layer_specs",
              False, ALL),
             ("get_num_layers_to_build",
              "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs", True, ALL),
             ("get_num_layers_to_build",
              "megatron.core.models.gpt.experimental_attention_variant_module_specs", True,
              ALL))
         ] + _rows("megatron.core.models.common.language_module.language_module",
                   "megatron/model.py")(
        ("LanguageModule.shared_embedding_or_output_weight", "the word embedding's copies on "
         "rank 0", {"kind": _C}),
        ("LanguageModule.sharded_state_dict", "wrapped per chunk 1: its embedding copy stays a "
         "non-main replica (replicas.py)", {"kind": _C}),
    ) + _rows("megatron.core.models.gpt.gpt_model", "megatron/model.py", kind=Kind.SOURCE)(
        *((f"self.{field}", "read: which chunk holds the embedding copy")
          for field in ("pre_process", "post_process", "share_embeddings_and_output_weights",
                        "mtp_process", "output_layer")),
    )
    # -- checkpoints (replicas.py, checkpoints.py) --------------------------------------------
    + _rows("megatron.core.dist_checkpointing.mapping", "megatron/replicas.py")(
        ("ShardedTensor", "subclassed: NonMainReplica", {"kind": Kind.CLASS}),
        ("ShardedTensorFactory", "chunk 1's embedding copy entry, built positionally",
         {"kind": _C, "leading": ("key", "data", "build_fn", "merge_fn", "replica_id",
                                  "flattened_range")}),
        *((f"ShardedTensor.{field}", "NonMainReplica keeps megatron's entry's fields",
           {"kind": Kind.FIELD})
          for field in ("key", "data", "dtype", "replica_id", "flattened_range")),
        ("is_main_replica", "which entries to keep non-main", {"kind": _C}),
    ) + _rows("megatron.core.dist_checkpointing.dict_utils", "megatron/replicas.py")(
        ("dict_list_map_outplace", "map the sharded state dict", {"kind": _C}),
    ) + _rows("megatron.core.dist_checkpointing", "megatron/checkpoints.py")(
        ("load_content_metadata", "the saved optimizer format", {"kind": _C}),
    ) + _rows("megatron.core.optimizer.distrib_optimizer", "megatron/checkpoints.py")(
        ("DistributedOptimizer.checkpoint_fully_reshardable_formats", "the formats any "
         "chunk layout loads"),
    )
    # -- data, MTP (batch.py, mtp.py) ---------------------------------------------------------
    + _rows(_PS, "megatron/batch.py", kind=_C)(
        ("get_tensor_model_parallel_rank", "the V's data rank"),
        ("get_tensor_model_parallel_world_size", "broadcast the batch over TP"),
        ("get_tensor_model_parallel_src_rank", "broadcast the batch over TP"),
        ("get_tensor_model_parallel_group", "broadcast the batch over TP"),
        ("get_context_parallel_world_size", "this CP rank's slice"),
        ("get_context_parallel_group", "this CP rank's slice"),
        ("get_data_parallel_group", "the relayed MTP values' averaging group (mtp.py)"),
    ) + _rows("megatron.core.utils", "megatron/batch.py")(
        ("get_batch_on_this_cp_rank", "this CP rank's slice, as pretrain_gpt's get_batch",
         {"kind": _C}),
        ("flatten_batch_for_packed_sequences", "packed sequences' offsets (0.19's SFTDataset)",
         {"kind": _C, "probed": True, "versions": ("0.19", "0.20")}),
    ) + _rows("megatron.core.packed_seq_params", "megatron/batch.py")(
        ("PackedSeqParams", "packed sequences (--sft)", {"kind": Kind.CLASS}),
        *((f"PackedSeqParams.{field}", "packed sequences (--sft)", {"kind": Kind.FIELD})
          for field in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                        "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv")),
        ("PackedSeqParams.tokens_per_sample", "set where the field exists",
         {"kind": Kind.FIELD, "probed": True, "versions": ("0.19", "0.20")}),
    ) + _rows("megatron.core.transformer.multi_token_prediction", "megatron/mtp.py")(
        ("MTPLossLoggingHelper.tracker", "the MTP loss values relayed to the last rank"),
    ) + _rows("megatron.core.transformer.multi_token_prediction", "megatron/mtp.py",
              kind=Kind.SOURCE)(
        ("reduce_group", "the tracker's key, set as GPTModel's save_*_to_tracker sets it"),
        ("avg_group", "the tracker's key, as reduce_group"),
    ) + _rows("megatron.core.transformer.pipeline_parallel_layer_layout",
              "megatron/stage_layout.py")(
        ("PipelineParallelLayerLayout.parse_str_to_list", "a V layout's 2 x PP stages, by "
         "megatron's own grammar", {"kind": _C}),
        ("PipelineParallelLayerLayout.validate_layer_layout", "megatron's own checks of a V "
         "layout (layer and MTP counts)", {"kind": _C}),
    ) + _rows("megatron.core.transformer.enums", "megatron/stage_layout.py")(
        ("LayerType", "what each position of a parsed layout holds", {"kind": Kind.CLASS}),
        ("LayerType.decoder", "a V stage's transformer layers"),
        ("LayerType.embedding", "the stage holding the embedding"),
        ("LayerType.loss", "the stage holding the loss"),
        ("LayerType.mtp", "the stage holding the MTP layers"),
    )
    # -- Megatron-LM (megatron_lm_patch.py, checkpoints.py, the script) -----------------------
    + _rows(_TRAINING, "megatron/megatron_lm_patch.py", Side.TRAINING)(
        ("DistributedDataParallelConfig", "rebound: a subclass with delay_wgrad_compute=True",
         {"kind": Kind.CLASS}),
        ("load_checkpoint", "rebound: checked_load_checkpoint refuses another chunk layout's "
         "optimizer state", {"kind": _C}),
        ("report_theoretical_memory", "rebound: the V's activation memory", {"kind": _C,
                                                                              "probed": True}),
        ("train", "read: check_schedule_binding checks it calls get_forward_backward_func",
         {"kind": _C}),
        ("evaluate", "read: as train", {"kind": _C}),
    ) + _rows(_TRAINING, "megatron/step_log.py", Side.TRAINING)(
        ("train_step", "rebound with $VSHAPE_STEP_LOG: one [vshape] line per iteration per rank",
         {"kind": _C}),
    ) + _rows(_SCHED, "megatron/step_log.py")(
        ("backward_step", "rebound with $VSHAPE_STEP_LOG (forward_step too, the row above): timed (megatron's schedules)",
         {"kind": _C}),
    ) + _rows("megatron.training.initialize", "megatron/megatron_lm_patch.py", Side.TRAINING)(
        ("validate_args", "rebound: the plugin's checks and install() (core_v0.16.1's caller)",
         {"kind": _C, "probed": True, "versions": ("0.16", "0.17")}),
        ("validate_yaml", "rebound: --yaml-cfg refused (core_v0.16.1's caller)",
         {"kind": _C, "probed": True, "versions": ("0.16", "0.17")}),
    ) + _rows("megatron.training.arguments", "megatron/megatron_lm_patch.py", Side.TRAINING)(
        ("validate_args", "rebound: the plugin's checks and install()", {"kind": _C}),
        ("parse_and_validate_args", "the 0.19-era script path parses the flags itself "
         "(scripts/pretrain_gpt_vshape.py)", {"kind": _C, "probed": True,
                                              "versions": ("0.18", "0.19", "0.20")}),
        ("core_transformer_config_from_args", "the V chunks' TransformerConfig "
         "(scripts/pretrain_gpt_vshape.py)", {"kind": _C}),
    ) + _rows("megatron.training.yaml_arguments", "megatron/megatron_lm_patch.py",
              Side.TRAINING)(
        ("validate_yaml", "rebound: --yaml-cfg refused", {"kind": _C, "probed": True}),
    ) + _rows("megatron.training.theoretical_memory_usage", "megatron/megatron_lm_patch.py",
              Side.TRAINING)(
        ("NUM_BYTES_IN_MEGABYTE", "the V's memory report"),
        ("compute_weight_and_optimizer_memory", "the V's memory report", {"kind": _C}),
        ("compute_activation_memory", "the V's memory report", {"kind": _C}),
        ("compute_activation_memory_without_sp", "the V's memory report", {"kind": _C}),
    ) + _rows("megatron.training", "megatron/megatron_lm_patch.py", Side.TRAINING, kind=_C)(
        ("get_args", "the parsed flags (DDP config, load checkpoint, the script)"),
        ("get_timers", "the V forward step's batch timer (scripts/pretrain_gpt_vshape.py)"),
        ("pretrain", "the training loop (scripts/pretrain_gpt_vshape.py)",
         {"params": ("get_embedding_ranks",)}),
    ) + _rows("megatron.training.checkpointing", "megatron/checkpoints.py", Side.TRAINING)(
        ("_load_base_checkpoint", "read the saved arguments before loading", {"kind": _C}),
        ("CheckpointType.GLOBAL", "only global (torch_dist) checkpoints are checked"),
        ("distrib_optim_sharding_type", "the content-metadata key of the saved optimizer "
         "format", {"kind": Kind.SOURCE}),
    ) + _rows("megatron.training.argument_utils", "scripts/pretrain_gpt_vshape.py",
              Side.TRAINING)(
        ("pretrain_cfg_container_from_args", "the 0.19-era pretrain()'s config container",
         {"kind": _C, "probed": True, "versions": ("0.18", "0.19", "0.20")}),
    ) + _rows("megatron.core.enums", "scripts/pretrain_gpt_vshape.py", Side.TRAINING)(
        ("ModelType.encoder_or_decoder", "pretrain()'s model type"),
    ) + _rows("pretrain_gpt", "scripts/pretrain_gpt_vshape.py", Side.TRAINING)(
        ("loss_func", "the V forward step's loss", {"kind": _C}),
        ("forward_step", "1f1b, interleaved-1f1b, zb-1p: pretrain_gpt's own", {"kind": _C}),
        ("train_valid_test_datasets_provider", "the datasets", {"kind": _C}),
        ("is_dataset_built_on_rank", "rebound under a V: pipeline rank 0 reads the data",
         {"kind": _C}),
        ("get_embedding_ranks", "1f1b, interleaved-1f1b, zb-1p: pretrain_gpt's own",
         {"kind": _C}),
        ("has_nvidia_modelopt", "register nvidia-modelopt's flags where pretrain_gpt does",
         {"probed": True}),
        ("add_modelopt_args", "as has_nvidia_modelopt", {"kind": _C, "probed": True}),
        ("maybe_enable_modelopt", "as has_nvidia_modelopt (bound only where nvidia-modelopt "
         "imports: absent in the CPU environments measured)",
         {"kind": _C, "probed": True, "versions": ()}),
    ) + _rows("gpt_builders", "scripts/pretrain_gpt_vshape.py", Side.TRAINING)(
        ("gpt_builder", "builds one GPT chunk", {"kind": _C}),
    ) + _rows("model_provider", "scripts/pretrain_gpt_vshape.py", Side.TRAINING)(
        ("model_provider", "builds one GPT chunk", {"kind": _C}),
    ) + _rows("megatron.training.arguments", "megatron/megatron_lm_patch.py, checkpoints.py, "
              "scripts/pretrain_gpt_vshape.py", Side.TRAINING, kind=Kind.FLAG)(
        *((dest, "a flag read outside features.py")
          for dest in ("num_layers", "pipeline_model_parallel_size", "sequence_parallel",
                       "recompute_granularity", "use_distributed_optimizer", "finetune",
                       "no_load_optim", "no_save_optim", "ckpt_format", "load", "seq_length",
                       "micro_batch_size", "create_attention_mask_in_dataloader",
                       "transformer_impl", "sft")),
        ("align_param_gather", "put back after validate_args (read with getattr: a rename "
         "would silently drop it)"),
        ("encoder_num_layers", "put back after validate_args's num_layers check (getattr)"),
    )
    # -- hybrid models (megatron/hybrid.py, scripts/pretrain_hybrid_vshape.py) ------------------
    + _rows("megatron.core.models.hybrid.hybrid_layer_allocation", "megatron/hybrid.py")(
        ("select_pipeline_segment", "rebound: the V's chunk 1 (its pipeline group reports the "
         "mirrored rank) selects its V stage's segment of --hybrid-layer-pattern",
         {"kind": _C, "leading": ("main_pattern", "pp_group", "vp_stage"), "probed": True,
          "versions": ("0.18", "0.19", "0.20")}),
    ) + _rows(_PS, "scripts/pretrain_gpt_vshape.py", Side.TRAINING)(
        ("default_embedding_ranks", "pretrain()'s own embedding ranks, for megatron's schedules "
         "of a training script without its own (pretrain_hybrid)", {"kind": _C}),
    ) + _rows("pretrain_hybrid", "scripts/pretrain_hybrid_vshape.py", Side.TRAINING)(
        ("", "loss_func, forward_step, train_valid_test_datasets_provider and "
         "is_dataset_built_on_rank, as pretrain_gpt's (found, not imported: its import filters "
         "warnings on ranks > 0)", {"kind": Kind.SPEC, "probed": True,
                                    "versions": ("0.18", "0.19", "0.20")}),
    ) + _rows("hybrid_builders", "scripts/pretrain_hybrid_vshape.py", Side.TRAINING)(
        ("hybrid_builder", "builds one HybridModel chunk (from the V's pattern under a V)",
         {"kind": _C, "probed": True, "versions": ("0.18", "0.19", "0.20"),
          "leading": ("args", "pre_process", "post_process", "vp_stage"),
          "params": ("config", "pg_collection")}),
    )
    # -- the CPU harness (harness/) -----------------------------------------------------------
    + _rows(_RANDOM, "harness/cpu.py", Side.HARNESS)(
        ("get_cuda_rng_tracker", "rebound: a CPU RNG tracker", {"kind": _C}),
        ("model_parallel_cuda_manual_seed", "rebound: CPU seeding", {"kind": _C}),
        ("_get_cuda_rng_state", "rebound: torch's CPU generator state", {"kind": _C}),
        ("_set_cuda_rng_state", "rebound: a no-op", {"kind": _C}),
    ) + _rows("megatron.core.models.backends", "harness/cpu.py", Side.HARNESS)(
        ("LNImpl", "rebound: a LayerNorm that accepts sequence parallel"),
    ) + _rows("megatron.core.transformer.transformer_block", "harness/cpu.py", Side.HARNESS)(
        ("LayerNormImpl", "rebound: as LNImpl"),
    ) + _rows(_PS, "harness/", Side.HARNESS, kind=_C)(
        ("initialize_model_parallel", "the demo's and profiler's groups",
         {"params": ("pipeline_model_parallel_size", "get_embedding_ranks")}),
        ("destroy_model_parallel", "between the demo's layouts"),
        ("is_rank_in_embedding_group", "the demo's 1f1b tied embedding gradients"),
        ("get_embedding_group", "the demo's 1f1b tied embedding gradients"),
    ) + _rows("megatron.core.models.gpt", "harness/", Side.HARNESS)(
        ("", "imported before the CPU shims rebind megatron's RNG", {"kind": Kind.MODULE}),
        ("GPTModel", "the demo's and profiler's model", {"kind": Kind.CLASS}),
    ) + _rows("megatron.core.models.gpt.gpt_layer_specs", "harness/", Side.HARNESS, kind=_C)(
        ("get_gpt_layer_local_spec", "the demo's and profiler's layers"),
        ("get_gpt_layer_with_transformer_engine_spec", "the profiler's TE layers (GPU)"),
    ) + _rows("megatron.core.transformer.transformer_config", "harness/", Side.HARNESS)(
        ("TransformerConfig", "the demo's and profiler's config", {"kind": Kind.CLASS}),
    ) + _rows("megatron.core", "harness/profiling.py", Side.HARNESS)(
        ("__version__", "recorded with a profile"),
    )
)


def _resolve(module, dotted: str):
    """``module``'s attribute ``dotted`` (a.b.c), megatron's own where the plugin has replaced
    it already (its subclass's ``vshape_base``, its wrapper's ``vshape_original``: install()
    may run again); AttributeError where it is missing."""
    value = module
    for part in dotted.split("."):
        value = getattr(value, part)
        value = getattr(value, "vshape_base", None) or getattr(value, "vshape_original", None) \
            or value
    return value


def _source(module) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def _problem(row: TouchPoint) -> str | None:
    """What is wrong with ``row`` in the installed megatron (None: it holds)."""
    assert row.kind is not Kind.FLAG, "FLAG rows are checked on a namespace (check_flags)"
    if row.kind is Kind.SPEC:
        try:
            found = importlib.util.find_spec(row.module) is not None
        except ImportError:
            found = False
        return None if found else "module not found"
    try:
        module = importlib.import_module(row.module)
    except ImportError as err:
        return f"module does not import ({err})"
    if row.kind is Kind.MODULE:
        return None
    if row.kind is Kind.SOURCE:
        return None if row.name in _source(module) else "not in its source"
    owner, _, field = row.name.rpartition(".")
    try:
        value = _resolve(module, owner if row.kind is Kind.FIELD else row.name)
    except AttributeError:
        return "missing"
    if row.kind is Kind.FIELD:
        names = {f.name for f in dataclasses.fields(value)} if dataclasses.is_dataclass(value) \
            else set()
        return None if field in names else "not a dataclass field"
    if row.kind is Kind.CLASS and not isinstance(value, type):
        return f"not a class ({type(value).__name__})"
    if row.kind is Kind.CALLABLE:
        if not callable(value):
            return f"not callable ({type(value).__name__})"
        return _signature_problem(value, row.leading, row.params)
    return None


def _signature_problem(function, leading, params) -> str | None:
    """What keeps ``function`` from taking ``leading`` by position and ``params`` by keyword."""
    if not (leading or params):
        return None
    try:
        parameters = inspect.signature(inspect.unwrap(function)).parameters
    except (TypeError, ValueError):
        return None
    first = list(parameters)[:len(leading)]
    if first != list(leading):
        return f"its parameters start ({', '.join(first)}), not ({', '.join(leading)})"
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return None
    missing = [p for p in params if p not in parameters]
    return f"takes no {', '.join(missing)}" if missing else None


def touch_point_problems(sides=(Side.CORE,), rows=TOUCH_POINTS, args=None
                         ) -> list[tuple[TouchPoint, str]]:
    """(row, problem) for every row of ``sides`` that does not hold here, probed rows too;
    FLAG rows only where ``args`` (Megatron-LM's parsed namespace) is given."""
    def problem(row):
        if row.kind is Kind.FLAG:
            return None if hasattr(args, row.name) else "not in Megatron-LM's parsed arguments"
        return _problem(row)
    return [(row, found) for row in rows if row.side in sides
            and (row.kind is not Kind.FLAG or args is not None)
            for found in [problem(row)] if found is not None]


def check_touch_points(sides=(Side.CORE,), rows=TOUCH_POINTS, args=None) -> None:
    """Raise :class:`TouchPointError` naming every name of ``sides`` that the installed megatron
    lacks or has changed (probed rows are no error), with its version and the supported ones;
    nothing is patched before this passes. ``install()`` checks :attr:`Side.CORE`,
    ``patch_megatron_lm()`` :attr:`Side.TRAINING`; FLAG rows need ``args`` (:func:`check_flags`)."""
    from .versions import installed_megatron_core_version, supported_description

    broken = [(row, problem) for row, problem in touch_point_problems(sides, rows, args)
              if not row.probed]
    if not broken:
        return
    lines = "\n".join(f"  {row.label}: {problem} (used for: {row.use}; {row.where})"
                      for row, problem in broken)
    raise TouchPointError(
        f"megatron-vshape relies on {len(broken)} name(s) that this megatron lacks or has "
        f"changed (megatron-core {installed_megatron_core_version()}; supported: "
        f"{supported_description()} releases, with Megatron-LM's training code of the same "
        f"era):\n{lines}\nInstall a supported release; the full list of names the plugin relies "
        "on is megatron_vshape/megatron/touch_points.py")


def check_flags(args, rows=TOUCH_POINTS) -> None:
    """The FLAG rows against Megatron-LM's parsed namespace ``args`` (validate_args's, before
    it derives fields): a dest renamed upstream fails here instead of a ``getattr`` default
    switching the glue's handling off silently."""
    check_touch_points((Side.TRAINING,), [r for r in rows if r.kind is Kind.FLAG], args)
