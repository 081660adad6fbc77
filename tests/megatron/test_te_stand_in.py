"""The CPU stand-in of Transformer Engine (tests/support/te_stand_in, imitating TE v2.11) against
plain torch math, in spawned processes (support.te_stand_in_workers says why).

Every comparison is float64, so a correct module differs from the reference by rounding only;
the bound 1e-12 leaves three orders of magnitude above the ~1e-15 measured and is far below
anything a wrong bias gradient, reduction or microbatch would give (order one). FP8 (the
second half, support.te_stand_in_fp8_workers) runs float32 against quantize-then-float64
references: :data:`FP8_TOL`.
"""
import pytest

pytest.importorskip("torch")

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support import te_stand_in_fp8_workers as fp8_workers  # noqa: E402
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
def delayed_and_fp8():
    [result] = _one(fp8_workers.delayed_and_fp8_checks)
    return result


@pytest.fixture(scope="module")
def delayed(delayed_and_fp8):
    return delayed_and_fp8["delayed"]


@pytest.fixture(scope="module")
def tensor_parallel():
    return _one(fp8_workers.tensor_parallel_and_fp8_checks, world=2)


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


def test_tensor_parallel_linears_on_two_ranks(tensor_parallel):
    """TP 2: column- and row-parallel Linear with and without sequence parallel, and a
    column-parallel LayerNormLinear with sequence parallel, give each rank its part of the
    unsharded output, input gradient and weight gradient (TE's all-gather / reduce-scatter /
    all-reduce placement)."""
    for rank, result in enumerate(r["plain"] for r in tensor_parallel):
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


# -- FP8 ------------------------------------------------------------------------------------------
FP8_TOL = 1e-5
"""Against references that quantize as TE does and multiply in float64, the stand-in's FP8
modules differ by their float32 GEMMs' rounding (measured at most 2.6e-6 on values of order one);
a missing, extra or wrongly scaled quantization moves a value by an FP8 step (2^-4 of it for
E4M3, 2^-3 for E5M2, ~1e-2 here and more)."""


@pytest.fixture(scope="module")
def fp8(delayed_and_fp8):
    return delayed_and_fp8["fp8"]


def test_fp8_casts_are_torchs_float8_conversion_saturated(fp8):
    """Delayed scaling's cast: torch's float8_e4m3fn / float8_e5m2 conversion of ``x * scale``
    where in range, the largest finite value beyond (TE's satfinite cast; torch saturates
    E4M3 itself but takes E5M2 to infinity), scale_inv ``1 / scale``, the amax a running max
    that skips NaN."""
    for dtype, cast in fp8["casts"].items():
        assert cast["in_range_mismatches"] == 0, (dtype, cast)
        assert cast["saturated"], (dtype, cast)
        assert cast["torch_overflows"] == ("e5m2" in dtype), (dtype, cast)
        assert cast["scale_inv"] and cast["amax"] and cast["amax_kept_max_skipping_nan"], cast
        assert cast["dequantize"] == 0.0, (dtype, cast)


def test_delayed_scaling_updates_as_te_computes(fp8):
    """The amax history and scale update against TE's formulas (quantization.py:865-964) for
    "max" and "most_recent", margins 0 and 2: equal where the new amax is not zero; a zero
    amax leaves that quantizer's history and scale alone (TE's fused kernel); an overflowing
    scale becomes the largest fp32. In a Linear under fp8_autocast, the forward scales come
    from the input's and weight's amax at the autocast's exit, the backward's from the output
    gradient's (E5M2) at the end of the region's first module's backward."""
    for case, update in fp8["scale_update"].items():
        assert update["history"] == 0.0 and update["scale"] == 0.0, (case, update)
        assert update["zero_amax_untouched"] and update["overflow_to_fp32_max"], (case, update)
    scales = fp8["module_scales"]
    for name in ("input", "weight", "grad_output"):
        assert abs(scales[name]) <= 1e-7, scales
    assert scales["output_unused"] == 1.0 and scales["history_rolled"], scales


def test_fp8_linears_compute_with_quantized_operands(fp8):
    """Linear and LayerNormLinear in FP8 on their second microbatch: output, input and weight
    gradient from the FP8 input, the cached FP8 weight and the FP8 (E5M2) output gradient; the
    bias rounded to bf16 in the GEMM, its gradient the unquantized output gradient's sum; far
    from the plain float32 linear."""
    for name, diffs in fp8["linear"].items():
        for key in ("output", "dgrad", "wgrad", "bias_grad"):
            assert diffs[key] <= FP8_TOL, (name, key, diffs)
        assert diffs["plain"] >= 1e-3, (name, diffs)
    for key, diff in fp8["current_scaling"].items():  # --fp8-recipe tensorwise
        assert diff <= FP8_TOL, (key, fp8["current_scaling"])


def test_the_weight_cast_is_cached_by_is_first_microbatch(fp8):
    """is_first_microbatch True casts and caches the weight; False computes with the cache --
    the weight before the "optimizer step", stale; None casts the new weight every time and
    leaves the cache alone; True casts the new weight into it."""
    cache = fp8["weight_cache"]
    for key in ("true_casts_into_the_cache", "false_computes_with_the_cache",
                "none_casts_the_new_weight", "none_leaves_the_cache", "true_recasts"):
        assert cache[key] <= FP8_TOL, (key, cache)
    assert cache["false_is_stale"] >= 1e-2, cache


def test_backward_dw_in_fp8_equals_the_undelayed_backward(fp8):
    """delay_wgrad_compute in FP8: B, B, W, W sum to the undelayed module's gradients (W runs
    the GEMM on the FP8 tensors B saved); the bias gradient comes in B, so TE's own second
    backward_dw fails on its None bias gradient, and the plugin's W passes."""
    outcome = fp8["backward_dw"]
    assert isinstance(outcome["te"], str) and "'NoneType' object has no attribute 'to'" in \
        outcome["te"], outcome
    assert outcome["plugin"] <= FP8_TOL, outcome


def test_fp8_state_survives_a_checkpoint(fp8):
    """The extra state carries the recipe and delayed scaling's scales and histories into a
    fresh module, which computes as the saved one; without FP8 it stays empty."""
    state = fp8["extra_state"]
    assert state["state"] == 0.0 and state["outputs"] == 0.0, state
    assert state["recipe"] == "DelayedScaling" and state["without_fp8_empty"], state


def test_evaluation_amaxes_update_a_module_before_its_own_forward(fp8):
    """TE's delayed scaling across two chunks of one rank: amaxes of forwards without grad
    (evaluation) wait for the next training forward's autocast exit, which updates every
    module of the recipe -- so the chunk that runs second takes the evaluation's amax as its
    own history entry, one forward before 1f1b's single chunk would (the FP8 real-loop tests
    evaluate after the last step for this reason)."""
    pending = fp8["pending_eval_amax"]
    assert pending["unchanged_before"] and abs(pending["chunk1_scale_from_evaluation"]) <= 1e-7


def test_fp8_tensor_parallel_linears_on_two_ranks(tensor_parallel):
    """TP 2 with sequence parallel, delayed scaling: the FP8 input (column) and output gradient
    (row) are gathered as FP8 bytes, the amaxes reduced over the group, and each rank's output,
    input gradient and weight gradient shard are the unsharded FP8 module's."""
    for rank, result in enumerate(r["fp8"] for r in tensor_parallel):
        for case, worst in result.items():
            assert worst <= FP8_TOL, (rank, case, worst)
