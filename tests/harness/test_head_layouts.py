"""The demo's heavy-head case (harness/head_layouts.py): which layouts it runs and the
per-stage costs it emulates them with. Pure schedule code, milliseconds."""
import pytest

from megatron_vshape.harness.head_layouts import (balanced_stage_layers, emulated_stage_costs,
                                                  stage_layouts)
from megatron_vshape.schedule import build_schedule, simulate
from megatron_vshape.schedule.model.costs import Costs
from megatron_vshape.schedule.model.placement import Layout, Placement

LAYER = (0.02, 0.0278, 0.007)
"""One layer's emulated F, B, W (the demo's p = 4, 8 layers, 40 ms per rank's share)."""


def _rank_loads(layers, head):
    placement = Placement(len(layers) // 2, Layout.V)
    return [sum(layers[placement.stage_of(r, c)] for c in (0, 1)) + (head if r == 0 else 0)
            for r in range(placement.ranks)]


@pytest.mark.parametrize("num_layers,ranks,head,want", [
    (8, 4, 2, (1, 1, 1, 2, 1, 1, 1, 0)),    # rank 0: 1 layer + head 2 = 3 = rank 3's 3
    (8, 2, 4, (1, 3, 3, 1)),                # loads 6 and 6 (even: 8 and 4)
    (8, 2, 6, (1, 4, 3, 0)),                # rank 0 keeps its one layer, on stage 0
    (16, 4, 4, (1, 3, 3, 3, 2, 2, 2, 0)),
])
def test_balanced_layout_moves_layers_off_rank_0(num_layers, ranks, head, want):
    got = balanced_stage_layers(num_layers, ranks, head)
    assert got == want and sum(got) == num_layers
    even = stage_layouts(num_layers, ranks, head)["even"]
    assert max(_rank_loads(got, head)) < max(_rank_loads(even, head))
    assert got[0] >= 1 and min(got[1:-1]) >= 1  # every stage but the head's keeps a layer


@pytest.mark.parametrize("num_layers,ranks,head", [(8, 2, 1), (8, 4, 1), (14, 4, 2)])
def test_the_even_layout_stays_where_balancing_gains_nothing(num_layers, ranks, head):
    assert list(stage_layouts(num_layers, ranks, head)) == ["even"]


def test_too_few_layers_for_a_v_are_refused():
    with pytest.raises(ValueError, match="num_layers >= 8"):
        balanced_stage_layers(6, 4, 2)


def test_emulated_costs_are_per_stage_with_the_head_on_the_last():
    costs = emulated_stage_costs((1, 1, 1, 2, 1, 1, 1, 0), LAYER, 2)
    stages = costs.stage_times(Placement(4, Layout.V))
    assert [t.forward for t in stages] == pytest.approx([0.02, 0.02, 0.02, 0.04, 0.02, 0.02,
                                                         0.02, 0.04])
    assert stages[3].backward == pytest.approx(2 * 0.0278)
    assert stages[7].weight == pytest.approx(2 * 0.007)  # the head's W, two layers' worth


def test_the_even_layout_without_a_head_is_the_demos_uniform_emulation():
    """So the layouts' costs and the main table's (40 ms per rank's share) are one model."""
    costs = emulated_stage_costs((1,) * 8, LAYER, 0)
    assert costs == Costs.build(4, 0.04, 0.0556, 0.014)


def test_the_simulator_finds_the_balanced_layout_faster():
    """What the demo shows measured: p = 4, m = 8, head = 2 layers, V-ZB (1.39 s vs 1.76 s)."""
    spans = {}
    for label, layers in stage_layouts(8, 4, 2).items():
        costs = emulated_stage_costs(layers, LAYER, 2)
        spans[label] = simulate(build_schedule("v-zb", 4, 8, costs), costs).makespan
    assert spans["balanced"] < 0.85 * spans["even"]
