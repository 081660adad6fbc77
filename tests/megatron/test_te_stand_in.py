"""The CPU stand-in of Transformer Engine (tests/support/te_stand_in, imitating TE v2.11) against
plain torch math, in spawned processes (support.te_stand_in_workers says why).

Every comparison is float64, so a correct module differs from the reference by rounding only;
the bound 1e-12 leaves three orders of magnitude above the ~1e-15 measured and is far below
anything a wrong bias gradient, reduction or microbatch would give (order one).
"""
import pytest

pytest.importorskip("torch")

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support import te_stand_in_workers as workers  # noqa: E402

TOL = 1e-12


def _one(fn, world=1):
    outcomes = run_gloo(fn, world, timeout=240)
    for outcome in outcomes:
        assert outcome.ok, outcome.error
    return [o.value for o in outcomes]


def test_modules_compute_what_torch_computes():
    """Linear (bias applied, and returned), LayerNormLinear (LayerNorm, zero-centred RMSNorm),
    GroupedLinear (one expert with no rows) and DotProductAttention (causal sbhd with
    grouped-query heads, a "thd" pack of three documents): outputs and every gradient; the RNG
    tracker's fork, and checkpoint's recomputation with the tracker's states."""
    [result] = _one(workers.single_process_checks)
    assert result["version"] == "2.11.0"
    for name in ("linear", "layernorm_linear", "grouped", "attention", "checkpoint"):
        assert result[name] <= TOL, (name, result[name])


@pytest.fixture(scope="module")
def delayed():
    [result] = _one(workers.delayed_wgrad_checks)
    return result


def test_delayed_weight_gradients_equal_the_undelayed_ones(delayed):
    """delay_wgrad_compute: two Bs, then two backward_dw (with hooks doing what megatron's DDP
    does) sum to the undelayed module's gradients, for Linear, LayerNormLinear and
    GroupedLinear; backward_dw runs the GEMMs first in, first out and refuses an empty queue;
    fuse_wgrad_accumulation overwrites main_grad on the first microbatch and adds after."""
    for name in ("linear", "layernorm_linear", "grouped", "fifo", "fused_main_grad"):
        assert delayed[name] <= TOL, (name, delayed[name])


def test_a_bias_outside_tes_gemm_needs_the_plugins_w(delayed):
    """TE's own backward_dw fails at the second of two Ws for a bias TE's GEMM did not see
    (return_bias: megatron's linear_proj and fc2), once DDP's hook took the first W's bias
    gradient; the plugin's W gives it a zero gradient first and the sums are right."""
    outcome = delayed["unfused_bias"]
    assert isinstance(outcome["te"], str) and "'NoneType' object has no attribute 'to'" in \
        outcome["te"], outcome
    assert outcome["plugin"] <= TOL, outcome


def test_tensor_parallel_linears_on_two_ranks():
    """TP 2: column- and row-parallel Linear with and without sequence parallel, and a
    column-parallel LayerNormLinear with sequence parallel, give each rank its part of the
    unsharded output, input gradient and weight gradient (TE's all-gather / reduce-scatter /
    all-reduce placement)."""
    for rank, result in enumerate(_one(workers.tensor_parallel_checks, world=2)):
        for case, worst in result.items():
            assert worst <= TOL, (rank, case, worst)
