"""Megatron-LM's pretrain_gpt with the megatron-vshape schedules (Megatron-LM tags core_v0.16.1,
core_v0.17.1 and core_v0.18.2 with their megatron-core, or the 0.19-era training code with
megatron-core 0.19.2).

    torchrun --nproc-per-node 8 scripts/pretrain_gpt_vshape.py <pretrain_gpt flags> \\
        --pipeline-schedule v-half [--pipeline-memory-limit 0.5] [--pipeline-replan-after 3]

Run it exactly like pretrain_gpt.py (every Megatron-LM flag works as there), with Megatron-LM
on PYTHONPATH (``export PYTHONPATH=$MEGATRON_LM:$PYTHONPATH``; scripts/slurm/ does this). The
added flags are megatron_vshape.megatron.arguments.add_arguments's (with nvidia-modelopt's,
as pretrain_gpt.py registers them, where Megatron-LM's post-training code imports). For V schedules
(v-min, v-half, v-zb, auto) the model, batch and forward step are V-aware (pipeline rank 0 holds
embedding and LM head, reads tokens and labels); 1f1b, interleaved-1f1b and zb-1p keep
pretrain_gpt's own. Losses are logged as usual (relayed to the last pipeline rank). No patch of
Megatron-LM is needed (see patches/README.md).

The two training loops differ in who parses the flags: core_v0.16.1's and core_v0.17.1's
``pretrain()`` parses them itself (``extra_args_provider``, ``args_defaults``); core_v0.18.2's
and the 0.19-era one take a config
container built from flags the script has parsed (``parse_and_validate_args``). ``_pretrain``
is the one place that tells them apart, by ``pretrain()``'s signature. Everything but the
model's script module and builder is :func:`run`'s, which scripts/pretrain_hybrid_vshape.py
shares (pretrain_hybrid, hybrid_builder). Under both, the model
is built by the model provider through Megatron-LM's ``get_model`` (0.19's container holds no
ModelConfig, so its builder path, which cannot place a V, stays unused).
"""
import functools
import inspect
import logging
import os
import sys
import warnings
from functools import partial


def _log_on_rank_0() -> None:
    """The plugin logs its schedule lines (``[vshape] schedule=...``, which ``vshape collect``
    reads) through logging; print them on global rank 0 only (every rank builds the same plan,
    and a job's log holds every rank's output). Other ranks still report warnings."""
    logger = logging.getLogger("megatron_vshape")
    if int(os.environ.get("RANK", "0")) != 0:
        logger.setLevel(logging.WARNING)
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _config():
    """The plugin's configuration, installed by Megatron-LM's validate_args (megatron_lm_patch):
    the one place the running schedule is read from once flags are parsed."""
    from megatron_vshape.megatron.install import installed_config

    config = installed_config()
    if config is None:
        raise RuntimeError("the plugin's schedule is not installed: pretrain_gpt_vshape.py "
                           "needs Megatron-LM's validate_args to run first (patch_megatron_lm)")
    return config


def _schedule() -> str:
    return _config().schedule


class _BySchedule:
    """Chooses between the V-aware callable and pretrain_gpt's own once flags are parsed."""

    def __init__(self, v, standard):
        self.v, self.standard = v, standard

    def __call__(self, *args, **kwargs):
        from megatron_vshape.schedule.names import V_SCHEDULES

        return (self.v if _schedule() in V_SCHEDULES else self.standard)(*args, **kwargs)


def main() -> None:
    try:
        import pretrain_gpt
        from gpt_builders import gpt_builder
    except ImportError as err:
        raise SystemExit(f"pretrain_gpt_vshape.py needs Megatron-LM's training code of your "
                         f"megatron-core release (core_v0.16.1 to 0.19, or main) on PYTHONPATH: "
                         f"export PYTHONPATH=$MEGATRON_LM:$PYTHONPATH ({err})")
    run(pretrain_gpt, gpt_builder, pretrain_gpt.get_embedding_ranks)


def run(training, builder, standard_embedding_ranks, v_builder=None) -> None:
    """Megatron-LM's ``training`` script module (pretrain_gpt, pretrain_hybrid: its
    ``forward_step``, ``loss_func``, ``train_valid_test_datasets_provider``,
    ``is_dataset_built_on_rank``) with the plugin installed; ``builder`` its model builder
    (gpt_builder, hybrid_builder), ``standard_embedding_ranks`` the embedding ranks of
    megatron's own schedules (None: pretrain()'s default), ``v_builder(builder)`` the builder
    V chunks are built with (None: ``builder``)."""
    from megatron.core.enums import ModelType
    from megatron.training import get_args, get_timers, pretrain
    from megatron.training.arguments import core_transformer_config_from_args
    from model_provider import model_provider
    from megatron_vshape.megatron import batch as vbatch
    from megatron_vshape.megatron import providers
    from megatron_vshape.megatron.arguments import recheck_arguments
    from megatron_vshape.megatron.megatron_lm_patch import patch_megatron_lm
    from megatron_vshape.megatron.model import v_embedding_ranks
    from megatron_vshape.schedule.names import V_SCHEDULES

    _log_on_rank_0()
    patch_megatron_lm()
    base = partial(model_provider, builder)
    v_base = base if v_builder is None else partial(model_provider, v_builder(builder))

    @functools.lru_cache(maxsize=None)
    def v_chunks():  # one per run: it keeps chunk 0 until get_model asks for chunk 1
        return providers.VChunkProvider(
            v_base, lambda: core_transformer_config_from_args(get_args()),
            te_delay_wgrad=get_args().transformer_impl == "transformer_engine",
            stage_layers=_config().stage_layers)

    def v_provider(*args, **kwargs):
        recheck_arguments(get_args())
        return v_chunks()(*args, **kwargs)

    def standard_provider(*args, **kwargs):
        if _schedule() != "zb-1p":
            return base(*args, **kwargs)
        recheck_arguments(get_args())
        build = providers.deferred_standard_provider(  # TE layers: TE's own W split, as for a V
            base, lambda: core_transformer_config_from_args(get_args()),
            te_delay_wgrad=get_args().transformer_impl == "transformer_engine")
        return build(*args, **kwargs)

    def v_forward_step(data_iterator, model):
        args = get_args()
        batch = vbatch.VBatch(args.seq_length, args.micro_batch_size,
                              args.create_attention_mask_in_dataloader, packed=args.sft)
        return vbatch.VForwardStep(batch, training.loss_func, get_timers())(data_iterator, model)

    def datasets(train_val_test_num_samples, vp_stage=None):
        if _schedule() in V_SCHEDULES:  # pipeline rank 0 reads data under a V (--sft: all)
            training.is_dataset_built_on_rank = \
                lambda vp_stage=None, **_: vbatch.is_v_dataset_rank(packed=get_args().sft)
        return training.train_valid_test_datasets_provider(train_val_test_num_samples,
                                                           vp_stage=vp_stage)

    datasets.is_distributed = True

    def embedding_ranks(pp_ranks, *rest):
        if _schedule() in V_SCHEDULES:
            return v_embedding_ranks(pp_ranks)
        if standard_embedding_ranks is None:  # pretrain()'s default
            from megatron.core.parallel_state import default_embedding_ranks

            return default_embedding_ranks(pp_ranks)
        return standard_embedding_ranks(pp_ranks, *rest)

    _pretrain(pretrain, datasets, _BySchedule(v_provider, standard_provider),
              ModelType.encoder_or_decoder, _BySchedule(v_forward_step, training.forward_step),
              embedding_ranks, _extra_args_provider(training), training)


_ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
"""pretrain_gpt's own default."""


def _extra_args_provider(training):
    """The plugin's flags, and nvidia-modelopt's where pretrain_gpt.py registers them (its
    ``extra_args_provider``: core_v0.16.1 pretrain_gpt.py:348, 0.19 :513), so that every
    recipe stock pretrain_gpt.py parses parses here too."""
    from megatron_vshape.megatron.arguments import add_arguments

    def add(parser):
        add_arguments(parser)
        if getattr(training, "has_nvidia_modelopt", False):
            training.add_modelopt_args(parser)
        return parser
    return add


def _pretrain(pretrain, datasets, provider, model_type, forward_step, embedding_ranks,
              extra_args_provider, training) -> None:
    """Call Megatron-LM's pretrain() the way its version wants (module doc): the one branch
    between the two training loops, on pretrain()'s own parameters."""
    if "extra_args_provider" in inspect.signature(pretrain).parameters:  # core_v0.16.1
        pretrain(datasets, provider, model_type, forward_step, args_defaults=_ARGS_DEFAULTS,
                 extra_args_provider=extra_args_provider, get_embedding_ranks=embedding_ranks)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults=_ARGS_DEFAULTS)
    enable_modelopt = getattr(training, "maybe_enable_modelopt", None)  # 0.18: none
    if getattr(training, "has_nvidia_modelopt", False) and enable_modelopt is not None:
        enable_modelopt(args)  # as 0.19's pretrain_gpt.py:517 does
    with warnings.catch_warnings():  # "use a ModelConfig": a V needs the model provider
        warnings.filterwarnings("ignore", message=".*ModelConfig", category=UserWarning)
        container = pretrain_cfg_container_from_args(args)
    # by keyword: 0.18's pretrain() takes model_provider third (training.py:1032), 0.19's
    # fifth (training.py:1019)
    pretrain(container, datasets, model_type=model_type, forward_step_func=forward_step,
             model_provider=provider, get_embedding_ranks=embedding_ranks)


if __name__ == "__main__":
    main()
