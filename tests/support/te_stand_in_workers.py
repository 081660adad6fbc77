"""Process bodies for tests/megatron/test_te_stand_in.py: the Transformer Engine stand-in
(support/te_stand_in) against plain torch math, run in spawned processes (run_gloo) because a
process that imports it has "TE": the pytest process must not (megatron decides HAVE_TE at
import). Each returns the largest differences it measured; the test asserts on them.

References are float64 torch (F.linear, F.layer_norm, F.rms_norm, scaled_dot_product_attention)
on the same weights; the stand-in runs in float64 too, so the differences are rounding of
different summation orders (~1e-15), and any mistake (a missing bias gradient, a wrong
reduction, a gradient of the wrong microbatch) is of order one.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

__all__ = ["single_process_checks", "tensor_parallel_checks", "delayed_wgrad_checks",
           "context_parallel_checks"]

F64 = torch.float64


def _import_te():
    from support.megatron_lm_cpu import TE_STAND_IN_PATH

    if TE_STAND_IN_PATH not in sys.path:
        sys.path.insert(0, TE_STAND_IN_PATH)
    import transformer_engine

    assert transformer_engine.STAND_IN
    return transformer_engine


def _diff(a, b) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _rand(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=F64, requires_grad=requires_grad)


# -- one process --------------------------------------------------------------------------------
def single_process_checks(rank, world) -> dict:
    te = _import_te()
    torch.manual_seed(0)
    return {"linear": _linear(te), "layernorm_linear": _layernorm_linear(te),
            "grouped": _grouped(te), "attention": _attention(te),
            "checkpoint": _checkpoint_with_tracker(te), "version": te.__version__}


def _linear(te) -> float:
    worst = 0.0
    for return_bias in (False, True):
        lin = te.pytorch.Linear(6, 5, params_dtype=F64, device="cpu", return_bias=return_bias)
        torch.nn.init.normal_(lin.bias)
        x = _rand(3, 2, 6, requires_grad=True)
        out = lin(x)
        y = out[0] + out[1] if return_bias else out
        g = _rand(*y.shape)
        y.backward(g)
        ref_x = x.detach().clone().requires_grad_()
        w, b = (lin.weight.detach().clone().requires_grad_(),
                lin.bias.detach().clone().requires_grad_())
        ref = F.linear(ref_x, w, b)
        ref.backward(g)
        worst = max(worst, _diff(y, ref), _diff(x.grad, ref_x.grad),
                    _diff(lin.weight.grad, w.grad), _diff(lin.bias.grad, b.grad))
    return worst


def _layernorm_linear(te) -> float:
    worst = 0.0
    for normalization, zero_centered in (("LayerNorm", False), ("RMSNorm", True)):
        lin = te.pytorch.LayerNormLinear(6, 4, normalization=normalization, params_dtype=F64,
                                         device="cpu", zero_centered_gamma=zero_centered)
        with torch.no_grad():
            lin.layer_norm_weight.normal_()
            lin.bias.normal_()
        x = _rand(3, 2, 6, requires_grad=True)
        y = lin(x)
        g = _rand(*y.shape)
        y.backward(g)
        ref_x = x.detach().clone().requires_grad_()
        gamma = lin.layer_norm_weight.detach().clone().requires_grad_()
        w, b = lin.weight.detach().clone().requires_grad_(), lin.bias.detach().clone()
        scale = gamma + 1 if zero_centered else gamma
        if normalization == "LayerNorm":
            beta = lin.layer_norm_bias.detach().clone()
            normed = F.layer_norm(ref_x, (6,), scale, beta, lin.eps)
        else:
            normed = F.rms_norm(ref_x, (6,), scale, lin.eps)
        ref = F.linear(normed, w, b)
        ref.backward(g)
        worst = max(worst, _diff(y, ref), _diff(x.grad, ref_x.grad),
                    _diff(lin.weight.grad, w.grad), _diff(lin.layer_norm_weight.grad, gamma.grad))
    return worst


def _grouped(te) -> float:
    lin = te.pytorch.GroupedLinear(3, 4, 5, params_dtype=F64, device="cpu")
    with torch.no_grad():
        for i in range(3):
            getattr(lin, f"bias{i}").normal_()
    splits = [3, 0, 4]
    x = _rand(sum(splits), 4, requires_grad=True)
    y = lin(x, splits)
    g = _rand(*y.shape)
    y.backward(g)
    ref_x = x.detach().clone().requires_grad_()
    ws = [getattr(lin, f"weight{i}").detach().clone().requires_grad_() for i in range(3)]
    bs = [getattr(lin, f"bias{i}").detach().clone().requires_grad_() for i in range(3)]
    ref = torch.cat([F.linear(part, w, b)
                     for part, w, b in zip(torch.split(ref_x, splits), ws, bs)])
    ref.backward(g)
    worst = max(_diff(y, ref), _diff(x.grad, ref_x.grad))
    for i in range(3):
        worst = max(worst, _diff(getattr(lin, f"weight{i}").grad, ws[i].grad),
                    _diff(getattr(lin, f"bias{i}").grad, bs[i].grad))
    return worst


def _attention(te) -> float:
    """Causal sbhd with grouped-query heads, and a "thd" pack of documents, against torch's
    scaled_dot_product_attention (per document for the pack)."""
    dpa = te.pytorch.DotProductAttention(4, 8, num_gqa_groups=2)
    q, k, v = _rand(5, 2, 4, 8), _rand(5, 2, 2, 8), _rand(5, 2, 2, 8)
    out = dpa(q, k, v, attn_mask_type="causal")
    ref = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3).repeat_interleave(2, 1),
        v.permute(1, 2, 0, 3).repeat_interleave(2, 1), is_causal=True)
    worst = _diff(out, ref.permute(2, 0, 1, 3).reshape(5, 2, 32))
    cu = torch.tensor([0, 3, 7, 9], dtype=torch.int32)
    q, k, v = _rand(9, 4, 8), _rand(9, 4, 8), _rand(9, 4, 8)
    out = dpa(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
              attn_mask_type="padding_causal")
    parts = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        sub = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        parts.append(F.scaled_dot_product_attention(*sub, is_causal=True).transpose(0, 1))
    return max(worst, _diff(out, torch.cat(parts).reshape(9, 32)))


def _checkpoint_with_tracker(te) -> float:
    """CudaRNGStatesTracker forks a named state and keeps where it left off; checkpoint
    recomputes a forward that draws dropout from the tracker with the states it first ran
    with: the same gradients as without recomputation."""
    tracker = te.pytorch.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(3))
    torch.set_rng_state(outside)
    weight = _rand(4, 4, requires_grad=True)

    def block(x):
        with tracker.fork():
            return F.dropout(x @ weight, p=0.5).square().sum()

    x = _rand(5, 4)
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    block(x).backward()
    direct = weight.grad.clone()
    weight.grad = None
    tracker.set_states(saved)
    te.pytorch.checkpoint(block, x, distribute_saved_activations=False,
                          get_rng_state_tracker=lambda: tracker, tp_group=None).backward()
    return _diff(weight.grad, direct)


# -- delay_wgrad_compute ------------------------------------------------------------------------
def delayed_wgrad_checks(rank, world) -> dict:
    """Two microbatches' B, then their Ws (backward_dw): the same gradients as the undelayed
    module; the first backward_dw runs the first B's GEMM (FIFO); an unfused bias (return_bias)
    fails at the second W under DDP's hook as TE's does, and the plugin's W passes it."""
    te = _import_te()
    torch.manual_seed(0)
    results = {}
    makers = {
        "linear": lambda delay: te.pytorch.Linear(
            4, 3, params_dtype=F64, device="cpu", delay_wgrad_compute=delay),
        "layernorm_linear": lambda delay: te.pytorch.LayerNormLinear(
            4, 3, params_dtype=F64, device="cpu", delay_wgrad_compute=delay),
        "grouped": lambda delay: te.pytorch.GroupedLinear(
            2, 4, 3, params_dtype=F64, device="cpu", delay_wgrad_compute=delay),
    }
    for name, make in makers.items():
        results[name] = _delayed_equals_undelayed(make)
    results["fifo"] = _fifo(te)
    results["fused_main_grad"] = _fused_main_grad(te)
    results["unfused_bias"] = _unfused_bias_under_ddp_hooks(te)
    return results


def _run(module, x):
    return module(x, [2, 3]) if hasattr(module, "num_gemms") else module(x)


def _delayed_equals_undelayed(make) -> float:
    eager, delayed = make(False), make(True)
    delayed.load_state_dict(eager.state_dict())
    inputs = [_rand(5, 4), _rand(5, 4)]
    for x in inputs:
        _run(eager, x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in eager.named_parameters()}
    summed = {n: torch.zeros_like(p) for n, p in delayed.named_parameters()}
    hooks = _ddp_like_hooks(delayed, summed)
    for x in inputs:  # B, B
        _run(delayed, x).square().sum().backward()
    marked = all(getattr(p, "skip_backward_post_hook", False)
                 for n, p in delayed.named_parameters() if "layer_norm" not in n)
    assert marked, "delay_wgrad_compute marks weights and biases skip_backward_post_hook"
    for _ in inputs:  # W, W
        delayed.backward_dw()
    assert hooks == [], "DDP-like hooks leave nothing behind"
    for n, p in delayed.named_parameters():  # norms: autograd, in B
        if p.grad is not None:
            summed[n] += p.grad
    return max(_diff(summed[n], grads[n]) for n in grads)


def _ddp_like_hooks(module, summed: dict) -> list:
    """What megatron's DDP does with delay_wgrad_compute for the parameters TE marked
    (megatron-core 0.16.1 distributed_data_parallel.py:323-337, hook :427-446): W's hook adds
    ``.grad`` to the main gradient and clears it. Returns a list that stays empty."""
    names = {id(p): n for n, p in module.named_parameters()}
    for param in module.parameters():
        if getattr(param, "skip_backward_post_hook", False):
            def hook(param=param):
                if param.grad is not None:
                    summed[names[id(param)]] += param.grad
                param.grad = None
            module.register_wgrad_accumulation_and_reduce_hooks(hook)
    return []


def _fifo(te) -> float:
    """After B(x1), B(x2), the first backward_dw leaves x1's weight gradient."""
    lin = te.pytorch.Linear(4, 3, bias=False, params_dtype=F64, device="cpu",
                            delay_wgrad_compute=True)
    x1, x2 = _rand(5, 4), _rand(5, 4)
    for x in (x1, x2):
        lin(x).sum().backward()
    lin.backward_dw()
    first = lin.weight.grad.clone()
    lin.backward_dw()
    second = lin.weight.grad.clone()
    ones = torch.ones(5, 3, dtype=F64)
    try:
        lin.backward_dw()
        raise AssertionError("a third backward_dw popped something")
    except RuntimeError as err:
        assert "Pop empty queue" in str(err)
    return max(_diff(first, ones.t() @ x1), _diff(second, ones.t() @ x2))


def _fused_main_grad(te) -> float:
    """fuse_wgrad_accumulation: the GEMM writes main_grad, overwriting on the first
    microbatch and adding on later ones; autograd gets a dummy and megatron's flag is set."""
    lin = te.pytorch.Linear(4, 3, bias=False, params_dtype=F64, device="cpu",
                            fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    lin.weight.main_grad = torch.full_like(lin.weight, 7.0)  # stale: the first overwrites
    lin.weight.grad_added_to_main_grad = False
    x1, x2 = _rand(5, 4), _rand(5, 4)
    lin(x1, is_first_microbatch=True).sum().backward()
    lin(x2, is_first_microbatch=False).sum().backward()
    assert lin.weight.grad_added_to_main_grad
    lin.backward_dw()
    lin.backward_dw()
    ones = torch.ones(5, 3, dtype=F64)
    return _diff(lin.weight.main_grad, ones.t() @ x1 + ones.t() @ x2)


def _unfused_bias_under_ddp_hooks(te) -> dict:
    """A return_bias Linear (megatron's linear_proj, fc2) under DDP-like hooks: B, B, W, W
    fails at the second W in TE's backward_dw (base.py:1494-1497, the None bias gradient),
    and passes with the plugin's W (te_wgrad.te_backward_dw), with the right sums."""
    from megatron_vshape.megatron.te_wgrad import te_backward_dw

    out = {}
    for plugin in (False, True):
        lin = te.pytorch.Linear(4, 3, return_bias=True, params_dtype=F64, device="cpu",
                                delay_wgrad_compute=True)
        summed = {n: torch.zeros_like(p) for n, p in lin.named_parameters()}
        _ddp_like_hooks(lin, summed)
        xs = [_rand(5, 4), _rand(5, 4)]
        for x in xs:
            y, b = lin(x)
            (y + b).square().sum().backward()
        try:
            for _ in xs:
                te_backward_dw([lin]) if plugin else lin.backward_dw()
        except AttributeError as err:
            out["plugin" if plugin else "te"] = f"AttributeError: {err}"
            continue
        ref = te.pytorch.Linear(4, 3, params_dtype=F64, device="cpu")
        ref.load_state_dict(lin.state_dict())
        for x in xs:
            ref(x).square().sum().backward()
        out["plugin" if plugin else "te"] = max(_diff(summed["weight"], ref.weight.grad),
                                                _diff(summed["bias"], ref.bias.grad))
    return out


# -- tensor parallel ----------------------------------------------------------------------------
def tensor_parallel_checks(rank, world) -> dict:
    """Column- and row-parallel Linear and a column-parallel LayerNormLinear on ``world`` ranks,
    with and without sequence parallel, against the unsharded float64 computation: output,
    input gradient and this rank's shard of the weight gradient."""
    te = _import_te()
    group = torch.distributed.new_group(list(range(world)))
    results = {}
    for mode in ("column", "row"):
        for sp in (False, True):
            results[f"{mode}{'-sp' if sp else ''}"] = _tp_linear(te, group, rank, world, mode, sp)
    results["layernorm-column-sp"] = _tp_linear(te, group, rank, world, "column", True, ln=True)
    return results


def _tp_linear(te, group, rank, world, mode, sp, ln=False) -> float:
    torch.manual_seed(1)  # the same full tensors on every rank
    full_w, full_b = _rand(6, 4), _rand(6)
    x_full, g_full = _rand(4, 2, 4), _rand(4, 2, 6)
    kwargs = dict(params_dtype=F64, device="cpu", tp_group=group, parallel_mode=mode,
                  sequence_parallel=sp)
    lin = te.pytorch.LayerNormLinear(4, 6, **kwargs) if ln else te.pytorch.Linear(4, 6, **kwargs)
    shard = full_w.chunk(world, dim=0 if mode == "column" else 1)[rank]
    with torch.no_grad():
        lin.weight.copy_(shard)
        lin.bias.copy_(full_b.chunk(world)[rank] if mode == "column" else full_b)
    local_x = x_full.chunk(world, dim=0)[rank] if sp and mode == "column" else \
        (x_full.chunk(world, dim=-1)[rank] if mode == "row" else x_full)
    local_x = local_x.clone().requires_grad_()
    y = lin(local_x)
    if mode == "column":
        local_g = g_full.chunk(world, dim=-1)[rank]
    else:
        local_g = g_full.chunk(world, dim=0)[rank] if sp else g_full
    y.backward(local_g)
    ref_x = x_full.clone().requires_grad_()
    w = full_w.clone().requires_grad_()
    inp = F.layer_norm(ref_x, (4,), eps=lin.eps) if ln else ref_x
    ref = F.linear(inp, w, full_b)
    ref.backward(g_full)
    ref_y = ref.chunk(world, dim=-1)[rank] if mode == "column" else \
        (ref.chunk(world, dim=0)[rank] if sp else ref)
    ref_dx = ref_x.grad.chunk(world, dim=0)[rank] if sp and mode == "column" else \
        (ref_x.grad.chunk(world, dim=-1)[rank] if mode == "row" else ref_x.grad)
    ref_dw = w.grad.chunk(world, dim=0 if mode == "column" else 1)[rank]
    return max(_diff(y, ref_y), _diff(local_x.grad, ref_dx), _diff(lin.weight.grad, ref_dw))


# -- context parallel ---------------------------------------------------------------------------
CP_CASES = {
    "sbhd-causal-gqa": ("sbhd", "causal", 2),
    "bshd-causal": ("bshd", "causal", 4),
    "sbhd-no-mask": ("sbhd", "no_mask", 4),
    "thd-padded": ("thd", "padding_causal", 4),
    "thd-unpadded": ("thd", "padding_causal", 4),
}
"""name: (layout, mask, key/value heads of 4 query heads). "thd-padded": documents of 3, 7 and
2 tokens padded to 4, 8 and 4 (cu_seqlens_padded given, padding between documents);
"thd-unpadded": documents of 4, 8 and 4 with no padded offsets (megatron 0.19's --sft with
CP: its SFTDataset pads each document to a multiple of 2 x CP, and cu_seqlens are those)."""
CP_COMM = ("p2p", "all_gather", "a2a", "a2a+p2p")
REFUSE_THD = ("all_gather", "a2a+p2p")
"""The communications TE refuses "thd" under (all_gather takes no padding mask; a2a+p2p no
"thd"): the cases below skip them, _cp_refusals checks the refusal."""


def context_parallel_checks(rank, world) -> dict:
    """CP ``world``: each rank's output and query/key/value gradients of the stand-in's
    context-parallel attention against its own attention over the whole sequence (float64),
    for every communication type; the refusals TE makes; the thd partition."""
    te = _import_te()
    group = torch.distributed.new_group(list(range(world)))
    singles = [torch.distributed.new_group([r]) for r in range(world)]
    results = {}
    for comm in CP_COMM:
        cp_group = [group, singles[rank]] if comm == "a2a+p2p" else group  # a2a+p2p: [a2a, p2p]
        for name, (fmt, mask, kv_heads) in CP_CASES.items():
            if fmt == "thd" and comm in REFUSE_THD:
                continue
            results[f"{comm} {name}"] = _cp_case(te, cp_group, comm, rank, world, fmt, mask,
                                                 kv_heads, name)
    results.update(_cp_refusals(te, group, rank, world))
    if rank == 0:
        results["partition"] = _thd_partition(world)
    return results


def _cp_inputs(fmt, name, kv_heads):
    """Whole-sequence q, k, v, output gradient and offsets (the same on every rank)."""
    torch.manual_seed(3)
    if fmt == "thd":
        if name == "thd-padded":
            cu, padded = torch.tensor([0, 3, 11, 13]), torch.tensor([0, 4, 12, 16])
        else:
            cu, padded = torch.tensor([0, 4, 12, 16]), None
        shape = lambda heads: (16, heads, 8)  # noqa: E731
    else:
        cu = padded = None
        shape = (lambda heads: (8, 2, heads, 8)) if fmt == "sbhd" else \
            (lambda heads: (2, 8, heads, 8))
    q, k, v = _rand(*shape(4)), _rand(*shape(kv_heads)), _rand(*shape(kv_heads))
    return q, k, v, cu, padded


def _cp_case(te, cp_group, comm, rank, world, fmt, mask, kv_heads, name) -> float:
    import transformer_engine_torch as tex

    q, k, v, cu, padded = _cp_inputs(fmt, name, kv_heads)
    kwargs = {}
    if cu is not None:
        kwargs = dict(cu_seqlens_q=cu.to(torch.int32), cu_seqlens_kv=cu.to(torch.int32),
                      cu_seqlens_q_padded=None if padded is None else padded.to(torch.int32),
                      cu_seqlens_kv_padded=None if padded is None else padded.to(torch.int32))
    whole = te.pytorch.DotProductAttention(4, 8, num_gqa_groups=kv_heads, qkv_format=fmt)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = whole(*refs, attn_mask_type=mask, **kwargs)
    grad = _rand(*out.shape)
    out.backward(grad)
    seq_dim = 1 if fmt == "bshd" else 0
    total = q.shape[seq_dim]
    if fmt == "thd":
        offsets = (padded if padded is not None else cu).to(torch.int32)
        index = tex.thd_get_partitioned_indices(offsets, total, world, rank).to(torch.int64)
    else:
        chunk = total // (2 * world)
        index = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                           torch.arange((2 * world - 1 - rank) * chunk,
                                        (2 * world - rank) * chunk)])
    mine = [t.index_select(seq_dim, index).clone().requires_grad_() for t in (q, k, v)]
    dpa = te.pytorch.DotProductAttention(4, 8, num_gqa_groups=kv_heads, qkv_format=fmt,
                                         cp_group=cp_group, cp_comm_type=comm)
    local = dpa(*mine, attn_mask_type=mask, **kwargs)
    local.backward(grad.index_select(seq_dim, index))
    return max([_diff(local, out.index_select(seq_dim, index))] +
               [_diff(m.grad, r.grad.index_select(seq_dim, index)) for m, r in zip(mine, refs)])


def _cp_refusals(te, group, rank, world) -> dict:
    """The errors TE gives: megatron's spelling "allgather" (TE's is "all_gather"), padding
    masks under all_gather, thd under a2a+p2p, and heads not divisible by CP under a2a."""
    q, k, v, cu, _ = _cp_inputs("thd", "thd-unpadded", 4)
    cu = cu.to(torch.int32)
    local = [t[: t.shape[0] // world] for t in (q, k, v)]
    thd = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
               attn_mask_type="padding_causal")
    sq, sk, sv = (t[:4] for t in _cp_inputs("sbhd", "", 4)[:3])
    cases = {"allgather": ("allgather", group, local, thd),
             "all_gather thd": ("all_gather", group, local, thd),
             "a2a+p2p thd": ("a2a+p2p", [group, group], local, thd),
             "a2a heads": ("a2a", group, [sq[:, :, :1], sk[:, :, :1], sv[:, :, :1]],
                           dict(attn_mask_type="causal"))}
    out = {}
    for name, (comm, cp_group, tensors, kwargs) in cases.items():
        heads = tensors[0].shape[-2]
        dpa = te.pytorch.DotProductAttention(heads, 8, qkv_format="sbhd", cp_group=group,
                                             cp_comm_type="p2p")
        dpa.cp_group, dpa.cp_comm_type = cp_group, comm  # as set_context_parallel_group would
        try:
            dpa(*tensors, **kwargs)
            out[f"refuses {name}"] = "ran"
        except (AssertionError, ValueError) as err:
            out[f"refuses {name}"] = f"{type(err).__name__}: {err}"
    return out


def _thd_partition(world) -> dict:
    """tex.thd_get_partitioned_indices against the split written out: of each document's
    2 x world chunks, rank r takes chunk r then chunk 2 x world - 1 - r; its errors."""
    import transformer_engine_torch as tex

    cu = torch.tensor([0, 4, 12, 20, 24], dtype=torch.int32)
    wrong = 0
    for rank in range(world):
        want = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            chunk = (end - start) // (2 * world)
            for c in (rank, 2 * world - 1 - rank):
                want += range(start + c * chunk, start + (c + 1) * chunk)
        got = tex.thd_get_partitioned_indices(cu, 24, world, rank)
        wrong += int(got.dtype != torch.int32 or got.tolist() != want)
    errors = {}
    for name, call in {"none": lambda: tex.thd_get_partitioned_indices(None, 24, world, 0),
                       "odd document": lambda: tex.thd_get_partitioned_indices(
                           torch.tensor([0, 6, 24], dtype=torch.int32), 24, world, 0),
                       "int64": lambda: tex.thd_get_partitioned_indices(cu.long(), 24, world, 0)
                       }.items():
        try:
            call()
            errors[name] = "ran"
        except (TypeError, RuntimeError) as err:
            errors[name] = type(err).__name__
    return {"wrong": wrong, "errors": errors}
