"""Profiled costs per stage: a heavy chunk (rank 0's chunk 1 under a V: the LM head and the
loss) stays heavy in the Costs that ``auto`` re-plans from, instead of being averaged over the
rank's two chunks. One process (a gloo world of one for the re-planner's reductions)."""
import pytest
import torch
import torch.distributed as dist

from megatron_vshape.megatron.replan import Replanner
from megatron_vshape.runtime.profile import PassProfile, stage_costs_of
from megatron_vshape.schedule import Action, Costs, Layout, PassKind, Placement, build_schedule

P4 = Placement(4, Layout.V)
HEAD = 3.0
"""Rank 0's chunk 1 (stage 7) runs this many times as long as a layer stage."""


def _profiles() -> dict[int, PassProfile]:
    """Each rank's profile of two steps: every stage's passes F 0.1, B 0.2, W 0.3 seconds,
    stage 7's F and B HEAD times that (its W: the head's weight gradient, the same)."""
    profiles = {}
    for rank in range(4):
        profile = PassProfile()
        for _ in range(2):
            timeline = []
            for chunk in range(2):
                stage = P4.stage_of(rank, chunk)
                scale = HEAD if stage == 7 else 1.0
                for kind, base in ((PassKind.F, 0.1), (PassKind.B, 0.2), (PassKind.W, 0.3)):
                    seconds = base * (scale if kind is not PassKind.W else 1.0)
                    timeline.append((Action(kind, stage, 0), 1.0, 1.0 + seconds))
            profile.add(timeline)
        profiles[rank] = profile
    return profiles


def test_a_heavy_chunk_stays_heavy_in_the_gathered_costs():
    by_rank = {r: p.measured_stages() for r, p in _profiles().items()}
    assert by_rank[0][7] == pytest.approx((0.3, 0.6, 0.3))
    costs = stage_costs_of(P4, by_rank, comm=0.01)
    rank0 = costs.pass_times(P4)[0]
    assert rank0[1].forward == pytest.approx(HEAD * rank0[0].forward)  # chunk 1: the head
    assert rank0[1].backward == pytest.approx(HEAD * rank0[0].backward)
    assert [t.forward for t in costs.pass_times(P4)[2]] == pytest.approx([0.1, 0.1])
    assert costs.forward[0] == pytest.approx(0.1 + HEAD * 0.1)  # the rank's share: its sum
    assert costs.comm == 0.01


def test_stages_measured_on_the_wrong_rank_or_missing_are_refused():
    by_rank = {r: p.measured_stages() for r, p in _profiles().items()}
    with pytest.raises(ValueError, match="no pipeline rank measured stages \\[1, 6\\]"):
        stage_costs_of(P4, {r: s for r, s in by_rank.items() if r != 1})
    with pytest.raises(ValueError, match="pipeline rank 1 measured stage 0, which the v layout"):
        stage_costs_of(P4, {**by_rank, 1: by_rank[0]})


class _GatheredProfile:
    """What PassProfile.gather_costs returns on every pipeline rank (the all-gather itself
    needs the pipeline's ranks; tests/megatron/test_megatron_gloo.py runs it)."""

    def __init__(self, costs):
        self.costs = costs

    def gather_costs(self, placement, rank, group=None):
        return self.costs


@pytest.fixture
def world_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.gloo  # a process group, if only of one, in this process (about 1 s)
def test_replanner_passes_per_stage_costs_to_the_search(world_of_one, monkeypatch):
    """The re-planner's agreed costs keep stage 7 heavy, and the search plans from them."""
    measured = stage_costs_of(P4, {r: p.measured_stages() for r, p in _profiles().items()})
    monkeypatch.setattr("megatron_vshape.megatron.replan.measure_hop_latency",
                        lambda *args, **kwargs: 0.002)
    spec = type("Spec", (), {"shape": (2, 2), "dtype": torch.float32, "wire_device": "cpu"})
    schedule = build_schedule("v-half", 4, 8)
    replanner = Replanner(after=1)
    costs = replanner.measured(_GatheredProfile(measured), schedule, 0, None, None, spec)
    assert replanner.done and costs.stages is not None
    assert [t.forward for t in costs.stage_times(P4)] == pytest.approx(
        [t.forward for t in measured.stage_times(P4)])
    assert costs.stage_times(P4)[7].backward == pytest.approx(HEAD * 0.2)
    assert costs.comm == 0.002
    planned = build_schedule("auto", 4, 8, costs=costs, memory_limit=3.0)
    assert planned.placement == P4


class _BadProfile:
    """A profile whose measured times are not times (a failed timer): what gather_costs raises
    on every rank of that pipeline."""

    def gather_costs(self, placement, rank, group=None):
        return Costs.for_stages(placement, [1.0] * 8, [1.0] * 7 + [float("nan")], [1.0] * 8)


@pytest.mark.gloo  # a process group of one in this process (about 1 s)
def test_a_replan_from_measurements_that_are_not_times_keeps_the_schedule(world_of_one,
                                                                          monkeypatch, caplog):
    """The rank that measured NaN still joins the all-reduce (with NaN, so every rank's mean
    is NaN and every rank falls back alike), re-planning stops, and the log says why."""
    monkeypatch.setattr("megatron_vshape.megatron.replan.measure_hop_latency",
                        lambda *args, **kwargs: 0.002)
    spec = type("Spec", (), {"shape": (2, 2), "dtype": torch.float32, "wire_device": "cpu"})
    replanner = Replanner(after=1)
    with caplog.at_level("WARNING", logger="megatron_vshape.megatron.replan"):
        costs = replanner.measured(_BadProfile(), build_schedule("v-half", 4, 8), 0, None, None,
                                   spec)
    assert costs is None and replanner.done and not replanner.profiling
    assert replanner.memory is None and replanner.activation_bytes is None
    assert "pipeline rank 0 measured costs: every backward (B) time must be a finite" in \
        caplog.text and "not re-planning" in caplog.text
