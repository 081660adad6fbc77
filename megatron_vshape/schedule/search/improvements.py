"""What the adaptive search does to its constructions (adaptive.py's module doc, from "timed
replay" on): the fastest replayed in real time, re-laid and polished; then the winner polished
further, W-deferred, gap-filled and, on small schedules at V-Min's memory, improved by moves
repeated per microbatch. Each result is one more candidate of the pool (pool.py), so a step
only adds wins; the constants below say how many candidates each step takes, and what that
was measured to buy.

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
from ..model.placement import Placement
from .local import Improved, improve, improve_repeated
from .pool import Candidate, Pool, candidate_key, fastest_distinct, fresh

__all__ = ["replays", "relays", "polishes", "relay_winner", "polish_winner", "defer_fastest",
           "fills_gaps", "fill_fastest", "repeats", "repeat_moves", "final_budget", "capped"]

_REPLAYS = 4
_REPLAYS_LARGE = 3
_LARGE_PASSES = 12_000
_EXTRA_PEAKS = 2
_EXTRA_PEAKS_LARGE = 1
_REPLAY_WINDOWS = (4,)
"""The replays' lookahead (rewrite/replay.py): how many of a rank's next passes a replay may
choose from. Over p 4 and 8, m 2p and 4p, the costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1
and the limits V-Min's, V-Half's and 3p/4 (36 searches) window 2 instead was faster at 8 points
and slower at 12 (by up to 2.5%), window 8 faster at 7 and slower at 10 (up to 14%), and the
three windows 2, 4 and 8 together faster at 4 and slower at 4 (their replays take later steps'
starts): 4 loses least."""
_REPLAY_SLACK = (0, 1)
_POLISHED = 3
_FILLED = 5
"""The fastest candidates (distinct orders) whose W passes are deferred (weight_deferral.py), after
the last polish, so that the search up to there is unchanged and the deferred orders can only add
wins (0.003-0.12 s each at p = 4-16, m = 4p-8p; with 3, a relaid family block that the
deferral makes fastest fell out of them once the polishes improved the others: v-half at
p = 16, m = 64, H100 costs, 0.990 -> 0.992 x 1F1B). Deferred before the polish instead, they took
the polish's starts from orders that polished better: V-Half at p = 4, m = 16, H100 costs
0.950 -> 0.953 x 1F1B, V-Min at costs 1,1.2,0.8: 61.0 -> 61.1. Each is deferred within its own
peak, not the limit: the same makespans at the named levels (where the peak is the limit),
and a large limit is not filled with waiting W passes for a sliver of time (the planner's
gpt-9.6b at seq 1024 went from 20 to 54 GiB for 0.06% more throughput)."""
_GAPS_FILLED = 3
"""The fastest candidates (distinct orders) whose unit-slot bubbles are filled (gap_fill.py),
last, and the best of them with its W passes deferred: so they only add wins (filled among the
re-lays, they took an earlier step's starts: the planner's gpt-9.6b at seq 1024 lost 0.2%
where a wave no longer got polished). Costs 2,2,2 at V-Min's limit, where the reference's
search was ahead: p = 16, hop 0.1, m = 16/32/64: 169.4/274.2/484.2 -> 169.0/274.0/483.8 (the
reference's), hop 0.5, m = 64: 649.0 -> 647.0 (same); p = 8, m = 64, hop 0.1: 434.2 -> 432.8
(the reference: 434.0). 2 bases reach all five; 0.05-0.2 s at p = 16, m = 64."""
_SLOT_SPREAD = 2.0
_GAPS_CHEAP_PASSES = 2_000
"""Gaps are filled only where, on every rank, the longest of F, B and W takes at most
``_SLOT_SPREAD`` times the shortest, and the limit is not 1F1B's memory (p units, V-ZB's level),
or where that is cheap (at most this many passes): the fill counts every pass as one slot
(gap_fill.py), so where a W takes a quarter of a B its gaps are not the real ones. Over the
named levels' grid (p 4-16, m p-8p, 9 cost sets, both memory models: 396 builds) it won only at
costs 2,2,2 and 1,1.2,0.8 (spread 1-1.5), never at the H100 costs (2, 2.78, 0.7: spread 4),
where it took 0.03-0.04 s at p = 16, m = 64 (v-half, v-zb); of 198 searches at spreads 3-5 (p
4-16, m p-4p, 4 limits) it won 2, at p = 4, m = 8 (costs 2,3,0.6,0.1 at 2 units: 72.9 against
73.1), where it takes 2 ms. At exactly p units it never won over 2,000 passes: of 90 such
searches (p 8 and 16, m 32-64, spreads 1-1.5, hops 0-0.5, both models) every winner came from
the V-ZB block or the wave, and there it cost 0.04 s (v-zb at p = 16, m = 64: 0.50 -> 0.43 s
without it at costs 2,2,2,0.1 / 1,1.2,0.8,0.1 / 2,2.4,1.6,0.5). Below p and above it, it does
win at spread 1.5: 26 of 336 searches at every limit from V-Min's to p - 1 (up to 1.0%: p = 16,
m = 32, costs 2,2.4,1.6,0 at 14 units, 218.2 -> 216.0), and 28 of 108 at p + 2, 1.5p and 2p."""
_RELAID = 4
_RELAID_LARGE = 1
"""The fastest candidates (distinct orders) whose warm-up and cool-down are re-laid, besides
every finished construction (slot-reordered blocks, the wave); over 12,000 passes only the
fastest (a re-lay times the order twice: p = 32, m = 256 took 12.6 s instead of 9.6 s)."""
_POLISH_BUDGET = 100_000
"""Passes the local search may time per start (a bound, so results repeat; local.py counts
what each move re-times and costs: about 10 ms per 100,000)."""
_FINAL_POLISH_BUDGET = 600_000
"""Passes for polishing the winner once more (about 0.4 s): at p = 4, m = 16, costs 1,1.2,0.8
at V-Min's memory it takes the makespan from 61.4 to issue 3's best known (CP-SAT) 61.1, and
67.2 to 66.6 with comm 0.1; 500,000 stop at 66.7, 200,000 at 61.4 and 66.9."""
_FINAL_POLISH_LARGE = 150_000
_FINAL_POLISH_LARGE_PASSES = 4_000
"""From this many passes (p = 16, m = 48) the winner's second polish gets the smaller budget:
over p = 16, m = 32 and 64, four cost ratios and four limits (32 points) 150,000 passes gave
the same makespans as 600,000 at every point, for 0.1-0.6 s less; at p = 8, m = 64 (3,072
passes, below the threshold) the larger budget still gained 0.05% at 2 of 16 points."""
_REPEATED_BUDGET = 1_000_000
_REPEATED_PASSES = 768
"""The winner's last improvement, moves repeated in every microbatch (local.py's
``improve_repeated``), runs at V-Min's memory or less on schedules of at most this many passes
(p = 4, m = 32), where it pays: at the H100 costs (2, 2.78, 0.7, hop 0.05), V-Min at p = 4
from 1.219 to 1.196 x 1F1B (m = 16) and from 1.296 to 1.253 x (m = 32), for 0.2-0.5 s more.
Run everywhere (periods 1-4), it gained at most 0.15% on the rest of the named levels' grid
(p 4-16, m 4p and 8p, both memory models; p = 8, m = 32, V-Min) for 0.6-1.3 s more, and at
V-Half's and V-ZB's memory 0.1% at most."""
_BUDGET_PER_PASS = 1_600
"""Both polish budgets are capped at this many passes timed per pass of the schedule: the local
search spends its whole budget, and a small schedule (p = 2, m = 2: 24 passes) would otherwise
be timed 25,000 times (4 s) for nothing; from 375 passes (p = 4, m = 16) the caps above bind."""
_EPS = 1e-9


def _large(pool: Pool) -> bool:
    """Whether the schedule has over ``_LARGE_PASSES`` passes: fewer replays and re-lays."""
    return 6 * pool.placement.ranks * pool.microbatches > _LARGE_PASSES


def replays(pool: Pool) -> None:
    """The replay bases (``_replay_bases``) replayed in real time under the limit (replay.py).

    A base whose orders an earlier base has too (the V-Min block and the family block of
    offsets 1 at p = 16) is not replayed again: its replay would be a copy of that one's,
    later in the pool, so never the first of its orders anywhere (ties go to the earlier)."""
    counts = (_REPLAYS_LARGE, _EXTRA_PEAKS_LARGE) if _large(pool) else (_REPLAYS, _EXTRA_PEAKS)
    replayed = set()
    for base, slacks in _replay_bases(pool.candidates, *counts):
        for window in _REPLAY_WINDOWS:
            for slack in slacks:  # one chunk of slack: the replay's peak often lands lower
                if (base.orders, window, slack) in replayed:
                    continue
                replayed.add((base.orders, window, slack))
                pool.consider(base.provenance + (f"replayed in time (window {window})",),
                              functools.partial(replay_in_time, base.orders, pool.placement,
                                                pool.costs, pool.cap + slack, pool.memory,
                                                window, abandon_above=pool.cap))


def relays(pool: Pool) -> None:
    """The ``_RELAID`` fastest candidates and the finished constructions with their warm-up
    and cool-down re-laid (reshape_ends.py); over ``_LARGE_PASSES`` the fastest alone."""
    large = _large(pool)  # a re-lay times the order twice
    finished = [] if large else [c for c in pool.candidates if not c.replayable]
    bases = fastest_distinct(pool.candidates, _RELAID_LARGE if large else _RELAID)
    starts = bases + fastest_distinct(finished, len(finished))
    for base in fresh(starts, pool.reshaped, pool.shapes):
        _reshape_ends(pool, base, int(base.peak * pool.placement.chunks + _EPS))


def polishes(pool: Pool) -> None:
    """The ``_POLISHED`` fastest candidates improved by the local search (local.py)."""
    for base in fastest_distinct(pool.candidates, _POLISHED):
        pool.consider(base.provenance + ("polished",),
                      functools.partial(_polish, pool, base.orders, _POLISH_BUDGET))


def relay_winner(pool: Pool) -> None:
    """The winner so far re-laid, where it was not yet (a replay or a block won), its
    cool-down alone too."""
    winner = pool.fastest()
    for base in fresh([winner], pool.reshaped, pool.shapes and not _relaid(winner)):
        _reshape_ends(pool, base, pool.full, cool_down_alone=True)


def polish_winner(pool: Pool) -> None:
    """The winner so far polished once more, with the larger budget (``final_budget``)."""
    _polish_further(pool, pool.fastest())


def defer_fastest(pool: Pool) -> None:
    """The ``_FILLED`` fastest with their W passes deferred; a winner among them polished."""
    _then_polished(pool, functools.partial(_defer_fastest, pool, _FILLED))


def fill_fastest(pool: Pool) -> None:
    """The ``_GAPS_FILLED`` fastest with their bubbles filled, the best of them W-deferred;
    a winner among them polished."""
    _then_polished(pool, functools.partial(_fill_fastest, pool, _GAPS_FILLED))


def repeat_moves(pool: Pool) -> None:
    """Last, the winner improved by moves repeated in every microbatch (local.py), as a
    candidate: so it only adds wins."""
    base = pool.fastest()
    pool.consider(base.provenance + ("moves repeated per microbatch",),
                  functools.partial(_repeated, pool, base.orders))


def _relaid(candidate: Candidate) -> bool:
    """Whether ``candidate``'s warm-up or cool-down was re-laid on its way."""
    return any("re-laid" in step for step in candidate.provenance)


def repeats(pool: Pool) -> bool:
    """Whether the search ends with the moves repeated per microbatch (``_REPEATED_PASSES``)."""
    p = pool.placement.ranks
    return (pool.limit <= V_MIN.memory_bound(p) + _EPS
            and 6 * p * pool.microbatches <= _REPEATED_PASSES)


def _deferred(pool: Pool, base: Candidate) -> None:
    """``base`` with its W passes deferred within its own peak (weight_deferral.py), a candidate."""
    pool.consider(base.provenance + ("W deferred",),
                  functools.partial(defer_weight_passes, base.orders, pool.placement, pool.costs,
                                    base.peak * pool.placement.chunks, pool.memory),
                  replayable=False)


def _defer_fastest(pool: Pool, count: int) -> None:
    for base in fastest_distinct(pool.candidates, count):
        _deferred(pool, base)


def _fill_fastest(pool: Pool, count: int) -> None:
    """The ``count`` fastest candidates with their bubbles filled (gap_fill.py), and the best
    of those with its W passes deferred."""
    before = len(pool.candidates)
    for base in fastest_distinct(pool.candidates, count):
        pool.consider(base.provenance + ("gaps filled",),
                      functools.partial(fill_gaps, pool.placement, base.orders, pool.memory),
                      replayable=False)
    for base in fastest_distinct(pool.candidates[before:], 1):
        _deferred(pool, base)


def fills_gaps(pool: Pool) -> bool:
    """Whether the search fills unit-slot bubbles (``_GAPS_FILLED``): not with ``shapes=False``,
    and only where F, B and W take about as long as each other, not at 1F1B's memory, or where
    the schedule is small (``_SLOT_SPREAD``, ``_GAPS_CHEAP_PASSES``)."""
    costs, p = pool.costs, pool.placement.ranks
    if 6 * p * pool.microbatches <= _GAPS_CHEAP_PASSES:
        return pool.shapes
    return pool.shapes and abs(pool.limit - p) > _EPS and all(
        max(f, b, w) <= _SLOT_SPREAD * min(f, b, w)
        for f, b, w in zip(costs.forward, costs.backward, costs.weight))


def _then_polished(pool: Pool, step: Callable[[], None]) -> None:
    """Runs ``step``, which adds candidates; when one of them wins, it gets the last polish."""
    before = len(pool.candidates)
    step()
    winner = pool.fastest()
    if winner.position >= before:
        _polish_further(pool, winner)


def _replay_bases(pool: list[Candidate], count: int, extra: int) -> list[tuple[Candidate, tuple]]:
    """(base, slacks) to replay: the ``count`` fastest candidates with every slack, then the
    fastest candidate of each other memory peak with one chunk of slack (at most ``extra``).

    A replay fills stalls differently at each memory level, so the order before replay
    predicts the order after it poorly across levels (p = 16, m = 256, costs 1, 1.2, 0.8:
    the 7.5-unit block ranks fourth before replay and first after it).
    """
    ranked = sorted((c for c in pool if c.replayable), key=candidate_key)
    bases = [(c, _REPLAY_SLACK) for c in ranked[:count]]
    peaks = {c.peak for c in ranked[:count]}
    for candidate in ranked[count:]:
        if candidate.peak not in peaks and len(bases) < count + extra:
            peaks.add(candidate.peak)
            bases.append((candidate, _REPLAY_SLACK[-1:]))
    return bases


def _polish(pool: Pool, orders, budget: int) -> Improved:
    """``orders`` improved by the local search within the limit (local.py)."""
    passes = sum(len(order) for order in orders)
    return improve(pool.placement, pool.microbatches, orders, pool.costs, pool.cap, pool.memory,
                   capped(budget, passes))


def _repeated(pool: Pool, orders) -> Improved:
    """``orders`` improved by moves repeated per microbatch (local.py), budgeted as ``_polish``."""
    budget = capped(_REPEATED_BUDGET, sum(len(order) for order in orders))
    return improve_repeated(pool.placement, pool.microbatches, orders, pool.costs, pool.cap,
                            pool.memory, budget)


def final_budget(p: int, m: int) -> int:
    """The last polish's budget: the smaller one from ``_FINAL_POLISH_LARGE_PASSES`` on."""
    return _FINAL_POLISH_LARGE if 6 * p * m >= _FINAL_POLISH_LARGE_PASSES else _FINAL_POLISH_BUDGET


def capped(budget: int, passes: int) -> int:
    """``budget``, at most ``_BUDGET_PER_PASS`` per pass of the schedule."""
    return min(budget, _BUDGET_PER_PASS * passes)


def _polish_further(pool: Pool, base: Candidate) -> None:
    """The last polish, with the larger budget (``final_budget``), as a candidate."""
    budget = final_budget(pool.placement.ranks, pool.microbatches)
    pool.consider(base.provenance + ("polished further",),
                  functools.partial(_polish, pool, base.orders, budget))


def _reshape_ends(pool: Pool, base: Candidate, own: int, cool_down_alone: bool = False) -> None:
    """Candidates from ``base`` re-laid (reshape_ends.py): its warm-up at the limit's peak
    (``pool.full``) and at its ``own`` (chunk-activations), warm-up and cool-down at the
    limit's, and, for the winner of the replays, the cool-down alone."""
    full, placement = pool.full, pool.placement
    for peak in sorted({full, own}):
        pool.consider(base.provenance + (f"warm-up re-laid (peak {peak})",),
                      functools.partial(reshape_warm_up, placement, base.orders, peak),
                      replayable=False)
    pool.consider(base.provenance + (f"warm-up and cool-down re-laid (peak {full})",),
                  functools.partial(_reshape_both, placement, base.orders, full), replayable=False)
    if cool_down_alone:
        pool.consider(base.provenance + (f"cool-down re-laid (peak {full})",),
                      functools.partial(reshape_cool_down, placement, base.orders, full),
                      replayable=False)


def _reshape_both(placement: Placement, orders, peak: int) -> tuple:
    """The warm-up re-laid, then the cool-down (the order of the paper code's steps)."""
    return reshape_cool_down(placement, reshape_warm_up(placement, orders, peak), peak)
