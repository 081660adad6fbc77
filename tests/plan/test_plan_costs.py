"""The planner's shape cost model (plan/kernels.py, plan/layer_kernels.py): what small GEMMs,
TP shards and micro batch sizes cost, checked against the GPU facts the project has and the
trends the paper reports."""
import math

import pytest

from megatron_vshape.cli import main
from megatron_vshape.plan.cost import analytic_times, replay_share
from megatron_vshape.plan.evaluate import Evaluator
from megatron_vshape.plan.kernels import GpuSpec, gemm
from megatron_vshape.plan.layer_kernels import part_kernels
from megatron_vshape.plan.model import ModelConfig, load_model_config
from megatron_vshape.plan.profile_file import MeasuredProfile, Measurement
from megatron_vshape.plan.settings import ClusterConfig, TrainingConfig

PAPER_MODELS = ("gpt-9.6b", "gpt-21b", "gpt-38.5b", "gpt-98.5b")
PASSES = ("forward", "backward", "weight")
CLUSTER = ClusterConfig(8, 80.0)


def _fractions(model, training, tp, micro_batch):
    """Per pass, FLOPs executed / (time x peak) of one layer."""
    kernels = part_kernels(model, training, CLUSTER, tp, micro_batch)
    return [kernels.layer.flops(k) / (kernels.layer.seconds(k) * kernels.gpu.flops)
            for k in PASSES]


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("name", PAPER_MODELS)
def test_fraction_of_peak_falls_with_tp_and_rises_with_micro_batch(name, flash):
    """The paper's single-pass observation, at seq 3072: F, B and W each reach less of the
    GPU's peak as TP shards the GEMMs (and adds its collectives), and more as the micro batch
    grows."""
    model = load_model_config(name)
    training = TrainingConfig(3072, 128, flash_attention=flash, fp32_softmax_copy=not flash)
    table = {(tp, b): _fractions(model, training, tp, b) for tp in (1, 2, 4, 8) for b in (1, 2, 4)}
    for b in (1, 2, 4):
        for low, high in ((2, 1), (4, 2), (8, 4)):
            assert all(x < y for x, y in zip(table[low, b], table[high, b])), (b, low, high)
    for tp in (1, 2, 4, 8):
        for small, large in ((1, 2), (2, 4)):
            assert all(x < y for x, y in zip(table[tp, small], table[tp, large])), (tp, small)
    assert all(0 < f <= 1 for row in table.values() for f in row)


@pytest.mark.parametrize("tp,b", [(1, 1), (8, 1), (2, 4)])
@pytest.mark.parametrize("flash", [True, False])
def test_no_kernel_beats_the_peak_rate_or_the_memory_bound(tp, b, flash):
    """Every kernel takes at least its bytes over the peak bandwidth and its FLOPs at the
    peak rate; so does every pass (the sum)."""
    model = load_model_config("gpt-21b")
    training = TrainingConfig(3072, 128, flash_attention=flash, fp32_softmax_copy=not flash)
    kernels = part_kernels(model, training, CLUSTER, tp, b)
    gpu = kernels.gpu
    for part in (kernels.layer, kernels.head, kernels.embedding):
        for kind in PASSES:
            listed = getattr(part, kind)
            for k in listed:
                assert k.seconds >= k.bytes / gpu.bandwidth
                assert k.seconds >= k.flops / gpu.flops
                assert k.bound in ("compute", "memory", "launch")
            assert part.seconds(kind) >= sum(k.bytes for k in listed) / gpu.bandwidth


# The project's H100 measurement (scripts/bench/bw_split_gpu.py defaults: megatron-core GPT
# layers, local spec, bf16, hidden 4096, 32 heads, seq 2048, micro batch 1, dropout 0, no flash
# attention, fp32 softmax), milliseconds per layer
H100_LAYER_MS = {"forward": 3.35, "backward": 4.64, "weight": 1.16}


def test_the_measured_h100_layer_is_predicted_within_15_percent():
    model = ModelConfig("bench", num_layers=4, hidden_size=4096, num_attention_heads=32,
                        vocab_size=128, seq_length=2048)
    training = TrainingConfig(2048, 8, dropout=False, flash_attention=False,
                              fp32_softmax_copy=True)
    layer = part_kernels(model, training, ClusterConfig(1, 80.0), 1, 1).layer
    for kind, measured in H100_LAYER_MS.items():
        predicted = layer.seconds(kind) * 1e3
        assert predicted == pytest.approx(measured, rel=0.15), kind
    # the one-MFU model is off by far more (the local layer reaches about 27% of peak in F)
    mfu = analytic_times(model, training, ClusterConfig(1, 80.0, cost_model="mfu"), 1, 1).layer
    assert mfu.forward * 1e3 < 0.7 * H100_LAYER_MS["forward"]


def test_wave_quantization_and_thin_gemms():
    """One tile row more than a full wave needs another wave (softened, as in cuBLAS, by
    smaller tiles or split-K: still over 10% slower per FLOP); a GEMM whose inner dimension is
    a head (128) moves more bytes than it computes, so memory bounds it."""
    gpu = GpuSpec()
    full = gemm("full wave", 128 * 12, 256 * 11, 32768, gpu)  # 132 tiles of 128 x 256
    over = gemm("one tile over", 128 * 12 + 1, 256 * 11, 32768, gpu)
    assert full.bound == over.bound == "compute"
    assert over.fraction_of_peak(gpu) < 0.9 * full.fraction_of_peak(gpu)
    thin = gemm("scores", 2048, 2048, 128, gpu, batch=32)
    assert thin.bound == "memory" and thin.fraction_of_peak(gpu) < 0.4
    assert full.fraction_of_peak(gpu) == pytest.approx(gpu.gemm_efficiency, rel=0.02)


def test_selective_recomputation_replays_the_attention_cores_time():
    model = load_model_config("gpt-9.6b")
    training = TrainingConfig(3072, 16, flash_attention=False, fp32_softmax_copy=True)
    evaluator = Evaluator(model, training, CLUSTER)
    none, sel = (evaluator.times(1, 1, kind).layer for kind in ("none", "selective"))
    share = replay_share(model, training, CLUSTER, 1, 1)
    kernels = part_kernels(model, training, CLUSTER, 1, 1)
    core = sum(k.seconds for k in kernels.attention_core)
    assert share == pytest.approx(core / kernels.layer.seconds("forward"))
    assert sel.backward == pytest.approx(none.backward + core)


def test_a_profile_replaces_its_setting_and_others_scale_by_the_model():
    model = load_model_config("gpt-9.6b")
    training = TrainingConfig(3072, 16)
    measured = analytic_times(model, training, CLUSTER, 1, 1).layer.scaled(1.5)
    profile = MeasuredProfile(3072, (Measurement(1, 1, measured),), path="h.yaml")
    evaluator = Evaluator(model, training, CLUSTER, profile)
    assert evaluator.times(1, 1).layer == measured
    for tp, b in ((1, 4), (2, 1), (8, 2)):
        scaled = evaluator.times(tp, b).layer
        model_there = analytic_times(model, training, CLUSTER, tp, b).layer
        assert scaled.forward == pytest.approx(1.5 * model_there.forward)
        assert scaled.weight == pytest.approx(1.5 * model_there.weight)
        assert "scaled by the cost model" in evaluator.times(tp, b).source


def test_cost_model_setting_is_checked():
    with pytest.raises(ValueError, match=r"--cost-model.*shapes, mfu"):
        ClusterConfig(8, 80.0, cost_model="flops")
    with pytest.raises(ValueError, match="--sms"):
        ClusterConfig(8, 80.0, sms=0)
    with pytest.raises(ValueError, match="memory_efficiency"):
        GpuSpec(memory_efficiency=1.5)


def test_plan_explain_shows_pass_times_and_kernels(capsys):
    args = ["plan", "--model", "gpt-9.6b", "--gpus", "8", "--gpu-memory", "80", "--pp", "2",
            "--tp", "1", "2", "--micro-batch-sizes", "1", "2", "--schedules", "1f1b", "v-half",
            "--recompute", "none", "--top", "2", "--explain"]
    assert main(args) == 0
    out = capsys.readouterr().out
    why = out[out.index("why (shape cost model"):]
    assert "F ms/mb" in why and "%peak" in why
    rows = [line.split() for line in why.splitlines()[3:] if line.strip()[:1].isdigit()]
    assert rows and all(r[0] in ("1", "2") and r[1] in ("1", "2") for r in rows)
    for name in ("QKV GEMM", "flash attention backward", "FC2 weight gradient"):
        assert name in why
    fractions = [float(x.rstrip("%")) for x in why.split() if x.endswith("%")
                 and x.rstrip("%").replace(".", "").isdigit()]
    assert fractions and max(fractions) <= 100.0
    assert main(args + ["--cost-model", "mfu"]) == 0
    assert "runs every pass at one rate" in capsys.readouterr().out


def test_the_shape_model_moves_the_best_configuration_towards_larger_micro_batches():
    """The point of the issue: under one MFU a micro batch of 1 is as fast per sample as 4;
    under the shape model the larger micro batch wins per sample at the same TP."""
    model = load_model_config("gpt-9.6b")
    training = TrainingConfig(3072, 128)
    one, four = (analytic_times(model, training, CLUSTER, 1, b).layer for b in (1, 4))
    per_sample = [(t.forward + t.backward + t.weight) / b for t, b in ((one, 1), (four, 4))]
    assert per_sample[1] < per_sample[0]
    mfu = ClusterConfig(8, 80.0, cost_model="mfu")
    one, four = (analytic_times(model, training, mfu, 1, b).layer for b in (1, 4))
    assert math.isclose((four.forward + four.backward + four.weight) / 4,
                        one.forward + one.backward + one.weight, rel_tol=1e-9)
