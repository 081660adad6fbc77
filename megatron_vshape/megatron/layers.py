"""Uneven layer counts on the V: which global layers each of the 2p stages holds.

The counts come from Megatron-LM's layer-placing flags read on the V's stages
(stage_layout.py: a layout, first/last stage layers, the embedding or loss counted as a
layer). Without them: rank 0 also runs the embedding (stage 0) and the final norm, LM head
and loss (stage 2p-1), so a model whose layer count does not fill 2p equal stages gives the
missing layers to rank 0's chunks first (then rank 1's, ...)::

    p = 4, 14 layers:   stage  0  1  2  3  4  5  6  7
                        layers 1  2  2  2  2  2  2  1      (rank 0 holds stages 0 and 7)

megatron computes a chunk's layers with ``get_transformer_layer_offset`` and
``get_num_layers_to_build``, bound by name in several modules and called again when saving
checkpoints. :func:`patch_layer_placement` wraps them in those modules: a config carrying
``vshape_stage_layers`` (every V chunk's, model.v_chunk_config) gets the V's counts (the loop
stage of (pp rank, vp stage) is the V stage, since chunk 1 reports the mirrored rank, see
model.py); any other config goes to megatron's own functions.

Callers that pass no ``pp_rank`` ask parallel_state: Megatron-LM's gpt_builder does so for an
MoE model's layer specs (``get_gpt_decoder_block_spec(config, vp_stage=)``, core_v0.16.1
gpt_builders.py:58, 0.19 :43), which slices the dense / MoE pattern of ``--moe-layer-freq`` by
the chunk's offset and count, and for the MTP block's spec. model.build_v_chunk builds chunk 1
while parallel_state reports the mirrored rank, so these get the V's stage 2p-1-r too; with
the real rank they would get the loop's stage p+r: other layers' types (a dense layer where
the model has an MoE one), with uneven stages another layer count, and MTP on rank p-1.

Multi-token prediction (megatron-core 0.16): the MTP layer's transformer layer is numbered
num_layers + depth, as megatron builds it: ``depth + num_layers - offset`` with the offset
from ``multi_token_prediction``'s binding, plus the offset TransformerLayer adds itself. That
layer is built without the chunk's pipeline group (parallel_state's real group, whose rank is
not mirrored), so the binding there answers with the offset of that same rank, which cancels
(:func:`_cancelling_offset`); megatron-core 0.19 numbers MTP layers from 1 without offsets.
"""
from __future__ import annotations

import importlib

from ..schedule.model.placement import stage_layer_counts

__all__ = ["stage_layers", "patch_layer_placement"]

_ATTR = "vshape_stage_layers"
_MTP_MODULE = "megatron.core.transformer.multi_token_prediction"
_SPECS = ("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
          "megatron.core.models.gpt.experimental_attention_variant_module_specs")
"""Layer-spec modules that bind both names too (megatron-core 0.16 and 0.19)."""
_BINDINGS = {
    "get_transformer_layer_offset": ("megatron.core.transformer.transformer_layer",
                                     "megatron.core.transformer.transformer_block",
                                     "megatron.core.models.gpt.gpt_layer_specs",
                                     _MTP_MODULE) + _SPECS,
    "get_num_layers_to_build": ("megatron.core.transformer.transformer_block",
                                "megatron.core.models.gpt.gpt_layer_specs") + _SPECS,
}


def stage_layers(num_layers: int, ranks: int) -> tuple[int, ...]:
    """Layers per V stage (2p of them): schedule.placement.stage_layer_counts (equal, the
    shortfall taken from rank 0's chunks first, then rank 1's, ...), with the error naming
    the V's need."""
    try:
        return stage_layer_counts(num_layers, 2 * ranks)
    except ValueError:
        raise ValueError(
            f"num_layers={num_layers} cannot give each of the V's 2 x {ranks} stages at least one "
            f"layer; use num_layers >= {2 * ranks}") from None


def _v_stage(config, vp_stage, pp_rank) -> int:
    """The V stage of chunk ``vp_stage`` on the rank ``pp_rank`` reports (chunk 1 reports the
    mirrored rank); without ``pp_rank``, the rank parallel_state reports (mirrored while chunk
    1 is built: module doc)."""
    ranks = config.pipeline_model_parallel_size
    if pp_rank is None:
        from megatron.core import parallel_state

        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return (vp_stage or 0) * ranks + pp_rank


def _offset(original):
    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        counts = getattr(config, _ATTR, None)
        if counts is None:
            return original(config, vp_stage, pp_rank)
        return sum(counts[:_v_stage(config, vp_stage, pp_rank)])
    get_transformer_layer_offset.vshape_original = original
    return get_transformer_layer_offset


def _count(original):
    def get_num_layers_to_build(config, vp_stage=None, pp_rank=None):
        counts = getattr(config, _ATTR, None)
        if counts is None:
            return original(config, vp_stage, pp_rank)
        return counts[_v_stage(config, vp_stage, pp_rank)]
    get_num_layers_to_build.vshape_original = original
    return get_num_layers_to_build


def _cancelling_offset(original):
    """``get_transformer_layer_offset`` as multi_token_prediction (megatron-core 0.16) binds it:
    the offset that the MTP layer's transformer layer adds itself, from parallel_state's real
    pipeline group (module doc)."""
    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        counts = getattr(config, _ATTR, None)
        if counts is None:
            return original(config, vp_stage, pp_rank)
        if pp_rank is None:
            import torch
            from megatron.core import parallel_state

            pp_rank = torch.distributed.get_rank(
                group=parallel_state.get_pipeline_model_parallel_group())
        return sum(counts[:_v_stage(config, vp_stage, pp_rank)])
    get_transformer_layer_offset.vshape_original = original
    return get_transformer_layer_offset


def patch_layer_placement() -> None:
    """Wrap megatron's placement functions where they are bound (idempotent)."""
    wrappers = {"get_transformer_layer_offset": _offset, "get_num_layers_to_build": _count}
    for name, modules in _BINDINGS.items():
        for module_name in modules:
            module = _importable(module_name)
            current = getattr(module, name, None)
            if current is not None and not hasattr(current, "vshape_original"):
                wrap = _cancelling_offset if module_name == _MTP_MODULE else wrappers[name]
                setattr(module, name, wrap(current))


def _importable(module_name: str):
    """The module, or None where this megatron-core has no such module (the spec modules
    come and go between releases; the ones the V builds with always exist)."""
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


def with_stage_layers(config, ranks: int, counts=None):
    """A copy of ``config`` that places the V's stage layers: ``counts`` (one per V stage, from
    stage_layout.py), else :func:`stage_layers`' even split."""
    import dataclasses

    copy = dataclasses.replace(config)
    setattr(copy, _ATTR, tuple(counts) if counts is not None
            else stage_layers(config.num_layers, ranks))
    return copy
