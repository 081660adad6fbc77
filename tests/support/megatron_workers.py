"""Workers for the megatron-core gloo tests (run in every spawned rank)."""
import time

import torch
import torch.distributed as dist

from support.megatron_cpu import allow_sequence_parallel_norms, install_cpu_shims

SEQ, MBS, VOCAB, HIDDEN = 8, 2, 64, 16


def _setup(pp, vp=None, tp=1, embedding_ranks=None):
    import megatron.core.models.gpt  # noqa: F401  (import before shimming: rebinding needs it)
    from megatron.core import parallel_state as ps

    install_cpu_shims()
    kwargs = {"get_embedding_ranks": embedding_ranks} if embedding_ranks else {}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp, **kwargs)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(123)


def gpt_config(num_layers, pp, vp=None, tp=1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    values = dict(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=2,
                  use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                  pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                  tensor_model_parallel_size=tp, pipeline_dtype=torch.float32,
                  bf16=False, fp16=False, params_dtype=torch.float32, batch_p2p_sync=False)
    values.update(overrides)
    return TransformerConfig(**values)


def batches(num_microbatches, step):
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(MBS, SEQ), "position_ids":
                    torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()})
    return out


def forward_step(data_iterator, model):
    from functools import partial
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def _loss(mask, output):
    losses = output.float().view(-1)
    loss = torch.sum(losses * mask.view(-1)) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def megatron_1f1b(rank, world, num_layers, num_microbatches, steps):
    """Megatron's own 1F1B, PP = world: losses per step and every parameter's gradient."""
    _setup(world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = gpt_config(num_layers, world)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ,
                     pre_process=pp_rank == 0, post_process=pp_rank == world - 1)
    fb = get_forward_backward_func()
    out = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = None
        losses = fb(forward_step_func=forward_step, data_iterator=iter(batches(num_microbatches, step)),
                    model=[model], num_microbatches=num_microbatches, seq_length=SEQ,
                    micro_batch_size=MBS, forward_only=False)
        out.append({"losses": [d["lm loss"].item() for d in losses],
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}})
    return out


def global_named_parameters(chunks):
    """(name with global layer numbers, parameter) over a rank's chunks (1F1B and V alike)."""
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)  # DDP-wrapped
        numbers = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
        for name, p in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(numbers[int(parts[2])])
            yield ".".join(parts), p


def global_grads(chunks):
    """{global name: gradient} (``main_grad`` under DDP) over a rank's chunks."""
    out = {}
    for key, p in global_named_parameters(chunks):
        grad = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad
        if grad is not None:
            out[key] = grad.detach().clone()
    return out


def _gpt_provider(num_layers_unused=None):
    from functools import partial
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return partial(GPTModel, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ)


def compare_runs(rank, world, schedules, num_layers, num_microbatches, steps, tied, pp=None,
                 ddp=None, tp=1, sequence_parallel=False, reference_config=None):
    """Megatron's own 1F1B, then each V schedule, on one world: {name: per-step results}.

    ``pp`` defaults to the world (else the rest is data parallel); ``ddp`` is a dict of
    DistributedDataParallelConfig settings (None: no DDP)."""
    from megatron.core import parallel_state as ps

    pp = pp or world // tp
    par = {"tp": tp, "sequence_parallel": sequence_parallel}
    if sequence_parallel:
        allow_sequence_parallel_norms()
    out = {"1f1b": megatron_reference(rank, pp, num_layers, num_microbatches, steps, tied, ddp,
                                      reference_config=reference_config, **par)}
    ps.destroy_model_parallel()
    for name in schedules:
        out[name] = vshape_run(rank, pp, name, num_layers, num_microbatches, steps, tied, ddp,
                               standard_config=reference_config, **par)
        ps.destroy_model_parallel()
    return out


def _wrap_ddp(config, chunks, ddp, delay_wgrad):
    """Megatron DDP per chunk, with the config hooks Megatron-LM's training loop sets."""
    if ddp is None:
        return chunks
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    ddp_config = DistributedDataParallelConfig(delay_wgrad_compute=delay_wgrad, **ddp)
    wrapped = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    for chunk in wrapped:
        chunk.zero_grad_buffer()
    funcs = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = funcs if len(funcs) > 1 else funcs[0]
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def megatron_reference(rank, pp, num_layers, num_microbatches, steps, tied, ddp=None, tp=1,
                       sequence_parallel=False, reference_config=None):
    """Megatron's own 1F1B: per step the losses and global-name gradients."""
    _setup(pp, tp=tp)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = gpt_config(num_layers, pp, tp=tp, sequence_parallel=sequence_parallel,
                        **(reference_config or {}))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = _gpt_provider()(config=config, pre_process=pp_rank == 0,
                            post_process=pp_rank == pp - 1,
                            share_embeddings_and_output_weights=tied)
    init_by_name([model], tied)
    chunks = _wrap_ddp(config, [model], ddp, delay_wgrad=False)
    return _train(chunks, get_forward_backward_func(), num_microbatches, steps, tied,
                  reference=ddp is None)


def vshape_run(rank, world, schedule, num_layers, num_microbatches, steps, tied, ddp=None, tp=1,
               sequence_parallel=False, standard_config=None):
    """The same model and data under a V schedule through our forward-backward function."""
    from functools import partial

    from megatron_vshape.megatron.forward_backward import VShapeForwardBackward
    from megatron_vshape.megatron.model import build_v_chunks, v_embedding_ranks

    _setup(world, tp=tp, embedding_ranks=v_embedding_ranks)
    from megatron.core import parallel_state as ps

    config = gpt_config(num_layers, world, tp=tp, sequence_parallel=sequence_parallel)
    provider = partial(_gpt_provider(), share_embeddings_and_output_weights=tied)
    if schedule == "zb-1p":  # one chunk per rank, the standard placement, W deferred
        from megatron_vshape.megatron.wgrad import defer_weight_grads
        from megatron_vshape.runtime.wgrad import WeightGradStore

        ps.destroy_model_parallel()
        _setup(world, tp=tp)
        config = gpt_config(num_layers, world, tp=tp, sequence_parallel=sequence_parallel,
                            **(standard_config or {}))
        r = ps.get_pipeline_model_parallel_rank()
        chunks = [provider(config=config, pre_process=r == 0, post_process=r == world - 1)]
        defer_weight_grads(chunks[0], WeightGradStore(), mark_for_ddp=ddp is not None)
    else:
        chunks = build_v_chunks(provider, config, ps.get_pipeline_model_parallel_group(),
                                ddp_delay_wgrad=ddp is not None)
    init_by_name(chunks, tied)
    chunks = _wrap_ddp(config, chunks, ddp, delay_wgrad=True)
    fb = VShapeForwardBackward(schedule, timeout=60)
    out = _train(chunks, fb, num_microbatches, steps, tied, reference=schedule == "zb-1p" and
                 ddp is None)
    out[-1]["costs"] = fb.measured_costs(num_microbatches)  # profiled F, B, W per rank
    return out


def init_by_name(chunks, tied):
    """Give every parameter values that depend only on its global name, so 1F1B and V models
    (built in different orders on different ranks) start identical."""
    import zlib
    for key, p in global_named_parameters(chunks):
        if tied and key == "output_layer.weight":
            key = "embedding.word_embeddings.weight"
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        values = 0.05 * torch.randn(p.shape, generator=gen)
        if "norm" in key and key.endswith("weight"):
            values += 1.0
        with torch.no_grad():
            p.copy_(values)


def _grad_buffers(chunk):
    """DDP's main_grad views (parameters' gradient storage is not activation memory)."""
    return [p.main_grad for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]


def _allreduce_tied_grads(model):
    """What megatron's finalize_model_grads does for tied embeddings (it needs DDP-wrapped
    models, which these plain reference runs are not): sum the first and last rank's grads."""
    from megatron.core import parallel_state as ps
    if ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def _train(chunks, fb, num_microbatches, steps, tied, reference=False):
    """Steps of plain SGD; per step the losses, gradients by global name, the peak bytes kept
    for backward (saved tensors and what W keeps), and how many weight gradients ran in W."""
    from megatron_vshape.megatron.wgrad import store_of
    from megatron_vshape.runtime.memory import ActivationTracker

    tracker = ActivationTracker([p for c in chunks for p in c.parameters()] +
                                [b for c in chunks for b in _grad_buffers(c)])
    stores = [store_of(c) for c in chunks]
    for store in stores:
        store.tracker = tracker
    out = []
    for step in range(steps):
        for chunk in chunks:
            for p in chunk.parameters():
                p.grad = None
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        from megatron.core import parallel_state as ps
        dp = (ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank())
        data = [iter(batches(num_microbatches, 100 * step + dp[0])) for _ in chunks]
        tracker.reset_peak()
        ran = sum(s.ran for s in stores)
        dist.barrier()
        begin = time.perf_counter()
        with tracker.saved_tensors_hooks():
            losses = fb(forward_step_func=forward_step,
                        data_iterator=data if len(chunks) > 1 else data[0], model=chunks,
                        num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
                        forward_only=False)
        seconds = time.perf_counter() - begin
        if tied and reference:
            _allreduce_tied_grads(chunks[0])
        out.append({"losses": [d["lm loss"].item() for d in losses], "dp": dp,
                    "grads": {(dp, k): g for k, g in global_grads(chunks).items()},
                    "peak": tracker.peak, "w_ran": sum(s.ran for s in stores) - ran,
                    "seconds": seconds})
        with torch.no_grad():  # a plain SGD step so later steps check updated weights
            for chunk in chunks:
                for p in chunk.parameters():
                    grad = p.main_grad if hasattr(p, "main_grad") else p.grad
                    if grad is not None:
                        p -= 0.01 * grad
    data = [iter(batches(num_microbatches, 999)) for _ in chunks]
    evaluation = fb(forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else
                    data[0], model=chunks, num_microbatches=num_microbatches, seq_length=SEQ,
                    micro_batch_size=MBS, forward_only=True)
    out[-1]["eval"] = [d["lm loss"].item() for d in evaluation]
    return out


def _named_values(chunks):
    """{global name: value} of a rank's chunks (parameters; no gradients)."""
    return {key: p.detach().clone() for key, p in global_named_parameters(chunks)}


def _build(layout, world, num_layers, tied):
    """Fresh chunks for ``layout`` ("v" or "1f1b") with parallel state set up for it."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron_vshape.megatron.model import build_v_chunks, v_embedding_ranks

    ps.destroy_model_parallel()
    provider = partial(_gpt_provider(), share_embeddings_and_output_weights=tied)
    config = gpt_config(num_layers, world)
    if layout == "v":
        _setup(world, embedding_ranks=v_embedding_ranks)
        return build_v_chunks(provider, config, ps.get_pipeline_model_parallel_group())
    _setup(world)
    r = ps.get_pipeline_model_parallel_rank()
    return [provider(config=config, pre_process=r == 0, post_process=r == world - 1)]


def _sharded(chunks):
    state = {}
    for i, chunk in enumerate(chunks):
        state[f"model{i}" if len(chunks) > 1 else "model"] = chunk.sharded_state_dict()
    return state


def checkpoint_round_trip(rank, world, directory, src, dst, num_layers, tied):
    """Save ``src`` ("v"/"1f1b") weights with dist_checkpointing (torch_dist), load them into a
    freshly built ``dst`` model of the same PP size; return both sides' values by name."""
    import os

    from megatron.core import dist_checkpointing

    chunks = _build(src, world, num_layers, tied)
    init_by_name(chunks, tied)
    saved = _named_values(chunks)
    path = os.path.join(directory, f"{src}-to-{dst}")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(chunks), path)
    fresh = _build(dst, world, num_layers, tied)
    with torch.no_grad():
        for chunk in fresh:
            for p in chunk.parameters():
                p.fill_(7.0)  # anything the load does not overwrite shows
    loaded = dist_checkpointing.load(_sharded(fresh), path)
    for i, chunk in enumerate(fresh):
        chunk.load_state_dict(loaded[f"model{i}" if len(fresh) > 1 else "model"])
    return {"saved": saved, "loaded": _named_values(fresh)}
