"""Benchmark: our schedules side by side with the paper's reference generators, one JSON line per case.

    python scripts/bench/reference_compare.py --reference PATH
        [--ranks 4 8 16] [--microbatches 8 16 32 64] [--costs 2,2,2 2,2.4,1.6] [--comm 0 0.1 0.5]
        [--schedules v-min v-half v-zb zb-1p auto@v-min auto@v-half auto@1f1b] [--timeout 1800]

PATH (default: the ZB_REFERENCE environment variable) is a checkout of
github.com/sail-sg/zero-bubble-pipeline-parallelism. Its schedule generators are imported from
there at run time, nothing of them is copied here; without a checkout the script prints one
``{"skipped": ...}`` line and exits 0. The generators it calls (all in
``megatron/core/pipeline_parallel/zerobubble/scheduler/``):

    v-min, v-half   zbv_greedy.PipelineGraph(p, m, "min" | "half", f, b, w, c).create_schedule
    v-zb            zbv.PipelineGraph(p, m, f, b, w, c, 1, 0, -1, max_mem=2p).create_schedule
    zb-1p           zb.Graph.build_graph + zb.initial_solution (ZB-H1, max_mem = p F's)
    auto@LEVEL      v_auto_schedule.schedule(p, m, [f, b, w, c], max_mem=2 x LEVEL's units)

``--costs F,B,W`` are our CLI's: times of one rank's whole layer share. The V generators take a
chunk's pass times, half of those; ZB-1P (one chunk per rank) takes them whole. ``--comm`` is one
pipeline hop on both sides. Memory is counted in chunk-activations there (F +1, B 0, W -1) and
in units of two chunk-activations (one rank's share) here. ``auto@LEVEL`` runs both adaptive
searches at the same limit: V-Min's (p+4)//3, V-Half's (p+2)//2 or 1F1B's p units.

Each reference schedule is converted into our ``Schedule``, checked by our validator, timed by
the reference's own cost model and by our simulator (``ref_makespan_own`` and
``ref_makespan_rel_diff`` show they agree), then both sides' schedules are simulated by our
simulator on the same costs. ``bubble_rate`` is over the whole iteration (simulate.py).
"""
import argparse
import contextlib
import importlib
import io
import json
import os
import signal
import sys
import time
import types
from pathlib import Path

from megatron_vshape.schedule import (Action, Costs, Layout, PassKind, Placement, Schedule,
                                      ScheduleError, build_schedule, parse_costs, simulate,
                                      validate)

SCHEDULER_PACKAGE = "megatron.core.pipeline_parallel.zerobubble.scheduler"
REFERENCE_MODULES = ("graph", "zb", "zbv", "zbv_greedy", "v_auto_schedule")
FIXED = ("v-min", "v-half", "v-zb", "zb-1p")
LEVELS = ("v-min", "v-half", "1f1b")
DEFAULT_SCHEDULES = FIXED + tuple(f"auto@{level}" for level in LEVELS)
KINDS = {"F": PassKind.F, "B": PassKind.B, "W": PassKind.W}


def memory_level_units(level: str, p: int) -> int:
    """Our peak-memory bound of a schedule family (units of one rank's layer share)."""
    return {"v-min": (p + 4) // 3, "v-half": (p + 2) // 2, "v-zb": p, "zb-1p": p, "1f1b": p}[level]


# --- loading the reference -------------------------------------------------------------------

@contextlib.contextmanager
def _stub_modules(stubs: dict):
    """Put ``stubs`` into sys.modules for the duration, then restore what was there: the
    reference's schedulers are imported without megatron, torch or pulp (they use torch only
    in a type annotation and pulp only to read numbers), and nothing leaks into this process."""
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _package_stubs(root: Path) -> dict:
    """Empty packages for megatron, megatron.core, ... down to the scheduler package, pointing
    at the checkout's folders: importing a scheduler module then skips the packages'
    ``__init__`` files, which pull in torch.distributed and all of Megatron."""
    parts = SCHEDULER_PACKAGE.split(".")
    stubs = {}
    for depth in range(1, len(parts) + 1):
        package = types.ModuleType(".".join(parts[:depth]))
        package.__path__ = [str(root.joinpath(*parts[:depth]))]
        stubs[package.__name__] = package
    torch = types.ModuleType("torch")
    torch.Tensor = object
    pulp = types.ModuleType("pulp")
    pulp.value = lambda x: x
    stubs.update(torch=torch, pulp=pulp)
    return stubs


def load_reference(root: Path) -> types.SimpleNamespace:
    """The reference's scheduler modules, imported from the checkout at ``root``."""
    names = [f"{SCHEDULER_PACKAGE}.{name}" for name in REFERENCE_MODULES]
    with _stub_modules(_package_stubs(root)):
        modules = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in names}
    for name in names:  # they live on in `modules`; sys.modules keeps no half-megatron
        sys.modules.pop(name, None)
    return types.SimpleNamespace(**modules)


def missing_reference(path: str | None) -> str | None:
    """Why ``path`` cannot be used as the reference checkout, or None when it can."""
    if not path:
        return "no reference checkout: pass --reference PATH or set ZB_REFERENCE"
    folder = Path(path).joinpath(*SCHEDULER_PACKAGE.split("."))
    absent = [m for m in REFERENCE_MODULES if not (folder / f"{m}.py").is_file()]
    if absent:
        return f"{folder} lacks {', '.join(absent)}.py: not a zero-bubble-pipeline-parallelism checkout"
    return None


# --- calling the reference generators ---------------------------------------------------------

class ReferenceTimeout(Exception):
    """A reference generator ran past --timeout (its adaptive search can take many minutes)."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise ReferenceTimeout in the main thread after ``seconds`` (no limit where SIGALRM is absent)."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise ReferenceTimeout(f"reference generator ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _graph_config(ref, p: int, m: int, fbw, comm: float, chunks: int, max_mem=None):
    """The reference's GraphConfig with uniform costs and our memory model (F +1, B 0, W -1
    per chunk-activation), as its runtime builds one."""
    return ref.graph.GraphConfig(
        cost_f=[float(fbw[0])] * p, cost_b=[float(fbw[1])] * p, cost_w=[float(fbw[2])] * p,
        cost_comm=float(comm), mem_f=[1.0] * p, mem_b=[0.0] * p, mem_w=[-1.0] * p,
        max_mem=max_mem, max_chunks=chunks, n_stages=p, n_micro=m,
    )


def _recording(obj, method: str, keep=lambda kwargs: True) -> list:
    """Wrap ``obj.method`` on this instance only, recording the results of the calls ``keep``
    accepts: the reference's ``create_schedule`` returns the order but drops the times its
    own cost model gave it, which we want for the cross-check."""
    calls, original = [], getattr(obj, method)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if keep(kwargs):
            calls.append(result)
        return result

    setattr(obj, method, wrapper)
    return calls


def ref_v_greedy(ref, p, m, fbw, comm, setup):
    """V-Min / V-Half (``setup`` "min" / "half"): fixed building block, repeated, squeezed and
    reordered in unit slots (cost-independent), then timed by ``eager_execution_time``.
    Returns their nodes and their makespan."""
    graph = ref.zbv_greedy.PipelineGraph(p, m, setup, *fbw, comm)
    calls = _recording(graph, "schedule_from_pattern")
    nodes = graph.create_schedule(_graph_config(ref, p, m, fbw, comm, chunks=2))
    _, start, _ = calls[-1]
    cost = [fbw[kind // 2] for kind in range(6)]  # F f B b W w: chunk passes
    ends = [s + cost[kind] for rank in start for kind, row in enumerate(rank) for s in row]
    return nodes, max(ends) - min(s for rank in start for row in rank for s in row)


def ref_v_zb(ref, p, m, fbw, comm, max_mem):
    """V-ZB: the greedy list scheduler under ``max_mem`` chunk-activations, which tries four
    fill settings and keeps the one with the smallest per-rank bubble (first of equals)."""
    graph = ref.zbv.PipelineGraph(p, m, *fbw, comm, 1, 0, -1, max_mem=max_mem)
    calls = _recording(graph, "try_v_schedule", keep=lambda kw: kw.get("approved_bubble") is None)
    nodes = graph.create_schedule(_graph_config(ref, p, m, fbw, comm, chunks=2))
    best = min(range(len(calls)), key=lambda i: (calls[i][2], i))
    end_time = calls[best][1]  # their times start at 0
    return nodes, max(end_time)


def ref_zb_1p(ref, p, m, fbw, comm, max_mem):
    """ZB-1P (ZB-H1): the heuristic ``initial_solution`` of zb.py, with its memory cap; the
    same three calls as ``zb.create_schedule``, kept apart to keep the completion times."""
    config = _graph_config(ref, p, m, fbw, comm, chunks=1, max_mem=[float(max_mem)] * p)
    graph = ref.zb.Graph.build_graph(p, m, config)
    _, _, end = ref.zb.initial_solution(graph, print_result=False)
    nodes = ref.zb.create_scheduled_nodes(graph, end)
    start = [t - graph.get_cost(i) for i, t in enumerate(end)]
    return nodes, max(end) - min(start)


def ref_auto(ref, p, m, fbw, comm, max_mem):
    """The adaptive building-block search (v_auto_schedule.schedule) under ``max_mem``
    chunk-activations; it picks the block whose schedule is fastest under the costs."""
    nodes = ref.v_auto_schedule.schedule(p, m, [*fbw, comm], max_mem)
    return nodes, (max(n.completion_time for rank in nodes for n in rank)
                   - min(n.start_time for rank in nodes for n in rank))


# --- converting reference schedules into ours -------------------------------------------------

def _convert_graph_nodes(nodes, p: int, m: int, layout: Layout, name: str) -> Schedule:
    """graph.ScheduledNode lists (per rank, in order) -> our Schedule.

    Their node's ``stage`` is the rank, ``chunk`` the chunk on it (0 = the V's down-leg, as
    ours; their B/W chunk index is already flipped back to the real chunk by create_schedule)
    and ``layer_group_idx`` the global stage, which must equal our placement's.
    """
    placement = Placement(p, layout)
    ranks = []
    for rank, rank_nodes in enumerate(nodes):
        actions = []
        for node in rank_nodes:
            stage = placement.stage_of(node.stage, node.chunk)
            if node.stage != rank or node.layer_group_idx != stage:
                raise ScheduleError(f"reference node {node} on rank {rank}: expected stage {stage}")
            actions.append(Action(KINDS[node.type.value], stage, node.microbatch))
        ranks.append(actions)
    return Schedule(name=name, placement=placement, microbatches=m,
                    rank_actions=tuple(tuple(a) for a in ranks))


def _convert_auto_nodes(nodes, p: int, m: int) -> Schedule:
    """v_auto_schedule.ScheduledNode lists -> our Schedule. There ``type`` is "F"/"B"/"W",
    ``chunk`` is True for the V's up-leg (their f, B, W letters: B is chunk 1's backward,
    which runs first) and ``minibatch`` the microbatch; the order is theirs per rank."""
    placement = Placement(p, Layout.V)
    ranks = [tuple(Action(KINDS[n.type], placement.stage_of(rank, int(n.chunk)), n.minibatch)
                   for n in rank_nodes) for rank, rank_nodes in enumerate(nodes)]
    return Schedule(name="auto (reference)", placement=placement, microbatches=m,
                    rank_actions=tuple(ranks))


def reference_case(ref, name: str, p: int, m: int, costs: Costs, limit: int | None):
    """Run the reference generator for ``name``; returns (our Schedule of it, their own
    makespan, generator seconds). V generators get a chunk's pass times (half of ``costs``)."""
    whole = (costs.forward[0], costs.backward[0], costs.weight[0])
    chunk = tuple(t / 2 for t in whole)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # every generator prints its summary
        if name in ("v-min", "v-half"):
            nodes, own = ref_v_greedy(ref, p, m, chunk, costs.comm, name[2:])
        elif name == "v-zb":
            nodes, own = ref_v_zb(ref, p, m, chunk, costs.comm, 2 * limit)
        elif name == "zb-1p":
            nodes, own = ref_zb_1p(ref, p, m, whole, costs.comm, limit)
        else:
            nodes, own = ref_auto(ref, p, m, chunk, costs.comm, 2 * limit)
    seconds = time.perf_counter() - started
    if name == "zb-1p":
        schedule = _convert_graph_nodes(nodes, p, m, Layout.SINGLE, "zb-1p (reference)")
    elif name.startswith("auto"):
        schedule = _convert_auto_nodes(nodes, p, m)
    else:
        schedule = _convert_graph_nodes(nodes, p, m, Layout.V, f"{name} (reference)")
    return schedule, own, seconds


# --- one case ---------------------------------------------------------------------------------

def _ours(name: str, p: int, m: int, costs: Costs, limit: int | None) -> dict:
    """Our schedule's numbers (keys prefixed ours_)."""
    started = time.perf_counter()
    try:
        schedule = build_schedule(name, p, m, costs=costs, memory_limit=limit)
    except ScheduleError as err:
        return {"ours_error": str(err).splitlines()[0]}
    seconds = time.perf_counter() - started
    result = simulate(schedule, costs)
    return {"ours_bubble_rate": round(result.bubble_rate, 5), "ours_makespan": round(result.makespan, 4),
            "ours_peak": result.peak_memory_max, "ours_generator_s": round(seconds, 4)}


def _theirs(ref, name: str, p: int, m: int, costs: Costs, limit: int | None, timeout: float) -> dict:
    """The reference schedule's numbers under our simulator, and the cross-checks of the
    conversion (keys prefixed ref_)."""
    try:
        with _time_limit(timeout):
            schedule, own, seconds = reference_case(ref, name, p, m, costs, limit)
    except Exception as err:  # a reference failure is a result to report, not a crash
        return {"ref_error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    row = {}
    try:
        validate(schedule)
    except ScheduleError as err:
        row["ref_invalid"] = str(err).splitlines()[0]
        return row
    result = simulate(schedule, costs)
    row.update({
        "ref_bubble_rate": round(result.bubble_rate, 5), "ref_makespan": round(result.makespan, 4),
        "ref_peak": result.peak_memory_max, "ref_generator_s": round(seconds, 4),
        "ref_makespan_own": round(own, 4),
        "ref_makespan_rel_diff": round(abs(result.makespan - own) / own, 6),
    })
    if limit is not None:
        row["ref_within_limit"] = result.peak_memory_max <= limit + 1e-9
    return row


def run_case(ref, schedule: str, p: int, m: int, fbw: str, comm: float, timeout: float) -> dict:
    """Both sides of one grid point, as one flat JSON-ready dict."""
    costs = parse_costs(f"{fbw},{comm}", p)
    name, _, level = schedule.partition("@")
    limit = memory_level_units(level or name, p) if (level or name in ("v-zb", "zb-1p")) else None
    row = {"schedule": schedule, "ranks": p, "microbatches": m, "costs": costs.as_list()[:3],
           "comm": costs.comm, "memory_limit_units": limit}
    row.update(_ours(name, p, m, costs, limit))
    row.update(_theirs(ref, name, p, m, costs, limit, timeout))
    if "ours_bubble_rate" in row and "ref_bubble_rate" in row:
        row["bubble_diff"] = round(row["ours_bubble_rate"] - row["ref_bubble_rate"], 5)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default=os.environ.get("ZB_REFERENCE"),
                        help="checkout of sail-sg/zero-bubble-pipeline-parallelism (default: $ZB_REFERENCE)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--costs", nargs="+", default=["2,2,2", "2,2.4,1.6"],
                        help="F,B,W of one rank's whole layer share (as our CLI), several allowed")
    parser.add_argument("--comm", type=float, nargs="+", default=[0.0, 0.1, 0.5], help="one pipeline hop")
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                        choices=DEFAULT_SCHEDULES)
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per reference generator call (0: none)")
    args = parser.parse_args()
    for fbw in args.costs:
        if len(fbw.split(",")) != 3:
            parser.error(f"--costs takes F,B,W (comm goes in --comm), got {fbw!r}")
    why = missing_reference(args.reference)
    if why:
        print(json.dumps({"skipped": why}))
        return
    ref = load_reference(Path(args.reference))
    for p in args.ranks:
        for m in args.microbatches:
            for fbw in args.costs:
                for comm in args.comm:
                    for schedule in args.schedules:
                        print(json.dumps(run_case(ref, schedule, p, m, fbw, comm, args.timeout)),
                              flush=True)


if __name__ == "__main__":
    main()
