"""W passes that do something: zb-1p with Transformer Engine layers, and models no split covers.

zb-1p and the V schedules defer weight gradients to W by two mechanisms: our B/W split of
megatron's Column/RowParallelLinear (local spec, wgrad.py) and Transformer Engine's own
(``delay_wgrad_compute``, W calls ``backward_dw``). zb-1p used only the first, so a TE model
(Megatron-LM's default --transformer-impl) ran empty W passes: right losses, 1F1B's bubble, no
word. Its provider now builds TE models with delay_wgrad_compute as V chunks are, and every
deferring provider refuses a model in which no layer splits its weight gradient.

Transformer Engine needs a GPU: these tests check the wiring on CPU with stand-ins of TE's
megatron wrappers (a module of megatron.core.extensions.transformer_engine with the wrappers'
``config`` and ``backward_dw``). tests/megatron/test_gpu.py runs a real TELinear's backward_dw in W.
"""
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_vshape.megatron.providers import (  # noqa: E402
    check_weight_grads_split, deferred_standard_provider)


class FakeTELinear(torch.nn.Module):
    """What the plugin reads of megatron's TE linear wrappers: their module, ``config`` (with
    delay_wgrad_compute) and ``backward_dw``, which here counts its calls."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.ones(4, 4))
        self.dw_calls = 0

    def forward(self, x):
        return x @ self.weight.t()

    def backward_dw(self):
        self.dw_calls += 1


FakeTELinear.__module__ = "megatron.core.extensions.transformer_engine"


def _config():
    return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)


def _te_model(pre_process=True, post_process=True, vp_stage=None, config=None,
              pg_collection=None):
    """A TE 'model' as Megatron-LM's model_provider(gpt_builder) would build from ``config``."""
    model = torch.nn.Sequential(FakeTELinear(config))
    model.built_with = config
    return model


def test_zb1p_builds_transformer_engine_layers_with_delayed_weight_grads():
    """The config the model is built with has delay_wgrad_compute; the user's is untouched,
    whether get_model passes it or the factory makes it."""
    given = _config()
    model = deferred_standard_provider(_te_model, _config, te_delay_wgrad=True)(
        pre_process=True, post_process=True, config=given)
    assert model.built_with.delay_wgrad_compute and not given.delay_wgrad_compute
    assert model[0].config is model.built_with
    made = deferred_standard_provider(_te_model, _config, te_delay_wgrad=True)(
        pre_process=True, post_process=True)
    assert made.built_with.delay_wgrad_compute


def test_v_chunk_configs_keep_the_v_layers_with_te_delayed_weight_grads():
    """v_chunk_config with te_delay_wgrad: the copy that turns on TE's split keeps the V's stage
    layers (before, dataclasses.replace dropped them, and a TE model's chunk 1 sliced
    --moe-layer-freq by megatron's loop stage); the caller's config is untouched."""
    from megatron_vshape.megatron.layers import stage_layers
    from megatron_vshape.megatron.model import v_chunk_config

    config = TransformerConfig(num_layers=8, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    built = v_chunk_config(config, 2, te_delay_wgrad=True)
    assert built.delay_wgrad_compute and not config.delay_wgrad_compute
    assert built.vshape_stage_layers == stage_layers(8, 2)
    assert not hasattr(config, "vshape_stage_layers")
    laid_out = v_chunk_config(config, 2, te_delay_wgrad=True, stage_layers=(1, 4, 3, 0))
    assert laid_out.vshape_stage_layers == (1, 4, 3, 0) and laid_out.delay_wgrad_compute


def test_zb1p_w_pass_calls_transformer_engines_backward_dw():
    """MegatronStages under zb-1p: B leaves the TE layer's weight GEMM, its W calls
    backward_dw, once per microbatch, in W and not before."""
    from megatron_vshape.megatron.compute import MegatronStages
    from megatron_vshape.schedule.registry import build_schedule

    model = deferred_standard_provider(_te_model, _config, te_delay_wgrad=True)(
        pre_process=True, post_process=True)
    schedule = build_schedule("zb-1p", 2, 2, variant="paper")
    config = SimpleNamespace(timers=None, grad_sync_func=None, grad_scale_func=None,
                             no_sync_func=None, param_sync_func=None)
    stages = MegatronStages(schedule, 1, [model], None, [None], config)
    last = schedule.num_stages - 1
    for microbatch in range(2):
        output = model(torch.ones(2, 4)).sum()
        stages.backward_input(last, microbatch, output, None)
        assert model[0].dw_calls == microbatch
        stages.backward_weight(last, microbatch)
        assert model[0].dw_calls == microbatch + 1
    assert not stages.pending_weight_work()


def test_transformer_engine_layers_without_delay_are_refused():
    """Before: a TE model under zb-1p split nothing, silently. A model with no layer whose
    weight gradient W can take is refused, naming the schedule and the ways out."""
    with pytest.raises(ValueError) as err:
        deferred_standard_provider(_te_model)(pre_process=True, post_process=True,
                                              config=_config())
    message = str(err.value)
    assert "--pipeline-schedule zb-1p" in message and "no layer" in message
    assert "--transformer-impl" in message and "--pipeline-schedule 1f1b" in message
    with pytest.raises(ValueError, match="v-min/v-half/v-zb/auto"):
        check_weight_grads_split(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                 "v-min/v-half/v-zb/auto")


def test_layers_no_split_covers_are_named_in_a_warning(caplog):
    """Split layers, embeddings and the LM head pass quietly; a layer type neither split
    covers (here torch's Linear) is named: its weight gradient stays in B."""
    chunk = torch.nn.Module()
    chunk.te = FakeTELinear(SimpleNamespace(delay_wgrad_compute=True))
    chunk.embedding = torch.nn.Embedding(8, 4)
    chunk.output_layer = torch.nn.Linear(4, 8)
    with caplog.at_level(logging.WARNING, logger="megatron_vshape"):
        check_weight_grads_split(chunk, "zb-1p")
    assert not caplog.records
    chunk.extra = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING, logger="megatron_vshape"):
        check_weight_grads_split(chunk, "zb-1p")
    [record] = caplog.records
    assert "zb-1p" in record.getMessage() and "Linear" in record.getMessage()
