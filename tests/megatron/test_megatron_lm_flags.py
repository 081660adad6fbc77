"""Megatron-LM flags that change how a pipeline schedule, its communication or its backward
runs, under the plugin's schedules, in Megatron-LM's own loop (scripts/pretrain_gpt_vshape.py
on 4 gloo processes, as tests/megatron/test_megatron_lm_e2e.py runs it).

The refusals themselves are unit-tested on an argument namespace (tests/megatron/test_megatron_lm_args.py,
PIPELINE_REFUSALS); here a few go through the script's real parse_args and validate_args, and
what runs on CPU is run against 1f1b on the same flags: activation recomputation (its
backward re-runs the forward). Multi-token prediction has its own tier
(tests/megatron/test_megatron_lm_mtp.py, every schedule of the plugin).
"""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("megatron.core")

from support.megatron_lm_launch import MEGATRON_LM, Launcher  # noqa: E402
from support.megatron_lm_tier import PP4, REL, SCRIPT  # noqa: E402
from support.megatron_lm_tier import TINY_GPT as TIER_GPT  # noqa: E402
from support.megatron_lm_probe import read_records  # noqa: E402

pytestmark = pytest.mark.e2e

if not (MEGATRON_LM / "megatron" / "training").is_dir():
    pytest.skip(f"Megatron-LM's training code is not at {MEGATRON_LM} (../shared/megatron-lm)",
                allow_module_level=True)

ITERS = 3
TINY_GPT = TIER_GPT + PP4
"""The tiers' tiny GPT at PP 4 (dropout off); fewer iterations than the tiers, which also
check resumes."""


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    launcher = Launcher()
    root = tmp_path_factory.mktemp("megatron-lm-flags")
    done = {}

    def run(name: str, flags: list, expect_ok: bool = True):
        if name not in done:
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)
            result = launcher.run(SCRIPT, TINY_GPT + flags, 4, folder / "logs",
                                  env={"VSHAPE_E2E_RECORD": str(folder)})
            if expect_ok:
                assert result.ok, f"run {name!r} failed:\n{result.failure()}"
            done[name] = (read_records(folder, 3) if result.ok else None), result
        return done[name]

    run.root = root
    yield run
    launcher.close()


@pytest.mark.parametrize("flags,needle", [
    (["--pipeline-schedule", "v-half", "--overlap-p2p-communication-warmup-flush"],
     "--pipeline-schedule v-half runs its own pass order: drop "
     "--overlap-p2p-communication-warmup-flush"),
    (["--pipeline-schedule", "zb-1p", "--cuda-graph-impl", "local"],
     "--pipeline-schedule zb-1p does not support CUDA graphs"),
    (["--pipeline-schedule", "v-min", "--defer-embedding-wgrad-compute"],
     "--pipeline-schedule v-min does not support --defer-embedding-wgrad-compute"),
    (["--pipeline-schedule", "zb-1p", "--hybrid-context-parallel"],
     "--pipeline-schedule zb-1p does not support --hybrid-context-parallel"),
])
def test_pipeline_flags_stop_at_parsing_with_the_flag_named(launch, flags, needle):
    """Through the script's real parse_args and validate_args: the run stops before
    torch.distributed is initialised, and says which flag to drop."""
    _, result = launch(f"refused-{abs(hash(tuple(flags)))}", flags, expect_ok=False)
    assert not result.ok
    log = result.log(0)
    assert needle in log, log[-2000:]
    assert "initializing torch distributed" not in log


RECOMPUTE = {
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
}


def _trained(launch, schedule: str, extra: list):
    start = launch.root / "init" / "checkpoint"
    launch("init", ["--pipeline-schedule", "1f1b", "--train-iters", "1", "--save", str(start),
                    "--save-interval", "1"])
    name = f"{schedule}-{'-'.join(extra).replace('--', '')}"
    return launch(name, ["--pipeline-schedule", schedule, "--load", str(start), "--finetune",
                         "--train-iters", str(ITERS), *extra])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("schedule", ["v-half", "zb-1p"])
@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_activation_recomputation_trains_like_1f1b(launch, schedule, recompute):
    """--recompute-granularity full (uniform, one layer) and selective: B re-runs the forward
    of the recomputed layers, W takes the weight gradients from what that re-run saved."""
    want, _ = _trained(launch, "1f1b", RECOMPUTE[recompute])
    got, result = _trained(launch, schedule, RECOMPUTE[recompute])
    assert got.iterations() == want.iterations() == list(range(1, ITERS + 1))
    assert all(event["skipped"] == 0 for event in got.train)
    report = {"loss": max(map(_rel, got.losses(), want.losses())),
              "grad_norm": max(map(_rel, got.grad_norms(), want.grad_norms())),
              "seconds": round(result.seconds, 1)}
    print(schedule, recompute, report)
    assert report["loss"] <= REL and report["grad_norm"] <= REL, report


PRECISION = {
    "bf16": ["--bf16"],
    "fp16": ["--fp16", "--initial-loss-scale", "512"],
}
"""Half precision on the CPU: bf16 (fp32 main grads, as Megatron-LM sets for bf16), and fp16
with dynamic loss scaling from 2^9 (megatron's default 2^32 overflows the first iterations,
which 1f1b skips too)."""
FP16_GRAD_NORM = 1e-3
"""fp16 under a V: rank 0 sums the squared norms of other parameters than 1f1b's rank 0 (both
ends of the model), so the global grad norm, and the clipping coefficient (--clip-grad 1.0,
active here), can differ in the last bit (the fp32 runs show it: grad norms 8e-8 apart, losses
equal). fp32 and bf16 main weights absorb that; fp16 weights round it to their 2^-11 (4.9e-4)
step, which the next iterations' grad norms show (measured: 1e-4 relative from iteration 3;
the same runs with --clip-grad 0 agree to the last bit but for one grad norm's last bit)."""


@pytest.mark.parametrize("schedule,precision", [("v-half", "bf16"), ("v-zb", "fp16"),
                                                ("zb-1p", "fp16")])
def test_half_precision_trains_like_1f1b(launch, schedule, precision):
    """From the fp32 initial checkpoint, cast on load: every iteration's loss and grad norm
    equal 1f1b's on the same flags (bf16, and fp16 under zb-1p: bit-identical; fp16 under a
    V: losses within REL, grad norms within FP16_GRAD_NORM), no skipped iteration."""
    want, _ = _trained(launch, "1f1b", PRECISION[precision])
    got, result = _trained(launch, schedule, PRECISION[precision])
    assert got.iterations() == want.iterations() == list(range(1, ITERS + 1))
    assert all(event["skipped"] == 0 for event in got.train + want.train)
    report = {"loss": max(map(_rel, got.losses(), want.losses())),
              "grad_norm": max(map(_rel, got.grad_norms(), want.grad_norms())),
              "seconds": round(result.seconds, 1)}
    print(schedule, precision, report)
    norm = FP16_GRAD_NORM if precision == "fp16" and schedule != "zb-1p" else REL
    assert report["loss"] <= REL and report["grad_norm"] <= norm, report
