"""The adaptive search's tuning constants in one place (the steps that read them: adaptive.py's
``STEPS``; docs/design.md draws them). Each field says why it is what it is, with the
measurement that set it; a field whose measurement it shares with the next one says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..construct.greedy import Policy

__all__ = ["SETTINGS", "Settings"]


@dataclass(frozen=True)
class Settings:
    """How many candidates each step of the search takes, when a step runs, and how many
    passes the local search may time: bounds, so that results repeat."""

    family_budget: int = 6
    """The V family blocks built in full, those closest under the limit: more memory buys fewer
    bubbles."""
    period_scales: tuple = (1.0, 1.1, 1.2, 1.35, 1.5)
    """The continuous-offset blocks' periods, as multiples of a rank's compute per microbatch: a
    longer period holds fewer microbatches in flight, so the five give blocks at several memory
    levels below the tightest one's, and those over the limit drop out. Over p 4 and 8, m 2p and 4p,
    the costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1 and the limits V-Min's, V-Half's and 3p/4
    (36 searches) the tightest period alone lost at one point (0.6%); 1.0, 1.2 and 1.5 alone gave
    the same makespans as the five, and 1.75 and 2.0 added nothing."""
    wave_cheap_passes: int = 2_000
    """The wave is tried at 1F1B's memory, where it wins (V-ZB), and below it only when it is cheap
    (at most this many passes) or nothing else fits: over p 4-16, m 8 and 32, three cost ratios,
    two hop times and both memory models it won 42 of 72 points at p units, 2 of 72 at V-Min's and
    none at V-Half's or 3p/4, and it costs about 0.3 s at p = 16, m = 64."""
    replays: int = 4
    """The fastest candidates replayed in time, each at every slack: replays reorder them."""
    replays_large: int = 3
    """The same over ``large_passes``: a replay times the whole order."""
    large_passes: int = 12_000
    """From this many passes (6pm) the replays and re-lays take fewer starts."""
    extra_peaks: int = 2
    """Also replayed, at one slack: the fastest of up to this many other memory peaks
    (improvements.py's ``_replay_bases``)."""
    extra_peaks_large: int = 1
    """The same over ``large_passes``."""
    replay_windows: tuple = (4,)
    """The replays' lookahead (rewrite/replay.py): how many of a rank's next passes a replay may
    choose from. Over p 4 and 8, m 2p and 4p, the costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1
    and the limits V-Min's, V-Half's and 3p/4 (36 searches) window 2 instead was faster at 8 points
    and slower at 12 (by up to 2.5%), window 8 faster at 7 and slower at 10 (up to 14%), and the
    three windows 2, 4 and 8 together faster at 4 and slower at 4 (their replays take later steps'
    starts): 4 loses least. The replay's own default used to be 24 (rewrite/replay.py now has
    none): over the same grid's 30 distinct searches window 24 was faster at 7 (by up to 0.95%)
    and slower at 6, by up to 14.7% (p = 8, m = 32, costs 2,2.78,0.7,0.05 at 4 units: 239.61
    -> 274.93)."""
    replay_slack: tuple = (0, 1)
    """Chunk-activations a replay may hold over the limit while it runs: its peak often lands
    lower (a replay over the limit is dropped)."""
    relaid: int = 4
    """The fastest candidates re-laid (see ``relaid_large``)."""
    relaid_large: int = 1
    """The fastest candidates (distinct orders) whose warm-up and cool-down are re-laid, besides
    every finished construction (slot-reordered blocks, the wave); over 12,000 passes only the
    fastest (a re-lay times the order twice: p = 32, m = 256 took 12.6 s instead of 9.6 s)."""
    polished: int = 3
    """The fastest candidates polished by the local search after the re-lays."""
    polish_budget: int = 100_000
    """Passes the local search may time per start (a bound, so results repeat; local.py counts
    what each move re-times and costs: about 10 ms per 100,000)."""
    final_polish_budget: int = 600_000
    """Passes for polishing the winner once more (about 0.4 s): at p = 4, m = 16, costs 1,1.2,0.8
    at V-Min's memory it takes the makespan from 61.4 to the best known (CP-SAT) 61.1, and
    67.2 to 66.6 with comm 0.1; 500,000 stop at 66.7, 200,000 at 61.4 and 66.9."""
    final_polish_large: int = 150_000
    """The last polish's budget from ``final_polish_large_passes`` on."""
    final_polish_large_passes: int = 4_000
    """From this many passes (p = 16, m = 48) the winner's second polish gets the smaller budget:
    over p = 16, m = 32 and 64, four cost ratios and four limits (32 points) 150,000 passes gave
    the same makespans as 600,000 at every point, for 0.1-0.6 s less; at p = 8, m = 64 (3,072
    passes, below the threshold) the larger budget still gained 0.05% at 2 of 16 points."""
    filled: int = 5
    """The fastest candidates (distinct orders) whose W passes are deferred
    (weight_deferral.py), after the last polish, so that the search up to there is unchanged and
    the deferred orders can only add wins (0.003-0.12 s each at p = 4-16, m = 4p-8p; with 3, a
    relaid family block that the deferral makes fastest fell out of them once the polishes
    improved the others: v-half at p = 16, m = 64, H100 costs, 0.990 -> 0.992 x 1F1B). Deferred
    before the polish instead, they took the polish's starts from orders that polished better:
    V-Half at p = 4, m = 16, H100 costs 0.950 -> 0.953 x 1F1B, V-Min at costs 1,1.2,0.8: 61.0 ->
    61.1. Each is deferred within its own peak, not the limit: the same makespans at the named
    levels (where the peak is the limit), and a large limit is not filled with waiting W passes
    for a sliver of time (the planner's gpt-9.6b at seq 1024 went from 20 to 54 GiB for 0.06%
    more throughput)."""
    gaps_filled: int = 3
    """The fastest candidates (distinct orders) whose unit-slot bubbles are filled (gap_fill.py),
    last, and the best of them with its W passes deferred: so they only add wins (filled among the
    re-lays, they took an earlier step's starts: the planner's gpt-9.6b at seq 1024 lost 0.2%
    where a wave no longer got polished). Costs 2,2,2 at V-Min's limit, where the reference's
    search was ahead: p = 16, hop 0.1, m = 16/32/64: 169.4/274.2/484.2 -> 169.0/274.0/483.8 (the
    reference's), hop 0.5, m = 64: 649.0 -> 647.0 (same); p = 8, m = 64, hop 0.1: 434.2 -> 432.8
    (the reference: 434.0). 2 bases reach all five; 0.05-0.2 s at p = 16, m = 64."""
    slot_spread: float = 2.0
    """Gaps are filled only where on every rank the longest of F, B and W takes at most this times
    the shortest (see ``gaps_cheap_passes``)."""
    gaps_cheap_passes: int = 2_000
    """Gaps are filled only where, on every rank, the longest of F, B and W takes at most
    ``slot_spread`` times the shortest, and the limit is not 1F1B's memory (p units, V-ZB's level),
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
    repeated_budget: int = 1_000_000
    """Passes the moves repeated per microbatch may time (see ``repeated_passes``)."""
    repeated_passes: int = 768
    """The winner's last improvement, moves repeated in every microbatch (local.py's
    ``improve_repeated``), runs at V-Min's memory or less on schedules of at most this many passes
    (p = 4, m = 32), where it pays: at the H100 costs (2, 2.78, 0.7, hop 0.05), V-Min at p = 4
    from 1.219 to 1.196 x 1F1B (m = 16) and from 1.296 to 1.253 x (m = 32), for 0.2-0.5 s more.
    Run everywhere (periods 1-4), it gained at most 0.15% on the rest of the named levels' grid
    (p 4-16, m 4p and 8p, both memory models; p = 8, m = 32, V-Min) for 0.6-1.3 s more, and at
    V-Half's and V-ZB's memory 0.1% at most."""
    move_window: int = 6
    """How many positions a move of the local search (local.py) may carry a pass earlier, and
    how far a kick's random move reaches. Over p 4 and 8, m 2p and 4p, the costs 2,2.78,0.7,0.05 /
    1,1.2,0.8,0.1 / 2,2,2,0.1 and the limits V-Min's, V-Half's and 3p/4 (30 distinct
    searches) window 4 was faster at 4 points (by up to 0.60%) and slower at 2 (up to 0.61%),
    window 8 faster at 1 (0.19%) and slower at 3 (up to 0.79%), in the same time: 6 is kept,
    4 being a wash there that would change answers all over the referee."""
    kicks: int = 3
    """Random moves per kick of the local search's iterated descent (``LocalSearch.run``):
    enough to leave a local optimum, few enough that the descent after it stays near the best
    found. Over p 4 and 8, m 2p and 4p, the costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1
    and the limits V-Min's, V-Half's and 3p/4 (36 searches) 1 and 6 kicks were each slower at
    2 points (by up to 0.4%) and faster at none."""
    move_cost: int = 100
    """A move's fixed cost in passes timed, charged to the local search's budget besides the
    passes it re-times: building and checking a move takes about 10 us, what timing 100
    passes takes, so a budget buys about the same wall time whatever the moves cost."""
    many_timings: int = 1_000
    """Below this many passes of budget per pass of the schedule, a polish's budget buys one
    partial descent, and that descent takes the critical path's gaps first (p 8-16 at H100 and
    unbalanced costs: faster at 33 of 34 changed points, by up to 2.8%); from it (small
    schedules: hundreds of full timings, many descents) all gaps biggest first, which reached
    the better basins at p = 4 (m 8-16: 7 of 9 changed points slower with critical-first)."""
    deadlock_probe: int = 64
    """How many passes the local search's deadlock check (``LocalSearch.deadlocks``) visits
    before it gives up and leaves the move to a timing: at the H100 costs it settles 97-100% of
    the deadlocked single moves of v-min's searches at p 4-16 (about 28 passes each at p = 16,
    m = 16) and 95% of v-half's at p = 16, m = 64. A move repeated per microbatch is not timed
    either when the move itself, made once, surely deadlocks (``LocalSearch.repeated``)."""
    repeated_periods: tuple = (1,)
    """The periods (microbatches) the repeated moves are made in (``improve_repeated``):
    periods 1-4 instead of 1 reached the same makespans at p = 4, m = 16 and 32 (V-Min's
    memory, H100 costs), in more time."""
    repeated_polish: int = 300_000
    """Passes of the single-move polish after each round of repeated moves (``improve_repeated``;
    at most the round's whole budget). Over p = 4, m 8, 16 and 32 at V-Min's memory (where the
    repeated moves run), the costs 2,2.78,0.7,0.05 / 1,1.2,0.8,0.1 / 2,2,2,0.1 (9 searches):
    150,000 lost 1.35% at one (m = 32, H100 costs: 243.54 -> 246.82), 600,000 lost 0.29% at
    one (m = 16: 126.22 -> 126.58), both faster nowhere, in the same time."""
    zb_policies: tuple = (Policy(), Policy(ranked_warm_up=True, alternate=True))
    """The greedy's policies (construct/greedy.py) zb-1p's level tries besides the paper's
    order (levels.py): between them the fastest of all 64 policies on every point of the
    reference comparison grid (p 4-16, m 8-64, two cost ratios, three hop times)."""
    budget_per_pass: int = 1_600
    """Both polish budgets are capped at this many passes timed per pass of the schedule: the local
    search spends its whole budget, and a small schedule (p = 2, m = 2: 24 passes) would otherwise
    be timed 25,000 times (4 s) for nothing; from 375 passes (p = 4, m = 16) the caps above bind."""


SETTINGS = Settings()
"""The settings every search uses unless it is given others (``search(..., settings=
dataclasses.replace(SETTINGS, gaps_filled=0))``); the ``STEPS`` table's budgets read them."""
