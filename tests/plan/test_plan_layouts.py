"""Per-stage pass times, the layouts the planner chooses, their bounds and flags (tier 1).

The planner gives the simulator per-STAGE costs (plan/cost.py ``stage_costs``), so under a V it
sees rank 0's chunk 1 (LM head and loss) as the heavy one, and it chooses the layers per stage
(plan/layout_search.py) jointly with the schedule.
"""
import itertools
import re

import pytest

from megatron_vshape.plan import ClusterConfig, TrainingConfig, load_model_config
from megatron_vshape.plan.bounds import pipeline_bounds
from megatron_vshape.plan.candidates import GridPoint, SearchSpace
from megatron_vshape.plan.cost import rank_costs, stage_times
from megatron_vshape.plan.evaluate import Evaluator
from megatron_vshape.schedule.io.megatron_layout import layout_of_counts
from megatron_vshape.plan.layout_search import (best_layout, rank_work, whole_layer_rank_counts,
                                                whole_layer_work)
from megatron_vshape.plan.memory import chunk_parameters
from megatron_vshape.plan.shares import (even_stages, rank_shares, shares_by_rank,
                                         stages_from_counts)
from megatron_vshape.schedule.model.placement import Layout, Placement

LLAMA = load_model_config("llama-3-8b")
TRAINING = TrainingConfig(seq_length=8192, global_batch=64)
CLUSTER = ClusterConfig(gpus=8, gpu_memory_gib=80.0)
PLACEMENTS = [Placement(4, Layout.SINGLE), Placement(4, Layout.V), Placement(4, Layout.LOOP)]


@pytest.fixture(scope="module")
def times():
    return Evaluator(LLAMA, TRAINING, CLUSTER).times(1, 1)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.layout.value)
def test_stage_times_sum_to_the_rank_costs_of_the_even_layout(placement, times):
    stages = even_stages(LLAMA, placement)
    per_stage = stage_times(stages, times)
    costs = rank_costs(rank_shares(LLAMA, placement), times, 0.0)
    for rank in range(placement.ranks):
        mine = [per_stage[placement.stage_of(rank, c)] for c in range(placement.chunks)]
        assert sum(t.forward for t in mine) == pytest.approx(costs.forward[rank], rel=1e-12)
        assert sum(t.backward for t in mine) == pytest.approx(costs.backward[rank], rel=1e-12)
        assert sum(t.weight for t in mine) == pytest.approx(costs.weight[rank], rel=1e-12)
    # the V's rank 0 holds the embedding on chunk 0 and the head on chunk 1: chunk 1 is heavier
    if placement.layout is Layout.V:
        assert per_stage[-1].forward > 1.5 * per_stage[0].forward


def test_the_head_outweighs_a_layer_for_a_128k_vocabulary(times):
    """Llama-3-8B at seq 8192: the LM head and loss cost over two layers (the issue's cause)."""
    head = times.head.forward + times.head.backward + times.head.weight
    layer = times.layer.forward + times.layer.backward + times.layer.weight
    assert 2 < head / layer < 4


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: p.layout.value)
@pytest.mark.parametrize("layers", [8, 10, 13])
def test_whole_layer_counts_are_the_exhaustive_optimum(placement, layers, times):
    """The greedy assignment's busiest rank equals the best over every assignment of layers to
    ranks (each non-end stage one layer at least)."""
    floors = [sum(placement.stage_of(r, c) not in (0, placement.num_stages - 1)
                  for c in range(placement.chunks)) for r in range(placement.ranks)]
    if placement.layout is Layout.V:
        floors[0] = 1  # the plugin's V wants a layer on rank 0 (megatron/stage_layout.py)
    layer = times.layer.forward + times.layer.backward + times.layer.weight
    extra = [w - n * layer for w, n in zip(
        rank_work(tuple(s.layers for s in even_stages(LLAMA.with_overrides(num_layers=layers),
                                                      placement)), placement, times),
        [sum(s.layers for s in chunks) for chunks in rank_shares(
            LLAMA.with_overrides(num_layers=layers), placement)])]
    best = min(max(e + n * layer for e, n in zip(extra, counts))
               for counts in itertools.product(range(layers + 1), repeat=placement.ranks)
               if sum(counts) == layers and all(n >= f for n, f in zip(counts, floors)))
    assert whole_layer_work(placement, layers, times) == pytest.approx(best, rel=1e-12)
    assert sum(whole_layer_rank_counts(placement, layers, times)) == layers


def test_stages_need_a_layer_but_the_ends():
    assert [s.layers for s in stages_from_counts((0, 3, 2, 0))] == [0, 3, 2, 0]
    with pytest.raises(ValueError, match="stage 1 would hold 0 layers"):
        stages_from_counts((2, 0, 3, 1))


def _megatron_unroll(text: str) -> list[str]:
    """Megatron-core's parse_str_to_list, its two regular expressions (see schedule/io/megatron_layout.py)."""
    for pattern in (r'\(([^)]+)\)\*(\d+)', r'(.)\*(\d+)'):
        text = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), text)
    return text.split("|")


@pytest.mark.parametrize("counts", [(0, 2, 3, 2, 2, 3, 2, 0), (4, 4, 4, 4), (1, 1, 0)])
def test_the_layout_flag_parses_back_to_the_counts(counts):
    flag = layout_of_counts(counts)
    stages = _megatron_unroll(flag)
    assert [s.count("t") for s in stages] == list(counts)
    assert stages[0].startswith("E") and stages[-1].endswith("L")
    assert layout_of_counts((0, 2, 3, 2, 2, 3, 2, 0)) == "E|t*2|t*3|t*2|t*2|t*3|t*2|L"


def test_megatron_parses_the_flag():
    layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    parsed = layout.PipelineParallelLayerLayout.parse_str_to_list(layout_of_counts((0, 2, 3, 1)))
    assert [len(stage) for stage in parsed] == [1, 2, 3, 2]


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-1p", "v-half", "v-zb"])
def test_the_chosen_layout_is_never_slower_than_even(name):
    point = GridPoint(1, 1, 4, 1, 16)
    h200 = ClusterConfig(gpus=4, gpu_memory_gib=141.0)  # every schedule fits at PP 4
    best = Evaluator(LLAMA, TRAINING, h200, stage_layouts="best").evaluate(point, name)
    even = Evaluator(LLAMA, TRAINING, h200, stage_layouts="even").evaluate(point, name)
    assert best.feasible
    assert even.feasible and best.iteration_seconds <= even.iteration_seconds
    assert sum(best.stage_layers) == LLAMA.num_layers


def test_the_busiest_bound_is_below_every_simulated_layout(times):
    """Every layout a search scores simulates no faster than m x the whole-layer busiest rank;
    the balanced bound is below the whole-layer one."""
    evaluator = Evaluator(LLAMA, TRAINING, CLUSTER)
    point = GridPoint(1, 1, 4, 1, 16)
    schedule = evaluator.schedule("v-zb", 4, 16)
    placement = schedule.placement
    seen = []

    def score(counts):
        makespan = evaluator.simulate_stages("v-zb", schedule,
                                             stage_times(stages_from_counts(counts), times),
                                             evaluator.hop(point))[0]
        seen.append(makespan)
        return makespan

    even = tuple(s.layers for s in even_stages(LLAMA, placement))
    choice = best_layout(placement, LLAMA.num_layers, times, even, score, budget=40)
    bounds = pipeline_bounds(evaluator, point, "v-zb")
    assert len(seen) >= 10 and choice.score <= choice.even_score
    assert min(seen) >= bounds.busiest
    assert bounds.balanced <= bounds.whole_layer
    assert choice.score < choice.even_score  # the even layout leaves rank 0 the slowest


def test_memory_counts_each_stage(times):
    """Per-rank memory follows the layout: moving layers off the V's rank 0 takes exactly their
    parameters and activations off it; its embedding and LM head stay."""
    evaluator = Evaluator(LLAMA, TRAINING, CLUSTER)
    point = GridPoint(1, 1, 4, 1, 16)
    placement = Placement(4, Layout.V)
    even = even_stages(LLAMA, placement)
    counts = [s.layers for s in even]
    lighter = [0] + counts[1:4] + [counts[4] + counts[0] + counts[-1]] + counts[5:-1] + [0]
    before = evaluator.rank_memory(point, shares_by_rank(even, placement), single=False)
    after = evaluator.rank_memory(point, shares_by_rank(stages_from_counts(lighter), placement),
                                  single=False)
    moved = counts[0] + counts[-1]
    layer = chunk_parameters(LLAMA, stages_from_counts((1, 0))[0], 1, 8192) - \
        chunk_parameters(LLAMA, stages_from_counts((0, 0))[0], 1, 8192)
    assert before.static[0].parameters - after.static[0].parameters == pytest.approx(moved * layer)
    assert after.static[0].parameters > 2 * LLAMA.vocab_size * LLAMA.hidden_size  # E and head
    kept = [sum(c.forward for c in rank) for rank in after.chunks]
    kept_before = [sum(c.forward for c in rank) for rank in before.chunks]
    assert kept_before[0] - kept[0] == pytest.approx(kept[3] - kept_before[3])


def test_the_plan_prints_the_layout_of_counts():
    from megatron_vshape.plan.launch_flags import row_flags
    from megatron_vshape.plan.planner import plan

    space = SearchSpace(schedules=("1f1b", "interleaved-1f1b", "v-zb"), micro_batch_sizes=(1,),
                        tensor_parallel=(1,), pipeline_parallel=(8,), auto_candidates=0,
                        recompute=("none",), stage_layouts="best")
    result = plan(LLAMA, TRAINING, CLUSTER, space)
    for row in result.feasible:
        flags = row_flags(row, result)
        assert "--pipeline-model-parallel-layout" in flags
        flag = flags[flags.index("--pipeline-model-parallel-layout") + 1]
        assert [s.count("t") for s in _megatron_unroll(flag)] == list(row.stage_layers)
        assert "--num-virtual-stages-per-pipeline-rank" not in flags  # megatron refuses both


def test_bad_stage_layouts_are_refused():
    with pytest.raises(ValueError, match="--stage-layouts must be one of best, even"):
        SearchSpace(stage_layouts="uneven")
    with pytest.raises(ValueError, match="--stage-layouts"):
        Evaluator(LLAMA, TRAINING, CLUSTER, stage_layouts="uneven")


@pytest.mark.parametrize("pp, gib", [(4, 141.0), (8, 80.0), (16, 80.0)])
def test_the_plugin_reads_the_chosen_v_layouts(pp, gib):
    """The flag the planner prints for a V is what the plugin's V reader (megatron-core's
    parser and the V's rules, megatron/stage_layout.py) turns back into the same counts."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from megatron_vshape.megatron.stage_layout import v_stage_layout

    evaluator = Evaluator(LLAMA, TRAINING, ClusterConfig(gpus=pp, gpu_memory_gib=gib),
                          stage_layouts="best")
    for name in ("v-min", "v-half", "v-zb"):
        row = evaluator.evaluate(GridPoint(1, 1, pp, 1, 64), name)
        if not row.feasible:
            continue
        args = SimpleNamespace(pipeline_model_parallel_size=pp, num_layers=LLAMA.num_layers,
                               pipeline_model_parallel_layout=layout_of_counts(row.stage_layers))
        assert v_stage_layout(args).layers == row.stage_layers
