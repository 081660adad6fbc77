"""``vshape trial --example tiny``: the trial of a bundled tiny recipe on 4 CPU processes.

What CI runs, so the trial's whole path -- a launch command per schedule, Megatron-LM's real
``pretrain()`` loop, the step log on every rank, the report -- is exercised without a GPU: a
tiny GPT (8 layers of width 64, fp32, mock data) at PP 4 with 8 microbatches, on gloo
processes. The launcher is the test support's one-run mode of its fork server
(tests/support/megatron_lm_launch.py: it applies Megatron-LM's CPU patches, as a GPU-less
checkout needs, and imports torch and Megatron-LM once instead of four times), so the example
needs a repository checkout and Megatron-LM's training code ($MEGATRON_LM, else
../shared/megatron-lm beside the checkout, as the tests find it).

The width is 64 against a vocabulary of 128 so that the LM head and loss, which a V puts on
rank 0 and 1F1B on the last rank, keep few activations beside a rank's two layers: the
fullest ranks' measured ratio then stays near the simulator's, which counts layers only.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["TINY_RECIPE", "tiny_example"]

REPO = Path(__file__).resolve().parents[2]

TINY_RECIPE = (
    "--pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 16 "
    "--lr 1e-3 --min-lr 1e-4 --seed 1234 --attention-dropout 0 --hidden-dropout 0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --split 98,1,1 "
    "--transformer-impl local --no-gradient-accumulation-fusion --use-cpu-initialization "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --distributed-backend gloo --log-interval 1 "
    "--eval-interval 1000 --eval-iters 1 --num-workers 0 --pipeline-replan-after 1").split()
"""The tiny recipe's flags (dropout off: its random streams follow each rank's pass order).
``--pipeline-replan-after 1``: auto and the memory levels re-plan from the first iteration's
measurements, inside the trial's warm-up (megatron's 1F1B ignores it)."""


def tiny_example() -> tuple[list[str], dict, Path]:
    """(launch command, environment additions, working folder) of the tiny recipe; ValueError
    naming what is missing."""
    launcher = REPO / "tests" / "support" / "megatron_lm_launch.py"
    script = REPO / "scripts" / "pretrain_gpt_vshape.py"
    if not launcher.is_file() or not script.is_file():
        raise ValueError(f"--example tiny needs a megatron-vshape repository checkout (its "
                         f"tests/support CPU launcher and scripts/); {REPO} has none")
    paths = [str(REPO / "tests"), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "support.megatron_lm_launch", "--nproc", "4", str(script),
               *TINY_RECIPE]
    return command, env, REPO
