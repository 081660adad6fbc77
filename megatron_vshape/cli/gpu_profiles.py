"""``vshape gpu-check``'s profile step: per-layer F, B, W and bytes of the paper's four models.

For each bundled paper model (``gpt-9.6b``, ``gpt-21b``, ``gpt-38.5b``, ``gpt-98.5b``) and
sequence length 1024 and 3072, one profile file ``cuda-<model>-s<S>.yaml`` with measurements at
TP 1, 2, 4, 8 (a TP shard's layer on one GPU, :func:`..harness.profiling.shard`), each file
recording the ``vshape profile`` command that measures it again and the machine. All shapes are
measured in one spawned process, smallest model first, until the time budget is spent: a
lent GPU's minutes are few. Commit the files into configs/profiles/.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..plan.model import load_model_config
from ..plan.profile_file import format_profile
from .profile import profile_command, profile_comment

__all__ = ["PAPER_MODELS", "SEQ_LENGTHS", "TENSOR_PARALLEL", "paper_requests",
           "profile_paper_layers"]

PAPER_MODELS = ("gpt-9.6b", "gpt-21b", "gpt-38.5b", "gpt-98.5b")
SEQ_LENGTHS = (1024, 3072)
TENSOR_PARALLEL = (1, 2, 4, 8)
_LAYERS, _ITERS, _WARMUP = 2, 5, 2
"""Two layers per stack (per-call overhead averages out; 98.5B's two TP-1 layers are 5 GB in
bf16), 5 timed iterations after 2 warm-up ones: about a second per shape on an H100."""


def paper_requests(device: str = "cuda") -> list[tuple]:
    """(ProfileRequest, file name, command) per model and sequence length, smallest first."""
    from ..harness.profiling import ProfileRequest

    out = []
    for name in PAPER_MODELS:
        model = load_model_config(name)
        for seq in SEQ_LENGTHS:
            file = f"{device}-{name}-s{seq}.yaml"
            args = argparse.Namespace(model=name, iters=_ITERS, warmup=_WARMUP, threads=1,
                                      no_head=False)
            # the command names the file where it is committed (docs/gpu-check.md)
            command = profile_command(args, seq, (1,), _LAYERS, device,
                                      f"configs/profiles/{file}",
                                      TENSOR_PARALLEL)
            request = ProfileRequest(model, seq, (1,), _LAYERS, _ITERS, _WARMUP, device,
                                     None if device == "cuda" else 1, True, TENSOR_PARALLEL)
            out.append((request, file, command))
    return out


def profile_paper_layers(out: Path, budget: float, device: str = "cuda") -> list[dict]:
    """Measure :func:`paper_requests` within ``budget`` seconds and write the profile files
    into ``out``; the report's entries for those written."""
    from ..harness.profiling import profile_models

    requests = paper_requests(device)
    profiles = profile_models([r for r, _, _ in requests], [c for _, _, c in requests], budget)
    entries = []
    for profile, (request, file, command) in zip(profiles, requests):
        (out / file).write_text(format_profile(profile, profile_comment(profile)))
        entries.append({"file": file, "model": request.model.name,
                        "seq_length": request.seq_length, "tp": list(TENSOR_PARALLEL),
                        "command": command})
    return entries
