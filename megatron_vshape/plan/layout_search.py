"""Which whole-layer layout a schedule runs fastest: the busiest rank's bound, seeds, local moves.

Under a V rank 0 holds stage 0 (the embedding) and stage 2p-1 (final layernorm, LM head and
cross entropy over the vocabulary), and the pipeline runs at its pace: with Llama-3-8B's
128k vocabulary at seq 8192 the head costs about four layers. Moving layers off rank 0 (and,
in 1F1B, off the last rank) is the cure within whole layers::

    even V, p = 4, 14 layers   stage   0  1  2  3 | 4  5  6  7     rank 0: 1 + 1 + E + LM head
                               layers  1  2  2  2 | 2  2  2  1     ranks 1-3: 4 layers each
    whole-layer optimum                2  2  2  2 | 2  2  2  0     the same counts per rank,
    (Llama-3-8B's head: 2.4 layers)                                the head's chunk lighter

(At more layers the optimum moves whole layers off rank 0: Llama-3-8B, PP 8 gives rank 0 two
of 32 layers and ranks 1 and 2 five.) Under a V rank 0 keeps a layer at least, as the plugin
requires (megatron/stage_layout.py).

Three steps, each cheap:

1. :func:`whole_layer_rank_counts`: layers per RANK minimising the busiest rank's work
   (F + B + W of one microbatch): each layer goes, one at a time, to the rank it leaves least
   loaded, which is optimal for equal items (the busiest rank cannot do better).
2. :func:`seed_layouts`: per-STAGE counts from it (each rank's layers split so its two
   chunks cost the same, or split in halves) and the even layout.
3. :func:`best_layout`: the best seed under ``score`` (the schedule simulated with per-stage
   costs, memory checked), then moves of one layer between neighbouring stages or a rank's
   two stages while they help, within a budget of scored layouts.

The even layout is always scored, so the choice is never slower than it under ``score``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from ..schedule.model.placement import Placement
from .cost import PartTimes, PassTimes, stage_times
from .shares import stages_from_counts

__all__ = ["LayoutChoice", "stage_work", "rank_work", "whole_layer_rank_counts",
           "whole_layer_work", "seed_layouts", "best_layout", "BUDGET"]

BUDGET = 60
"""Layouts :func:`best_layout` scores at most (a simulation each, milliseconds)."""

Counts = tuple  # layers per global stage


def _total(t: PassTimes) -> float:
    return t.forward + t.backward + t.weight


def stage_work(counts: Counts, times: PartTimes) -> tuple[float, ...]:
    """F + B + W seconds of one microbatch through each stage."""
    return tuple(_total(t) for t in stage_times(stages_from_counts(counts), times))


def rank_work(counts: Counts, placement: Placement, times: PartTimes) -> tuple[float, ...]:
    """F + B + W seconds of one microbatch through each rank's stages."""
    work = stage_work(counts, times)
    return tuple(sum(work[placement.stage_of(r, c)] for c in range(placement.chunks))
                 for r in range(placement.ranks))


def _is_end(stage: int, placement: Placement) -> bool:
    return stage in (0, placement.num_stages - 1)


def _rank_floor(rank: int, placement: Placement) -> int:
    """Layers a rank must hold: one per stage of it that is not an end stage, and one on the
    V's rank 0, which holds both ends (the plugin's V refuses a rank 0 without a layer:
    megatron/stage_layout.py)."""
    stages = [placement.stage_of(rank, c) for c in range(placement.chunks)]
    inner = sum(not _is_end(s, placement) for s in stages)
    return max(inner, 1) if len(stages) > 1 else inner


def _rank_extra(rank: int, placement: Placement, times: PartTimes) -> float:
    """A rank's work besides its layers: the embedding, the LM head."""
    stages = [placement.stage_of(rank, c) for c in range(placement.chunks)]
    last = placement.num_stages - 1
    return (_total(times.embedding) * (0 in stages) + _total(times.head) * (last in stages))


def whole_layer_rank_counts(placement: Placement, num_layers: int,
                            times: PartTimes) -> tuple[int, ...]:
    """Layers per rank that minimise the busiest rank's work (module docstring, step 1);
    ties go to the lower rank. Raises ValueError when the layers cannot fill every stage."""
    counts = [_rank_floor(r, placement) for r in range(placement.ranks)]
    if sum(counts) > num_layers:
        raise ValueError(f"{num_layers} layers cannot give each of the "
                         f"{placement.num_stages - 2} inner pipeline stages a layer (--pp)")
    layer = _total(times.layer)
    heap = [(_rank_extra(r, placement, times) + (n + 1) * layer, r)
            for r, n in enumerate(counts)]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(counts)):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (_rank_extra(r, placement, times) + (counts[r] + 1) * layer, r))
    return tuple(counts)


def whole_layer_work(placement: Placement, num_layers: int, times: PartTimes) -> float:
    """The least busiest-rank work (F + B + W, one microbatch) whole layers allow."""
    counts = whole_layer_rank_counts(placement, num_layers, times)
    layer = _total(times.layer)
    return max(_rank_extra(r, placement, times) + n * layer for r, n in enumerate(counts))


def _split(rank: int, layers: int, placement: Placement, times: PartTimes,
           halves: bool) -> list[tuple[int, int]]:
    """(stage, layers) of a rank's chunks holding ``layers`` in all: in halves (chunk 0 the
    larger), or so the chunks' work is as equal as whole layers allow."""
    stages = [placement.stage_of(rank, c) for c in range(placement.chunks)]
    if len(stages) == 1:
        return [(stages[0], layers)]
    low = [0 if _is_end(s, placement) else 1 for s in stages]
    layer, last = _total(times.layer), placement.num_stages - 1

    def extra(stage: int) -> float:
        return (_total(times.embedding) * (stage == 0) + _total(times.head) * (stage == last))

    choices = range(low[0], layers - low[1] + 1)
    if halves:
        first = min(max(-(-layers // 2), low[0]), layers - low[1])
    else:
        first = min(choices, key=lambda a: (abs(extra(stages[0]) + a * layer
                                                - extra(stages[1]) - (layers - a) * layer), -a))
    return [(stages[0], first), (stages[1], layers - first)]


def seed_layouts(placement: Placement, num_layers: int, times: PartTimes,
                 even: Counts) -> list[Counts]:
    """The even layout and the whole-layer optimum's splits (module docstring, step 2)."""
    per_rank = whole_layer_rank_counts(placement, num_layers, times)
    seeds = [tuple(even)]
    for halves in (False, True):
        counts = [0] * placement.num_stages
        for rank, layers in enumerate(per_rank):
            for stage, n in _split(rank, layers, placement, times, halves):
                counts[stage] = n
        seeds.append(tuple(counts))
    return list(dict.fromkeys(seeds))


def _moves(placement: Placement) -> list[tuple[int, int]]:
    """(from, to) stage pairs a local move shifts one layer between: neighbours in stage
    order and the two stages of one rank."""
    stages = placement.num_stages
    pairs = [(s, s + 1) for s in range(stages - 1)]
    pairs += [(placement.stage_of(r, 0), placement.stage_of(r, c))
              for r in range(placement.ranks) for c in range(1, placement.chunks)]
    pairs = list(dict.fromkeys(tuple(sorted(p)) for p in pairs if p[0] != p[1]))
    return [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]


def _valid(counts: Sequence[int], placement: Placement) -> bool:
    if not all(n >= (0 if _is_end(s, placement) else 1) for s, n in enumerate(counts)):
        return False
    return all(sum(counts[placement.stage_of(r, c)] for c in range(placement.chunks))
               >= _rank_floor(r, placement) for r in range(placement.ranks))


@dataclass(frozen=True)
class LayoutChoice:
    """The layout :func:`best_layout` chose and what it saw."""

    counts: Counts
    """Layers per global stage."""
    score: float
    """Its score (seconds; lower is better)."""
    even_score: float
    """The even layout's score."""
    scored: int
    """Layouts scored."""


def best_layout(placement: Placement, num_layers: int, times: PartTimes, even: Counts,
                score: Callable[[Counts], float], budget: int = BUDGET) -> LayoutChoice:
    """The lowest-``score`` layout found from :func:`seed_layouts` by local moves (module
    docstring, step 3); ``score`` returns ``inf`` for a layout that does not fit."""
    seen: dict[Counts, float] = {}

    def value(counts: Counts) -> float:
        if counts not in seen:
            seen[counts] = score(counts)
        return seen[counts]

    seeds = seed_layouts(placement, num_layers, times, even)
    best = min(seeds, key=value)
    moves = _moves(placement)
    improved = True
    while improved and len(seen) < budget:
        improved = False
        for source, target in moves:
            trial = list(best)
            trial[source] -= 1
            trial[target] += 1
            trial = tuple(trial)
            if trial in seen or not _valid(trial, placement):
                continue
            if value(trial) < value(best):
                best, improved = trial, True
                break
            if len(seen) >= budget:
                break
    return LayoutChoice(best, value(best), value(tuple(even)), len(seen))
