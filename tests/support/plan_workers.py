"""Workers for the planner's memory check: a bundled model (``configs/models``)
on megatron-core (CPU, gloo, fp32, local spec), its peak bytes kept for backward per rank under
one schedule.

What is measured is what the planner predicts as activation memory: every tensor autograd
saves in a forward plus what a deferred weight gradient keeps for W
(:class:`megatron_vshape.runtime.memory.ActivationTracker`), parameters excluded.
"""
import torch
import torch.distributed as dist

from support.megatron_cpu import allow_sequence_parallel_norms
from support.megatron_workers import _setup, forward_step, gpt_config


def _batches(count, micro_batch_size, seq_length, vocab_size, step):
    gen = torch.Generator().manual_seed(2000 + step)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(micro_batch_size, seq_length),
                    "position_ids": torch.arange(seq_length).unsqueeze(0)
                    .expand(micro_batch_size, seq_length).contiguous()})
    return out


_RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
              "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 1}}
"""The planner's recomputation kinds as megatron's TransformerConfig settings (Megatron-LM's
--recompute-* flags of the paper's 1F1B-R; selective recomputes the attention core)."""


def _model_config(model, pp, tp, sequence_parallel, dropout, recompute="none"):
    """megatron's TransformerConfig for a planner ModelConfig (fp32, local spec)."""
    return gpt_config(model.num_layers, pp, tp=tp, sequence_parallel=sequence_parallel,
                      hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                      ffn_hidden_size=model.ffn, num_query_groups=model.num_query_groups,
                      hidden_dropout=dropout, attention_dropout=dropout, **_RECOMPUTE[recompute])


def _provider(model, seq_length):
    from functools import partial

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return partial(GPTModel, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=model.vocab_size, max_sequence_length=seq_length,
                   share_embeddings_and_output_weights=not
                   model.untie_embeddings_and_output_weights)


def _chunks(schedule, pp, tp, model, seq_length, sequence_parallel, dropout, recompute):
    """This rank's model chunks and forward-backward function for ``schedule``."""
    from megatron.core import parallel_state as ps

    if sequence_parallel:
        allow_sequence_parallel_norms()
    provider = _provider(model, seq_length)
    config = _model_config(model, pp, tp, sequence_parallel, dropout, recompute)
    if schedule == "1f1b":  # megatron's own 1F1B, the standard placement
        from megatron.core.pipeline_parallel import get_forward_backward_func

        _setup(pp, tp=tp)
        r = ps.get_pipeline_model_parallel_rank()
        return [provider(config=config, pre_process=r == 0, post_process=r == pp - 1)], \
            get_forward_backward_func()
    from megatron_vshape.megatron.forward_backward import VShapeForwardBackward
    from megatron_vshape.megatron.model import build_v_chunks, v_embedding_ranks

    _setup(pp, tp=tp, embedding_ranks=v_embedding_ranks)
    chunks = build_v_chunks(provider, config, ps.get_pipeline_model_parallel_group())
    return chunks, VShapeForwardBackward(schedule, timeout=120)


def _peak(schedule, pp, tp, model, microbatches, micro_batch_size, sequence_parallel, dropout,
          steps, recompute="none"):
    """Peak bytes kept for backward on this rank under ``schedule``, the largest over
    ``steps`` training steps."""
    from megatron_vshape.megatron.wgrad import store_of
    from megatron_vshape.runtime.memory import ActivationTracker

    seq = model.seq_length
    chunks, fb = _chunks(schedule, pp, tp, model, seq, sequence_parallel, dropout, recompute)
    tracker = ActivationTracker([p for c in chunks for p in c.parameters()])
    for chunk in chunks:
        store_of(chunk).tracker = tracker
    peak = 0
    for step in range(steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        data = [iter(_batches(microbatches, micro_batch_size, seq, model.vocab_size, step))
                for _ in chunks]
        tracker.reset_peak()
        dist.barrier()
        with tracker.saved_tensors_hooks():
            fb(forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0],
               model=chunks, num_microbatches=microbatches, seq_length=seq,
               micro_batch_size=micro_batch_size, forward_only=False)
        peak = max(peak, tracker.peak)
    return peak


def measure_peaks(rank, world, schedules, model, microbatches, micro_batch_size, tp=1,
                  sequence_parallel=False, dropout=0.0, steps=2):
    """{schedule: (pipeline rank, tensor-parallel rank, peak activation bytes)} for a
    planner ``ModelConfig`` at its seq_length, on world / tp pipeline ranks; ``1f1b`` is
    megatron's own schedule, the others the plugin's. A schedule may be a (name, recompute)
    pair (recompute: none, selective, full), the key of its result."""
    from megatron.core import parallel_state as ps

    out = {}
    for schedule in schedules:
        name, recompute = schedule if isinstance(schedule, tuple) else (schedule, "none")
        peak = _peak(name, world // tp, tp, model, microbatches, micro_batch_size,
                     sequence_parallel, dropout, steps, recompute)
        out[schedule] = (ps.get_pipeline_model_parallel_rank(),
                         ps.get_tensor_model_parallel_rank(), peak)
        ps.destroy_model_parallel()
    return out
