"""The V's stage layout: what each of the 2p stages holds, from Megatron-LM's own flags.

Under a V rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1); rank 0 holds both ends,
the embedding (stage 0) and the final norm, LM head and loss (stage 2p-1). Megatron-LM's
flags that place layers keep their meaning, read on the V's 2p stages in V order (stage s on
rank s for s < p, on rank 2p-1-s after; docs/training.md, "Stage layouts")::

    --pipeline-model-parallel-layout "Et|ttt|tt|L"   PP 2: stage 0 = E + 1 layer (rank 0),
                                                      1 = 3 layers (rank 1), 2 = 2 layers
                                                      (rank 1), 3 = loss alone (rank 0)
    --decoder-first/last-pipeline-num-layers F / L    stage 0 gets F, stage 2p-1 gets L, the
                                                      other stages share the rest evenly
    --account-for-embedding/loss-in-pipeline-split    the embedding (loss) counts as a layer:
                                                      (layers + 1 + 1) / 2p per stage, stage
                                                      0 (2p-1) one layer fewer
    none of them                                      schedule.placement.stage_layer_counts

Every stage holds at least one transformer layer, except the end stages, which hold the
embedding or the loss and may hold none; rank 0 holds at least one (its two stages together).
A layout string is parsed by megatron-core's own PipelineParallelLayerLayout (its grammar and
its checks: one embedding first, one loss last, the layer and MTP counts, decoder layers before
MTP); the V adds its own (2 x PP stages, E in stage 0, L and MTP in stage 2p-1). Multi-token
prediction sits in stage 2p-1 beside the LM head, as under the V without a layout.

:func:`v_stage_layout` raises ValueError naming the flag and the valid choices; a run's
checks collect it (arguments.py), and megatron_lm_patch.py hands the counts to the model
(``VShapeConfig.stage_layers``), with the flags hidden from megatron's own config, which would
read them in its interleaved order.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..schedule.io.megatron_layout import layout_string
from ..schedule.model.placement import Layout, Placement, stage_layer_counts

__all__ = ["VStage", "VStageLayout", "v_stage_layout", "LAYOUT_FLAGS", "layout_flags_set",
           "layout_stage_count"]

LAYOUT_FLAGS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split")
"""Megatron-LM's fields that place layers on pipeline stages."""


@dataclass(frozen=True)
class VStage:
    """One V stage: its transformer layers, and what else it runs."""

    layers: int
    embedding: bool = False
    loss: bool = False
    mtp: int = 0
    """Multi-token prediction layers (stage 2p-1 only)."""


@dataclass(frozen=True)
class VStageLayout:
    """The V's 2p stages, stage 0 first. Layer numbering is global: stage s holds layers
    sum(layers[:s]) + 1 ... sum(layers[:s+1]), so a checkpoint (keyed by global layer) loads
    under any layout and schedule."""

    stages: tuple[VStage, ...]

    @property
    def ranks(self) -> int:
        return len(self.stages) // 2

    @property
    def layers(self) -> tuple[int, ...]:
        """Transformer layers per V stage."""
        return tuple(stage.layers for stage in self.stages)

    def rank_layers(self, rank: int) -> int:
        """Transformer layers of ``rank``'s two stages."""
        placement = Placement(self.ranks, Layout.V)
        return sum(self.stages[placement.stage_of(rank, chunk)].layers for chunk in (0, 1))

    def megatron_layout(self) -> str:
        """This layout as --pipeline-model-parallel-layout, its stages in V order."""
        return layout_string([(s.layers, s.embedding, s.loss, s.mtp) for s in self.stages])


def _set(value) -> bool:
    """Whether a flag's value is set (0 layers is a setting; False and None are not)."""
    return value is not None and value is not False


def layout_flags_set(args) -> list[str]:
    """The layer-placing flags set in ``args``, as a user writes them."""
    return ["--" + name.replace("_", "-") for name in LAYOUT_FLAGS
            if _set(getattr(args, name, None))]


def layout_stage_count(layout: str) -> int:
    """Stages of a --pipeline-model-parallel-layout, by megatron-core's own parser."""
    return len(_parsed(layout))


def _parsed(layout: str) -> list:
    """The layout's stages (lists of megatron's LayerType) by megatron-core's own parser, its
    grammar errors as ValueError naming the flag."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import \
        PipelineParallelLayerLayout

    try:
        return PipelineParallelLayerLayout.parse_str_to_list(layout)
    except AssertionError as err:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: {err}") from None


def v_stage_layout(args) -> VStageLayout:
    """The V's stages from Megatron-LM's arguments (module doc); ValueError naming the flag
    and the valid choices where they cannot place a V."""
    p, layers = args.pipeline_model_parallel_size, args.num_layers
    mtp = getattr(args, "mtp_num_layers", None) or 0
    if getattr(args, "pipeline_model_parallel_layout", None):
        others = [f for f in layout_flags_set(args) if f != "--pipeline-model-parallel-layout"]
        if others:
            raise ValueError(f"--pipeline-model-parallel-layout places every layer itself: drop "
                             f"{' / '.join(others)} (megatron refuses them together too)")
        return _checked(_from_layout(args.pipeline_model_parallel_layout, p, layers, mtp),
                        "--pipeline-model-parallel-layout")
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    embedding = bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(args, "account_for_loss_in_pipeline_split", False))
    if (first is not None or last is not None) and (embedding or loss):
        raise ValueError("--decoder-first/last-pipeline-num-layers and --account-for-embedding/"
                         "loss-in-pipeline-split place layers two ways: use one of them "
                         "(megatron refuses them together too)")
    if first is not None or last is not None:
        counts, flag = _from_ends(layers, 2 * p, first, last), \
            "--decoder-first/last-pipeline-num-layers"
    elif embedding or loss:
        counts, flag = _accounting(layers, 2 * p, embedding, loss), \
            "--account-for-embedding/loss-in-pipeline-split"
    else:
        counts, flag = stage_layer_counts(layers, 2 * p), "--num-layers"
    return _checked(_stages(counts, mtp), flag)


def _stages(counts, mtp: int) -> VStageLayout:
    last = len(counts) - 1
    return VStageLayout(tuple(VStage(n, embedding=s == 0, loss=s == last,
                                     mtp=mtp if s == last else 0)
                              for s, n in enumerate(counts)))


def _from_ends(layers: int, stages: int, first, last) -> tuple[int, ...]:
    """megatron's uneven first/last stages on the V's stages: the stages without a count of
    their own share the rest evenly (transformer_block.get_num_layers_to_build)."""
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 0:
            raise ValueError(f"--decoder-{name}-pipeline-num-layers must be >= 0, got {value}")
    ends = (first or 0) + (last or 0)
    middle = stages - (first is not None) - (last is not None)
    rest = layers - ends
    if rest < middle or rest % middle:
        raise ValueError(
            f"--decoder-first/last-pipeline-num-layers ({first} / {last}) leave {rest} of "
            f"--num-layers {layers} for the V's {middle} other stages (of 2 x PP = {stages}): "
            f"they must share them evenly, at least one each; choose first and last so that "
            f"num_layers - first - last is a positive multiple of {middle}")
    per = rest // middle
    counts = [per] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _accounting(layers: int, stages: int, embedding: bool, loss: bool) -> tuple[int, ...]:
    """megatron's --account-for-embedding/loss-in-pipeline-split on the V's stages: the
    embedding (loss) is one more layer of stage 0 (2p-1), and all stages split evenly
    (transformer_layer.get_transformer_layer_offset)."""
    total = layers + embedding + loss
    if total % stages:
        raise ValueError(
            f"--account-for-embedding/loss-in-pipeline-split: num_layers {layers} + "
            f"{embedding + loss} must be a multiple of the V's 2 x PP = {stages} stages (as "
            f"megatron asks of PP x VP stages); use --num-layers "
            f"{total - total % stages + stages - embedding - loss}")
    per = total // stages
    return (per - embedding,) + (per,) * (stages - 2) + (per - loss,)


def _from_layout(layout: str, p: int, layers: int, mtp: int) -> VStageLayout:
    """A layout string read in V order, through megatron-core's parser and checks."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import \
        PipelineParallelLayerLayout

    stages = _parsed(layout)
    if len(stages) != 2 * p:
        raise ValueError(
            f"--pipeline-model-parallel-layout {layout!r} has {len(stages)} stages; a V has "
            f"2 x PP = {2 * p}, in V order (stage s on rank s for s < {p}, on rank "
            f"{2 * p - 1}-s after): write {2 * p} stages separated by '|'")
    try:  # megatron's checks: stage count over PP gives its VP size, 2 (never used to place)
        PipelineParallelLayerLayout(layout, p).validate_layer_layout(layers, mtp or None)
    except (AssertionError, NotImplementedError) as err:
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r}: {err}") from None
    return VStageLayout(tuple(
        VStage(stage.count(LayerType.decoder), embedding=LayerType.embedding in stage,
               loss=LayerType.loss in stage, mtp=stage.count(LayerType.mtp))
        for stage in stages))


def _checked(layout: VStageLayout, flag: str) -> VStageLayout:
    """The V's own rules (module doc), naming ``flag``."""
    stages, last = layout.stages, len(layout.stages) - 1
    where = layout.megatron_layout()
    if not stages[0].embedding or not stages[last].loss:
        raise ValueError(f"{flag}: under a V the embedding is in stage 0 and the loss in "
                         f"stage 2p-1 = {last} (both on rank 0), got {where!r}")
    if any(s.mtp for s in stages[:last]):
        raise ValueError(f"{flag}: under a V multi-token prediction sits in stage 2p-1 = "
                         f"{last} beside the loss (rank 0's chunk 1), got {where!r}")
    empty = [s for s in range(1, last) if stages[s].layers < 1]
    if empty:
        raise ValueError(f"{flag}: V stages {empty} hold no transformer layer ({where!r}); "
                         f"every stage but 0 and {last} (the embedding's and the loss's) "
                         "needs at least one")
    if layout.rank_layers(0) < 1:
        raise ValueError(f"{flag}: rank 0 (stages 0 and {last}) holds no transformer layer "
                         f"({where!r}); give stage 0 or stage {last} at least one")
    return layout
