"""Runtime pieces in one process: W deferral, memory tracking, receive posting, config errors."""
import gc

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from torch import nn

from megatron_vshape.runtime import (ActivationTracker, DeferredLinear, PipelineRunner,
                                     RunnerConfig, WeightGradStore, defer_linear_weight_grads)
from megatron_vshape.runtime.backward import deallocate, run_backward
from megatron_vshape.runtime.interpreter import receive_posting_points
from megatron_vshape.runtime.p2p import TensorSpec, Transport
from megatron_vshape.runtime.streams import route_of
from megatron_vshape.runtime.toy import ToyModel, build_layers, make_batch, reference_step
from megatron_vshape.schedule import SCHEDULES, PassKind, ValidationError, build_schedule, lower
from megatron_vshape.schedule.model.lower import message_of


def _model(kind="transformer"):
    return build_layers(ToyModel(kind=kind, layers=2))


def test_deferred_linear_gradients_equal_nn_linear_and_wait_for_w():
    ref, model = _model(), _model()
    store = WeightGradStore()
    assert defer_linear_weight_grads(model, store) == 8  # 4 linears per transformer block
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    reference_step(ref, [(x, torch.zeros(3, 5, dtype=torch.float64))])
    out = nn.Sequential(*model)(x)
    loss = torch.nn.functional.mse_loss(out.sum(-1), torch.zeros(3, 5, dtype=torch.float64))
    with store.collecting(0):
        loss.backward()
    deferred = [n for n, p in model.named_parameters() if n.endswith("weight") and p.grad is None]
    assert len(deferred) == 8 and all("norm" not in n for n in deferred)  # norms: grads in B
    assert store.pending == [0] and store.run(0) == 8 and store.pending == []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-12, name


def test_deferral_keeps_parameter_objects_and_names():
    model = _model("mlp")
    before = dict(model.named_parameters())
    defer_linear_weight_grads(model, WeightGradStore())
    assert isinstance(model[0].linear, DeferredLinear)
    assert dict(model.named_parameters()) == before  # same names, same Parameter objects


def test_store_runs_now_outside_collecting_and_refuses_nesting():
    store, ran = WeightGradStore(), []
    store.defer(lambda: ran.append(1))
    assert ran == [1] and store.pending == []
    with store.collecting(3):
        store.defer(lambda: ran.append(2))
        with pytest.raises(RuntimeError, match="already collecting"):
            with store.collecting(4):
                pass
    assert ran == [1] and store.pending == [3]
    store.run(3)
    assert ran == [1, 2]


def test_tracker_counts_storages_once_skips_parameters_and_holds_no_reference():
    weight = nn.Parameter(torch.ones(4, 4))
    tracker = ActivationTracker([weight])
    x = torch.ones(8, 4)  # 128 bytes
    with tracker.saved_tensors_hooks():
        y = (x @ weight).sin()  # saves x, weight (skipped), x @ weight
        z = x[:2] * 3  # a view of x: same storage, counted once
    assert tracker.live == 128 + 128 and tracker.peak == 256
    del x, y, z
    gc.collect()
    assert tracker.live == 0 and tracker.peak == 256
    tracker.reset_peak()
    assert tracker.peak == 0


def test_backward_leftover_is_what_b_keeps_per_chunk():
    from megatron_vshape.runtime import backward_leftover
    from megatron_vshape.schedule import Action, Layout, Placement

    placement = Placement(2, Layout.V)  # rank 0 holds stages 0 (chunk 0) and 3 (chunk 1)
    F, B = PassKind.F, PassKind.B
    passes = [(Action(F, 0, 0), 100), (Action(F, 3, 0), 40), (Action(B, 3, 0), -30),
              (Action(F, 0, 1), 100), (Action(B, 0, 0), -80), (Action(B, 0, 1), -90)]
    # chunk 0: (100 - 80 + 100 - 90) / 200; chunk 1: (40 - 30) / 40; a lone F is not counted
    assert backward_leftover(passes, placement) == {0: pytest.approx(0.15), 1: pytest.approx(0.25)}
    assert backward_leftover([(Action(F, 0, 0), 10), (Action(B, 0, 0), 5)], placement) == {0: 1.0}
    assert backward_leftover([], placement) == {}


def test_w_store_counts_what_w_keeps_until_w_runs():
    tracker = ActivationTracker()
    store = WeightGradStore(tracker)
    kept = torch.ones(10)  # 40 bytes
    with store.collecting(0):
        store.defer(lambda t: None, kept)
    del kept
    assert tracker.live == 40
    store.run(0)
    gc.collect()
    assert tracker.live == 0


def test_backward_after_deallocating_the_output():
    layer = nn.Linear(4, 4).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    grad = torch.randn(2, 4, dtype=torch.float64)
    layer(x).backward(grad)
    want = layer.weight.grad.clone()
    layer.weight.grad = None
    out = layer(x)
    deallocate(out)
    assert out.numel() == 1
    run_backward(out, grad)
    assert torch.equal(layer.weight.grad, want)
    with pytest.raises(ValueError, match="view"):
        deallocate(layer(x)[0])


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([s for s in SCHEDULES if s != "auto"]), st.integers(2, 5),
       st.integers(1, 10), st.integers(0, 3))
def test_receives_are_posted_before_use_in_stream_order(name, p, m, lookahead):
    assume(name != "interleaved-1f1b" or m % p == 0)
    low = lower(build_schedule(name, p, m))
    for r, actions in enumerate(low.rank_actions):
        points = receive_posting_points(actions, lookahead)
        order = [j for i in sorted(points) for j in points[i]]
        assert sorted(order) == [j for j, a in enumerate(actions) if a.kind.is_recv]
        assert order == sorted(order)  # list order: per-stream FIFO as validated
        for i, js in points.items():
            assert all(i <= j for j in js)


def test_routes_pair_sends_with_receives():
    s = build_schedule("v-half", 2, 2)
    low = lower(s)
    sends = {route_of(a, s.placement).message: (r, route_of(a, s.placement))
             for r, acts in enumerate(low.rank_actions) for a in acts if a.kind.is_send}
    for r, acts in enumerate(low.rank_actions):
        for a in acts:
            if a.kind.is_recv:
                route = route_of(a, s.placement)
                src, send_route = sends[route.message]
                assert route.peer == src and send_route.peer == r
                assert route.stream == send_route.stream
                assert route.message == message_of(a)
    streams = {route_of(a, s.placement).stream for acts in low.rank_actions for a in acts
               if a.kind.is_send}
    assert len(streams) == 4  # p = 2 on the V: four streams between the same two ranks


def test_bad_schedule_is_rejected_before_anything_runs():
    s = build_schedule("v-half", 4, 8)
    rows = [list(r) for r in s.rank_actions]
    rows[1][0], rows[1][-1] = rows[1][-1], rows[1][0]
    with pytest.raises(ValidationError, match="dependency cycle(.|\n)*ERROR HERE"):
        PipelineRunner(s.with_actions(rows), compute=None, groups=None, spec=None)
    low = lower(build_schedule("1f1b", 2, 4))
    rows = [list(r) for r in low.rank_actions]
    recv = [i for i, a in enumerate(rows[1]) if a.kind is PassKind.RECV_F]
    rows[1][recv[0]], rows[1][recv[1]] = rows[1][recv[1]], rows[1][recv[0]]
    with pytest.raises(ValidationError):
        PipelineRunner(low.with_actions(rows), compute=None, groups=None, spec=None)


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="timeout"):
        RunnerConfig(timeout=0)
    with pytest.raises(ValueError, match="recv_lookahead"):
        RunnerConfig(recv_lookahead=-1)
    with pytest.raises(ValueError, match="kind must be one of"):
        ToyModel(kind="cnn")
    with pytest.raises(ValueError, match="timeout"):
        Transport(groups=None, spec=TensorSpec(), timeout=-1)


def test_forward_only_keeps_each_ranks_forward_order():
    s = build_schedule("v-zb", 4, 8)
    f = s.forward_only()
    for r in range(4):
        assert list(f.compute_actions(r)) == [a for a in s.compute_actions(r) if a.kind is PassKind.F]
    assert f.memory_bound is None


def test_toy_batches_are_a_function_of_step():
    model = ToyModel(kind="mlp")
    a, b = make_batch(model, 2, 5), make_batch(model, 2, 5)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert not torch.equal(make_batch(model, 1, 6)[0][0], a[0][0])


def test_pass_profile_takes_medians_and_sums_a_ranks_chunks():
    from megatron_vshape.runtime.profile import PassProfile
    from megatron_vshape.schedule import Action

    profile = PassProfile(window=2)
    for scale in (9.0, 1.0, 2.0):  # the window keeps the last two
        timeline = [(Action(kind, stage, 0), 0.0, scale * base * (stage + 1))
                    for stage in (0, 7) for kind, base in
                    ((PassKind.F, 0.1), (PassKind.B, 0.2), (PassKind.W, 0.3))]
        profile.add(timeline + [(Action(PassKind.BW, 0, 1), 0.0, 5.0)])  # fused: ignored
    assert profile.stage_costs()[7]["F"] == pytest.approx(1.5 * 0.1 * 8)
    f, b, w = profile.rank_costs()
    assert (f, b, w) == pytest.approx((1.5 * 0.1 * 9, 1.5 * 0.2 * 9, 1.5 * 0.3 * 9))
    empty = PassProfile()
    empty.add([(Action(PassKind.BW, 0, 0), 0.0, 1.0)])
    with pytest.raises(ValueError, match="B/W split"):
        empty.rank_costs()


def test_wire_device_stages_messages_through_host_memory():
    """gloo cannot move CUDA tensors: TensorSpec.wire = "cpu" makes buffers and sends live on
    the host (what VShapeForwardBackward picks for gloo with CUDA); without it, on the device."""
    staged = TensorSpec((2, 3), torch.float32, device="meta", wire="cpu")
    direct = TensorSpec((2, 3), torch.float32, device="meta")
    assert staged.wire_device == "cpu" and direct.wire_device == "meta"
    transport = Transport.__new__(Transport)  # no groups needed to allocate receive buffers
    transport.spec = staged
    assert transport.receive_buffer((2, 3)).device.type == "cpu"
    transport.spec = direct
    assert transport.receive_buffer((2, 3)).device.type == "meta"
