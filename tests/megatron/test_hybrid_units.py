"""megatron_vshape/megatron/hybrid.py: a --hybrid-layer-pattern read on the V's 2 x PP stages,
the families refused at argument parsing, and chunk 1's segment selection (no megatron
needed: the selection wrapper is driven with a recording stand-in of megatron's function).
The real loop is tests/megatron/test_megatron_lm_hybrid.py."""
from __future__ import annotations

import argparse

import pytest

from megatron_vshape.megatron import features
from megatron_vshape.megatron.hybrid import (
    _selecting, hybrid_layer_count, hybrid_stage_layers, unsupported_families, v_pattern)


@pytest.mark.parametrize("pattern,ranks,want", [
    ("*-E-*-E-", 2, "*-|E-|*-|E-"),           # even split
    ("*-E-*-E-", 4, "*|-|E|-|*|-|E|-"),
    ("*-E-*-E", 2, "*|-E|-*|-E"),             # 7 layers: rank 0's stages give up one
    ("*-E|-*|-E|-", 2, "*-E|-*|-E|-"),        # 2 x PP segments: the V's stages as written
    ("*-|E-|*-|E-/*-", 2, "*-|E-|*-|E-/*-"),  # an MTP part is kept (features.py refuses it)
])
def test_v_pattern_cuts_the_layers_into_the_vs_stages(pattern, ranks, want):
    assert v_pattern(pattern, ranks) == want
    assert hybrid_layer_count(want) == hybrid_layer_count(pattern)


def test_a_pattern_of_pp_segments_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="write 4 segments, or none"):
        hybrid_stage_layers("*-E-|*-E-", 2)


def test_hybrid_stage_layers_follow_the_segments():
    assert hybrid_stage_layers("*-E|-*|-E|-", 2) == (3, 2, 2, 1)
    assert hybrid_stage_layers("*-E-*-E-", 2) == (2, 2, 2, 2)


def _args(pattern, pp=2):
    return argparse.Namespace(hybrid_layer_pattern=pattern, pipeline_model_parallel_size=pp,
                              num_layers=hybrid_layer_count(pattern),
                              **{name: None for name in _UNSET})


_UNSET = {row_field for row in features.SETTINGS for row_field in row.reads} - {
    "hybrid_layer_pattern", "pipeline_model_parallel_size", "num_layers"}


@pytest.mark.parametrize("pattern,symbols", [("M*M*", ["M"]), ("*G-D", ["D", "G"]),
                                             ("*-E+", ["+"]), ("*-E|-*", [])])
def test_families_outside_attention_mlp_moe_are_named(pattern, symbols):
    assert unsupported_families(pattern) == symbols


@pytest.mark.parametrize("pattern,schedule,refused", [
    ("M*M*-E-*", "v-half", "Mamba (M)"),
    ("M*M*-E-*", "zb-1p", "Mamba (M)"),
    ("*-E-*-E-/*-", "v-zb", "multi-token prediction"),
    ("*-E-|*-E-", "v-min", "write 2 x PP segments"),
])
def test_argument_checks_refuse_what_the_v_cannot_build(pattern, schedule, refused):
    problems = features.refusals(_args(pattern), schedule)
    assert any(refused in p for p in problems), problems


@pytest.mark.parametrize("pattern,schedule", [("*-E-*-E-", "v-half"), ("*-E|-*|-E|-", "v-zb"),
                                              ("*-E-|*-E-", "zb-1p")])
def test_attention_mlp_moe_patterns_pass_the_argument_checks(pattern, schedule):
    assert features.refusals(_args(pattern), schedule) == []


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_chunk_1_selects_its_v_stage_through_the_mirrored_group():
    """PP 4, rank 1: chunk 1 reports rank 2 and must get V stage 6 (megatron's selection
    asked as for a pipeline of one, segment 6); other groups go to megatron unchanged."""
    from megatron_vshape.megatron.model import MirroredGroup

    calls = []
    select = _selecting(lambda *args, **kwargs: calls.append(args) or ("layers", 0))
    select("p", MirroredGroup(_Group(1, 4)), 1, None, None)
    plain = _Group(1, 4)
    select("p", plain, 0)
    assert calls == [("p", None, 6, None, None), ("p", plain, 0)]


def test_zb1p_refuses_a_pattern_of_virtual_stages_and_1f1b_defaults_to_interleaving():
    """2 x PP segments are megatron's virtual pipeline stages outside a V."""
    from megatron_vshape.megatron.arguments import default_schedule

    args = _args("*-E|-*|-E|-")
    assert any("more than PP '|' segments" in p for p in features.refusals(args, "zb-1p"))
    assert default_schedule(args) == "interleaved-1f1b"
    assert default_schedule(_args("*-E-|*-E-")) == "1f1b"
