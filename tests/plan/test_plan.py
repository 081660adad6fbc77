"""The planner (``vshape plan``), pure Python: formulas, ranking, CSV, CLI contract (tier 1).

Memory predictions against megatron-core's measured peaks are in test_plan_memory.py.
"""
import csv
import io
import subprocess
import sys

import pytest

from megatron_vshape.cli import main
from megatron_vshape.configs import CONFIG_DIR
from megatron_vshape.plan import load_model_config
from megatron_vshape.plan.candidates import GridPoint, SearchSpace
from megatron_vshape.plan.cost import analytic_times, layer_flops
from megatron_vshape.plan.evaluate import Evaluator
from megatron_vshape.plan.memory import (ChunkBytes, Workspace, activation_sizes,
                                         chunk_parameters, peak_activation_bytes)
from megatron_vshape.plan.planner import plan
from megatron_vshape.plan.profile_file import load_profile
from megatron_vshape.plan.settings import ClusterConfig, TrainingConfig
from megatron_vshape.plan.shares import rank_shares, stage_layer_counts, whole_model_share
from megatron_vshape.plan.table import CSV_COLUMNS, format_csv, format_table
from megatron_vshape.schedule import Layout, Placement, build_schedule, simulate

MODELS = CONFIG_DIR / "models"
GPT_9B = load_model_config(MODELS / "gpt-9.6b.yaml")
SMALL = load_model_config(MODELS / "small.yaml")
FIXED = ("1f1b", "zb-1p", "interleaved-1f1b", "v-min", "v-half", "v-zb")


# -- formulas ---------------------------------------------------------------------------------
def _korthikanti(model, s, b, t=1, **changes):
    training = TrainingConfig(s, b, flash_attention=False, **changes)
    return activation_sizes(model, training, t, b).layer


@pytest.mark.parametrize("s,b", [(2048, 1), (3072, 2), (1024, 4)])
def test_layer_activations_are_korthikantis_34_plus_5as_over_h(s, b):
    """bf16, dropout, no flash attention, f = 4h, MHA: s b h (34 + 5 a s / h) bytes; with TP t
    and sequence parallel everything is divided by t."""
    m = GPT_9B
    h, a = m.hidden_size, m.num_attention_heads
    expected = s * b * h * (34 + 5 * a * s / h)
    assert _korthikanti(m, s, b) == pytest.approx(expected)
    assert _korthikanti(m, s, b, 4, sequence_parallel=True) == pytest.approx(expected / 4)
    # without sequence parallel the layernorm and dropout terms (10 s b h) stay whole
    assert _korthikanti(m, s, b, 4, sequence_parallel=False) == pytest.approx(
        s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))


def test_flash_attention_drops_the_score_terms_and_keeps_softmax_statistics():
    m, s, b = GPT_9B, 3072, 1
    flash = activation_sizes(m, TrainingConfig(s, b, flash_attention=True), 1, b).layer
    assert flash == pytest.approx(34 * s * b * m.hidden_size + 4 * m.num_attention_heads * s * b)


def test_fp32_and_no_dropout_change_their_terms_only():
    m, s, b = GPT_9B, 1024, 1
    h = m.hidden_size
    bf16 = activation_sizes(m, TrainingConfig(s, b, dropout=False), 1, b).layer
    fp32 = activation_sizes(m, TrainingConfig(s, b, precision="fp32", dropout=False), 1, b).layer
    assert bf16 == pytest.approx(32 * s * b * h + 4 * m.num_attention_heads * s * b)
    assert fp32 - 4 * m.num_attention_heads * s * b == pytest.approx(
        2 * (bf16 - 4 * m.num_attention_heads * s * b))


def test_parameters_per_rank_add_up_to_the_model():
    """TP 1, no pipeline: the chunk holds ModelConfig.parameters(); with a pipeline the last
    stage adds its tied copy of the word embedding."""
    for model in (GPT_9B, SMALL):
        (whole,), = whole_model_share(model)
        assert chunk_parameters(model, whole, 1, model.seq_length, True) == model.parameters()
        shares = rank_shares(model, Placement(4, Layout.SINGLE))
        total = sum(chunk_parameters(model, c, 1, model.seq_length) for r in shares for c in r)
        assert total == model.parameters() + model.vocab_size * model.hidden_size


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("layers", [30, 46, 62, 33])
def test_v_stage_layers_are_the_plugins_placement(p, layers):
    """One rule: plan/shares.py gives the V exactly what megatron/layers.py builds."""
    from megatron_vshape.megatron.layers import stage_layers

    if layers >= 2 * p:
        assert stage_layer_counts(layers, 2 * p) == stage_layers(layers, p)


def test_1f1b_shares_put_embedding_first_and_head_last_and_the_v_both_on_rank_0():
    single = rank_shares(GPT_9B, Placement(4, Layout.SINGLE))
    assert [c.layers for (c,) in single] == [7, 8, 8, 7]
    assert single[0][0].embedding and single[3][0].head
    v = rank_shares(GPT_9B, Placement(8, Layout.V))
    assert v[0][0].embedding and v[0][1].head and v[0][0].layers + v[0][1].layers == 2
    assert sum(c.layers for r in v for c in r) == 30
    with pytest.raises(ValueError, match="--pp"):
        rank_shares(GPT_9B, Placement(16, Layout.V))


@pytest.mark.parametrize("name", FIXED)
def test_memory_walk_equals_the_simulator_in_its_memory_model(name):
    """With W keeping everything (the paper's model) the byte walk is the simulator's peak."""
    schedule = build_schedule(name, 4, 8)
    half = 1.0 / schedule.placement.chunks
    chunks = [[ChunkBytes(half, half)] * schedule.placement.chunks] * 4
    assert peak_activation_bytes(schedule, chunks) == pytest.approx(
        simulate(schedule).peak_memory)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("name", FIXED)
def test_peak_memory_is_reached_within_3p_microbatches(name, p):
    """What the planner's memory probe (evaluate._PROBE) relies on: with more microbatches than
    3p no rank's peak grows, so min(m, 3p) microbatches decide whether a configuration fits."""
    chunks = [[ChunkBytes(1.3, 1.0), ChunkBytes(0.8, 0.5)]] * p
    short = build_schedule(name, p, 3 * p, variant="paper")
    for m in (4 * p, 5 * p + (0 if name == "interleaved-1f1b" else 1)):
        assert peak_activation_bytes(build_schedule(name, p, m, variant="paper"), chunks) == pytest.approx(
            peak_activation_bytes(short, chunks))


def test_analytic_costs_are_24bsh2_plus_4bs2h_and_backward_twice_forward():
    s, b, h = 3072, 2, GPT_9B.hidden_size
    linear, attention = layer_flops(GPT_9B, s, b)
    assert linear + attention == 24 * b * s * h * h + 4 * b * s * s * h
    cluster = ClusterConfig(8, 80, mfu=0.5, cost_model="mfu")
    t = analytic_times(GPT_9B, TrainingConfig(s, 16), cluster, 1, b).layer
    assert t.forward == pytest.approx((linear + attention) / cluster.flops_per_second)
    assert t.backward + t.weight == pytest.approx(2 * t.forward)
    tp2 = analytic_times(GPT_9B, TrainingConfig(s, 16), cluster, 2, b).layer
    assert tp2.forward > t.forward / 2  # half the FLOPs plus the TP collectives


@pytest.mark.parametrize("flash", [False, True])
def test_selective_recomputation_drops_the_attention_term_and_full_keeps_layer_inputs(flash):
    """Korthikanti et al.: selective leaves s b h 34 / t bytes (bf16, f = 4h); full keeps
    each layer's input, 2 s b h / t with sequence parallel."""
    m, s, b, t = GPT_9B, 3072, 2, 4
    h, a = m.hidden_size, m.num_attention_heads
    training = TrainingConfig(s, b, flash_attention=flash)
    none, sel, full = (activation_sizes(m, training, t, b, kind)
                       for kind in ("none", "selective", "full"))
    attention = 4 * a * s * b / t if flash else 5 * a * s * s * b / t
    assert none.layer - sel.layer == pytest.approx(attention)
    assert sel.layer == pytest.approx(34 * s * b * h / t)
    assert full.layer == pytest.approx(2 * s * b * h / t)
    assert full.transient == pytest.approx(none.layer - full.layer)
    assert none.wgrad == sel.wgrad == full.wgrad  # W's inputs and gradients are kept either way
    if not flash:  # the scores dwarf the MLP half: the replay outlives what B freed before it
        assert 0 < sel.transient < attention <= sel.transient_split


def test_recomputation_adds_the_replayed_forward_to_b():
    cluster, s, b = ClusterConfig(8, 80, mfu=0.5, cost_model="mfu"), 3072, 1
    evaluator = Evaluator(GPT_9B, TrainingConfig(s, 16), cluster)
    none, sel, full = (evaluator.times(1, b, kind).layer for kind in ("none", "selective", "full"))
    linear, attention = layer_flops(GPT_9B, s, b)
    assert full.backward == pytest.approx(none.backward + none.forward)
    assert sel.backward == pytest.approx(none.backward + none.forward * attention
                                         / (linear + attention))
    assert sel.forward == full.forward == none.forward and sel.weight == none.weight


def test_a_recomputing_bw_holds_the_replay_on_top_of_its_level():
    """1F1B's last rank runs F, BW per microbatch: the peak is one microbatch plus a replay."""
    schedule = build_schedule("1f1b", 2, 4)
    chunks = [[ChunkBytes(10.0, 0.0, transient=7.0)], [ChunkBytes(10.0, 0.0, transient=7.0)]]
    assert peak_activation_bytes(schedule, chunks)[1] == pytest.approx(17.0)


def test_the_walk_adds_each_pass_workspace_at_its_moment():
    """1F1B on 2 ranks, 2 microbatches: rank 0 runs F F BW BW. F's workspace sits above the
    level after F, BW's above the level before it; without ``workspace`` only levels count."""
    schedule = build_schedule("1f1b", 2, 2)
    ws = Workspace(forward=3.0, backward=5.0)
    chunks = [[ChunkBytes(10.0, 0.0, workspace=ws)]] * 2
    assert [a.kind.name for a in schedule.compute_actions(0)] == ["F", "F", "BW", "BW"]
    assert peak_activation_bytes(schedule, chunks)[0] == pytest.approx(20.0 + 5.0)
    assert peak_activation_bytes(schedule, chunks, workspace=False)[0] == pytest.approx(20.0)
    big_forward = [[ChunkBytes(10.0, 0.0, workspace=Workspace(forward=9.0, backward=5.0))]] * 2
    assert peak_activation_bytes(schedule, big_forward)[0] == pytest.approx(29.0)
    # zb-1p: rank 0 runs F0 F1 B0 W0 B1 W1, rank 1 F0 B0 F1 B1 W0 W1; B keeps 4 of 10 for W,
    # B's workspace is 1 and W's 8: rank 0 peaks in W0 (14 + 8), rank 1 in W0 (8 + 8)
    split = build_schedule("zb-1p", 2, 2)
    chunks = [[ChunkBytes(10.0, 4.0, workspace=Workspace(backward_split=1.0, weight=8.0))]] * 2
    assert peak_activation_bytes(split, chunks) == pytest.approx((22.0, 16.0))
    assert peak_activation_bytes(split, chunks, workspace=False) == pytest.approx((20.0, 14.0))


def test_without_a_pipeline_the_peak_is_a_microbatch_plus_its_larger_scratch():
    """PP 1 runs F then a fused backward per microbatch: the peak is one microbatch's bytes
    plus the larger of F's and the backward's scratch. Here both are the LM head's: its 16-bit
    logits in F and their gradient in B (e s V each; the probe's 128 MiB at gpu-check's
    shape), while the layers' backward scratch fits in what the head's backward frees."""
    from megatron_vshape.plan.memory import chunk_bytes

    training = TrainingConfig(3072, 16)
    row = Evaluator(GPT_9B, training, ClusterConfig(8, 80.0)).evaluate(
        GridPoint(8, 1, 1, 1, 2), "1f1b")
    (share,), = whole_model_share(GPT_9B)
    chunk = chunk_bytes(share, activation_sizes(GPT_9B, training, 1, 1))
    assert chunk.workspace.forward == pytest.approx(2 * 3072 * GPT_9B.vocab_size)
    assert chunk.workspace.backward == pytest.approx(2 * 3072 * GPT_9B.vocab_size)
    assert row.activation_bytes_per_rank == pytest.approx(
        (chunk.forward + chunk.workspace.forward,))


def test_plan_ranks_1f1b_r_beside_the_v_schedules_at_the_papers_long_sequences():
    """The issue's case: gpt-98.5b on 40 GPUs at seq 16384: 1F1B fits nowhere, 1F1B-R (the
    paper's baseline) and V schedules do, and both are ranked."""
    big = load_model_config(MODELS / "gpt-98.5b.yaml")
    result = plan(big, TrainingConfig(16384, 160), ClusterConfig(40, 80.0),
                  SearchSpace(schedules=("1f1b", "v-half", "auto"), micro_batch_sizes=(1,),
                              auto_candidates=2))
    labels = {r.layout.label for r in result.feasible}
    assert "1f1b-r" in labels and "auto" in labels and "1f1b" not in labels
    assert all(r.layout.recompute == "full" for r in result.feasible
               if r.layout.label == "1f1b-r")
    table = format_table(result)
    assert "speed-up vs the best 1f1b-r" in table and "-r: full activation recomputation" in table


# -- the planner ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt9_plan():
    """``vshape plan --model gpt-9.6b --gpus 16 --gpu-memory 80``'s plan."""
    return plan(GPT_9B, TrainingConfig(GPT_9B.seq_length, 128), ClusterConfig(16, 80.0))


def test_plan_ranks_feasible_rows_fastest_first(gpt9_plan):
    rows = gpt9_plan.feasible
    assert len(rows) > 20
    speeds = [r.tokens_per_second_per_gpu for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    budget = gpt9_plan.cluster.budget_bytes
    assert all(r.peak_bytes <= budget and r.iteration_seconds > 0 for r in rows)
    schedules = {r.layout.schedule for r in rows}
    assert {"1f1b", "v-half", "v-zb", "auto"} <= schedules
    assert sum(r.layout.schedule == "auto" for r in gpt9_plan.predictions) <= \
        SearchSpace().auto_candidates
    for r in rows:
        lay = r.layout
        assert lay.gpus == 16 and r.microbatches * lay.dp * lay.micro_batch_size == 128


def test_v_half_halves_the_first_ranks_activations_of_1f1b(gpt9_plan):
    by = {(r.layout.label, r.layout.dp, r.layout.tp, r.layout.pp, r.layout.micro_batch_size): r
          for r in gpt9_plan.predictions if r.activation_bytes_per_rank}
    one, half = by[("1f1b", 2, 1, 8, 1)], by[("v-half", 2, 1, 8, 1)]
    assert half.activation_bytes_per_rank[0] < 0.7 * one.activation_bytes_per_rank[0]


def test_table_and_csv(gpt9_plan):
    table = format_table(gpt9_plan, top=5)
    first = gpt9_plan.feasible[0]
    ranked = [line for line in table.splitlines() if line.strip().startswith("1 ")]
    assert ranked and first.layout.schedule in ranked[0]
    assert "best per schedule" in table
    rows = list(csv.DictReader(io.StringIO(format_csv(gpt9_plan))))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == len(gpt9_plan.predictions)
    feasible = [r for r in rows if r["feasible"] == "True"]
    assert [int(r["place"]) for r in feasible] == list(range(1, len(feasible) + 1))
    assert all(r["reason"] for r in rows if r["feasible"] == "False")
    assert all(r["dominant"] in ("activations", "weights", "gradients", "optimizer")
               for r in feasible)


def _feasible_layouts(model, memory, gpus=8):
    result = plan(model, TrainingConfig(2048, 64), ClusterConfig(gpus, memory),
                  SearchSpace(schedules=FIXED))
    return {(r.layout, r.microbatches) for r in result.feasible}


def test_more_gpu_memory_never_makes_a_configuration_infeasible():
    small, medium, large = (_feasible_layouts(SMALL, gib) for gib in (6, 10, 40))
    assert small <= medium <= large
    assert len(small) < len(medium) < len(large)


def test_too_little_memory_is_infeasible_with_a_clear_message():
    big = load_model_config(MODELS / "gpt-98.5b.yaml")
    result = plan(big, TrainingConfig(3072, 64), ClusterConfig(8, 16.0),
                  SearchSpace(schedules=("1f1b", "v-min", "auto")))
    assert not result.feasible and result.infeasible
    message = result.failure_message()
    assert "no configuration" in message and "GiB" in message and "--gpus" in message
    assert result.infeasible_counts()["memory"] > 0


# -- profile files ----------------------------------------------------------------------------
PROFILE = """\
seq_length: 2048
p2p_seconds: 0.0002
measurements:
  - micro_batch_size: 1
    tensor_parallel: 1
    layer: {F: 0.004, B: 0.005, W: 0.003}
    head: {F: 0.002, B: 0.004}
"""


def test_profile_costs_replace_the_flop_model(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_text(PROFILE)
    profile = load_profile(path)
    training = TrainingConfig(2048, 32)
    evaluator = Evaluator(SMALL, training, ClusterConfig(8, 80), profile)
    times = evaluator.times(1, 2)  # scaled from micro batch 1 by the cost model's ratio
    model = [analytic_times(SMALL, training, ClusterConfig(8, 80), 1, b).layer for b in (1, 2)]
    assert times.layer.forward == pytest.approx(0.004 * model[1].forward / model[0].forward)
    assert "scaled" in times.source
    row = evaluator.evaluate(GridPoint(2, 1, 4, 1, 16), "v-half")
    assert row.feasible and "profile.yaml" in row.costs and row.p2p_seconds == 0.0002
    with pytest.raises(ValueError, match="--seq-length"):
        Evaluator(SMALL, TrainingConfig(1024, 32), ClusterConfig(8, 80), profile)
    path.write_text(PROFILE.replace(", W: 0.003", ""))
    with pytest.raises(ValueError, match=r"measurements\[0\].layer.*missing \['W'\]"):
        load_profile(path)


# -- the command ------------------------------------------------------------------------------
def test_cli_prints_the_ranked_table_and_writes_the_csv(tmp_path, capsys):
    out_csv = tmp_path / "plan.csv"
    code = main(["plan", "--model", str(MODELS / "small.yaml"), "--gpus", "8", "--gpu-memory",
                 "24", "--global-batch", "32", "--schedules", "1f1b", "v-half", "--csv",
                 str(out_csv), "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tok/s/GPU" in out and f"wrote {out_csv}" in out
    rows = list(csv.DictReader(out_csv.open()))
    assert {r["schedule"] for r in rows} == {"1f1b", "1f1b-r", "v-half", "none", "none-r"}
    assert {r["recompute"] for r in rows} == {"none", "full"}


@pytest.mark.parametrize("changes,needle", [
    ({"--schedules": "v-quarter"}, "invalid choice: 'v-quarter'"),
    ({"--tp": "3"}, "--tp [3] invalid"),
    ({"--pp": "5"}, "valid choices: 1, 2, 4, 8"),
    ({"--gpus": "12"}, "--gpus-per-node"),
    ({"--model": "models/missing.yaml"}, "--model"),
    ({"--gpu-memory": "2"}, "--reserved-memory"),
    ({"--micro-batch-sizes": "0"}, "--micro-batch-sizes"),
    ({"--gpus": "eight"}, "--gpus: invalid int value"),
])
def test_cli_bad_flags_exit_2_naming_the_flag(changes, needle, capsys):
    flags = {"--model": str(MODELS / "small.yaml"), "--gpus": "8", "--gpu-memory": "24",
             **changes}
    try:
        code = main(["plan"] + [x for kv in flags.items() for x in kv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert needle in capsys.readouterr().err


def test_cli_nothing_fits_exits_1_with_the_reason(capsys):
    code = main(["plan", "--model", str(MODELS / "gpt-98.5b.yaml"), "--gpus", "8",
                 "--gpu-memory", "16", "--schedules", "1f1b", "v-min"])
    captured = capsys.readouterr()
    assert code == 1 and "no configuration of gpt-98.5b fits" in captured.err


def test_planner_imports_without_torch():
    """plan/ is pure Python + PyYAML: it must run where torch is not installed."""
    code = ("import sys; sys.modules['torch'] = None; "
            "from megatron_vshape.cli import main; "
            f"sys.exit(main(['plan', '--model', {str(MODELS / 'tiny.yaml')!r}, '--gpus', '4', "
            "'--gpu-memory', '1', '--global-batch', '8', '--schedules', 'v-half', "
            "'--precision', 'fp32', '--reserved-memory', '0.5']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "v-half" in done.stdout


def test_points_too_large_to_schedule_are_skipped_with_the_reason():
    """A global batch of 65,536 on 16 GPUs gives PP 2 at DP 8 8,192 microbatches (at the
    bound, kept) and PP 8 at DP 2 32,768 (over, skipped): ``vshape plan --global-batch 65536``
    ran past two minutes, now 68 s with 27 points skipped and said so."""
    from megatron_vshape.plan.candidates import grid_points
    from megatron_vshape.schedule.model.size import MAX_SIZE

    model = load_model_config("gpt-9.6b")
    space = SearchSpace(micro_batch_sizes=(1,), tensor_parallel=(1,))
    points, skipped = grid_points(model, TrainingConfig(seq_length=3072, global_batch=65536),
                                  ClusterConfig(gpus=16, gpu_memory_gib=80.0), space)
    kept = {(p.pp, p.microbatches) for p in points}
    assert (1, 4096) in kept and (2, 8192) in kept and (4, 16384) not in kept
    assert all(p.pp == 1 or p.pp * p.microbatches <= MAX_SIZE for p in points)
    assert skipped[f"PP x microbatches over {MAX_SIZE:,}, too large to schedule in about a "
                   f"minute"] == 3  # PP 4, 8, 16
