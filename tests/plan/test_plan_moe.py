"""The planner with Mixture-of-Experts models: parameters, expert-parallel memory, the MoE
layer's kernels, EP in the search, and the launch flags."""
import dataclasses

import pytest

from megatron_vshape.cli import main
from megatron_vshape.plan.candidates import SearchSpace
from megatron_vshape.plan.cost import layer_flops
from megatron_vshape.plan.layer_kernels import part_kernels
from megatron_vshape.plan.launch_flags import row_flags, shared_flags
from megatron_vshape.plan.memory import activation_sizes, static_memory
from megatron_vshape.plan.model import ModelConfig, load_model_config
from megatron_vshape.plan.planner import plan
from megatron_vshape.plan.settings import ClusterConfig, TrainingConfig
from megatron_vshape.plan.shares import ChunkShare

MIXTRAL = load_model_config("moe-8x7b")
FINE = load_model_config("moe-64e-top6")
CLUSTER = ClusterConfig(16, 80.0)


def _active(model: ModelConfig) -> float:
    return model.parameters() - model.num_layers * model.expert_parameters() * (
        1 - model.moe_router_topk / model.num_experts)


def test_the_bundled_shapes_have_their_published_sizes():
    """Mixtral-8x7B: 46.7B parameters, 12.9B active; DeepSeekMoE-16B: 16.4B, 2.8B (ours
    makes every layer MoE, so a little more)."""
    assert MIXTRAL.parameters() == pytest.approx(46.7e9, rel=0.01)
    assert _active(MIXTRAL) == pytest.approx(12.9e9, rel=0.01)
    assert FINE.parameters() == pytest.approx(16.9e9, rel=0.01)
    assert _active(FINE) == pytest.approx(2.8e9, rel=0.02)


def test_routed_experts_split_over_ep_and_their_state_over_the_expert_data_group():
    training = TrainingConfig(4096, 64)
    chunk = (ChunkShare(1, 4, False, False),)
    one, eight = (static_memory(MIXTRAL, training, chunk, 1, 8, ep=ep) for ep in (1, 8))
    experts = 4 * MIXTRAL.expert_parameters()
    assert one.expert_parameters == experts and eight.expert_parameters == experts / 8
    assert one.parameters - eight.parameters == pytest.approx(experts * 7 / 8)
    dense = one.parameters - one.expert_parameters
    # Adam's 12 bytes: dense over DP 8, experts over DP x TP / EP = 8 (EP 1) or 1 (EP 8)
    assert one.optimizer == pytest.approx(12 * (dense / 8 + experts / 8))
    assert eight.optimizer == pytest.approx(12 * (dense / 8 + experts / 8))
    assert eight.weights == pytest.approx(2 * (dense + experts / 8))


def test_moe_activations_grow_with_top_k_and_flops_count_active_experts():
    training = TrainingConfig(4096, 64)
    top1 = dataclasses.replace(MIXTRAL, moe_router_topk=1)
    a2, a1 = (activation_sizes(m, training, 1, 1) for m in (MIXTRAL, top1))
    h, f, s = MIXTRAL.hidden_size, MIXTRAL.expert_ffn, 4096
    per_copy = 2 * s * (h + 2 * f + f)  # bf16 expert input, SwiGLU FC1 output, FC2 input
    assert a2.layer - a1.layer == pytest.approx(per_copy)
    assert a2.wgrad > a1.wgrad
    (l2, _), (l1, _) = layer_flops(MIXTRAL, s, 1), layer_flops(top1, s, 1)
    assert l2 - l1 == pytest.approx(2 * s * h * 3 * f)


def test_all_to_all_only_with_ep_and_fewer_thicker_expert_gemms_as_ep_grows():
    training = TrainingConfig(4096, 64)
    names = {ep: [k.name for k in part_kernels(FINE, training, CLUSTER, 1, 1, ep).layer.forward]
             for ep in (1, 8)}
    assert "all-to-all dispatch" not in names[1] and "all-to-all dispatch" in names[8]

    def expert_fc1(ep):
        layer = part_kernels(FINE, training, CLUSTER, 1, 1, ep).layer
        return next(k for k in layer.forward if k.name == "expert FC1 GEMMs")

    small, large = expert_fc1(1), expert_fc1(8)
    gpu = CLUSTER.gpu
    # the same copies (balanced routing) over 64 local experts at EP 1, 8 at EP 8: the same
    # FLOPs in GEMMs 8 x thicker
    assert small.flops == pytest.approx(large.flops)
    assert small.fraction_of_peak(gpu) < large.fraction_of_peak(gpu)
    across = ClusterConfig(16, 80.0, gpus_per_node=4)
    a2a = [k for k in part_kernels(FINE, training, across, 1, 1, 8).layer.forward
           if k.name == "all-to-all dispatch"][0]
    inside = [k for k in part_kernels(FINE, training, CLUSTER, 1, 1, 8).layer.forward
              if k.name == "all-to-all dispatch"][0]
    assert a2a.seconds > 5 * inside.seconds  # EP 8 over 4-GPU nodes crosses the slow links


@pytest.fixture(scope="module")
def fine_plan():
    space = SearchSpace(schedules=("1f1b", "v-half"), micro_batch_sizes=(1, 2),
                        recompute=("none",), pipeline_parallel=(2, 4))
    return plan(FINE, TrainingConfig(4096, 64), CLUSTER, space)


def test_the_search_covers_ep_and_the_flags_say_it(fine_plan):
    eps = {r.layout.ep for r in fine_plan.feasible}
    assert eps >= {1, 2, 4, 8}
    assert all((r.layout.dp * r.layout.tp) % r.layout.ep == 0 for r in fine_plan.predictions)
    best = fine_plan.feasible[0]
    flags = row_flags(best, fine_plan)
    assert flags[flags.index("--expert-model-parallel-size") + 1] == str(best.layout.ep)
    assert "--expert-tensor-parallel-size" in flags
    shared = shared_flags(fine_plan)
    for flag, value in (("--num-experts", "64"), ("--moe-router-topk", "6"),
                        ("--moe-ffn-hidden-size", "1408"),
                        ("--moe-shared-expert-intermediate-size", "2816")):
        assert shared[shared.index(flag) + 1] == value


def test_ep_flag_is_checked(capsys):
    base = ["plan", "--gpus", "16", "--gpu-memory", "80", "--pp", "2", "--schedules", "1f1b"]
    assert main(base + ["--model", "gpt-9.6b", "--ep", "2"]) == 2
    assert "--ep [2] invalid for gpt-9.6b, a dense model" in capsys.readouterr().err
    assert main(base + ["--model", "moe-64e-top6", "--ep", "3"]) == 2
    assert "EP must divide them" in capsys.readouterr().err
    assert main(base + ["--model", "moe-64e-top6", "--ep", "16", "--tp", "1",
                        "--micro-batch-sizes", "1", "--flags", "0"]) == 1
    assert "skipped (EP does not divide DP x TP)" in capsys.readouterr().out
    assert main(base + ["--model", "moe-64e-top6", "--ep", "4", "--tp", "1",
                        "--micro-batch-sizes", "1", "--flags", "0"]) == 0
    out = capsys.readouterr().out
    assert "64 experts (top 6)" in out and " EP " in out
