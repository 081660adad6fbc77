"""Benchmark: how far a named schedule's cool-down is from the best one its warm-up and steady
state allow, by an exact solver; one JSON line per case.

    pip install ortools
    python scripts/bench/cooldown_gap.py [--ranks 4 8 16] [--per-rank 8]
        [--names v-min v-half v-zb] [--costs 2,2.78,0.7,0.05] [--memory-model 1,-0.75,-0.25]
        [--window 60] [--seconds 60] [--workers 2]

Per case (m = per-rank x p): the named schedule is built (``build_schedule``), and every pass
that starts in its last ``--window`` time units is set free; what starts before stays as it
is. A CP-SAT model then orders the free passes of each rank anew: one pass at a time per rank,
each after its dependency (plus the hop across ranks), forwards and backwards of a stage in
microbatch order (so it still lowers to matching sends and receives), each rank's activations
within the name's memory level at every point (a reservoir: F, B and W add the memory model's
deltas), the makespan minimized from our order as its hint. The solution's orders are
re-timed by our simulator and validated (``exact_makespan``).

``status`` OPTIMAL means no cool-down within the window is faster, given what starts before
it; ``bound`` is the solver's lower bound otherwise. It measures the cool-down only: a faster
schedule may need another warm-up or steady state (a window over the warm-up is the other
half of the question). Without OR-Tools the script prints one
``{"skipped": ...}`` line and exits 0: OR-Tools is a research tool here, never a dependency.
"""
import argparse
import json
import time

from megatron_vshape.schedule import (build_schedule, parse_costs, parse_memory_model, simulate,
                                      validate)
from megatron_vshape.schedule.model.actions import PassKind
from megatron_vshape.schedule.model.indexed import Dataflow, PassIndex
from megatron_vshape.schedule.model.simulate import pass_durations
from megatron_vshape.schedule.search.levels import memory_level

_ORDERED = (PassKind.F, PassKind.B)
"""Kinds whose passes of one stage keep microbatch order (W passes may reorder)."""


def integer_scale(values, name: str, most: int = 6) -> int:
    """The least power of ten that makes every value a whole number (CP-SAT's times and levels
    are integers); ValueError naming ``name`` when more than ``most`` digits would be needed."""
    for digits in range(most + 1):
        scale = 10 ** digits
        if all(abs(v * scale - round(v * scale)) < 1e-6 for v in values):
            return scale
    raise ValueError(f"{name} {sorted(set(values))} need more than {most} decimal digits")


class CoolDown:
    """The cool-down of one schedule as a CP-SAT model (module doc): ``free[r]`` are rank r's
    passes (ids of ``index``) that start in the window, after its ``frontier`` (the end of its
    last fixed pass, in scaled time)."""

    def __init__(self, schedule, costs, memory, level: float, window: float):
        from ortools.sat.python import cp_model
        self.schedule, self.index = schedule, PassIndex.of(schedule.placement,
                                                           schedule.microbatches)
        durations = self.index.durations(pass_durations(schedule.placement, costs))
        self.scale = integer_scale(durations + [costs.comm], "durations and hop")
        level_scale = integer_scale(list(memory.deltas.values()), "memory deltas")
        self.took = [round(d * self.scale) for d in durations]
        self.orders = self.index.encode(schedule.rank_actions)
        timing = Dataflow(self.index, durations, costs.comm).time(self.orders)
        ends = [e[-1] for e in timing.ends if e]
        cut = max(ends) - window
        self.fixed = [sum(1 for s in starts if s < cut) for starts in timing.starts]
        self.free = [order[k:] for order, k in zip(self.orders, self.fixed)]
        self.model = cp_model.CpModel()
        self.start: dict[int, object] = {}
        horizon = round(max(ends) * self.scale) + 1
        fixed_end = {self.index.key[a]: round(e * self.scale)
                     for order, k, en in zip(self.orders, self.fixed, timing.ends)
                     for a, e in zip(order[:k], en[:k])}
        deltas = {kind: round(d * level_scale) for kind, d in memory.deltas.items()}
        cap = round(level * schedule.placement.chunks * level_scale)
        for r, order in enumerate(self.orders):
            frontier = round(timing.ends[r][self.fixed[r] - 1] * self.scale) if self.fixed[r] else 0
            held = sum(deltas[self.index.kind[a]] for a in order[:self.fixed[r]])
            self._rank(self.free[r], frontier, held, deltas, cap, horizon)
        self._dependencies(fixed_end, round(costs.comm * self.scale))
        self._microbatch_order()
        self.makespan = self.model.NewIntVar(0, horizon, "makespan")
        for free in self.free:
            for a in free:
                self.model.Add(self.makespan >= self.start[a] + self.took[a])
        self.model.Minimize(self.makespan)
        for r, free in enumerate(self.free):
            for a, s in zip(free, timing.starts[r][self.fixed[r]:]):
                self.model.AddHint(self.start[a], round(s * self.scale))

    def _rank(self, free, frontier: int, held: int, deltas: dict, cap: int, horizon: int) -> None:
        """One pass at a time, after the fixed ones; activations within ``cap`` throughout."""
        intervals = []
        for a in free:
            self.start[a] = self.model.NewIntVar(frontier, horizon, f"start{a}")
            intervals.append(self.model.NewFixedSizeIntervalVar(self.start[a], self.took[a],
                                                                 f"pass{a}"))
        self.model.AddNoOverlap(intervals)
        self.model.AddReservoirConstraint(
            [self.start[a] for a in free] + [frontier],
            [deltas[self.index.kind[a]] for a in free] + [held], 0, cap)

    def _dependencies(self, fixed_end: dict, hop: int) -> None:
        index = self.index
        for free in self.free:
            for a in free:
                d = index.dep[a]
                if d < 0:
                    continue
                ready = (self.start[d] + self.took[d]) if d in self.start else fixed_end[d]
                self.model.Add(self.start[a] >= ready + (hop if index.remote[a] else 0))

    def _microbatch_order(self) -> None:
        groups: dict = {}
        for free in self.free:
            for a in free:
                action = self.index.actions[a]
                if action.kind in _ORDERED:
                    groups.setdefault((action.kind, action.stage), []).append(a)
        for group in groups.values():
            group.sort(key=lambda a: self.index.actions[a].microbatch)
            for earlier, later in zip(group, group[1:]):
                self.model.Add(self.start[later] > self.start[earlier])

    def solve(self, seconds: float, workers: int):
        """(status name, solver lower bound, the solved schedule or None)."""
        from ortools.sat.python import cp_model
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = seconds
        solver.parameters.num_workers = workers
        status = solver.Solve(self.model)
        bound = solver.BestObjectiveBound() / self.scale
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return solver.StatusName(status), bound, None
        orders = [order[:k] + sorted(free, key=lambda a: solver.Value(self.start[a]))
                  for order, k, free in zip(self.orders, self.fixed, self.free)]
        return solver.StatusName(status), bound, self.schedule.with_actions(
            self.index.decode(orders))


def case(name: str, p: int, m: int, args, costs, memory) -> dict:
    ours = build_schedule(name, p, m, costs, memory=memory)
    level = memory_level(name, p)
    one = simulate(build_schedule("1f1b", p, m), costs, memory).makespan
    started = time.perf_counter()
    problem = CoolDown(ours, costs, memory, level, args.window)
    status, bound, exact = problem.solve(args.seconds, args.workers)
    row = {"schedule": name, "ranks": p, "microbatches": m, "costs": args.costs,
           "memory_model": args.memory_model, "window": args.window,
           "free_passes": sum(map(len, problem.free)),
           "makespan": round(simulate(ours, costs).makespan, 4), "makespan_1f1b": round(one, 4),
           "status": status, "bound": round(bound, 4),
           "solve_s": round(time.perf_counter() - started, 1)}
    row["vs_1f1b"] = round(row["makespan"] / one, 4)
    if exact is not None:
        validate(exact, level, memory)  # raises when the model let something wrong through
        row["exact_makespan"] = round(simulate(exact, costs).makespan, 4)
        row["exact_vs_1f1b"] = round(row["exact_makespan"] / one, 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--per-rank", type=int, nargs="+", default=[8],
                        help="microbatches per rank: m = this x p")
    parser.add_argument("--names", nargs="+", default=["v-min", "v-half", "v-zb"],
                        choices=["zb-1p", "v-min", "v-half", "v-zb"])
    parser.add_argument("--costs", default="2,2.78,0.7,0.05")
    parser.add_argument("--memory-model", default="1,-0.75,-0.25")
    parser.add_argument("--window", type=float, default=60.0,
                        help="time units at the end whose passes are reordered")
    parser.add_argument("--seconds", type=float, default=60.0, help="solver time per case")
    parser.add_argument("--workers", type=int, default=2, help="solver threads")
    args = parser.parse_args()
    if args.window <= 0 or args.seconds <= 0 or args.workers < 1:
        parser.error("--window and --seconds must be > 0 and --workers >= 1, got "
                     f"{args.window:g}, {args.seconds:g}, {args.workers}")
    try:
        import ortools  # noqa: F401  (only whether it is there)
    except ImportError:
        print(json.dumps({"skipped": "OR-Tools is not installed (pip install ortools)"}))
        return
    memory = parse_memory_model(args.memory_model)
    for p in args.ranks:
        costs = parse_costs(args.costs, p)
        for per in args.per_rank:
            for name in args.names:
                print(json.dumps(case(name, p, per * p, args, costs, memory)), flush=True)


if __name__ == "__main__":
    main()
