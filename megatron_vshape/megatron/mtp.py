"""Multi-token prediction (MTP, ``--mtp-num-layers``) under a V: its logged loss.

Under a V the MTP block sits in rank 0's chunk 1, with the final norm, LM head and loss of
stage 2p-1 (model.py places it, and keeps its copy of the word embedding equal to chunk 0's).
megatron's GPTModel records each microbatch's MTP loss in ``MTPLossLoggingHelper.tracker`` on
the rank that computes it (megatron-core 0.16: ``values``; 0.19: ``loss_values`` with the
acceptance counts ``correct_values`` and ``total_values``), to be averaged over the
data-parallel group and logged by Megatron-LM's training_log (``track_mtp_metrics``) on the
last pipeline rank, where megatron's own schedules compute it. :func:`relay_mtp_metrics` moves
a training step's values there, as forward_backward relays the loss dicts, and leaves the
sending rank's tracker as megatron's clean step does, so that every rank logs and reduces what
it would under 1F1B::

    1F1B    last rank:  values += per microbatch -> training_log: avg over DP, x 1/m, logged
    V       rank 0:     values += per microbatch -> relayed, zeroed
            last rank:  values (relayed)          -> training_log: avg over DP, x 1/m, logged

The backward scale of the MTP loss (``MTPLossAutoScaler.set_loss_scale``) is set by megatron's
own forward_step in every F pass (compute.py).
"""
from __future__ import annotations

import torch

__all__ = ["relay_mtp_metrics"]


def _tracker() -> dict:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return MTPLossLoggingHelper.tracker


def _step_values(tracker: dict) -> dict:
    """The tracker's per-step tensors (not 0.19's process-local cumulative acceptance counts,
    nor the groups)."""
    return {key: value for key, value in tracker.items()
            if isinstance(value, torch.Tensor) and key.endswith("values")
            and not key.startswith("cumulative")}


def relay_mtp_metrics(pp_group, src: int, dst: int, device) -> None:
    """Move this step's MTP tracker values from pipeline rank ``src`` (where the V computes the
    MTP loss) to ``dst`` (the last rank, where Megatron-LM logs it); collective on those two
    ranks of ``pp_group``, nothing to do where they are one rank."""
    if src == dst:
        return
    rank = pp_group.rank()
    ranks = torch.distributed.get_process_group_ranks(pp_group)
    tracker = _tracker()
    if rank == src:
        values = _step_values(tracker)
        torch.distributed.send_object_list([{k: v.detach().cpu() for k, v in values.items()}],
                                           ranks[dst], group=pp_group)
        for value in values.values():  # megatron's clean_*_in_tracker
            value.zero_()
        tracker["reduce_group"] = None
        tracker["avg_group"] = None
    elif rank == dst:
        from megatron.core import parallel_state

        box = [None]
        torch.distributed.recv_object_list(box, ranks[src], group=pp_group)
        if not box[0]:
            return
        for key, value in box[0].items():
            tracker[key] = value.to(device)
        # as GPTModel's save_*_to_tracker sets them where the MTP loss is computed
        tracker["reduce_group"] = None
        tracker["avg_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
