"""Megatron-LM's model providers for the plugin's schedules (``scripts/pretrain_gpt_vshape.py``).

Under a V, get_model asks for one chunk per vp stage with megatron's loop-order pre/post flags,
which are wrong for a V: :class:`VChunkProvider` builds chunk ``vp_stage`` of the V instead
(model.py). zb-1p keeps megatron's placement with the weight gradients deferred to W
(:func:`deferred_standard_provider`). Both refuse a model whose W passes would do nothing.
"""
from __future__ import annotations

import logging
from typing import Callable

from ..schedule.names import ZB_1P

__all__ = ["VChunkProvider", "deferred_standard_provider", "check_weight_grads_split",
           "weights_kept_in_b"]

log = logging.getLogger(__name__)


class VChunkProvider:
    """Megatron-LM's ``model_provider`` for the V: get_model calls it once per vp stage with
    pre/post flags for megatron's loop order, which are wrong for a V; this builds chunk
    ``vp_stage`` of the V instead (model.build_v_chunk) and, with chunk 1, ties the embeddings
    and defers the weight gradients of both chunks (DDP with delay_wgrad_compute wraps them).

    ``base(pre_process=, post_process=, vp_stage=, config=, pg_collection=)`` builds one GPT
    chunk (Megatron-LM's ``partial(model_provider, gpt_builder)``); ``config_factory()`` gives
    the TransformerConfig (``core_transformer_config_from_args(get_args())``);
    ``stage_layers`` the layers of each V stage (VShapeConfig.stage_layers: stage_layout.py),
    None for the even split.
    """

    def __init__(self, base: Callable, config_factory: Callable, te_delay_wgrad: bool = False,
                 stage_layers=None):
        self.base = base
        self.config_factory = config_factory
        self.te_delay_wgrad = te_delay_wgrad
        self.stage_layers = stage_layers
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
                                self.te_delay_wgrad, self.stage_layers)
        chunk = build_v_chunk(self._base_provider, config, vp_stage, pg)
        if vp_stage == 0:
            self._chunk0 = chunk
        else:
            finish_v_chunks(self._chunk0, chunk, ddp_delay_wgrad=True)
            check_weight_grads_split(self._chunk0, "v-min/v-half/v-zb/auto", also=(chunk,))
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
    from .te_wgrad import with_te_delay_wgrad
    from .wgrad import defer_weight_grads

    def provider(*args, **kwargs):
        if te_delay_wgrad:
            config = kwargs.get("config") or config_factory()
            kwargs = dict(kwargs, config=with_te_delay_wgrad(config))
        model = base(*args, **kwargs)
        defer_weight_grads(model, WeightGradStore(), mark_for_ddp=True)
        check_weight_grads_split(model, ZB_1P)
        return model
    return provider


def check_weight_grads_split(chunk, schedule: str, also=()) -> None:
    """Refuse a rank whose W passes would do nothing (no layer of ``chunk`` and the chunks in
    ``also``, the rank's other V chunk, splits its weight gradient off B: the schedule would
    run with 1F1B's bubble, silently), and warn about weights whose gradients stay in B (layer
    types neither split covers). A V chunk may hold no transformer layer (a stage layout's
    end stage with the embedding or the loss alone: stage_layout.py); its rank's other may
    not."""
    from .te_wgrad import te_wgrad_modules

    chunks = (chunk, *also)
    te = [module for c in chunks for module in te_wgrad_modules(c)]
    split = sum(bool(getattr(p, "skip_backward_post_hook", False))
                for c in chunks for p in c.parameters())
    if not split and not te:
        raise ValueError(
            f"--pipeline-schedule {schedule} computes weight gradients in W passes, but no layer "
            "of this model splits them off B (the split covers megatron's Column/RowParallel"
            "Linear of --transformer-impl local, and Transformer Engine linears built with "
            "delay_wgrad_compute): use megatron's GPT layer specs with --transformer-impl "
            "local or transformer_engine, or --pipeline-schedule 1f1b")
    kept = set().union(*(weights_kept_in_b(c, te) for c in chunks))
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
