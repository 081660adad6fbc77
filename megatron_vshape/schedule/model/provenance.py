"""How a schedule was made, as data: the steps (a step's name and its parameters), first to last.

Code reads the steps by name (``step.name == RELAID``, never a substring of their words); the
words for people, ``str(step)`` and ``str(provenance)`` (a schedule's ``description``), are
rendered only where they are shown: the CLI, the logs, an error message, a benchmark line::

    Provenance((Step("block", (("family", "v-min"),)), Step("replayed in time", (("window", 4),))),
               Chosen("auto", "limit", 3.0))
    -> "auto: v-min block, replayed in time (window 4) (limit 3 units)"

``WORDS`` holds each step's words; a step not in it is an internal error (``step``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Step", "Chosen", "Provenance", "step", "describe", "WORDS", "RELAID",
           "CRITICAL_TAIL"]


@dataclass(frozen=True)
class Step:
    """One step that made (or rewrote) an order: its name and its parameters."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    """(parameter, value) pairs, in the order ``step`` was given them; values are hashable
    (candidates are keyed by their provenance)."""

    def __str__(self) -> str:
        return WORDS[self.name](**dict(self.params))


def step(name: str, **params) -> Step:
    """The step ``name`` with ``params``; the name must have words (``WORDS``)."""
    assert name in WORDS, f"step {name!r} has no words in WORDS"
    return Step(name, tuple(params.items()))


def describe(steps: tuple[Step, ...]) -> str:
    """Steps in words, first to last."""
    return ", ".join(map(str, steps))


@dataclass(frozen=True)
class Chosen:
    """Which name chose the order, under which bound: the adaptive search under its limit
    (``auto``, ``limit``) or a memory level's build (``v-half``, ``level``)."""

    by: str
    bound: str
    units: float


@dataclass(frozen=True)
class Provenance:
    """A schedule's steps, the name that chose them (None: a fixed order) and the rewrites
    made to the chosen order after (``then``: Transformer Engine's W order)."""

    steps: tuple[Step, ...] = ()
    chosen: Chosen | None = None
    then: tuple[Step, ...] = ()

    def followed_by(self, *steps: Step) -> "Provenance":
        """This provenance with ``steps`` made to its finished order."""
        return Provenance(self.steps, self.chosen, self.then + steps)

    def __str__(self) -> str:
        words = describe(self.steps)
        if self.chosen is not None:
            c = self.chosen
            words = f"{c.by}: {words} ({c.bound} {c.units:g} units)"
        return words + "".join(f", {s}" for s in self.then)


RELAID = ("warm-up re-laid", "warm-up and cool-down re-laid")
"""The steps that re-lay a warm-up or cool-down (rewrite/reshape_ends.py)."""
CRITICAL_TAIL = "cool-down critical path first"
"""The critical-path cool-down (search/critical_path_step.py)."""

WORDS: dict[str, Callable[..., str]] = {
    # fixed orders (construct/named.py) and what a run measured
    "paper block": lambda family, interval, bound:
        f"{family} block, interval {interval}, bound {bound:g} units",
    "interleaved 1F1B": lambda: "megatron interleaved 1F1B, 2 chunks, loop placement",
    "measured": lambda: "measured",
    # the adaptive search's constructions (search/constructions.py)
    "block": lambda family: f"{family} block",
    "slot-reordered": lambda: "slot-reordered",
    "wave": lambda: "V-ZB wave, cost-aware",
    "family block": lambda offsets: f"V family block, {offsets.describe()}",
    "continuous block": lambda scale: f"continuous-offset block, period x{scale:g}",
    # its improvements (search/improvements.py)
    "replayed in time": lambda window: f"replayed in time (window {window})",
    "polished": lambda: "polished",
    "polished further": lambda: "polished further",
    "moves repeated per microbatch": lambda: "moves repeated per microbatch",
    "W deferred": lambda: "W deferred",
    "gaps filled": lambda: "gaps filled",
    RELAID[0]: lambda peak: f"warm-up re-laid (peak {peak})",
    RELAID[1]: lambda peak: f"warm-up and cool-down re-laid (peak {peak})",
    # under a memory model that frees at B (search/freeing_at_b.py)
    "W deferred under the model": lambda: "W deferred under the model",
    "W deferred and polished under the model": lambda: "W deferred and polished under the model",
    # the last step of the search (search/critical_path_step.py)
    CRITICAL_TAIL: lambda line, again:
        f"{CRITICAL_TAIL} ({line} line){' again' if again else ''}",
    # zb-1p's one-chunk orders (search/levels.py)
    "paper order": lambda: "paper order",
    "greedy": lambda policy: f"greedy ({policy.describe()})",
    "fastest where B frees nothing": lambda: "the fastest order where B frees nothing",
    # a finished order rewritten for Transformer Engine (rewrite/weight_order.py)
    "W in B order": lambda: "W in B order",
}
"""Each step's words for people, from its parameters."""
