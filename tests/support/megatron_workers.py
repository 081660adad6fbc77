"""Workers for the megatron-core gloo tests (run in every spawned rank).

The model, data and by-name initialisation are megatron_vshape.harness.tiny_gpt's (the demo
uses them too). ``options`` switch on what Megatron-LM's training loop does on top of plain
megatron-core: ``per_token`` (pretrain_gpt's per-token loss, calculate_per_token_loss),
``relay`` (losses read on the last pipeline rank), ``timers`` (megatron's timers),
``param_sync`` (config.param_sync_func), ``replan_after`` / ``memory_limit`` (auto re-planned
from measured costs), ``config`` (TransformerConfig fields both runs get, e.g. recomputation).
"""
import time
from functools import partial

import torch
import torch.distributed as dist

from support.megatron_cpu import allow_sequence_parallel_norms, install_cpu_shims  # first: it
# prepares megatron imports on CPU (megatron-core 0.19's triton)
from megatron_vshape.harness import tiny_gpt  # noqa: E402
from megatron_vshape.harness.tiny_gpt import (  # noqa: F401,E402
    global_grads, global_named_parameters, init_by_name)

TEST_GPT = tiny_gpt.TinyGPT(hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8,
                            micro_batch_size=2)
SEQ, MBS, VOCAB, HIDDEN = (TEST_GPT.seq_length, TEST_GPT.micro_batch_size, TEST_GPT.vocab_size,
                           TEST_GPT.hidden_size)


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
    values = dict(num_layers=num_layers, virtual_pipeline_model_parallel_size=vp)
    values.update(overrides)
    hidden = values.pop("hidden_size", HIDDEN)
    heads = values.pop("num_attention_heads", TEST_GPT.num_attention_heads)
    model = tiny_gpt.TinyGPT(num_layers=values.pop("num_layers"), hidden_size=hidden,
                             num_attention_heads=heads)
    return model.transformer_config(pp, tp, **values)


def batches(num_microbatches, step):
    return tiny_gpt.batches(TEST_GPT, num_microbatches, step)


def forward_step(data_iterator, model):
    return tiny_gpt.forward_step(data_iterator, model)


def _gpt_provider():
    """GPTModel for TEST_GPT; callers pass share_embeddings_and_output_weights. With
    ``config.mtp_num_layers`` the model gets megatron's MTP block spec where megatron's
    placement puts it (asked per chunk, as Megatron-LM's gpt_builder does) and rotary position
    embeddings (Megatron-LM allows MTP with rope or none only)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)

    def provider(config, pre_process=True, post_process=True, vp_stage=None, pg_collection=None,
                 **kwargs):
        spec = get_gpt_layer_local_spec()
        if getattr(config, "mtp_num_layers", None):
            kwargs.update(position_embedding_type="rope", mtp_block_spec=get_gpt_mtp_block_spec(
                config, spec, use_transformer_engine=False, vp_stage=vp_stage))
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                        max_sequence_length=SEQ, pre_process=pre_process,
                        post_process=post_process, vp_stage=vp_stage,
                        pg_collection=pg_collection, **kwargs)
    return provider


def compare_runs(rank, world, schedules, num_layers, num_microbatches, steps, tied, pp=None,
                 ddp=None, tp=1, sequence_parallel=False, reference_config=None, options=None):
    """Megatron's own 1F1B, then each V schedule, on one world: {name: per-step results}.

    ``pp`` defaults to the world (else the rest is data parallel); ``ddp`` is a dict of
    DistributedDataParallelConfig settings (None: no DDP); ``options`` see the module doc."""
    from megatron.core import parallel_state as ps

    pp = pp or world // tp
    par = {"tp": tp, "sequence_parallel": sequence_parallel, "options": options or {}}
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
                       sequence_parallel=False, reference_config=None, options=None):
    """Megatron's own 1F1B: per step the losses and global-name gradients."""
    _setup(pp, tp=tp)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    options = options or {}
    config = gpt_config(num_layers, pp, tp=tp, sequence_parallel=sequence_parallel,
                        calculate_per_token_loss=bool(options.get("per_token")),
                        **(reference_config or {}), **options.get("config", {}))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = _gpt_provider()(config=config, pre_process=pp_rank == 0,
                            post_process=pp_rank == pp - 1,
                            share_embeddings_and_output_weights=tied)
    init_by_name([model], tied)
    chunks = _wrap_ddp(config, [model], ddp, delay_wgrad=False)
    return _train(chunks, get_forward_backward_func(), num_microbatches, steps, tied,
                  reference=ddp is None, options=options)


def vshape_run(rank, world, schedule, num_layers, num_microbatches, steps, tied, ddp=None, tp=1,
               sequence_parallel=False, standard_config=None, options=None):
    """The same model and data under a V schedule through our forward-backward function."""
    from megatron_vshape.megatron.forward_backward import VShapeForwardBackward
    from megatron_vshape.megatron.model import build_v_chunks, v_embedding_ranks

    _setup(world, tp=tp, embedding_ranks=v_embedding_ranks)
    from megatron.core import parallel_state as ps

    options = options or {}
    per_token = bool(options.get("per_token"))
    config = gpt_config(num_layers, world, tp=tp, sequence_parallel=sequence_parallel,
                        calculate_per_token_loss=per_token, **options.get("config", {}))
    provider = partial(_gpt_provider(), share_embeddings_and_output_weights=tied)
    if schedule == "zb-1p":  # one chunk per rank, the standard placement, W deferred
        from megatron_vshape.megatron.wgrad import defer_weight_grads
        from megatron_vshape.runtime.wgrad import WeightGradStore

        ps.destroy_model_parallel()
        _setup(world, tp=tp)
        config = gpt_config(num_layers, world, tp=tp, sequence_parallel=sequence_parallel,
                            calculate_per_token_loss=per_token, **(standard_config or {}),
                            **options.get("config", {}))
        r = ps.get_pipeline_model_parallel_rank()
        chunks = [provider(config=config, pre_process=r == 0, post_process=r == world - 1)]
        defer_weight_grads(chunks[0], WeightGradStore(), mark_for_ddp=ddp is not None)
    elif options.get("megatron_lm"):  # as Megatron-LM's get_model calls it: once per vp stage
        from megatron_vshape.megatron.providers import VChunkProvider

        v_provider = VChunkProvider(provider, lambda: config)
        chunks = [v_provider(pre_process=True, post_process=True, vp_stage=v) for v in (0, 1)]
    else:
        chunks = build_v_chunks(provider, config, ps.get_pipeline_model_parallel_group(),
                                ddp_delay_wgrad=ddp is not None)
    init_by_name(chunks, tied)
    chunks = _wrap_ddp(config, chunks, ddp, delay_wgrad=True)
    auto = schedule == "auto"
    fb = VShapeForwardBackward(schedule, timeout=60, losses_on_last_rank=bool(options.get("relay")),
                               replan_after=options.get("replan_after", 0) if auto else 0,
                               memory_limit=options.get("memory_limit") if auto else None)
    out = _train(chunks, fb, num_microbatches, steps, tied, reference=schedule == "zb-1p" and
                 ddp is None, options=options)
    out[-1]["costs"] = fb.measured_costs(num_microbatches)  # profiled F, B, W per rank
    out[-1]["replanned"] = fb.replanner.done
    out[-1]["replanned_costs"] = fb.costs if fb.replanner.done else None
    out[-1]["activation_bytes"] = fb.replanner.activation_bytes
    out[-1]["memory_model"] = fb.replanner.memory
    out[-1]["plans"] = list(fb.plans)
    return out


def _grad_buffers(chunk):
    """DDP's main_grad views (parameters' gradient storage is not activation memory)."""
    return [p.main_grad for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]


def _allreduce_tied_grads(model):
    """What megatron's finalize_model_grads does for tied embeddings and MTP's embedding copy
    (it needs DDP-wrapped models, which these plain reference runs are not): sum the first and
    last rank's grads."""
    from megatron.core import parallel_state as ps
    if ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


class RecordingTimers:
    """Stands in for Megatron-LM's timers: records which timers ran and how often."""

    def __init__(self):
        self.started = {}

    def __call__(self, name, log_level=0):
        return _RecordingTimer(self, name)


class _RecordingTimer:
    def __init__(self, timers, name):
        self.timers, self.name = timers, name

    def start(self, barrier=False):
        self.timers.started[self.name] = self.timers.started.get(self.name, 0) + 1

    def stop(self, barrier=False):
        pass


def _install_loop_hooks(chunks, options):
    """The config hooks Megatron-LM's training loop sets that ``options`` asks for."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.timers = RecordingTimers() if options.get("timers") else None
    if options.get("align_grad_reduce") and hasattr(chunks[0], "start_grad_sync"):
        funcs = [chunk.start_grad_sync for chunk in chunks]  # as Megatron-LM's train() sets it
        config.grad_sync_func = funcs if len(funcs) > 1 else funcs[0]
    synced = []
    if options.get("param_sync"):
        config.param_sync_func = [partial(lambda c, params: synced.append(c), c)
                                  for c in range(len(chunks))]
    return config, synced


def _train(chunks, fb, num_microbatches, steps, tied, reference=False, options=None):
    """Steps of plain SGD; per step the losses, gradients by global name, the peak bytes kept
    for backward (saved tensors and what W keeps), and how many weight gradients ran in W."""
    from megatron_vshape.megatron.wgrad import store_of
    from megatron_vshape.runtime.memory import ActivationTracker

    options = options or {}
    config, synced = _install_loop_hooks(chunks, options)
    step_func = partial(tiny_gpt.forward_step, per_token=bool(options.get("per_token")))
    if options.get("megatron_lm") and len(chunks) == 2:  # the V batch: rank 0, TP broadcast
        from megatron_vshape.megatron.batch import VBatch, VForwardStep

        loss = tiny_gpt.per_token_loss if options.get("per_token") else tiny_gpt.mean_loss
        step_func = VForwardStep(VBatch(SEQ, MBS), loss, timers=config.timers)

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
            losses = fb(forward_step_func=step_func,
                        data_iterator=data if len(chunks) > 1 else data[0], model=chunks,
                        num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
                        forward_only=False)
        seconds = time.perf_counter() - begin
        if reference and (tied or getattr(config, "mtp_num_layers", None)):
            _allreduce_tied_grads(chunks[0])
        out.append({"losses": [tiny_gpt.loss_value(d) for d in losses], "dp": dp,
                    "pp_rank": ps.get_pipeline_model_parallel_rank(),
                    "timers": dict(config.timers.started) if config.timers else {},
                    "param_syncs": list(synced),
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
    evaluation = fb(forward_step_func=step_func, data_iterator=data if len(chunks) > 1 else
                    data[0], model=chunks, num_microbatches=num_microbatches, seq_length=SEQ,
                    micro_batch_size=MBS, forward_only=True)
    out[-1]["eval"] = [tiny_gpt.loss_value(d) for d in evaluation]
    out[-1]["mtp_layers"] = _mtp_layer_numbers(chunks)
    return out


def _mtp_layer_numbers(chunks) -> list:
    """The layer numbers of this rank's MTP layers' transformer layers (megatron-core 0.16:
    num_layers + depth; 0.19: the depth), in build order."""
    from megatron.core.utils import unwrap_model

    numbers = []
    for chunk in unwrap_model(list(chunks)):
        for layer in getattr(getattr(chunk, "mtp", None), "layers", []):
            inner = getattr(layer, "transformer_layer", None) or layer.mtp_model_layer
            numbers.append(inner.layer_number)
    return numbers


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


def megatron_schedules_on_v_chunks(rank, world, num_microbatches=4):
    """With a V schedule installed, megatron's own schedule functions called directly (as a
    loop that bypasses the wrapped get_forward_backward_func would) on V chunks, plain and
    DDP-wrapped: the errors they raise; then megatron's 1F1B on standard chunks, which must
    still run (its losses), and whether uninstall() put the unguarded functions back."""
    import megatron_vshape
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    megatron_vshape.install(schedule="v-half")
    try:
        chunks = _build("v", world, 2 * world, tied=True)
        wrapped = _wrap_ddp(chunks[0].config, chunks, {"overlap_grad_reduce": False},
                            delay_wgrad=True)
        errors = {}
        for name, model in (("forward_backward_pipelining_with_interleaving", chunks),
                            ("forward_backward_pipelining_without_interleaving", wrapped[:1]),
                            ("forward_backward_no_pipelining", chunks[1])):
            data = [iter(batches(num_microbatches, 0)) for _ in chunks]
            try:
                getattr(schedules, name)(
                    forward_step_func=forward_step, data_iterator=data, model=model,
                    num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
                errors[name] = None
            except Exception as err:  # the test reads type and message
                errors[name] = f"{type(err).__name__}: {err}"
        standard = _build("1f1b", world, 2 * world, tied=False)
        losses = schedules.forward_backward_pipelining_without_interleaving(  # guarded
            forward_step_func=forward_step, data_iterator=iter(batches(num_microbatches, 0)),
            model=standard, num_microbatches=num_microbatches, seq_length=SEQ,
            micro_batch_size=MBS, forward_only=True)
    finally:
        megatron_vshape.uninstall()
        ps.destroy_model_parallel()
    restored = not hasattr(schedules.forward_backward_pipelining_with_interleaving,
                           "vshape_original")
    return {"errors": errors, "losses": [tiny_gpt.loss_value(d) for d in losses],
            "restored": restored}


def moe_weight_grads_in_w(rank, world):
    """A two-layer MoE GPT (SequentialMLP experts, a shared expert, the top-k router with
    load-balancing and z-loss), built twice with the same weights: one as megatron computes
    it, one with its weight gradients deferred (defer_weight_grads, as V chunks and zb-1p are).
    One microbatch's B, then its W: which weights got their gradient in B, which in W, and how
    far the gradients are from megatron's."""
    from support.megatron_lm_cpu import install_moe_cpu_patches

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_vshape.megatron.providers import weights_kept_in_b
    from megatron_vshape.megatron.wgrad import defer_weight_grads
    from megatron_vshape.runtime.wgrad import WeightGradStore

    _setup(1)
    install_moe_cpu_patches()
    config = gpt_config(2, 1, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                        moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
                        moe_token_dispatcher_type="allgather", add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    models = [GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                       max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
              for _ in range(2)]
    for model in models:
        init_by_name([model], tied=False)
    reference, split = models
    store = WeightGradStore()
    registered = defer_weight_grads(split, store, mark_for_ddp=True)
    batch = batches(1, 0)[0]
    in_b = []
    for model in models:
        with store.collecting(0):
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            output.float().mean().backward()
        if model is split:
            in_b = sorted(n for n, p in split.named_parameters() if p.grad is not None)
            store.run(0)
    want = dict(reference.named_parameters())
    diff = max(float((p.grad - want[n].grad).abs().max()) for n, p in split.named_parameters())
    return {"registered": registered, "in_b": in_b, "diff": diff, "pending": store.pending,
            "kept": sorted(weights_kept_in_b(split, [])),
            "experts": sorted(n for n, _ in split.named_parameters() if "experts" in n)}
