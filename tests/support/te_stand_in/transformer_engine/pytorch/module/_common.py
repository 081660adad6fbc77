"""WeightGradStore: the queue of delayed weight-gradient GEMMs (TE v2.11 module/_common.py).

With ``delay_wgrad_compute`` a module's backward computes the input gradient only and *puts*
the weight-gradient GEMM (its tensors and a closure) here; ``backward_dw`` *pops* and runs it.
TE v2.11 keeps them in a ``queue.Queue`` (_common.py:203-204), so the GEMMs come out first in,
first out (``pop``, :241-253, takes the oldest with ``Queue.get``, :248): the i-th backward_dw runs
the i-th backward's GEMM. Popping an empty queue raises (:250-253).
"""
from __future__ import annotations

import queue

import torch

__all__ = ["WeightGradStore"]


class WeightGradStore:
    """_common.py:189-262."""

    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False):
        if delay_wgrad_compute:  # :203-210
            self.context = queue.Queue()
            assert ub_bulk_wgrad is False, \
                "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"
            self.enabled = delay_wgrad_compute
        else:
            self.context = None
            self.enabled = False

    def delay_wgrad_compute(self) -> bool:
        return self.enabled  # :213-220

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True  # :222-224

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False  # :226-228

    def put(self, tensor_list, func) -> None:
        """:230-238: keep the GEMM's tensors and closure for later."""
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        """:241-253: run the oldest GEMM; ``(its result, its tensors)``."""
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        if torch.distributed.is_initialized():
            raise RuntimeError(f"Pop empty queue. rank {torch.distributed.get_rank()}")
        raise RuntimeError("Pop empty queue. No distributed environment detected.")

    def assert_empty(self) -> None:
        """:255-262."""
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        assert self.context.empty(), "Queue is not empty."
