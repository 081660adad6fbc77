"""The planner's activation-memory predictions vs megatron-core, measured (tier 2, CPU, gloo).

The bundled tiny model (fp32, local spec, no flash attention) runs under megatron's own 1F1B
and the plugin's V schedules; every rank's peak bytes kept for backward (saved tensors and what
W keeps, :class:`megatron_vshape.runtime.memory.ActivationTracker`) is compared with
:mod:`megatron_vshape.plan.memory`'s prediction for that rank. Issue 6 asks for 20%; the
formulas are term-by-term, so they land within a few percent (what is left: small tensors the
formulas ignore, e.g. the causal mask and layernorm statistics), and the test holds them to 5%
so a formula that drifts shows.
"""
import pytest

pytest.importorskip("torch")
from support.megatron_cpu import importorskip_megatron  # noqa: E402

importorskip_megatron()

from megatron_vshape.plan import load_model_config  # noqa: E402
from megatron_vshape.plan.candidates import GridPoint  # noqa: E402
from megatron_vshape.plan.evaluate import Evaluator  # noqa: E402
from megatron_vshape.plan.settings import ClusterConfig, TrainingConfig  # noqa: E402
from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support.plan_workers import measure_peaks  # noqa: E402

pytestmark = pytest.mark.gloo

MODEL = load_model_config("tiny")
MICRO_BATCH = 2
ISSUE_TOLERANCE = 0.20
TOLERANCE = 0.05


def _measured(world, schedules, microbatches, tp=1, sequence_parallel=False, dropout=0.0):
    outcomes = run_gloo(measure_peaks, world, schedules, MODEL, microbatches, MICRO_BATCH, tp,
                        sequence_parallel, dropout, timeout=600)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[0].error
    out = {}
    for name in schedules:
        per_rank = {}
        for o in outcomes:
            pp_rank, tp_rank, peak = o.value[name]
            per_rank.setdefault(pp_rank, set()).add(peak)
        # tensor-parallel ranks of a pipeline rank keep the same bytes
        assert all(len(v) == 1 for v in per_rank.values()), per_rank
        out[name] = [per_rank[r].pop() for r in sorted(per_rank)]
    return out


def _predicted(name, pp, microbatches, tp=1, sequence_parallel=False, dropout=False,
               recompute="none"):
    training = TrainingConfig(MODEL.seq_length, MICRO_BATCH * microbatches, precision="fp32",
                              flash_attention=False, sequence_parallel=sequence_parallel,
                              distributed_optimizer=False, dropout=dropout,
                              dropout_mask_bytes=4)  # CPU torch keeps fp32 dropout masks
    evaluator = Evaluator(MODEL, training, ClusterConfig(pp * tp, 1000.0))
    point = GridPoint(1, tp, pp, MICRO_BATCH, microbatches)
    row = evaluator.evaluate(point, name, recompute)
    assert row.feasible, row.reason
    # the tracker sees saved tensors: the planner's kept bytes, without the passes' scratch
    kept = evaluator.activation_bytes(point, evaluator.schedule(name, pp, microbatches),
                                      workspace=False, recompute=recompute)
    assert all(a >= b for a, b in zip(row.activation_bytes_per_rank, kept))
    return kept


def _check(measured, predicted):
    ratios = [p / m for p, m in zip(predicted, measured)]
    assert len(ratios) == len(measured)
    assert all(abs(r - 1) <= ISSUE_TOLERANCE for r in ratios), ratios
    assert all(abs(r - 1) <= TOLERANCE for r in ratios), ratios


@pytest.fixture(scope="module")
def pp4_dropout():
    """PP = 4, 8 microbatches, dropout 0.1 (masks and the attention dropout's output)."""
    return _measured(4, ("1f1b", "v-half", "v-min"), 8, dropout=0.1)


@pytest.mark.parametrize("name", ["1f1b", "v-half", "v-min"])
def test_pp4_activation_bytes_per_rank_match_megatron(pp4_dropout, name):
    _check(pp4_dropout[name], _predicted(name, 4, 8, dropout=True))


def test_pp4_v_half_holds_less_than_1f1b_on_rank_0(pp4_dropout):
    """What the planner relies on, measured: the V halves the first rank's memory."""
    assert pp4_dropout["v-half"][0] < 0.85 * pp4_dropout["1f1b"][0]


RECOMPUTED = (("1f1b", "full"), ("1f1b", "selective"), ("v-half", "selective"))


@pytest.fixture(scope="module")
def pp4_recomputed():
    """PP = 4, 8 microbatches, dropout 0.1, megatron's recomputation (the paper's 1F1B-R and
    selective recomputation of the attention core)."""
    return _measured(4, RECOMPUTED, 8, dropout=0.1)


@pytest.mark.parametrize("name, recompute", RECOMPUTED)
def test_recomputation_bytes_per_rank_match_megatron(pp4_recomputed, name, recompute):
    """Kept layer inputs (full) or everything but the attention core (selective), plus the
    replay while a B runs: under the B/W split the replay comes after B has added the MLP's
    output gradients for W, which the fused backward frees instead."""
    _check(pp4_recomputed[(name, recompute)],
           _predicted(name, 4, 8, dropout=True, recompute=recompute))


def test_full_recomputation_keeps_a_fraction_of_1f1b(pp4_dropout, pp4_recomputed):
    """What 1F1B-R is for, measured: it keeps far less than 1F1B on every rank."""
    assert all(r < 0.5 * n for r, n in zip(pp4_recomputed[("1f1b", "full")], pp4_dropout["1f1b"]))


def test_tp2_sequence_parallel_activation_bytes_match_megatron():
    """TP = 2 x PP = 2: every term divided by TP, W keeping gathered output gradients."""
    measured = _measured(4, ("1f1b", "v-half"), 4, tp=2, sequence_parallel=True)
    for name in ("1f1b", "v-half"):
        _check(measured[name], _predicted(name, 2, 4, tp=2, sequence_parallel=True))
