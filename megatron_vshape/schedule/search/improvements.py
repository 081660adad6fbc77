"""What the adaptive search does to its constructions (adaptive.py's module doc, from "timed
replay" on): the fastest replayed in real time, re-laid and polished; then the winner polished
further, W-deferred, gap-filled and, on small schedules at V-Min's memory, improved by moves
repeated per microbatch. Each result is one more candidate of the pool (pool.py), so a step
only adds wins; settings.py says how many candidates each step takes, and what that was
measured to buy.

The schedule pipeline as a picture, with why each step is there: docs/design.md.
"""
from __future__ import annotations

import functools
from typing import Callable

from ..construct.blocks import V_MIN
from ..rewrite.gap_fill import fill_gaps
from ..rewrite.reshape_ends import reshape_cool_down, reshape_warm_up
from ..rewrite.replay import replay_in_time
from ..rewrite.weight_deferral import defer_weight_passes
from ..model.problem import Problem
from ..model.provenance import RELAID, step
from .local import Improved, improve, improve_repeated
from .settings import Settings
from .pool import Candidate, Pool, candidate_key, fastest_distinct, fresh

__all__ = ["replays", "relays", "polishes", "defer_fastest", "fills_gaps", "fill_fastest",
           "repeats", "repeat_moves", "final_budget", "capped"]

_EPS = 1e-9


def _large(pool: Pool) -> bool:
    """Whether the schedule has over ``large_passes`` passes: fewer replays and re-lays."""
    return 6 * pool.problem.ranks * pool.problem.microbatches > pool.settings.large_passes


def replays(pool: Pool) -> None:
    """The replay bases (``_replay_bases``) replayed in real time under the limit (replay.py).

    A base whose orders an earlier base has too (the V-Min block and the family block of
    offsets 1 at p = 16) is not replayed again: its replay would be a copy of that one's,
    later in the pool, so never the first of its orders anywhere (ties go to the earlier)."""
    s, problem = pool.settings, pool.problem
    counts = (s.replays_large, s.extra_peaks_large) if _large(pool) else (s.replays, s.extra_peaks)
    replayed = set()
    for base, slacks in _replay_bases(pool.candidates, *counts, s.replay_slack):
        for window in s.replay_windows:
            for slack in slacks:  # one chunk of slack: the replay's peak often lands lower
                if (base.orders, window, slack) in replayed:
                    continue
                replayed.add((base.orders, window, slack))
                pool.consider(base.provenance + (step("replayed in time", window=window),),
                              functools.partial(replay_in_time,
                                                problem.with_cap(problem.cap + slack),
                                                base.orders, window, abandon_above=problem.limit))


def relays(pool: Pool) -> None:
    """The ``relaid`` fastest candidates and the finished constructions with their warm-up
    and cool-down re-laid (reshape_ends.py); over ``large_passes`` the fastest alone."""
    large = _large(pool)  # a re-lay times the order twice
    finished = [] if large else [c for c in pool.candidates if not c.replayable]
    s = pool.settings
    bases = fastest_distinct(pool.candidates, s.relaid_large if large else s.relaid)
    starts = bases + fastest_distinct(finished, len(finished))
    for base in fresh(starts, pool.reshaped, pool.shapes):
        _reshape_ends(pool, base, pool.problem.with_limit(base.peak).full)


def polishes(pool: Pool) -> None:
    """The ``polished`` fastest candidates improved by the local search (local.py), then the
    winner so far once more, with the larger budget (``final_budget``): one job, on the few
    fastest and on the winner."""
    for base in fastest_distinct(pool.candidates, pool.settings.polished):
        pool.consider(base.provenance + (step("polished"),),
                      functools.partial(_polish, pool, base.orders, pool.settings.polish_budget))
    _polish_further(pool, pool.fastest())


def defer_fastest(pool: Pool) -> None:
    """The ``filled`` fastest with their W passes deferred; a winner among them polished."""
    _then_polished(pool, functools.partial(_defer_fastest, pool, pool.settings.filled))


def fill_fastest(pool: Pool) -> None:
    """The ``gaps_filled`` fastest with their bubbles filled, the best of them W-deferred;
    a winner among them polished."""
    _then_polished(pool, functools.partial(_fill_fastest, pool, pool.settings.gaps_filled))


def repeat_moves(pool: Pool) -> None:
    """Last, the winner improved by moves repeated in every microbatch (local.py), as a
    candidate: so it only adds wins."""
    base = pool.fastest()
    pool.consider(base.provenance + (step("moves repeated per microbatch"),),
                  functools.partial(_repeated, pool, base.orders))


def repeats(pool: Pool) -> bool:
    """Whether the search ends with the moves repeated per microbatch (``repeated_passes``)."""
    problem = pool.problem
    return (problem.limit <= V_MIN.memory_bound(problem.ranks) + _EPS
            and 6 * problem.ranks * problem.microbatches <= pool.settings.repeated_passes)


def _deferred(pool: Pool, base: Candidate) -> None:
    """``base`` with its W passes deferred within its own peak (weight_deferral.py), a candidate."""
    pool.consider(base.provenance + (step("W deferred"),),
                  functools.partial(defer_weight_passes, pool.problem.with_limit(base.peak),
                                    base.orders),
                  replayable=False)


def _defer_fastest(pool: Pool, count: int) -> None:
    for base in fastest_distinct(pool.candidates, count):
        _deferred(pool, base)


def _fill_fastest(pool: Pool, count: int) -> None:
    """The ``count`` fastest candidates with their bubbles filled (gap_fill.py), and the best
    of those with its W passes deferred."""
    before = len(pool.candidates)
    for base in fastest_distinct(pool.candidates, count):
        pool.consider(base.provenance + (step("gaps filled"),),
                      functools.partial(fill_gaps, pool.problem, base.orders),
                      replayable=False)
    for base in fastest_distinct(pool.candidates[before:], 1):
        _deferred(pool, base)


def fills_gaps(pool: Pool) -> bool:
    """Whether the search fills unit-slot bubbles (``gaps_filled``): not with ``shapes=False``,
    and only where F, B and W take about as long as each other, not at 1F1B's memory, or where
    the schedule is small (``slot_spread``, ``gaps_cheap_passes``)."""
    problem, s = pool.problem, pool.settings
    costs, p = problem.costs, problem.ranks
    if 6 * p * problem.microbatches <= s.gaps_cheap_passes:
        return pool.shapes
    return pool.shapes and abs(problem.limit - p) > _EPS and all(
        max(t.forward, t.backward, t.weight) <= s.slot_spread * min(t.forward, t.backward, t.weight)
        for chunks in costs.pass_times(problem.placement) for t in chunks)


def _then_polished(pool: Pool, step: Callable[[], None]) -> None:
    """Runs ``step``, which adds candidates; when one of them wins, it gets the last polish."""
    before = len(pool.candidates)
    step()
    winner = pool.fastest()
    if winner.position >= before:
        _polish_further(pool, winner)


def _replay_bases(pool: list[Candidate], count: int, extra: int,
                  slack: tuple) -> list[tuple[Candidate, tuple]]:
    """(base, slacks) to replay: the ``count`` fastest candidates with every ``slack``, then
    the fastest candidate of each other memory peak with the last slack (at most ``extra``).

    A replay fills stalls differently at each memory level, so the order before replay
    predicts the order after it poorly across levels (p = 16, m = 256, costs 1, 1.2, 0.8:
    the 7.5-unit block ranks fourth before replay and first after it).
    """
    ranked = sorted((c for c in pool if c.replayable), key=candidate_key)
    bases = [(c, slack) for c in ranked[:count]]
    peaks = {c.peak for c in ranked[:count]}
    for candidate in ranked[count:]:
        if candidate.peak not in peaks and len(bases) < count + extra:
            peaks.add(candidate.peak)
            bases.append((candidate, slack[-1:]))
    return bases


def _polish(pool: Pool, orders, budget: int) -> Improved:
    """``orders`` improved by the local search within the limit (local.py)."""
    passes = sum(len(order) for order in orders)
    return improve(pool.problem, orders, capped(budget, passes, pool.settings), pool.settings)


def _repeated(pool: Pool, orders) -> Improved:
    """``orders`` improved by moves repeated per microbatch (local.py), budgeted as ``_polish``."""
    budget = capped(pool.settings.repeated_budget, sum(len(order) for order in orders),
                    pool.settings)
    return improve_repeated(pool.problem, orders, budget, pool.settings)


def final_budget(p: int, m: int, s: Settings) -> int:
    """The last polish's budget: the smaller one from ``final_polish_large_passes`` on."""
    large = 6 * p * m >= s.final_polish_large_passes
    return s.final_polish_large if large else s.final_polish_budget


def capped(budget: int, passes: int, s: Settings) -> int:
    """``budget``, at most ``budget_per_pass`` per pass of the schedule."""
    return min(budget, s.budget_per_pass * passes)


def _polish_further(pool: Pool, base: Candidate) -> None:
    """The last polish, with the larger budget (``final_budget``), as a candidate."""
    budget = final_budget(pool.problem.ranks, pool.problem.microbatches, pool.settings)
    pool.consider(base.provenance + (step("polished further"),),
                  functools.partial(_polish, pool, base.orders, budget))


def _reshape_ends(pool: Pool, base: Candidate, own: int) -> None:
    """Candidates from ``base`` re-laid (reshape_ends.py): its warm-up at the limit's peak
    (the problem's ``full``) and at its ``own`` (whole chunk-activations), warm-up and
    cool-down at the limit's."""
    problem = pool.problem
    full = problem.full
    for peak in sorted({full, own}):
        pool.consider(base.provenance + (step(RELAID[0], peak=peak),),
                      functools.partial(reshape_warm_up, problem.with_cap(peak), base.orders),
                      replayable=False)
    pool.consider(base.provenance + (step(RELAID[1], peak=full),),
                  functools.partial(_reshape_both, problem, base.orders), replayable=False)


def _reshape_both(problem: Problem, orders) -> tuple:
    """The warm-up re-laid, then the cool-down (the order of the paper code's steps)."""
    return reshape_cool_down(problem, reshape_warm_up(problem, orders))
