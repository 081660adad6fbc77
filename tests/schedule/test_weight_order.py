"""Each stage's W passes relabelled into its B order (rewrite/weight_order.py), which Transformer
Engine's first-in first-out weight-gradient queue needs."""
import random

from hypothesis import given, settings, strategies as st

from megatron_vshape.schedule import (Costs, MemoryModel, PassKind, build_schedule, simulate,
                                      validate)
from megatron_vshape.schedule.model.provenance import step
from megatron_vshape.schedule.rewrite.weight_order import weights_in_backward_order

B, W = PassKind.B, PassKind.W

MEASURED = Costs.build(
    4, [0.022645701499868665, 0.01779680850006571, 0.01810208949996195, 0.013506251499961763],
    [0.010898519000079432, 0.009175331000164988, 0.007943056000044635, 0.00856547549994957],
    [0.0023279879999336117, 0.002941147000001365, 0.0025934304999282176,
     0.0020564039999726447], comm=0.00016500352500088412)
"""What the TE tier's grouped-GEMM MoE model (PP 4) measured on CPU: V-ZB re-planned from it put
W4 before W3 of stage 0 on rank 0 and failed Transformer Engine's queue."""


def _out_of_order(schedule) -> list:
    bad = []
    for rank, actions in enumerate(schedule.rank_actions):
        for stage in {a.stage for a in actions}:
            order = lambda kind: [a.microbatch for a in actions if a.kind is kind and a.stage == stage]
            if order(W) != order(B):
                bad.append((rank, stage, order(B), order(W)))
    return bad


def _same_run(a, b, costs, memory) -> None:
    x, y = simulate(a, costs, memory), simulate(b, costs, memory)
    assert x.makespan == y.makespan and x.peak_memory == y.peak_memory


def test_the_measured_v_zb_gets_its_w_passes_in_b_order_at_no_cost():
    memory = MemoryModel(1.0, -1.0, 0.0)
    polished = build_schedule("v-zb", 4, 8, costs=MEASURED, memory=memory)
    assert _out_of_order(polished), "the search no longer reorders W: find another case"
    fixed = weights_in_backward_order(polished)
    assert _out_of_order(fixed) == []
    validate(fixed)
    _same_run(polished, fixed, MEASURED, memory)
    assert [[a.kind for a in r] for r in fixed.rank_actions] == \
        [[a.kind for a in r] for r in polished.rank_actions]
    assert fixed.provenance == polished.provenance.followed_by(step("W in B order"))
    assert fixed.description == f"{polished.description}, W in B order"
    assert weights_in_backward_order(fixed) is fixed


def _shuffled_weights(schedule, seed: int):
    """Each W given, at random, a microbatch whose B has run and whose W has not: any valid
    W order a search could produce."""
    rng = random.Random(seed)
    ranks = []
    for actions in schedule.rank_actions:
        ready, out = {}, []
        for action in actions:
            if action.kind is B:
                ready.setdefault(action.stage, []).append(action.microbatch)
            if action.kind is W:
                pool = ready[action.stage]
                action = action._replace(microbatch=pool.pop(rng.randrange(len(pool))))
            out.append(action)
        ranks.append(out)
    return schedule.with_actions(ranks)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["zb-1p", "v-min", "v-half", "v-zb"]), p=st.integers(2, 5),
       m_factor=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_any_valid_w_order_becomes_the_b_order_with_the_same_run(name, p, m_factor, seed):
    paper = build_schedule(name, p, m_factor * p, variant="paper")
    shuffled = _shuffled_weights(paper, seed)
    validate(shuffled)
    fixed = weights_in_backward_order(shuffled)
    assert _out_of_order(fixed) == []
    validate(fixed)
    costs, memory = Costs.build(p, 1.0, 1.3, 0.6, 0.1), MemoryModel(1, -0.75, -0.25)
    _same_run(shuffled, fixed, costs, memory)
