"""The CPU shims live in the package (the CPU demo needs them too): re-exported for tests.

Importing this module prepares megatron imports for a CPU-only process (the triton stand-in
megatron-core >= 0.17 needs, ``typing.override`` on Python 3.11): test modules import it, or
call :func:`importorskip_megatron`, before their first megatron import, and so do the spawned
workers, which import it at the top of theirs.
"""
import pytest

from megatron_vshape.harness.cpu import (SequenceParallelLayerNorm,  # noqa: F401
                                          allow_sequence_parallel_norms, install_cpu_shims,
                                          prepare_cpu_imports)

prepare_cpu_imports()


def importorskip_megatron():
    """``pytest.importorskip("megatron.core")`` after the CPU import preparation: without it
    megatron-core 0.19 fails to import on CPU torch and every megatron test would be skipped
    instead of run."""
    return pytest.importorskip("megatron.core")
