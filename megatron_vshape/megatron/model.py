"""V-shape model chunks for megatron-core's GPTModel (paper, section 3: the V placement).

Rank r of p holds global stage r (chunk 0, the V's down-leg) and stage 2p-1-r (chunk 1, the
up-leg)::

    stage:  0  1  2  3 | 4  5  6  7          loop order (megatron's interleaved, vp = 2)
    rank :  0  1  2  3 | 3  2  1  0          the V: chunk 1 of rank r is loop rank p-1-r

megatron computes a chunk's layer offset from (pp rank, vp stage) in loop order, so chunk 1 is
built with a pipeline group that reports the mirrored rank p-1-r, and while it is built
parallel_state reports that rank too, with two chunks per rank (:func:`parallel_state_reports`),
for the placement queries that ask it instead of the chunk's group (the layer specs' slicing,
``mtp_on_this_rank``, ``get_mtp_num_layers_to_build``): its layers, layer numbers and
checkpoint keys then are those of stage 2p-1-r, and a V checkpoint is a standard one. Rank 0
holds the embedding (stage 0) and the final norm, LM head and loss (stage 2p-1), so the
embedding group is rank 0 alone (:func:`v_embedding_ranks`).

Copies of the word embedding. megatron keeps one Parameter per stage that uses the word
embedding and sums their gradients over its embedding group (finalize_model_grads); under the
V every such stage is on rank 0, so the copies are Parameters of rank 0's two chunks:

    chunk 0 (stage 0)      embedding.word_embeddings.weight     the one megatron initialises
    chunk 1 (stage 2p-1)   output_layer.weight                  tied embeddings, no MTP
                           embedding.word_embeddings.weight     multi-token prediction (MTP):
                                                                its embedding, and with tied
                                                                embeddings the LM head's weight

:func:`tie_embeddings` copies chunk 0's into chunk 1's (megatron zero-fills it and would fill it
by its all-reduce), :func:`sum_tied_embedding_grads` gives both the sum of their gradients
after every step (megatron's all-reduce over first, last and MTP stage), so they stay equal.
In a checkpoint chunk 1's copy is what megatron makes the last stage's, a replica of
``embedding.word_embeddings.weight`` that is loaded and never written, under megatron's fully
parallel save too (:func:`save_copy_as_replica`, replicas.py).
With tied embeddings and MTP, chunk 1 also holds an ``output_layer.weight`` that nothing uses,
exactly as megatron's last stage does (megatron-core builds it and passes the embedding's
weight to the LM head instead).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Callable

import torch

from ..runtime.wgrad import WeightGradStore
from .layers import patch_layer_placement, with_stage_layers
from .layers import stage_layers as stage_layers_of
from .te_wgrad import with_te_delay_wgrad
from .wgrad import defer_weight_grads

__all__ = ["MirroredGroup", "v_embedding_ranks", "build_v_chunks", "build_v_chunk",
           "v_chunk_config", "finish_v_chunks", "tie_embeddings", "save_copy_as_replica",
           "sum_tied_embedding_grads",
           "embedding_copy", "parallel_state_reports", "check_v_config", "V_PLACED",
           "is_v_placed"]

V_PLACED = "vshape_v_placed"
"""Attribute set on every chunk :func:`build_v_chunk` builds: megatron's own schedule
functions refuse such chunks (install.py), since they would run them in the interleaved
order, whose stage s is on rank s % p, not on the V."""


class MirroredGroup:
    """A pipeline group that reports rank p-1-r; everything else goes to the real group.

    Only layer placement reads it (offsets and checkpoint keys); the schedule's communication
    never goes through a model's pipeline group.
    """

    def __init__(self, group):
        self._group = group

    def rank(self) -> int:
        return self._group.size() - 1 - self._group.rank()

    def size(self) -> int:
        return self._group.size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def v_embedding_ranks(pp_ranks, split_rank=None):
    """``initialize_model_parallel(get_embedding_ranks=...)`` for the V: rank 0 holds both ends."""
    return [pp_ranks[0]]


def check_v_config(config, pp_size: int, stage_layers=None) -> None:
    """Refuse settings the V cannot run, naming the setting and what to change.
    ``stage_layers``: the layers of each V stage (stage_layout.py), None for an even split."""
    if pp_size < 2:
        raise ValueError("V schedules need pipeline_model_parallel_size >= 2 (got "
                         f"{pp_size}); with one stage use --pipeline-schedule 1f1b")
    if stage_layers is None:
        stage_layers_of(config.num_layers, pp_size)  # raises for too few layers
    elif len(stage_layers) != 2 * pp_size or sum(stage_layers) != config.num_layers:
        raise ValueError(f"stage_layers {tuple(stage_layers)} must give the V's 2 x {pp_size} "
                         f"stages num_layers={config.num_layers} layers in all")
    if getattr(config, "pipeline_model_parallel_layout", None):
        raise ValueError("pipeline_model_parallel_layout places stage s on rank s % p; for a V "
                         "leave it unset and pass stage_layers (the layers of each V stage: "
                         "stage_layout.v_stage_layout reads Megatron-LM's layout in V order)")
    if config.num_layers_in_first_pipeline_stage or config.num_layers_in_last_pipeline_stage \
            or getattr(config, "account_for_embedding_in_pipeline_split", False) \
            or getattr(config, "account_for_loss_in_pipeline_split", False):
        raise ValueError("num_layers_in_first/last_pipeline_stage and account_for_embedding/"
                         "loss_in_pipeline_split split megatron's interleaved stages; for a V "
                         "leave them unset and pass stage_layers (stage_layout.v_stage_layout "
                         "reads Megatron-LM's flags on the V's stages)")


def v_chunk_config(config, pp_size: int, te_delay_wgrad: bool = False, stage_layers=None):
    """A copy of ``config`` for building V chunks (``config`` itself is not modified): two chunks
    per rank (virtual_pipeline_model_parallel_size = 2, which megatron needs to place them),
    the V's stage layer counts (``stage_layers``, one per V stage, else layers.py's even split
    with the shortfall on rank 0; and the V's stage for callers that ask parallel_state, as
    Megatron-LM's MoE layer specs do), TE's delayed weight gradients if asked."""
    check_v_config(config, pp_size, stage_layers)
    config = dataclasses.replace(config, virtual_pipeline_model_parallel_size=2)
    patch_layer_placement()
    config = with_stage_layers(config, pp_size, stage_layers)
    if te_delay_wgrad:
        config = with_te_delay_wgrad(config)
    return config


def build_v_chunk(model_provider: Callable[..., torch.nn.Module], config, vp_stage: int,
                  pg_collection=None) -> torch.nn.Module:
    """One V chunk of this rank: chunk 0 is stage r (pre_process on rank 0), chunk 1 is stage
    2p-1-r (post_process on rank 0), built with the mirrored pipeline group (module doc).
    ``config`` comes from :func:`v_chunk_config`."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    base = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    first = base.pp.rank() == 0
    if vp_stage == 0:
        with parallel_state_reports(None):
            chunk = model_provider(config=config, pre_process=first, post_process=False,
                                   vp_stage=0, pg_collection=base)
    else:
        mirrored = copy.copy(base)
        mirrored.pp = MirroredGroup(base.pp)
        with parallel_state_reports(mirrored.pp.rank()):
            chunk = model_provider(config=config, pre_process=False, post_process=first,
                                   vp_stage=1, pg_collection=mirrored)
    setattr(chunk, V_PLACED, True)
    return chunk


@contextlib.contextmanager
def parallel_state_reports(pipeline_rank: int | None, virtual_size: int = 2):
    """Inside, megatron's parallel_state reports a V chunk's placement: ``pipeline_rank`` as
    this process's pipeline rank (None: the real one) and ``virtual_size`` chunks per rank, as
    Megatron-LM sets them for a V run (its setters, megatron's own way to build a chunk for
    another placement); the previous settings come back after."""
    from megatron.core import parallel_state

    rank = getattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", None)  # the setter's
    # own value (None: none set), which get_pipeline_model_parallel_rank does not return
    size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pipeline_rank is not None:
        parallel_state.set_pipeline_model_parallel_rank(pipeline_rank)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(virtual_size)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(rank)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(size)


def is_v_placed(chunk) -> bool:
    """Whether ``chunk`` (or the module a DDP / Float16Module wrapper holds) is a V chunk."""
    seen = 0
    while chunk is not None and seen < 8:  # wrappers nest a few levels at most
        if getattr(chunk, "__dict__", {}).get(V_PLACED, False):
            return True
        chunk = getattr(chunk, "module", None)
        seen += 1
    return False


def finish_v_chunks(chunk0, chunk1, defer_wgrad: bool = True, ddp_delay_wgrad: bool = False):
    """After building both chunks: copy the word embedding into chunk 1's copy on rank 0 (module
    doc) and route the parallel linears' weight gradients through a W store per chunk
    (:mod:`.wgrad`)."""
    if embedding_copy(chunk0, chunk1) is not None:
        tie_embeddings(chunk0, chunk1)
        save_copy_as_replica(chunk0, chunk1)
    if defer_wgrad:
        for chunk in (chunk0, chunk1):
            defer_weight_grads(chunk, WeightGradStore(), mark_for_ddp=ddp_delay_wgrad)


def build_v_chunks(model_provider: Callable[..., torch.nn.Module], config, pp_group,
                   pg_collection=None, defer_wgrad: bool = True,
                   ddp_delay_wgrad: bool = False, te_delay_wgrad: bool = False,
                   stage_layers=None) -> list[torch.nn.Module]:
    """Build this rank's two V chunks with ``model_provider(config=, pre_process=,
    post_process=, vp_stage=, pg_collection=)`` (e.g. a ``functools.partial`` of GPTModel).

    ``config`` is not modified (see :func:`v_chunk_config`). With ``defer_wgrad`` each chunk's
    parallel linears compute weight gradients in W (:mod:`.wgrad`); set ``ddp_delay_wgrad``
    when the chunks will be wrapped in DDP with delay_wgrad_compute=True. With a Transformer
    Engine layer spec (GPU) set ``te_delay_wgrad``: TE's own split (``backward_dw``) runs in W.
    ``stage_layers``: the layers of each of the 2p V stages (stage_layout.py), None for the
    even split.
    """
    config = v_chunk_config(config, pp_group.size(), te_delay_wgrad, stage_layers)
    chunks = [build_v_chunk(model_provider, config, v, pg_collection) for v in (0, 1)]
    finish_v_chunks(*chunks, defer_wgrad=defer_wgrad, ddp_delay_wgrad=ddp_delay_wgrad)
    return chunks


def embedding_copy(chunk0, chunk1):
    """Chunk 1's copy of the word embedding on rank 0 (the LM head's weight with tied
    embeddings, the MTP block's embedding with multi-token prediction: module doc), None where
    this rank holds none (other ranks, untied embeddings without MTP)."""
    if not getattr(chunk0, "pre_process", False):
        return None
    tied = getattr(chunk1, "post_process", False) and \
        getattr(chunk1, "share_embeddings_and_output_weights", False)
    if not (tied or getattr(chunk1, "mtp_process", False)):
        return None
    return chunk1.shared_embedding_or_output_weight()


def tie_embeddings(chunk0, chunk1) -> None:
    """Copy the word embedding into chunk 1's copy (megatron zero-fills it and would fill it by
    an all-reduce between the first and the last or MTP pipeline ranks, which under the V are
    one rank)."""
    with torch.no_grad():
        embedding_copy(chunk0, chunk1).copy_(chunk0.shared_embedding_or_output_weight())


def save_copy_as_replica(chunk0, chunk1) -> None:
    """Chunk 1's sharded state dict keeps its copy of the word embedding a non-main replica of
    ``embedding.word_embeddings.weight`` (megatron marks it one) under megatron's fully
    parallel save too, which would make it main beside chunk 0's (replicas.py): the copy and
    its optimizer state are loaded from that key, as megatron's last or MTP stage loads them,
    and only chunk 0's is written."""
    copy_ = embedding_copy(chunk0, chunk1)
    original = chunk1.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        from .replicas import replica_entries

        return replica_entries(original(*args, **kwargs), copy_)

    chunk1.sharded_state_dict = sharded_state_dict


def sum_tied_embedding_grads(chunks) -> None:
    """After backward: the word embedding's gradient is the sum over its uses; write it to both
    Parameters (``main_grad`` under megatron's DDP, else ``grad``), as megatron's all-reduce
    over its embedding group does."""
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(chunks))  # DDP / Float16Module wrappers
    if len(chunks) != 2:
        return
    b = embedding_copy(*chunks)
    if b is None:
        return
    a = chunks[0].shared_embedding_or_output_weight()
    attr = "main_grad" if hasattr(a, "main_grad") else "grad"
    ga, gb = getattr(a, attr), getattr(b, attr)
    if ga is None or gb is None:
        return
    total = ga + gb
    ga.copy_(total)
    gb.copy_(total)
