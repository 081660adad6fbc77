"""Run a function on several local gloo processes and collect what each returns.

For tests and CPU benchmarks. Unlike ``torch.multiprocessing.spawn``, a process that dies does
not take the others down with it: each reports its own result or error, so a test can check
what the survivors saw (e.g. the error a killed peer causes).
"""
from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankOutcome", "run_gloo"]


@dataclass(frozen=True)
class RankOutcome:
    """What one process ended with: ``value`` when ``ok``, else the error text (or exit)."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""


def _child(fn, rank, world, store_file, results, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                world_size=world)
        value = fn(rank, world, *args)
        # Plain pickle bytes: torch's queue pickler would pass tensors through shared memory
        # that vanishes when this process exits.
        results.put(RankOutcome(rank, True, pickle.dumps(value)))
    except BaseException as err:  # report, do not hang the parent
        results.put(RankOutcome(rank, False, error=f"{type(err).__name__}: {err}\n"
                                                   f"{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world_size: int, *args, timeout: float = 300.0
             ) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be importable (a module-level function). Returns one outcome per rank; a rank
    that exited without reporting gets ``ok=False`` with its exit code.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store, results, args))
                 for r in range(world_size)]
        for proc in procs:
            proc.start()
        outcomes = _collect(procs, results, timeout)
    return [outcomes[r] for r in range(world_size)]


def _unpickled(item: RankOutcome) -> RankOutcome:
    """The outcome with its value unpickled; a value this process cannot unpickle (a class
    whose module fails to import here) fails that rank instead of the collection, which would
    leave the other processes running with nobody to wait for them."""
    if not item.ok:
        return item
    try:
        return RankOutcome(item.rank, True, pickle.loads(item.value))
    except Exception as err:  # noqa: BLE001  (any import or unpickling error)
        return RankOutcome(item.rank, False, error=f"rank {item.rank}'s result could not be "
                                                   f"unpickled here: {type(err).__name__}: {err}")


def _collect(procs, results, timeout: float) -> dict[int, RankOutcome]:
    deadline = time.monotonic() + timeout
    outcomes: dict[int, RankOutcome] = {}
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            item = results.get(timeout=0.2)
            outcomes[item.rank] = _unpickled(item)
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in outcomes and not proc.is_alive() and proc.exitcode not in (0, None):
                outcomes[rank] = RankOutcome(rank, False, error=f"exited with code {proc.exitcode}")
    for rank, proc in enumerate(procs):
        if rank not in outcomes:
            outcomes[rank] = RankOutcome(rank, False, error=f"no result within {timeout:g} s")
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join()
    return outcomes
