"""megatron glue in one process: installation, configuration errors, the mirrored rank."""
import types

import pytest

pytest.importorskip("torch")
from support.megatron_cpu import importorskip_megatron  # noqa: E402

importorskip_megatron()
pytestmark = pytest.mark.megatron_versions  # all of it: one process, seconds, and the gloo guard

import megatron.core.pipeline_parallel as pipeline_parallel  # noqa: E402
import megatron.core.pipeline_parallel.schedules as schedules  # noqa: E402

import megatron_vshape  # noqa: E402
from megatron_vshape.megatron.forward_backward import VShapeForwardBackward  # noqa: E402
from megatron_vshape.megatron.install import VShapeConfig  # noqa: E402
from megatron_vshape.megatron.model import MirroredGroup, check_v_config  # noqa: E402
from megatron_vshape.schedule import ScheduleError, simulate  # noqa: E402


def test_install_is_idempotent_reversible_and_delegates():
    original = schedules.get_forward_backward_func
    try:
        megatron_vshape.install(schedule="v-half")
        megatron_vshape.install(schedule="v-min")  # replaces the configuration, not the original
        for module in (schedules, pipeline_parallel):
            fb = module.get_forward_backward_func(4, None)
            assert isinstance(fb, VShapeForwardBackward) and fb.schedule == "v-min"
            assert module.get_forward_backward_func(1, None) is original(1, None)
        megatron_vshape.install(schedule="1f1b")  # megatron's own everywhere
        assert schedules.get_forward_backward_func(4, None) is original(4, None)
    finally:
        megatron_vshape.uninstall()
    assert schedules.get_forward_backward_func is original
    assert pipeline_parallel.get_forward_backward_func is original


def test_wrapper_reads_the_pipeline_size_of_019s_schedule_pg_collection():
    """Megatron-LM 0.19's loop calls get_forward_backward_func(schedule_pg_collection=...)
    with no sizes: the V schedule is chosen by that collection's pipeline group, and a
    multi-module collection (no single pipeline) is refused by name."""
    pipeline = types.SimpleNamespace(pp=types.SimpleNamespace(size=lambda: 4))
    multi = types.SimpleNamespace(module_pgs={})
    try:
        megatron_vshape.install(schedule="v-half")
        fb = schedules.get_forward_backward_func(schedule_pg_collection=pipeline)
        assert isinstance(fb, VShapeForwardBackward) and fb.schedule == "v-half"
        with pytest.raises(ValueError, match="SimpleNamespace \\(multi-module pipeline\\): use "
                                             "--pipeline-schedule 1f1b"):
            schedules.get_forward_backward_func(schedule_pg_collection=multi)
    finally:
        megatron_vshape.uninstall()


def test_bad_settings_name_the_setting_and_the_choices():
    with pytest.raises(ValueError, match="valid choices: 1f1b"):
        VShapeConfig(schedule="v-quarter")
    with pytest.raises(ValueError, match="timeout"):
        VShapeConfig(schedule="v-half", timeout=0)
    config = types.SimpleNamespace(num_layers=14, pipeline_model_parallel_layout=None,
                                   num_layers_in_first_pipeline_stage=None,
                                   num_layers_in_last_pipeline_stage=None)
    config.num_layers = 6
    with pytest.raises(ValueError, match="num_layers >= 8"):
        check_v_config(config, 4)
    config.num_layers = 14
    check_v_config(config, 4)  # 14 layers: rank 0's chunks hold one layer less
    with pytest.raises(ValueError, match="pipeline_model_parallel_size >= 2"):
        check_v_config(config, 1)
    config.num_layers, config.pipeline_model_parallel_layout = 8, "Et|tL"
    with pytest.raises(ValueError, match="pipeline_model_parallel_layout"):
        check_v_config(config, 4)
    config.pipeline_model_parallel_layout = None
    check_v_config(config, 4, stage_layers=(0, 2, 1, 1, 1, 1, 1, 1))  # stage_layout.py's
    with pytest.raises(ValueError, match="must give the V's 2 x 4 stages num_layers=8"):
        check_v_config(config, 4, stage_layers=(1,) * 7)
    config.num_layers_in_first_pipeline_stage = 1
    with pytest.raises(ValueError, match="pass stage_layers"):
        check_v_config(config, 4)


def test_forward_backward_checks_chunks_and_microbatches_before_work():
    fb = VShapeForwardBackward("v-half")
    config = types.SimpleNamespace(calculate_per_token_loss=False)
    with pytest.raises(ValueError, match="needs 2 model chunk"):
        fb.schedule_for(4, 8, 1, 1, config)
    with pytest.raises(ScheduleError, match="microbatches"):
        fb.schedule_for(4, 0, 2, 2, config)
    with pytest.raises(ValueError, match="replan_after re-plans auto and the fastest variant"):
        VShapeForwardBackward("v-half", replan_after=3, variant="paper")
    with pytest.raises(ValueError, match="unknown schedule variant 'best'; valid choices: fastest, paper"):
        VShapeForwardBackward("v-half", variant="best")
    assert VShapeForwardBackward("v-half", replan_after=3).replan_after == 3  # a memory level
    with pytest.raises(ScheduleError, match="memory_limit must be a number with a unit"):
        VShapeForwardBackward("auto", memory_limit="40 bananas")


def test_auto_under_a_byte_limit_starts_as_v_min_until_measured():
    """A limit in bytes cannot be converted to units before a unit's bytes are measured, so
    the profiled iterations run the smallest-memory schedule; a fraction converts at once."""
    config = types.SimpleNamespace(calculate_per_token_loss=False)
    fb = VShapeForwardBackward("auto", memory_limit="2GiB", replan_after=2)
    assert fb.schedule_for(4, 8, 2, 2, config).name == "v-min"
    measured = VShapeForwardBackward("auto", memory_limit="2GiB", replan_after=2)
    measured.replanner.activation_bytes = 1 * 2**30  # as measured: 1 GiB per unit -> 2 units
    found = measured.schedule_for(4, 8, 2, 2, config)
    assert found.name == "auto" and simulate(found).peak_memory_max <= 2.0 + 1e-9
    half = VShapeForwardBackward("auto", memory_limit="0.5").schedule_for(4, 8, 2, 2, config)
    assert simulate(half).peak_memory_max <= 2.0 + 1e-9


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1e-3])
def test_a_replan_from_measured_costs_that_are_not_times_keeps_the_running_schedule(
        bad, caplog, monkeypatch):
    """A measured NaN, infinity or zero (a failed timer) must not build a schedule: the run
    goes on with the schedule it trained with, and the log says why. Good measurements do
    re-plan (the same path, so the check is what stops the bad ones)."""
    from megatron_vshape.megatron.replan import Replanner
    from megatron_vshape.schedule import Layout, Placement

    v2 = Placement(2, Layout.V)
    good = Replanner.agreed_costs(v2, [1.0] * 4, [1.0] * 4, [1.0] * 4, 0.01)
    assert good is not None and good.comm == 0.01
    with caplog.at_level("WARNING", logger="megatron_vshape.megatron.replan"):
        assert Replanner.agreed_costs(v2, [1.0] * 4, [1.0, bad, 1.0, 1.0], [1.0] * 4, 0.0) is None
    assert "not re-planning: the measured costs: every backward (B) time must be a finite " \
           "number > 0" in caplog.text and "keeping the schedule" in caplog.text

    config = types.SimpleNamespace(calculate_per_token_loss=False)
    for measured, replanned in ((None, False), (good, True)):
        fb = VShapeForwardBackward("auto", memory_limit="0.5", replan_after=1)
        running = fb.schedule_for(2, 4, 2, 2, config)
        monkeypatch.setattr(fb, "_stream_groups", lambda schedule, pg: None)
        monkeypatch.setattr(fb.replanner, "measured", lambda *args: measured)
        fb._replan(running, types.SimpleNamespace(pp=types.SimpleNamespace(rank=lambda: 0)),
                   None)
        assert (fb.costs is good) == replanned
        assert (fb._schedules == {}) == replanned  # kept: the next step runs it again
        if not replanned:
            assert fb.schedule_for(2, 4, 2, 2, config) is running


def test_mirrored_group_reports_the_v_rank():
    group = types.SimpleNamespace(rank=lambda: 1, size=lambda: 4, name="pp")
    mirrored = MirroredGroup(group)
    assert (mirrored.rank(), mirrored.size(), mirrored.name) == (2, 4, "pp")


def test_parallel_state_reports_a_v_chunks_placement_while_it_is_built():
    """What megatron's placement queries read while build_v_chunk builds a chunk (the mirrored
    rank, two chunks per rank: MTP and the layer specs ask parallel_state), and the previous
    settings back afterwards, an error inside included."""
    from megatron.core import parallel_state as ps

    from megatron_vshape.megatron.model import parallel_state_reports

    before = ps.get_virtual_pipeline_model_parallel_world_size()
    with pytest.raises(RuntimeError):
        with parallel_state_reports(3):
            assert ps.get_pipeline_model_parallel_rank() == 3
            assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
            assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
            raise RuntimeError("a failing build")
    assert getattr(ps, "_MPU_PIPELINE_MODEL_PARALLEL_RANK") is None
    assert ps.get_virtual_pipeline_model_parallel_world_size() == before


def test_uneven_layers_come_from_rank_0_first():
    from megatron_vshape.megatron.layers import stage_layers

    assert stage_layers(14, 4) == (1, 2, 2, 2, 2, 2, 2, 1)
    assert stage_layers(13, 4) == (1, 1, 2, 2, 2, 2, 2, 1)
    assert stage_layers(16, 4) == (2,) * 8
    assert sum(stage_layers(30, 4)) == 30


# -- checkpoints across schedules (megatron/checkpoints.py) -------------------------------------
def _ns(**fields):
    return types.SimpleNamespace(**fields)


@pytest.mark.parametrize("args,layout", [
    (_ns(pipeline_schedule="v-half", virtual_pipeline_model_parallel_size=2), "v"),
    (_ns(pipeline_schedule="auto", virtual_pipeline_model_parallel_size=2), "v"),
    (_ns(pipeline_schedule="zb-1p", virtual_pipeline_model_parallel_size=None), "single"),
    (_ns(pipeline_schedule="interleaved-1f1b", virtual_pipeline_model_parallel_size=2), "loop"),
    (_ns(virtual_pipeline_model_parallel_size=None), "single"),  # plain pretrain_gpt.py
    (_ns(virtual_pipeline_model_parallel_size=3), "loop"),
])
def test_checkpoint_layouts(args, layout):
    from megatron_vshape.megatron.checkpoints import layout_of

    assert layout_of(args) == layout


def test_dp_reshardable_optimizer_state_of_another_layout_is_refused():
    from megatron_vshape.megatron.checkpoints import check_optimizer_layout

    saved = _ns(virtual_pipeline_model_parallel_size=None)  # megatron's own pretrain_gpt.py
    run = "v-min"  # the installed schedule
    with pytest.raises(ValueError, match=r"--pipeline-schedule 1f1b \(single layout\).*v-min "
                                         r"builds other buckets.*--no-load-optim"):
        check_optimizer_layout(saved, "dp_reshardable", run, "ckpt/iter_0000002")
    # same layout, a reshardable format, or no distributed-optimizer state: nothing to refuse
    check_optimizer_layout(_ns(pipeline_schedule="v-zb"), "dp_reshardable", run, "x")
    check_optimizer_layout(saved, "fully_reshardable", run, "x")
    check_optimizer_layout(saved, "fully_sharded_model_space", run, "x")
    check_optimizer_layout(saved, None, run, "x")
    check_optimizer_layout(_ns(pipeline_schedule="zb-1p"), "dp_reshardable", "1f1b", "x")


def test_the_vs_embedding_copy_is_a_replica_that_is_never_made_main():
    """replicas.py: chunk 1's copy of the embedding (megatron's replica (1, 0, dp)) becomes a
    factory; what it builds, for the model and for megatron's optimizer state alike, stays
    non-main when the fully parallel save makes it main, and what it loads is its own tensor.
    Other entries, and the main replica of the same data, are left as megatron made them."""
    import pickle

    import torch
    from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                          apply_factories, is_main_replica)
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megatron_vshape.megatron.replicas import NonMainReplica, replica_entries

    copy_, embedding, other = (torch.nn.Parameter(torch.ones(4, 2)),
                               torch.nn.Parameter(torch.ones(4, 2)),
                               torch.nn.Parameter(torch.zeros(3)))
    key = "embedding.word_embeddings.weight"
    made = {"output_layer.weight": ShardedTensor.from_rank_offsets(key, copy_,
                                                                   replica_id=(1, 0, 1)),
            # chunk 0's, on data-parallel rank 1: not main either, but not the copy
            "embedding": ShardedTensor.from_rank_offsets(key, embedding, replica_id=(0, 0, 1)),
            "nested": [ShardedTensor.from_rank_offsets("b", other, replica_id=(1, 0, 0)),
                       ShardedTensor.from_rank_offsets(key, copy_, replica_id=(0, 0, 0))]}
    marked = replica_entries(made, copy_)
    factory = marked["output_layer.weight"]
    assert isinstance(factory, ShardedTensorFactory) and factory.data is copy_
    assert marked["embedding"] is made["embedding"]
    assert marked["nested"][0] is made["nested"][0] and marked["nested"][1] is made["nested"][1]
    assert type(made["output_layer.weight"]) is ShardedTensor  # out of place

    state = make_sharded_optimizer_tensor(factory, torch.full((4, 2), 3.0),
                                          "optimizer.state.exp_avg")
    for entry, want_key in ((factory, key), (state, f"optimizer.state.exp_avg.{key}")):
        built = {"x": entry}
        apply_factories(built)
        replica = built["x"]
        assert type(replica) is NonMainReplica and replica.key == want_key
        assert replica.replica_id == (1, 0, 1) and replica.global_shape == (4, 2)
        replica.replica_id = 0  # what the fully parallel save does on the rank it picks
        assert not is_main_replica(replica.replica_id)
        replica.replica_id = 1
        assert replica.replica_id == 1
        again = pickle.loads(pickle.dumps(replica.without_data()))  # as ranks exchange them
        assert type(again) is NonMainReplica and again.replica_id == 1
        loaded = torch.arange(8.0).reshape(4, 2)
        merged = entry.merge_fn(loaded)
        assert torch.equal(merged, loaded) and merged is not loaded


# -- megatron's own schedules refuse V chunks (install.py) --------------------------------------
def test_v_marker_is_found_through_wrappers():
    import torch

    from megatron_vshape.megatron.model import V_PLACED, is_v_placed

    chunk = torch.nn.Linear(2, 2)
    assert not is_v_placed(chunk)
    setattr(chunk, V_PLACED, True)
    wrapper = types.SimpleNamespace(module=types.SimpleNamespace(module=chunk))  # DDP(Float16)
    assert is_v_placed(chunk) and is_v_placed(wrapper)


@pytest.mark.gloo
def test_megatrons_schedules_refuse_v_chunks_while_installed():
    """A loop reaching megatron's interleaved (or 1F1B, or no-pipelining) function by a name
    install() does not wrap fails naming the problem, instead of running the interleaved order
    on V-placed chunks; standard chunks still run, and uninstall() removes the guard."""
    from megatron_vshape.runtime.launch import run_gloo
    from support.megatron_workers import megatron_schedules_on_v_chunks

    outcomes = run_gloo(megatron_schedules_on_v_chunks, 2, timeout=300)
    failed = [o for o in outcomes if not o.ok]
    assert not failed, failed[0].error
    for outcome in outcomes:
        errors = outcome.value["errors"]
        assert set(errors) == {"forward_backward_pipelining_with_interleaving",
                               "forward_backward_pipelining_without_interleaving",
                               "forward_backward_no_pipelining"}
        for name, error in errors.items():
            assert error is not None, f"{name} ran on V chunks"
            assert error.startswith("VPlacementError: megatron's own " + name), error
            assert "V-placed model chunks" in error and "get_forward_backward_func" in error
        assert outcome.value["restored"]
    assert len(outcomes[1].value["losses"]) == 4  # 1F1B's last rank: one loss per microbatch


def test_a_stage_whose_forwards_are_out_of_order_is_refused_before_any_pass():
    """Each F calls next() on its chunk's data iterator and the F of microbatch 0 carries
    megatron's first-microbatch flag (Transformer Engine recasts cached FP8 weights there):
    both need a stage's forwards in microbatch order. Every built schedule has them so; one
    that does not is refused when the rank's passes are set up, naming the pass."""
    from megatron_vshape.megatron.compute import MegatronStages
    from megatron_vshape.schedule.model.actions import PassKind
    from megatron_vshape.schedule.registry import build_schedule

    import torch

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    schedule = build_schedule("v-half", 2, 4)
    MegatronStages(schedule, 0, chunks, None, [None, None], None)
    order = list(schedule.rank_actions[0])
    first, second = [i for i, a in enumerate(order)
                     if a.kind is PassKind.F and a.stage == 0][:2]
    order[first], order[second] = order[second], order[first]
    swapped = schedule.with_actions([order] + list(schedule.rank_actions[1:]))
    with pytest.raises(ValueError, match=r"before stage 0's microbatch 0"):
        MegatronStages(swapped, 0, chunks, None, [None, None], None)


@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("sequence_parallel,shape", [(False, (16, 2, 8)), (True, (8, 2, 8))])
def test_message_spec_has_the_largest_messages_shape_under_variable_lengths(
        variable, sequence_parallel, shape):
    """megatron-core 0.19 on answers ``[()]`` from get_tensor_shapes for variable sequence
    lengths; the spec then still has the largest message's shape (seq 32 over CP 2, over TP 2
    with sequence parallel; what re-planning measures a hop with), messages carry their own,
    and the caller's config is left as it is."""
    from megatron_vshape.megatron.forward_backward import message_spec

    config = types.SimpleNamespace(variable_seq_lengths=variable, hidden_size=8,
                                   sequence_parallel=sequence_parallel, pipeline_dtype=None)
    before = dict(vars(config))
    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 2),
                               cp=types.SimpleNamespace(size=lambda: 2))
    spec = message_spec(config, pg, seq_length=32, micro_batch_size=2, decoder_seq_length=None,
                        adjust=None, device="cpu")
    assert spec.shape == shape and spec.variable is variable
    assert vars(config) == before
