"""GPU tier (skipped without CUDA): the CUDA path of the runtime and of the megatron glue.

Run on a GPU machine: ``python -m pytest -q -m gpu tests/megatron/test_gpu.py``. Multi-rank runs stay on
gloo (one GPU); these check the single-device CUDA code: deferred weight gradients on CUDA
tensors (megatron's fused accumulation kernel when apex is built), and Transformer Engine's
backward_dw split when TE is installed.
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_deferred_linear_on_cuda_matches_autograd():
    from megatron_vshape.runtime import WeightGradStore, defer_linear_weight_grads

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 64)).cuda().double()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64)).cuda().double()
    model.load_state_dict(ref.state_dict())
    store = WeightGradStore()
    defer_linear_weight_grads(model, store)
    x = torch.randn(32, 64, device="cuda", dtype=torch.float64)
    ref(x).square().sum().backward()
    with store.collecting(0):
        model(x).square().sum().backward()
    assert model[0].weight.grad is None and store.pending == [0]
    store.run(0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() < 1e-12


def _single_rank_megatron():
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(1)


@pytest.mark.parametrize("fusion", [False, True])
def test_parallel_linear_deferral_on_cuda(fusion):
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vshape.megatron.wgrad import defer_weight_grads
    from megatron_vshape.runtime import WeightGradStore

    if fusion and getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:
        pytest.skip("gradient_accumulation_fusion needs apex's fused_weight_gradient_mlp_cuda")
    _single_rank_megatron()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               gradient_accumulation_fusion=fusion)
    make = lambda: ColumnParallelLinear(64, 128, config=config, init_method=torch.nn.init.ones_,
                                        bias=True, gather_output=True)
    ref, lin = make().cuda(), make().cuda()
    for m in (ref, lin):
        if fusion:
            m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
    store = WeightGradStore()
    defer_weight_grads(lin, store)
    x = torch.randn(16, 2, 64, device="cuda")
    ref(x)[0].square().sum().backward()
    with store.collecting(0):
        lin(x)[0].square().sum().backward()
    store.run(0)
    attr = "main_grad" if fusion else "grad"
    assert torch.allclose(getattr(lin.weight, attr), getattr(ref.weight, attr), rtol=1e-5,
                          atol=1e-5)
    assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_transformer_engine_backward_dw_runs_in_w():
    pytest.importorskip("transformer_engine")
    from megatron.core.extensions.transformer_engine import TELinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vshape.megatron.te_wgrad import te_wgrad_modules, with_te_delay_wgrad
    from megatron_vshape.runtime import WeightGradStore

    _single_rank_megatron()
    base = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    make = lambda config: TELinear(64, 64, parallel_mode="duplicated", config=config,
                                   init_method=torch.nn.init.ones_, bias=False, skip_bias_add=False,
                                   skip_weight_param_allocation=False, tp_comm_buffer_name=None,
                                   is_expert=False)
    ref, lin = make(base), make(with_te_delay_wgrad(base))
    assert te_wgrad_modules(lin) == [lin] and te_wgrad_modules(ref) == []
    x = torch.randn(16, 64, device="cuda")
    ref(x)[0].square().sum().backward()
    store = WeightGradStore()
    with store.collecting(0):
        lin(x)[0].square().sum().backward()
        store.defer(lin.backward_dw)
    assert lin.weight.grad is None or not lin.weight.grad.abs().sum()
    store.run(0)
    assert torch.allclose(lin.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
