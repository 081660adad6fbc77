"""Process bodies for the FP8 tests of tests/megatron/test_te_stand_in.py: the Transformer Engine
stand-in's per-tensor FP8 (support/te_stand_in, imitating TE v2.11) against torch's float8
casts and TE's formulas written out here, in spawned processes (support.te_stand_in_workers
says why). Each returns what it measured; the test asserts on it.

The references quantize as TE does (``x * scale`` saturated to the FP8 type's largest finite
value, rounded to nearest-even) and multiply the dequantized values in float64, so a correct
module differs from them by its float32 GEMM's rounding only (~1e-7 of values of order one),
and a missing or wrong quantization by at least an FP8 step (2^-4 relative for E4M3, 2^-3 for
E5M2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from support import te_stand_in_workers as plain
from support.te_stand_in_workers import _diff, _import_te

__all__ = ["fp8_checks", "fp8_tensor_parallel_checks", "delayed_and_fp8_checks",
           "tensor_parallel_and_fp8_checks"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _q(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """TE's cast (common/cast/fp8/quantize_fp8.cuh:181, satfinite) dequantized, in float64."""
    scaled = (x.detach().double() * scale).clamp(-MAX[dtype], MAX[dtype])
    return scaled.float().to(dtype).double() / scale


def _recipe(te, **kwargs):
    return te.common.recipe.DelayedScaling(**kwargs)


def _state(lin, key):
    return lin.fp8_meta[key]


def delayed_and_fp8_checks(rank, world) -> dict:
    """support.te_stand_in_workers.delayed_wgrad_checks and :func:`fp8_checks` in one process
    (a spawned process costs seconds of imports)."""
    return {"delayed": plain.delayed_wgrad_checks(rank, world), "fp8": fp8_checks(rank, world)}


def tensor_parallel_and_fp8_checks(rank, world) -> dict:
    """support.te_stand_in_workers.tensor_parallel_checks and
    :func:`fp8_tensor_parallel_checks` in one set of processes."""
    return {"plain": plain.tensor_parallel_checks(rank, world),
            "fp8": fp8_tensor_parallel_checks(rank, world)}


def fp8_checks(rank, world) -> dict:
    te = _import_te()
    torch.manual_seed(0)
    checks = {"casts": _casts(te), "scale_update": _scale_update(te),
              "module_scales": _module_scales(te), "linear": _linear_fp8(te),
              "weight_cache": _weight_cache(te), "backward_dw": _backward_dw_fp8(te),
              "current_scaling": _current_scaling(te), "extra_state": _extra_state(te),
              "pending_eval_amax": _pending_eval_amax(te)}
    return checks


# -- casts --------------------------------------------------------------------------------------
def _casts(te) -> dict:
    """Float8Quantizer against torch's float8 conversion: the same FP8 values where ``x * scale``
    is in range, saturation where it is not (torch alone gives infinity for E5M2), scale_inv
    ``1 / scale``, the amax folded in with a max over casts, NaN elements skipped."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    out = {}
    for dtype in (E4M3, E5M2):
        scale, amax = torch.tensor([3.0]), torch.zeros(1)
        quantizer = Float8Quantizer(scale, amax, dtype)
        x = torch.randn(64, 16) * MAX[dtype] / 6  # some of x * 3 beyond the largest value
        q = quantizer.quantize(x)
        in_range = (x * 3.0).abs() <= MAX[dtype]
        mismatched = (q._data.float() != (x * 3.0).to(dtype).float()) & in_range
        saturated = q._data.float()[~in_range].abs()
        out[f"{dtype}"] = {
            "in_range_mismatches": int(mismatched.sum()),
            "saturated": bool(saturated.numel() > 0 and (saturated == MAX[dtype]).all()),
            "torch_overflows": bool(not torch.isfinite((x * 3.0).to(dtype).float()[~in_range])
                                    .all()),  # E5M2 to infinity; torch saturates E4M3 itself
            "scale_inv": float(q._scale_inv) == float(torch.tensor(1.0) / torch.tensor(3.0)),
            "dequantize": _diff(q.dequantize(), q._data.float() * q._scale_inv),
            "amax": float(amax) == float(x.abs().max())}
        y = x.clone()
        y[0, 0] = float("nan")
        quantizer.quantize(y * 0.5)
        out[f"{dtype}"]["amax_kept_max_skipping_nan"] = float(amax) == float(x.abs().max())
    return out


# -- delayed scaling ----------------------------------------------------------------------------
def _te_python_update(history, scale, amax, fp8_max, margin, algo):
    """TE v2.11's unfused update written out (quantization.py:865-964): roll the history with
    the new amax first, amax from it ("max" of the history, or the most recent), scale
    ``(fp8_max / amax) / 2^margin`` for a finite positive amax, else the old scale."""
    history = history.clone()
    history[0] = amax
    chosen = history.max(dim=0).values if algo == "max" else history[0].clone()
    history = torch.roll(history, -1, 0)
    history[0] = 0
    # (a tensor over a tensor: torch's ``scalar / tensor`` multiplies by a rounded
    # reciprocal, where TE's kernel divides, delayed_scaling.cu:239)
    sf = (torch.tensor(fp8_max) / chosen) / (2 ** margin)
    sf = torch.where(chosen > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(chosen), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)
    return history, sf


def _scale_update(te) -> dict:
    """The stand-in's fused update against TE's formulas: equal wherever the new amax is not
    zero; a zero amax leaves history and scale as they are (the fused kernel,
    common/recipe/delayed_scaling.cu:182-199), where the unfused formula would roll."""
    from transformer_engine.pytorch.quantization import _fused_amax_and_scale_update

    out = {}
    for algo in ("max", "most_recent"):
        for margin in (0, 2):
            history = torch.rand(5, 4) * 10
            history[0] = 0  # the row the next casts write (zeroed by the last roll)
            history[:, 2] = 0  # a quantizer whose only amax is tiny
            scale = torch.rand(4) + 0.5
            amax = torch.tensor([3.0, 0.0, 1e-40, 7.0])  # a zero, and one whose scale overflows
            want_history, want_scale = _te_python_update(history, scale, amax, 448.0, margin,
                                                         algo)
            got_history, got_scale = history.clone(), scale.clone()
            _fused_amax_and_scale_update(amax, got_history, got_scale, algo,
                                         448.0 * 2.0 ** -margin)
            moving = amax != 0
            out[f"{algo}/{margin}"] = {
                "history": _diff(got_history[:, moving], want_history[:, moving]),
                "scale": float(((got_scale - want_scale)[moving] / want_scale[moving]).abs()
                               .max()),
                "zero_amax_untouched": bool(torch.equal(got_history[:, 1], history[:, 1])
                                            and got_scale[1] == scale[1]),
                "overflow_to_fp32_max": float(got_scale[2]) == torch.finfo(torch.float32).max}
    return out


def _module_scales(te) -> dict:
    """A Linear under fp8_autocast (HYBRID, margin 1, most recent amax): leaving the autocast
    updates the forward scales from the input's and weight's amax (reduced over the group),
    the backward of the region's first module the grad output's (E5M2's maximum): the
    formulas of quantization.py:152-158 and delayed_scaling.cu:237-250."""
    te.pytorch.quantization.FP8GlobalStateManager.reset()
    recipe = _recipe(te, margin=1, amax_history_len=3, amax_compute_algo="most_recent")
    lin = te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 32, requires_grad=True)
    with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = lin(x)
    forward_scale = _state(lin, "scaling_fwd").scale.clone()
    g = torch.randn_like(y) * 5
    y.backward(g)
    backward_scale = _state(lin, "scaling_bwd").scale.clone()
    x = x.detach()
    return {"input": float(forward_scale[0]) / (448.0 / 2 / float(x.abs().max())) - 1,
            "weight": float(forward_scale[1]) / (448.0 / 2 / float(lin.weight.detach().abs().max()))
            - 1,
            "output_unused": float(forward_scale[2]),
            "grad_output": float(backward_scale[0]) / (57344.0 / 2 / float(g.abs().max())) - 1,
            "history_rolled": float(_state(lin, "scaling_fwd").amax_history[-1, 0])
            == float(x.abs().max())}


# -- the linears in FP8 -------------------------------------------------------------------------
def _linear_fp8(te) -> dict:
    """Linear and LayerNormLinear in FP8 (HYBRID), on the second microbatch (scales no longer
    1), against the quantized-then-float64 computation: output (the bias rounded to bf16),
    input gradient and weight gradient from the FP8 input, weight and output gradient; the
    bias gradient from the unquantized output gradient; and not the plain linear's output."""
    from transformer_engine.pytorch.module.layernorm import apply_normalization

    out = {}
    for name in ("linear", "layernorm_linear"):
        te.pytorch.quantization.FP8GlobalStateManager.reset()
        recipe = _recipe(te, amax_history_len=2, amax_compute_algo="max")
        cls = te.pytorch.Linear if name == "linear" else te.pytorch.LayerNormLinear
        lin = cls(32, 16, params_dtype=torch.float32, device="cpu")
        with torch.no_grad():
            lin.bias.normal_()
        for step in range(2):
            x = torch.randn(4, 2, 32, requires_grad=True)
            s_in, s_w = (float(v) for v in _state(lin, "scaling_fwd").scale[:2]) \
                if step else (1.0, 1.0)
            s_dy = float(_state(lin, "scaling_bwd").scale[0]) if step else 1.0
            with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = lin(x, is_first_microbatch=step == 0)
            g = torch.randn_like(y)
            y.backward(g)
            if step == 0:
                lin.weight.grad = lin.bias.grad = None
                w_cast = lin.weight.detach().clone()  # the cast False reuses
        ref_x = x.detach().requires_grad_()
        normed = ref_x if name == "linear" else apply_normalization(
            ref_x, lin.layer_norm_weight, lin.layer_norm_bias, lin.eps, False, "LayerNorm")
        xq, wq = _q(normed, s_in, E4M3), _q(w_cast, 1.0, E4M3)
        ref = xq @ wq.t() + lin.bias.detach().to(torch.bfloat16).double()
        dyq = _q(g.reshape(-1, 16), s_dy, E5M2)
        dx_lin = (dyq @ wq).view(4, 2, 32)
        if name == "linear":
            ref_dx = dx_lin
        else:  # the norm's backward (not quantized) from the linear's FP8 input gradient
            normed.backward(dx_lin.float())
            ref_dx = ref_x.grad
        out[name] = {"output": _diff(y, ref), "dgrad": _diff(x.grad, ref_dx),
                     "wgrad": _diff(lin.weight.grad, dyq.t() @ xq.reshape(-1, 32)),
                     "bias_grad": _diff(lin.bias.grad.double(),
                                        g.reshape(-1, 16).double().sum(0)),
                     "plain": _diff(y, F.linear(normed, lin.weight, lin.bias))}
    return out


def _weight_cache(te) -> dict:
    """TE's weight workspace (base.py:1322-1440, linear.py:267-277): is_first_microbatch True
    casts the weight (with the weight's current scale) and caches it; False reuses the cache,
    so a weight changed since (an optimizer step) is used stale; None casts every time and
    leaves the cache alone; True casts the new weight into the cache."""
    te.pytorch.quantization.FP8GlobalStateManager.reset()
    recipe = _recipe(te, amax_history_len=1, amax_compute_algo="most_recent")
    lin = te.pytorch.Linear(32, 16, bias=False, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 32)

    def run(flag):
        s_in, s_w = (float(v) for v in _state(lin, "scaling_fwd").scale[:2]) \
            if lin.fp8_meta.get("scaling_fwd") is not None else (1.0, 1.0)
        with torch.no_grad(), te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = lin(x, is_first_microbatch=flag)
        return y, _q(x, s_in, E4M3), s_w

    def workspace():
        return lin._fp8_workspaces["weight"].dequantize().double()

    run(True)
    first_cast = workspace()
    old_weight = lin.weight.detach().clone()
    with torch.no_grad():
        lin.weight.mul_(1.5)  # "the optimizer step"
    stale, xq, _ = run(False)
    uncached, xq_none, s_w = run(None)
    kept = workspace()
    _, _, s_w_true = run(True)
    return {"true_casts_into_the_cache": _diff(first_cast, _q(old_weight, 1.0, E4M3)),
            "false_computes_with_the_cache": _diff(stale, xq @ first_cast.t()),
            "false_is_stale": _diff(first_cast, _q(lin.weight, s_w, E4M3)),
            "none_casts_the_new_weight": _diff(uncached, xq_none @ _q(lin.weight, s_w,
                                                                       E4M3).t()),
            "none_leaves_the_cache": _diff(kept, first_cast),
            "true_recasts": _diff(workspace(), _q(lin.weight, s_w_true, E4M3))}


def _backward_dw_fp8(te) -> dict:
    """delay_wgrad_compute in FP8: two Bs, then two backward_dw with DDP-like hooks give the
    undelayed module's weight gradients (the GEMM on the FP8 input and output gradient B
    saved); the bias gradient comes in B (TE's FP8 GEMM runs without the bias, linear.py:861),
    and backward_dw has none to give: TE's own second backward_dw fails as without FP8 for a
    bias outside the GEMM, the plugin's W passes."""
    from megatron_vshape.megatron.te_wgrad import te_backward_dw
    from support.te_stand_in_workers import _ddp_like_hooks

    out = {}
    for plugin in (False, True):
        te.pytorch.quantization.FP8GlobalStateManager.reset()
        recipe = _recipe(te, amax_history_len=2, amax_compute_algo="max")
        eager = te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu")
        delayed = te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu",
                                    delay_wgrad_compute=True)
        delayed.load_state_dict(eager.state_dict())
        inputs = [torch.randn(8, 32), torch.randn(8, 32)]
        grads = [torch.randn(8, 16), torch.randn(8, 16)]
        eager_w, eager_b = torch.zeros_like(eager.weight), torch.zeros_like(eager.bias)
        for i, (x, g) in enumerate(zip(inputs, grads)):
            with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = eager(x, is_first_microbatch=i == 0)
            y.backward(g)
            eager_w += eager.weight.grad
            eager_b += eager.bias.grad
            eager.weight.grad = eager.bias.grad = None
        summed = {n: torch.zeros_like(p) for n, p in delayed.named_parameters()}
        _ddp_like_hooks(delayed, summed)
        for i, (x, g) in enumerate(zip(inputs, grads)):  # B, B
            with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = delayed(x, is_first_microbatch=i == 0)
            y.backward(g)
        try:
            for _ in inputs:  # W, W
                te_backward_dw([delayed]) if plugin else delayed.backward_dw()
        except AttributeError as err:
            out["plugin" if plugin else "te"] = f"AttributeError: {err}"
            continue
        out["plugin" if plugin else "te"] = max(_diff(summed["weight"], eager_w),
                                                _diff(summed["bias"], eager_b))
    return out


def _current_scaling(te) -> dict:
    """Float8CurrentScaling (megatron's --fp8-recipe tensorwise): every cast scales by its own
    tensor's amax (recipe_common.cuh:14-49), no state between calls; E4M3 backward with
    Format.E4M3."""
    te.pytorch.quantization.FP8GlobalStateManager.reset()
    recipe = te.common.recipe.Float8CurrentScaling(fp8_format=te.common.recipe.Format.E4M3)
    lin = te.pytorch.Linear(32, 16, bias=False, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 32, requires_grad=True) * 3
    x.retain_grad()
    with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    xq = _q(x, 448.0 / float(x.abs().max()), E4M3)
    wq = _q(lin.weight, 448.0 / float(lin.weight.abs().max()), E4M3)
    dyq = _q(g, 448.0 / float(g.abs().max()), E4M3)
    return {"output": _diff(y, xq @ wq.t()), "dgrad": _diff(x.grad, dyq @ wq),
            "wgrad": _diff(lin.weight.grad, dyq.t() @ xq)}


def _extra_state(te) -> dict:
    """The checkpoint's extra state (base.py:806-923) carries the recipe and the delayed
    scaling state into a fresh module, which then computes as the saved one."""
    te.pytorch.quantization.FP8GlobalStateManager.reset()
    recipe = _recipe(te, amax_history_len=3, amax_compute_algo="max")
    lin = te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    for _ in range(2):
        with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
            lin(torch.randn(8, 32)).sum().backward()
    fresh = te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    fresh.load_state_dict(lin.state_dict())
    empty = te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    x = torch.randn(8, 32)
    with torch.no_grad(), te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
        a, b = lin(x), fresh(x)
    return {"state": max(_diff(_state(fresh, k).scale, _state(lin, k).scale)
                         + _diff(_state(fresh, k).amax_history, _state(lin, k).amax_history)
                         for k in ("scaling_fwd", "scaling_bwd")),
            "outputs": _diff(a, b), "recipe": type(fresh.fp8_meta["recipe"]).__name__,
            "without_fp8_empty": empty.get_extra_state().numel() == 0}


def _pending_eval_amax(te) -> dict:
    """Why the FP8 real-loop tests evaluate only after the last step (module doc of
    tests/megatron/test_megatron_lm_te.py): forwards without grad (evaluation) record amaxes
    that no autocast exit reduces (quantization.py:607); the next training forward's exit
    updates every module of the recipe and group (:496-548), so a module that has not run yet
    -- chunk 1 on a rank with two chunks, after chunk 0's first forward -- takes the
    evaluation's amax as an entry of its own, where a module whose own forward comes first
    (1f1b's only chunk) folds it into that forward's amax."""
    te.pytorch.quantization.FP8GlobalStateManager.reset()
    recipe = _recipe(te, amax_history_len=1, amax_compute_algo="most_recent")
    chunk0, chunk1 = (te.pytorch.Linear(32, 16, params_dtype=torch.float32, device="cpu")
                      for _ in range(2))
    for module in (chunk0, chunk1):
        with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
            module(torch.randn(8, 32))
    evaluation = torch.randn(8, 32) * 7
    with torch.no_grad():
        for module in (chunk0, chunk1):
            with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
                module(evaluation)
    before = float(_state(chunk1, "scaling_fwd").scale[0])
    with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
        chunk0(torch.randn(8, 32))
    after = float(_state(chunk1, "scaling_fwd").scale[0])
    return {"unchanged_before": before != 448.0 / float(evaluation.abs().max()),
            "chunk1_scale_from_evaluation": after / (448.0 / float(evaluation.abs().max()))
            - 1}


# -- tensor parallel ----------------------------------------------------------------------------
def fp8_tensor_parallel_checks(rank, world) -> dict:
    """Column-parallel (sequence parallel: the FP8 input all-gathered) and row-parallel
    (sequence parallel: the FP8 output gradient all-gathered) Linear in FP8 on ``world`` ranks
    with delayed scaling, the amaxes reduced over the tensor-parallel group at the autocast's
    exit and in backward: on the second microbatch every rank's scales are the unsharded
    module's, so output, input gradient and weight gradient shard are its, to float32
    rounding. (Current scaling takes each rank's own amax where TE reduces none -- the weight
    shard, a column-parallel output gradient -- so its shards are not the unsharded module's,
    in TE as here.)"""
    te = _import_te()
    group = torch.distributed.new_group(list(range(world)))
    recipe = _recipe(te, amax_history_len=2, amax_compute_algo="max")
    return {f"{mode}-sp": _tp_fp8(te, group, rank, world, mode, recipe)
            for mode in ("column", "row")}


def _tp_fp8(te, group, rank, world, mode, recipe) -> float:
    te.pytorch.quantization.FP8GlobalStateManager.reset()
    torch.manual_seed(1)  # the same full tensors on every rank
    full = te.pytorch.Linear(32, 32, bias=False, params_dtype=torch.float32, device="cpu")
    lin = te.pytorch.Linear(32, 32, bias=False, params_dtype=torch.float32, device="cpu",
                            tp_group=group, parallel_mode=mode, sequence_parallel=True)
    dim = 0 if mode == "column" else 1
    with torch.no_grad():
        lin.weight.copy_(full.weight.chunk(world, dim=dim)[rank])
    worst = 0.0
    for step in range(2):
        x_full, g_full = torch.randn(16, 2, 32), torch.randn(16, 2, 32)
        local_x = (x_full.chunk(world, dim=0)[rank] if mode == "column" else
                   x_full.chunk(world, dim=-1)[rank]).clone().requires_grad_()
        local_g = g_full.chunk(world, dim=-1)[rank] if mode == "column" else \
            g_full.chunk(world, dim=0)[rank]
        ref_x = x_full.clone().requires_grad_()
        with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group):
            y = lin(local_x, is_first_microbatch=step == 0)
        y.backward(local_g)
        with te.pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=None):
            ref = full(ref_x, is_first_microbatch=step == 0)
        ref.backward(g_full)
        ref_y = ref.chunk(world, dim=-1)[rank] if mode == "column" else \
            ref.chunk(world, dim=0)[rank]
        ref_dx = ref_x.grad.chunk(world, dim=0)[rank] if mode == "column" else \
            ref_x.grad.chunk(world, dim=-1)[rank]
        ref_dw = full.weight.grad.chunk(world, dim=dim)[rank]
        if step:
            worst = max(_diff(y, ref_y), _diff(local_x.grad, ref_dx),
                        _diff(lin.weight.grad, ref_dw))
        lin.weight.grad = full.weight.grad = None
    return worst
