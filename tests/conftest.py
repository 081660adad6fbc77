"""What many test files share: the H100 cost set and the memory model where B frees most of a
chunk, and a fixture that empties the schedule caches around a test.

The test tiers (the markers registered in pytest.ini) and the fast loop that leaves out the slow
ones are described in docs/design.md, "Tests". Test files import from here by module name
(``from conftest import H100``): pytest puts tests/ on the path for its conftest.
"""
import pytest

from megatron_vshape.schedule import Costs, MemoryModel
from megatron_vshape.schedule.search.levels import clear_caches

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
