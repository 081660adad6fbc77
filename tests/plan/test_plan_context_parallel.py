"""Context parallelism in the planner (plan/context_parallel.py): per-rank tokens, the causal
work split, the K/V ring, the optimizer's DP x CP shards; hand-checked (tier 1)."""
import pytest

from megatron_vshape.cli import main
from megatron_vshape.plan import ClusterConfig, TrainingConfig, load_model_config
from megatron_vshape.plan.candidates import GridPoint, SearchSpace, grid_points
from megatron_vshape.plan.context_parallel import ring_bytes
from megatron_vshape.plan.evaluate import Evaluator
from megatron_vshape.plan.kernels import GpuSpec, flash_attention
from megatron_vshape.plan.layer_kernels import part_kernels
from megatron_vshape.plan.memory import activation_sizes

LLAMA = load_model_config("llama-3-8b")


def _training(seq: int, cp: int = 1) -> TrainingConfig:
    return TrainingConfig(seq_length=seq, global_batch=16, context_parallel=cp)


def test_each_cp_rank_keeps_the_activations_of_its_tokens():
    """With flash attention every kept term is per token: CP 2 at 16k keeps what 8k keeps."""
    assert activation_sizes(LLAMA, _training(16384, 2), 1, 1) == \
        activation_sizes(LLAMA, _training(8192), 1, 1)
    whole = activation_sizes(LLAMA, _training(16384), 1, 1)
    assert activation_sizes(LLAMA, _training(16384, 4), 1, 1).layer == pytest.approx(
        whole.layer / 4)


def test_attention_work_and_ring_traffic():
    gpu = GpuSpec()
    whole = flash_attention("f", 32, 8192, 128, gpu, False)
    half = flash_attention("f", 32, 8192, 128, gpu, False, parts=2)
    assert half.flops == whole.flops / 2
    # CP 4, s 8192: 2048 tokens of K and V (8 groups x 128 x 2 wide), 2 bytes, 3 ring steps
    assert ring_bytes(4, 2048, 2048, 2, backward=False) == 3 * 2048 * 2048 * 2
    assert ring_bytes(4, 2048, 2048, 2, backward=True) == 2 * 3 * 2048 * 2048 * 2
    assert ring_bytes(1, 8192, 2048, 2, backward=True) == 0
    cluster = ClusterConfig(gpus=8, gpu_memory_gib=80.0)
    cp = part_kernels(LLAMA, _training(32768, 4), cluster, 1, 1)
    ring = [k for k in cp.layer.forward if k.name.startswith("CP ring")]
    assert len(ring) == 1 and ring[0].bytes == 3 * 8192 * 2048 * 2
    plain = part_kernels(LLAMA, _training(32768), cluster, 1, 1)
    assert cp.layer.seconds("forward") < plain.layer.seconds("forward") / 3
    assert cp.head.seconds("forward") < plain.head.seconds("forward") / 3


def test_cp_takes_gpus_and_shards_the_optimizer():
    cluster = ClusterConfig(gpus=16, gpu_memory_gib=80.0)
    space = SearchSpace(schedules=("1f1b",), micro_batch_sizes=(1,), tensor_parallel=(1,),
                        pipeline_parallel=(8,))
    (point,), _ = grid_points(LLAMA, _training(8192, 2), cluster, space)
    assert (point.dp, point.tp, point.pp) == (1, 1, 8)
    with_cp = Evaluator(LLAMA, _training(8192, 2), cluster).evaluate(point, "1f1b")
    without = Evaluator(LLAMA, _training(8192), cluster).evaluate(point, "1f1b")
    assert with_cp.optimizer_bytes == pytest.approx(without.optimizer_bytes / 2)
    assert with_cp.weight_bytes == without.weight_bytes
    assert with_cp.iteration_seconds < 0.6 * without.iteration_seconds


def test_bad_cp_settings_are_refused(capsys):
    with pytest.raises(ValueError, match=r"--cp.*must be > 0"):
        _training(8192, 0)
    with pytest.raises(ValueError, match="2 x --cp = 6 equal chunks"):
        _training(8192, 3)
    with pytest.raises(ValueError, match="--cp needs flash attention"):
        TrainingConfig(seq_length=8192, global_batch=8, context_parallel=2,
                       flash_attention=False)
    with pytest.raises(ValueError, match="--gpus 12 must be a multiple of --cp 8"):
        grid_points(LLAMA, _training(8192, 8), ClusterConfig(gpus=12, gpu_memory_gib=80.0,
                                                             gpus_per_node=4), SearchSpace())
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--gpu-memory", "80", "--cp",
                 "3"]) == 2
    assert "--cp" in capsys.readouterr().err
