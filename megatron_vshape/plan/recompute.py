"""Activation recomputation: which kinds a plan row may use, and how each changes it.

Megatron-LM's two kinds (``--recompute-granularity``), as the paper's baselines run them:

- ``full`` (``--recompute-method uniform --recompute-num-layers 1``; the paper's 1F1B-R): a
  layer keeps only its input until B, and B first replays the layer's forward. Memory per
  layer and microbatch falls to e s b h / sp bytes, and while B runs one layer's whole
  activations exist again (a transient on top of the rank's level); time: B gains one F.
- ``selective`` (the attention core, ``--recompute-modules core_attn``): the softmax output
  and its dropout are not kept and B recomputes them: memory loses the attention term of
  :func:`.memory.activation_sizes`, B gains the attention core's forward.

Full recomputation is planned for megatron's own schedules (and PP = 1) only. Under the
plugin's B/W split, W keeps every linear layer's input and output gradient after B whatever
was recomputed, so a V or ZB schedule with full recomputation keeps several times 1F1B-R's
bytes (measured on configs/models/tiny.yaml, PP = 4: V-Half 1.4 to 2.9 x per rank) and is
slower: it is never the point to pick (it trains correctly, bit-identical to megatron's
1F1B-R: tests/megatron/test_megatron_gloo.py; only its memory makes it pointless). Selective recomputation applies to every schedule; with
flash attention the fused kernel keeps only its softmax statistics already, so the plan
evaluates it only without flash attention.
"""
from __future__ import annotations

from ..schedule.names import AUTO, MEGATRON_OWN_SCHEDULES, REFERENCE

__all__ = ["RECOMPUTE", "FULL_SCHEDULES", "SUFFIX", "label", "recompute_choices",
           "REFERENCE_RECOMPUTED"]

RECOMPUTE = ("none", "selective", "full")
"""Recomputation kinds (``vshape plan --recompute``)."""

FULL_SCHEDULES = ("none",) + MEGATRON_OWN_SCHEDULES
"""Schedules planned with full recomputation: megatron's own (``none``: PP = 1)."""

SUFFIX = {"none": "", "selective": "+sel", "full": "-r"}
"""Row labels: ``1f1b-r`` (the paper's 1F1B-R), ``v-half+sel``."""


def label(schedule: str, recompute: str) -> str:
    """The plan row's name for ``schedule`` under ``recompute``."""
    return schedule + SUFFIX[recompute]


REFERENCE_RECOMPUTED = label(REFERENCE, "full")
"""``1f1b-r``: the paper's 1F1B-R, 1F1B with full recomputation, its other baseline."""


def recompute_choices(schedule: str, wanted: tuple[str, ...], flash_attention: bool
                      ) -> tuple[str, ...]:
    """The kinds of ``wanted`` that are planned for ``schedule`` (module docstring)."""
    out = []
    for kind in wanted:
        if kind == "full" and schedule not in FULL_SCHEDULES:
            continue
        if kind == "selective" and (flash_attention or schedule == AUTO):
            continue
        out.append(kind)
    return tuple(out)
