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


def test_context_parallel_attention_equals_attention_over_the_whole_sequence():
    """CP 2, every cp_comm_type (a2a+p2p over [CP group, a one-rank group] falls back to a2a
    as TE's does): each rank's output and query/key/value gradients of its load-balanced
    slice (chunks r and 3-r of 4; for "thd" of each document, with and without padded
    offsets) equal the stand-in's attention over the whole sequence (causal with grouped-query
    heads, no mask, thd packs); TE's refusals: megatron's spelling "allgather", padding masks
    under all_gather, thd under a2a+p2p, heads not divisible by CP under a2a.
    tex.thd_get_partitioned_indices gives each rank chunks r and 3-r of every document, int32,
    and refuses None (TypeError), a document not a multiple of 2 x CP and int64 offsets."""
    refusals = {"allgather": "ValueError: Unsupported communication type: allgather!",
                "all_gather thd": "AssertionError: padding_causal mask type is not supported!",
                "a2a+p2p thd": "AssertionError: thd format is not supported with hierarchical",
                "a2a heads": "AssertionError: The number of attention heads needs to be "
                             "divisible by CP size!"}
    results = _one(workers.context_parallel_checks, world=2)
    for rank, result in enumerate(results):
        compared = [k for k, v in result.items() if isinstance(v, float)]
        assert len(compared) == 16, compared  # 4 types x 5 cases, less the 4 TE refuses
        for case in compared:
            assert result[case] <= TOL, (rank, case, result[case])
        for name, message in refusals.items():
            assert result[f"refuses {name}"].startswith(message), (rank, name, result)
    assert results[0]["partition"] == {"wrong": 0, "errors": {
        "none": "TypeError", "odd document": "RuntimeError", "int64": "RuntimeError"}}
