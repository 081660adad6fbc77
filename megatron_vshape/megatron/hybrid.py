"""megatron-core's HybridModel (``--hybrid-layer-pattern``) on the V.

A hybrid pattern names one layer family per position (``*`` attention, ``-`` MLP, ``E`` MoE,
``M`` Mamba, ...) and may cut the layers into pipeline segments with ``|``. Under a V the
pattern is read on the V's 2 x PP stages in V order, as Megatron-LM's layer-placing flags are
(stage_layout.py): stage s on rank s for s < p, on rank 2p-1-s after::

    p = 2, "*-|E*|-E|*-"    stage  0    1    2    3
                            layers *-   E*   -E   *-      (rank 0 holds stages 0 and 3)

a pattern without ``|`` is split evenly (layers.stage_layers: the shortfall on rank 0's
chunks). Layers are numbered globally (a checkpoint loads under any placement); rank 0 holds
the embedding (stage 0) and the final norm, LM head and loss (stage 2p-1).

megatron-core selects a chunk's segment itself (hybrid_layer_allocation.select_pipeline_segment:
segment ``vp_stage x p + pp rank`` of a pattern of ``vp x p`` segments, core 0.19.2
hybrid_layer_allocation.py:464), asking ``torch.distributed.get_rank`` of the chunk's pipeline
group. The V builds chunk 1 with a group that reports the mirrored rank p-1-r (model.py), which
torch cannot ask: :func:`patch_segment_selection` answers for that group with segment
``p + (p-1-r)`` = 2p-1-r, the V stage, and its global layer offset. The model is built from
the pattern with 2 x PP segments (:func:`v_pattern`), so the selection is always by segment.

Only the layer families whose linears the plugin's B/W split covers and which run on CPU are
accepted (:data:`V_FAMILIES`; features.py's row refuses the others at argument parsing).
"""
from __future__ import annotations

import argparse
from typing import Callable

from .layers import stage_layers

__all__ = ["V_FAMILIES", "PIPE", "MTP_SEPARATOR", "pattern_segments", "unsupported_families",
           "hybrid_layer_count", "hybrid_stage_layers", "v_pattern", "v_hybrid_builder",
           "patch_segment_selection"]

V_FAMILIES = {"*": "attention", "-": "MLP", "E": "MoE"}
"""The layer families proven under the plugin's schedules: their linears are megatron's
(Transformer Engine's with --transformer-impl transformer_engine), which both W splits cover."""
PIPE = "|"
"""megatron-core's segment separator (hybrid_layer_allocation.Symbols.PIPE)."""
MTP_SEPARATOR = "/"
"""megatron-core's separator of multi-token-prediction patterns (Symbols.MTP_SEPARATOR)."""


def _main(pattern: str) -> str:
    return pattern.split(MTP_SEPARATOR)[0]


def pattern_segments(pattern: str) -> list[str]:
    """The ``|`` segments of the main pattern (one, without ``|``)."""
    return _main(pattern).split(PIPE)


def unsupported_families(pattern: str | None) -> list[str]:
    """The layer symbols of ``pattern`` (its MTP part included) outside :data:`V_FAMILIES`."""
    if not pattern:
        return []
    symbols = set(pattern) - set(V_FAMILIES) - {PIPE, MTP_SEPARATOR}
    return sorted(symbols)


def hybrid_layer_count(pattern: str) -> int:
    """Layers of the main pattern (megatron's num_layers for it)."""
    return len(_main(pattern).replace(PIPE, ""))


def hybrid_stage_layers(pattern: str, ranks: int) -> tuple[int, ...]:
    """Layers of each of the V's 2p stages: the pattern's segments where it has 2p of them,
    else (no ``|``) the even split. Any other count of segments is refused with the way out."""
    segments = pattern_segments(pattern)
    if len(segments) == 2 * ranks:
        return tuple(len(s) for s in segments)
    if len(segments) == 1:
        return stage_layers(len(segments[0]), ranks)
    raise ValueError(
        f"--hybrid-layer-pattern has {len(segments)} '|' segments; a V reads them as its 2 x "
        f"{ranks} stages in V order (stage s on rank s for s < {ranks}, on rank "
        f"{2 * ranks - 1}-s after): write {2 * ranks} segments, or none for an even split "
        f"(a pattern of {ranks} segments is 1F1B's: use --pipeline-schedule zb-1p or 1f1b)")


def v_pattern(pattern: str, ranks: int) -> str:
    """``pattern`` with its main part cut into the V's 2p stages (:func:`hybrid_stage_layers`),
    its MTP part kept: the pattern the V's chunks are built from."""
    counts = hybrid_stage_layers(pattern, ranks)
    layers = _main(pattern).replace(PIPE, "")
    cuts, start = [], 0
    for count in counts:
        cuts.append(layers[start:start + count])
        start += count
    rest = pattern.split(MTP_SEPARATOR)[1:]
    return MTP_SEPARATOR.join([PIPE.join(cuts)] + rest)


def v_hybrid_builder(builder: Callable, ranks: Callable[[], int]) -> Callable:
    """Megatron-LM's ``hybrid_builder(args, pre_process, post_process, vp_stage, config=,
    pg_collection=)`` building from :func:`v_pattern` (on a copy of ``args``: the caller's
    flags stay as parsed); ``ranks()`` gives the pipeline size."""
    def build(args, *rest, **kwargs):
        patch_segment_selection()
        copy = argparse.Namespace(**vars(args))
        copy.hybrid_layer_pattern = v_pattern(args.hybrid_layer_pattern, ranks())
        return builder(copy, *rest, **kwargs)
    return build


def patch_segment_selection() -> None:
    """Wrap hybrid_layer_allocation.select_pipeline_segment (HybridModel imports it when it
    builds, core 0.19.2 hybrid_model.py:195) to answer for the V's mirrored pipeline group
    (module doc); idempotent."""
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation

    current = allocation.select_pipeline_segment
    if hasattr(current, "vshape_original"):
        return
    allocation.select_pipeline_segment = _selecting(current)


def _selecting(original):
    from .model import MirroredGroup

    def select_pipeline_segment(main_pattern, pp_group, vp_stage, *args, **kwargs):
        if not isinstance(pp_group, MirroredGroup):
            return original(main_pattern, pp_group, vp_stage, *args, **kwargs)
        # one segment per "rank" of a pipeline of one: segment index = the V stage
        stage = (vp_stage or 0) * pp_group.size() + pp_group.rank()
        return original(main_pattern, None, stage, *args, **kwargs)
    select_pipeline_segment.vshape_original = original
    return select_pipeline_segment
