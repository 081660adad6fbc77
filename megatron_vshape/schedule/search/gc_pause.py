"""The cyclic garbage collector paused while a search runs.

A search builds and drops millions of short-lived lists and tuples (timings, orders, moves),
none of them in reference cycles, so reference counting frees them all; the cyclic collector
only walks them, and every few thousand allocations it walks the whole young generation,
every few of those the whole heap. In a training process the heap is torch's and
megatron-core's (about 500,000 objects tracked after their import), so the re-plan after the
profiled iterations paid for walking them: v-half at p = 16, m = 64 (H100 costs,
``--memory-model 1,-0.75,-0.25``) took 0.675 s with the collector and 0.465 s without, with
torch and megatron.core imported; 0.50 and 0.48 s in a bare process.

The collector is switched back on when the outermost paused call returns (or raises), so
whatever cycles were made meanwhile are collected then; a caller that runs with it off keeps
it off.
"""
from __future__ import annotations

import functools
import gc
from typing import Callable, TypeVar

__all__ = ["collector_paused"]

_T = TypeVar("_T")


def collector_paused(function: Callable[..., _T]) -> Callable[..., _T]:
    """``function`` run with the cyclic collector off (module doc)."""

    @functools.wraps(function)
    def paused(*args, **kwargs) -> _T:
        if not gc.isenabled():  # off already: a nested call, or the caller's choice
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused
