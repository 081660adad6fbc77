"""FP8 linear layers in the planner (plan/fp8.py): faster GEMMs, smaller saved inputs, an FP8
weight copy; hand-checked on Llama-3-8B's shape (tier 1)."""
import pytest

from megatron_vshape.cli import main
from megatron_vshape.plan import ClusterConfig, TrainingConfig, load_model_config
from megatron_vshape.plan.cost import analytic_times
from megatron_vshape.plan.layer_kernels import part_kernels
from megatron_vshape.plan.memory import activation_sizes, static_memory
from megatron_vshape.plan.shares import stages_from_counts

LLAMA = load_model_config("llama-3-8b")
CLUSTER = ClusterConfig(gpus=8, gpu_memory_gib=80.0)
BF16 = TrainingConfig(seq_length=8192, global_batch=64)
FP8 = TrainingConfig(seq_length=8192, global_batch=64, fp8=True)


def _kernel(kernels, name):
    (found,) = [k for k in kernels if k.name.startswith(name)]
    return found


def test_fp8_linear_gemms_run_at_twice_the_rate():
    """FC1 at 8192 x 28672 x 4096 is compute-bound: its FP8 time is half its bf16 time, less
    the fixed 4 us per kernel, within 2% (the model may pick another tile for the one-byte
    operands); the attention core, the head and the embedding do not change."""
    bf16, fp8 = (part_kernels(LLAMA, t, CLUSTER, 1, 1) for t in (BF16, FP8))
    overhead = 4e-6
    fc1, fc1_fp8 = _kernel(bf16.layer.forward, "FC1 GEMM"), _kernel(fp8.layer.forward, "FC1 GEMM")
    assert fc1.bound == fc1_fp8.bound == "compute"
    assert fc1_fp8.seconds - overhead == pytest.approx((fc1.seconds - overhead) / 2, rel=0.02)
    assert _kernel(fp8.layer.forward, "flash attention") == _kernel(bf16.layer.forward,
                                                                    "flash attention")
    assert fp8.head == bf16.head and fp8.embedding == bf16.embedding
    casts = _kernel(fp8.layer.forward, "FP8 casts (FC1")
    assert casts.bytes == 3 * 8192 * (4096 + 14336)  # 2 bytes read, 1 written per element
    slow, fast = (analytic_times(LLAMA, t, CLUSTER, 1, 1) for t in (BF16, FP8))
    for kind in ("forward", "backward", "weight"):
        assert 0.5 < getattr(fast.layer, kind) / getattr(slow.layer, kind) < 0.9


def test_fp8_keeps_linear_inputs_in_one_byte():
    """Per layer, the QKV and FC1 inputs (hidden wide), the projection's (query wide) and FC2's
    (ffn wide) drop from two bytes to one: 8192 x (2 x 4096 + 4096 + 14336) bytes at TP 1."""
    bf16, fp8 = (activation_sizes(LLAMA, t, 1, 1) for t in (BF16, FP8))
    assert bf16.layer - fp8.layer == 8192 * (2 * 4096 + 4096 + 14336)
    assert bf16.head == fp8.head and bf16.embedding == fp8.embedding
    assert fp8.wgrad < bf16.wgrad


def test_fp8_adds_the_weight_copies():
    """Two bytes per linear weight (row- and column-wise FP8 copies) and three 1024-long fp32
    amax histories per linear, per layer; the embedding and head add nothing."""
    chunks = stages_from_counts((3, 0))
    bf16, fp8 = (static_memory(LLAMA, t, chunks, 2, 1) for t in (BF16, FP8))
    h, q, kv, f = 4096, 4096, 2 * 8 * 128, 14336
    linears = h * (q + kv) + q * h + 3 * h * f
    assert fp8.weights - bf16.weights == pytest.approx(3 * (2 * linears / 2 + 4 * 3 * 1024 * 4))
    assert (fp8.parameters, fp8.gradients, fp8.optimizer) == (bf16.parameters, bf16.gradients,
                                                              bf16.optimizer)


def test_bad_fp8_settings_are_refused(capsys):
    with pytest.raises(ValueError, match="use --precision bf16"):
        TrainingConfig(seq_length=1024, global_batch=8, precision="fp32", fp8=True)
    with pytest.raises(ValueError, match="fp8 .--fp8. must be true or false"):
        TrainingConfig(seq_length=1024, global_batch=8, fp8="e4m3")
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--gpu-memory", "80", "--precision",
                 "fp32", "--fp8"]) == 2
    assert "use --precision bf16" in capsys.readouterr().err
