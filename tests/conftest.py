"""What many test files share: the H100 cost set and the memory model where B frees most of a
chunk, hypothesis's reproducible profile, a fixture that empties the schedule caches around a
test, and a guard that puts a test file that starts processes into its tier even where the file
does not say so.

The test tiers (the markers registered in pytest.ini) and the fast loop that leaves them out are
described in docs/design.md, "Tests". Test files import from here by module name
(``from conftest import H100``): pytest puts tests/ on the path for its conftest.
"""
import os

import pytest
from hypothesis import settings

from megatron_vshape.schedule import Costs, MemoryModel
from megatron_vshape.schedule.search.levels import clear_caches

settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("VSHAPE_HYPOTHESIS", "reproducible"))
"""Hypothesis draws the same examples on every run (and in CI) unless ``VSHAPE_HYPOTHESIS=
explore`` asks for fresh ones: a property that a random draw falsifies then fails a developer's
exploring run, not a submission's CI (stop 54's did: zb-1p under a model freeing at B, fixed in
search/levels.py's ``_fastest_zb``). Loaded here, before the test modules, whose ``@settings``
inherit it."""

H100 = "2,2.78,0.7,0.05"
"""F, B, W and the hop time of one pipeline stage measured on an H100, in the ``--costs`` form
(``parse_costs(H100, p)``): the real-cost setting that the search's measured claims cite."""

B_FREES = MemoryModel(1, -0.75, -0.25)
"""B frees three quarters of a chunk's activations and W the rest (``--memory-model
1,-0.75,-0.25``): what an H100 keeps for W."""


def h100_costs(ranks: int) -> Costs:
    """:data:`H100` for ``ranks`` ranks as :class:`Costs`."""
    return Costs.build(ranks, 2, 2.78, 0.7, 0.05)


@pytest.fixture
def fresh_caches():
    """The named levels' and searches' caches emptied before and after the test, so that it
    times (or monkeypatches) a search that really runs and leaves nothing patched behind."""
    clear_caches()
    yield
    clear_caches()


_TIER_OF_IMPORT = {"Launcher": ("support.megatron_lm_launch", "e2e"),
                   "run_gloo": ("megatron_vshape.runtime.launch", "gloo")}
"""A module-level import that starts processes, and the tier of every test in such a module."""


def pytest_collection_modifyitems(items):
    """Tests in a module that imports Megatron-LM's launcher are ``e2e``, in one that imports
    ``run_gloo`` ``gloo``, unless marked either already: so a new file that forgets its
    ``pytestmark`` still stays out of the fast loop."""
    for item in items:
        module = getattr(item, "module", None)
        if module is None or item.get_closest_marker("e2e") or item.get_closest_marker("gloo"):
            continue
        for name, (source, tier) in _TIER_OF_IMPORT.items():
            if getattr(vars(module).get(name), "__module__", None) == source:
                item.add_marker(tier)
                break
