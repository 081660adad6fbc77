"""CPU stand-in of NVIDIA Transformer Engine v2.11 for the test tiers (see ../README.md).

TE v2.11 transformer_engine/__init__.py:68 sets ``__version__`` from the installed
distribution's metadata; the stand-in has none, so it states the version it imitates. megatron
reads ``te.__version__`` first (megatron-core 0.16.1 core/utils.py:326-332, 0.19.2
core/utils.py:309-315, cached in ``_te_version``) and takes its TE >= 2.x code paths from it.
"""
__version__ = "2.11.0"
STAND_IN = True
"""Marks this package as the test stand-in (support.te_stand_in_path checks it)."""

from . import common  # noqa: E402,F401  (TE v2.11 transformer_engine/__init__.py:11)
from . import pytorch  # noqa: E402,F401  (:13-14)
