"""The V's report_theoretical_memory (megatron_lm_patch._v_theoretical_memory) reads the V's
stage layout: activations weighted by each stage's layers, weights of the rank holding the
most layers. Megatron-LM's formulas are stood in by linear ones, so each number is checked by
hand; one process, milliseconds."""
import sys
import types
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("torch")
from support.megatron_cpu import importorskip_megatron  # noqa: E402

importorskip_megatron()
pytestmark = pytest.mark.megatron_versions

import megatron.core.pipeline_parallel as pipeline_parallel  # noqa: E402

from megatron_vshape.megatron import megatron_lm_patch  # noqa: E402
from megatron_vshape.megatron.install import VShapeConfig  # noqa: E402
from megatron_vshape.megatron.megatron_lm_patch import (_v_theoretical_memory,  # noqa: E402
                                                        v_activation_ratio)
from megatron_vshape.schedule import build_schedule, simulate  # noqa: E402


@pytest.fixture
def usage(monkeypatch):
    """megatron.training.theoretical_memory_usage with linear formulas: 10 MB of weights per
    layer on the most loaded rank (num_layers / PP of them) plus 100 MB of embedding; 1 MB of
    activations per layer-microbatch of rank 0 under 1F1B (megatron's per-layer x num_layers)."""
    module = types.ModuleType("megatron.training.theoretical_memory_usage")
    module.NUM_BYTES_IN_MEGABYTE = 1
    module.compute_weight_and_optimizer_memory = \
        lambda args: 10 * args.num_layers / args.pipeline_model_parallel_size + 100
    module.compute_activation_memory_without_sp = \
        lambda args, num_microbatches: float(args.num_layers)
    module.compute_activation_memory = module.compute_activation_memory_without_sp
    package = types.ModuleType("megatron.training")
    package.theoretical_memory_usage = module
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.theoretical_memory_usage", module)
    # no schedule has run (megatron's own function needs parallel_state): built by name
    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", lambda: None)
    return module


def _args(**overrides):
    values = dict(pipeline_schedule="v-half", pipeline_model_parallel_size=2, num_layers=8,
                  sequence_parallel=False, recompute_granularity=None,
                  virtual_pipeline_model_parallel_size=2)
    values.update(overrides)
    return SimpleNamespace(**values)


def _report(args, stage_layers):
    """The report as the installed configuration (v-half, these stage layers) asks for it."""
    config = VShapeConfig(schedule="v-half", stage_layers=stage_layers)
    with mock.patch.object(megatron_lm_patch, "installed_config", lambda: config):
        return _v_theoretical_memory(lambda *a, **k: None)(args, num_microbatches=4)


def test_an_even_layout_reports_megatrons_1f1b_formulas_times_the_simulated_ratio(usage):
    ratio = simulate(build_schedule("v-half", 2, 4)).peak_memory_vs_1f1b
    assert v_activation_ratio("v-half", 2, 4, (2, 2, 2, 2)) == pytest.approx(ratio)
    weights, activation, total = _report(_args(), (2, 2, 2, 2))
    assert weights == 10 * 4 + 100 and activation == pytest.approx(8 * ratio)


def test_an_uneven_layout_weights_each_stage_by_its_layers(usage):
    """V-Half, p = 2, m = 4, layers (1, 3, 3, 1): rank 1 (stages 1 and 2, 3 layers each) runs
    1F0 2F0 1F1 2F1 before its first W, so it keeps 4 x 3 = 12 layer-microbatches; rank 0 peaks
    at 4 x 1; 1F1B's rank 0 keeps 2 microbatches of 4 layers = 8: ratio 1.5 (even: 8 / 8)."""
    assert v_activation_ratio("v-half", 2, 4, (1, 3, 3, 1)) == pytest.approx(1.5)
    weights, activation, total = _report(_args(), (1, 3, 3, 1))
    assert activation == pytest.approx(8 * 1.5)
    assert weights == 10 * 6 + 100  # rank 1's 6 layers, counted with the embedding
    assert total == pytest.approx(weights + activation)


def test_a_per_layer_moe_list_keeps_megatrons_layer_count(usage):
    """--moe-layer-freq as a list is read per layer by megatron's formula: num_layers stays."""
    weights, _, _ = _report(_args(moe_layer_freq=[1] * 8), (1, 3, 3, 1))
    assert weights == 10 * 4 + 100


def test_other_schedules_get_megatrons_own_report(usage):
    calls = []
    report = _v_theoretical_memory(lambda args, **kwargs: calls.append(args) or "megatron's")
    assert report(_args(pipeline_schedule="1f1b")) == "megatron's" and len(calls) == 1  # none
    with mock.patch.object(megatron_lm_patch, "installed_config",
                           lambda: VShapeConfig(schedule="zb-1p")):
        assert report(_args(pipeline_schedule="zb-1p")) == "megatron's" and len(calls) == 2
