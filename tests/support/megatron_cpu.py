"""The CPU shims live in the package (the CPU demo needs them too): re-exported for tests."""
from megatron_vshape.megatron.cpu import (SequenceParallelLayerNorm, allow_sequence_parallel_norms,  # noqa: F401
                                          install_cpu_shims)
