"""V schedules on megatron-core GPTModel (local spec, fp32) vs megatron's own 1F1B, on gloo.

Every parameter starts from values that depend only on its global name, so the 1F1B and V
models (different layers per rank) are the same model. Each step's losses and every gradient
(summed over ranks by global name) must agree to 1e-5 (fp32); so far they agree exactly.
"""
import pytest

pytest.importorskip("megatron.core")

from megatron_vshape.runtime.launch import run_gloo  # noqa: E402
from support.megatron_workers import compare_runs  # noqa: E402

V_SCHEDULES = ("v-min", "v-half", "v-zb", "auto")
STEPS = 2


def _merge(values, name):
    """Per step: (losses from every rank, {global parameter name: grad})."""
    steps = []
    for s in range(STEPS):
        losses = [x for v in values for x in v[name][s]["losses"]]
        grads = {}
        for v in values:
            for key, grad in v[name][s]["grads"].items():
                assert key not in grads, f"{key} has a gradient on two ranks"
                grads[key] = grad
        steps.append((losses, grads))
    return steps


def _compare(p, layers, tied, microbatches=4):
    outcomes = run_gloo(compare_runs, p, V_SCHEDULES, layers, microbatches, STEPS, tied,
                        timeout=600)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[0].error
    values = [o.value for o in outcomes]
    return {name: _merge(values, name) for name in ("1f1b",) + V_SCHEDULES}


@pytest.fixture(scope="module")
def pp2_untied():
    return _compare(2, 4, tied=False)


@pytest.fixture(scope="module")
def pp4_tied():
    return _compare(4, 8, tied=True)


@pytest.mark.parametrize("fixture", ["pp2_untied", "pp4_tied"])
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_losses_and_gradients_equal_megatrons_1f1b(fixture, name, request):
    runs = request.getfixturevalue(fixture)
    for (ref_losses, ref_grads), (losses, grads) in zip(runs["1f1b"], runs[name]):
        assert len(losses) == len(ref_losses) == 4
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
        assert set(grads) == set(ref_grads)
        for key, grad in grads.items():
            assert (grad - ref_grads[key]).abs().max().item() < 1e-5, key
