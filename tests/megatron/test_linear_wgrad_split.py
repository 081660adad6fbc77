"""The plugin's B/W split of megatron's linear Function equals megatron's own backward.

megatron-vshape replaces megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` with a
subclass whose backward, for a weight registered with a W store, returns dX (and db) in B and
computes dW in W (megatron/wgrad.py). Here one linear's backward runs both ways on CPU, in one
process (tensor parallel 1): megatron's own (the unpatched Function), and the split (B, then
the store's W). Both gradients must match in value AND dtype, exactly: the split runs the same
GEMMs as megatron's backward on the same operands, so there is no rounding to allow for.

megatron-core 0.20 (main) gives the Function an ``output_dtype`` input (the forward GEMM may
write another dtype than its input's, e.g. fp32 from bf16) and casts dY back to the input's
dtype first in its backward; the output_dtype cases run where the Function has it and skip on
0.16-0.19. Its mixed-dtype forward needs Transformer Engine's ``general_gemm`` (GPU): a torch
stand-in of it is put where megatron imports it from; megatron's backward does not use it.
"""
import inspect
import sys
import types

import pytest

torch = pytest.importorskip("torch")
from support.megatron_cpu import importorskip_megatron  # noqa: E402

importorskip_megatron()
pytestmark = [pytest.mark.megatron_versions, pytest.mark.megatron_matrix]

from megatron.core.tensor_parallel import layers  # noqa: E402

from megatron_vshape.megatron.wgrad import patch_linear, unpatch_linear  # noqa: E402
from megatron_vshape.runtime.wgrad import WeightGradStore  # noqa: E402

SEQ, BATCH, IN, OUT = 6, 2, 8, 5
HAS_OUTPUT_DTYPE = "output_dtype" in inspect.signature(
    layers.linear_with_grad_accumulation_and_async_allreduce).parameters
needs_output_dtype = pytest.mark.skipif(
    not HAS_OUTPUT_DTYPE, reason="this megatron-core's linear Function has no output_dtype "
                                 "(added in 0.20)")


def _te_general_gemm(weight, input_2d, out_dtype, layout, bias=None, **_):
    """TE's general_gemm as megatron's forward calls it ("TN": input @ weight^T), in torch:
    accumulate in fp32 and write ``out_dtype``."""
    assert layout == "TN"
    out = input_2d.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return (out.to(out_dtype),)


@pytest.fixture
def te_gemm_stand_in(monkeypatch):
    module = types.ModuleType("megatron.core.extensions.transformer_engine")
    module.te_general_gemm = _te_general_gemm
    monkeypatch.setitem(sys.modules, module.__name__, module)


def _backward(dtype, bias, output_dtype, split):
    """(dX, dW, db) of one linear's backward, megatron's own or the plugin's split."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, BATCH, IN, generator=gen).to(dtype).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(OUT, IN, generator=gen).to(dtype))
    b = torch.nn.Parameter(torch.randn(OUT, generator=gen).to(dtype)) if bias else None
    out_dtype = output_dtype or dtype
    dy = torch.randn(SEQ, BATCH, OUT, generator=gen).to(out_dtype)
    kwargs = {"output_dtype": output_dtype} if HAS_OUTPUT_DTYPE else {}
    store = WeightGradStore()
    if split:
        patch_linear()
        weight.vshape_wgrad_store, weight.vshape_wgrad_hooks = store, []
    try:
        y = layers.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, b, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, grad_output_buffer=None, **kwargs)
        assert y.dtype == out_dtype
        with store.collecting(microbatch=0):
            y.backward(dy)
    finally:
        unpatch_linear()
    if split:
        assert weight.grad is None, "B computed the weight gradient: no split"
        assert store.run(0) == 1 and not store.pending
    return x.grad, weight.grad, None if b is None else b.grad


CASES = [
    pytest.param(torch.float32, True, None, id="fp32"),
    pytest.param(torch.bfloat16, True, None, id="bf16"),
    pytest.param(torch.bfloat16, False, None, id="bf16-no-bias"),
    pytest.param(torch.bfloat16, True, torch.float32, id="bf16-output-fp32",
                 marks=needs_output_dtype),
    pytest.param(torch.float32, False, torch.bfloat16, id="fp32-output-bf16",
                 marks=needs_output_dtype),
]


@pytest.mark.parametrize("dtype,bias,output_dtype", CASES)
def test_split_backward_equals_megatrons_in_values_and_dtypes(dtype, bias, output_dtype,
                                                               request):
    if output_dtype is not None:
        request.getfixturevalue("te_gemm_stand_in")
    reference = _backward(dtype, bias, output_dtype, split=False)
    split = _backward(dtype, bias, output_dtype, split=True)
    for name, mine, theirs in zip(("input", "weight", "bias"), split, reference):
        if theirs is None:
            assert mine is None, f"{name}: megatron gives no gradient, the split does"
            continue
        assert mine.dtype == theirs.dtype, f"{name} gradient: {mine.dtype}, megatron's " \
                                           f"{theirs.dtype}"
        assert torch.equal(mine, theirs), f"{name} gradient differs from megatron's by " \
                                          f"{(mine.float() - theirs.float()).abs().max()}"
    # the input's dtype, as megatron's backward gives it
    assert split[0].dtype == dtype and split[1].dtype == dtype

