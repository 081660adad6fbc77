"""scripts/pretrain_gpt_vshape.py's flags: parsing, and bad combinations refused at parsing.

Fast unit tests of the checks: Megatron-LM's argument namespace is stood in for by the fields
the checks read, with Megatron-LM's defaults. Through Megatron-LM's real parse_args and
validate_args the same refusals are run by tests/megatron/test_megatron_lm_e2e.py.
"""
import argparse

import pytest

from megatron_vshape.megatron.arguments import add_arguments, check_arguments, vshape_config
from megatron_vshape.schedule.model.limits import MemoryLimit


def _args(argv=(), **megatron):
    """Our flags parsed from ``argv`` plus Megatron-LM's fields (defaults as core_v0.16.1)."""
    args = add_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    fields = dict(pipeline_model_parallel_size=4, num_layers=30,
                  num_layers_per_virtual_pipeline_stage=None,
                  num_virtual_stages_per_pipeline_rank=None, pipeline_model_parallel_layout=None,
                  decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                  account_for_embedding_in_pipeline_split=False,
                  account_for_loss_in_pipeline_split=False, num_experts=None, mtp_num_layers=None,
                  context_parallel_size=1, use_legacy_models=False, use_torch_fsdp2=False,
                  use_megatron_fsdp=False, delay_wgrad_compute=False)
    fields.update(megatron)
    for key, value in fields.items():
        setattr(args, key, value)
    return args


def test_defaults_are_megatrons_own_1f1b():
    args = _args()
    check_arguments(args)
    assert args.pipeline_schedule == "1f1b" and vshape_config(args).schedule == "1f1b"


def test_v_schedule_flags_become_the_plugin_config():
    args = _args(["--pipeline-schedule", "auto", "--pipeline-memory-limit", "40GiB",
                  "--pipeline-replan-after", "5", "--pipeline-p2p-timeout", "30"])
    check_arguments(args)
    config = vshape_config(args)
    assert config.schedule == "auto" and config.memory_limit == MemoryLimit(bytes=40 * 2**30)
    assert config.replan_after == 5 and config.timeout == 30 and config.losses_on_last_rank
    half = vshape_config(_args(["--pipeline-schedule", "v-half"]))
    assert half.replan_after == 3 and half.memory_limit is None  # a memory level re-plans too
    assert half.variant == "fastest"
    paper = vshape_config(_args(["--pipeline-schedule", "v-half",
                                 "--pipeline-schedule-variant", "paper"]))
    assert paper.replan_after == 0 and paper.variant == "paper"  # the paper's order is fixed
    assert vshape_config(_args(["--pipeline-schedule", "1f1b"])).replan_after == 0


def test_unknown_schedule_fails_in_argparse_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        _args(["--pipeline-schedule", "v-quarter"])
    assert "invalid choice: 'v-quarter'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,megatron,needle", [
    (["--pipeline-schedule", "v-half"], {"pipeline_model_parallel_size": 1},
     "needs --pipeline-model-parallel-size >= 2"),
    (["--pipeline-schedule", "v-min"], {"num_layers": 6},
     "--num-layers must be >= 2 x --pipeline-model-parallel-size"),
    (["--pipeline-schedule", "v-zb"], {"num_virtual_stages_per_pipeline_rank": 2},
     "drop --num-layers-per-virtual-pipeline-stage"),
    (["--pipeline-schedule", "v-half"], {"pipeline_model_parallel_layout": "Et|tt|tt|ttL"},
     "write 2 x PP stages separated by '|' (a layout of PP stages is 1F1B's"),
    (["--pipeline-schedule", "v-half"], {"account_for_loss_in_pipeline_split": True},
     "must be a multiple of the V's 2 x PP = 8 stages"),
    (["--pipeline-schedule", "v-half"], {"context_parallel_size": 4, "cp_comm_type": ["a2a+p2p"],
                                         "hierarchical_context_parallel_sizes": [2, 2]},
     "use --cp-comm-type p2p, a2a or all_gather"),
    (["--pipeline-schedule", "v-half"], {"context_parallel_size": 2, "sft": True},
     "or --context-parallel-size 1"),
    (["--pipeline-schedule", "v-half"], {"use_legacy_models": True}, "drop --use-legacy-models"),
    (["--pipeline-schedule", "v-half"], {"use_torch_fsdp2": True}, "drop --use-torch-fsdp2"),
    (["--pipeline-schedule", "v-half"], {"delay_wgrad_compute": True},
     "drop it"),
    (["--pipeline-schedule", "interleaved-1f1b"], {},
     "interleaved-1f1b needs virtual pipeline stages"),
    (["--pipeline-schedule", "1f1b"], {"num_virtual_stages_per_pipeline_rank": 2},
     "use --pipeline-schedule interleaved-1f1b"),
    (["--pipeline-schedule", "zb-1p"], {"pipeline_model_parallel_size": 1},
     "zb-1p needs --pipeline-model-parallel-size >= 2"),
    (["--pipeline-schedule", "v-half", "--pipeline-memory-limit", "0.5"], {},
     "--pipeline-memory-limit applies to --pipeline-schedule auto only"),
    (["--pipeline-schedule", "auto", "--pipeline-memory-limit", "lots"], {},
     "--pipeline-memory-limit must be a number with a unit"),
    (["--pipeline-schedule", "auto", "--pipeline-replan-after", "-1"], {},
     "--pipeline-replan-after must be >= 0"),
    (["--pipeline-p2p-timeout", "0"], {}, "--pipeline-p2p-timeout must be > 0"),
])
def test_bad_combinations_name_the_flag(argv, megatron, needle):
    with pytest.raises(ValueError) as err:
        check_arguments(_args(argv, **megatron))
    assert needle in str(err.value)


PIPELINE_REFUSALS = [
    ({"context_parallel_size": 2, "cp_comm_type": ["p2p", "a2a+p2p"],
      "hierarchical_context_parallel_sizes": [1, 2]}, "hierarchical context parallelism"),
    ({"context_parallel_size": 2, "sft": True}, "Megatron-LM core_v0.16.1"),
    ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
    ({"use_legacy_models": True}, "drop --use-legacy-models"),
    ({"use_megatron_fsdp": True}, "drop --use-torch-fsdp2 / --use-megatron-fsdp"),
    ({"delay_wgrad_compute": True}, "--delay-wgrad-compute is megatron's MoE overlap"),
    ({"overlap_moe_expert_parallel_comm": True}, "drop --overlap-moe-expert-parallel-comm"),
    ({"ep_overlap_early_attn_memory_release": True}, "--ep-overlap-early-attn-memory-release"),
    ({"overlap_dispatch_backward_with_experts_wgrad": True},
     "--overlap-dispatch-backward-with-experts-wgrad"),
    ({"defer_embedding_wgrad_compute": True}, "drop it"),
    ({"fp8": "hybrid", "fp8_recipe": "mxfp8"}, "use --fp8-recipe delayed or tensorwise"),
    ({"fp8": "e4m3", "fp8_recipe": "blockwise"}, "use --fp8-recipe delayed or tensorwise"),
    ({"fp8": "hybrid", "fp8_recipe": "custom"}, "use --fp8-recipe delayed or tensorwise"),
    ({"fp8": "hybrid", "fp8_param_gather": True}, "drop --fp8-param-gather"),
    ({"fp8": "hybrid", "num_experts": 8, "moe_grouped_gemm": True,
      "transformer_impl": "transformer_engine", "moe_use_legacy_grouped_gemm": False},
     "FP8 grouped-GEMM experts"),
    ({"fp8": "hybrid", "recompute_granularity": "full"}, "use --recompute-granularity selective"),
    ({"fp4": "e2m1"}, "--fp4-format"),
    ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ({"cuda_graph_impl": "transformer_engine"}, "use --cuda-graph-impl none"),
    ({"enable_cuda_graph": True}, "--enable-cuda-graph"),
    ({"external_cuda_graph": True}, "--external-cuda-graph"),
    ({"fine_grained_activation_offloading": True}, "--fine-grained-activation-offloading"),
    ({"cpu_offloading_num_layers": 2}, "--cpu-offloading-num-layers"),
    ({"overlap_param_gather_with_optimizer_step": True},
     "drop --overlap-param-gather-with-optimizer-step"),
    ({"overlap_p2p_comm_warmup_flush": True}, "drop --overlap-p2p-communication-warmup-flush"),
    ({"microbatch_group_size_per_vp_stage": 2},
     "--microbatch-group-size-per-virtual-pipeline-stage"),
    ({"use_ring_exchange_p2p": True}, "drop --use-ring-exchange-p2p"),
    ({"pipeline_model_parallel_comm_backend": "ucc"}, "--pipeline-model-parallel-comm-backend"),
    ({"num_experts": 8, "moe_grouped_gemm": True}, "drop --moe-grouped-gemm"),
    ({"num_experts": 8, "moe_grouped_gemm": True, "transformer_impl": "transformer_engine",
      "moe_use_legacy_grouped_gemm": True}, "legacy GroupedMLP"),
    ({"num_experts": 8, "moe_token_dispatcher_type": "flex"},
     "use --moe-token-dispatcher-type alltoall"),
    ({"num_experts": 8, "moe_shared_expert_overlap": True}, "--moe-shared-expert-overlap"),
    ({"num_experts": 8, "moe_router_load_balancing_type": "sinkhorn"},
     "--moe-router-load-balancing-type"),
    ({"num_experts": 8, "moe_paged_stash": True}, "--moe-paged-stash"),
]
"""Flags that change how megatron's own schedules run passes or their communication, or are
untested under the B/W split: refused under V schedules and zb-1p alike. Fields one
Megatron-LM version lacks (overlap_dispatch_backward_with_experts_wgrad, moe_paged_stash) are
read with getattr, off when absent; Megatron-LM's defaults (cuda_graph_impl 'none', fp8 None)
pass (test_defaults_of_both_versions_pass)."""


@pytest.mark.parametrize("schedule", ["v-half", "zb-1p"])
@pytest.mark.parametrize("megatron,needle", PIPELINE_REFUSALS)
def test_pipeline_flags_are_refused_under_our_schedules(schedule, megatron, needle):
    with pytest.raises(ValueError) as err:
        check_arguments(_args(["--pipeline-schedule", schedule], **megatron))
    message = str(err.value)
    assert message.startswith(f"--pipeline-schedule {schedule} ") and needle in message
    assert "drop" in message or "use " in message  # the way out


@pytest.mark.parametrize("megatron,needle", PIPELINE_REFUSALS)
def test_megatrons_own_schedules_keep_these_flags(megatron, needle):
    check_arguments(_args(["--pipeline-schedule", "1f1b"], **megatron))


def test_defaults_of_both_versions_pass():
    """Megatron-LM's defaults of the refused flags (core_v0.16.1 and 0.19) are accepted, and
    so is overlap_p2p_comm's (on by default; Megatron-LM turns it off for one-chunk
    schedules, and ours post their own asynchronous p2p)."""
    defaults = dict(cuda_graph_impl="none", enable_cuda_graph=False, external_cuda_graph=False,
                    fp8=None, fp4=None, tp_comm_overlap=False, hybrid_context_parallel=False,
                    defer_embedding_wgrad_compute=False, overlap_moe_expert_parallel_comm=False,
                    fine_grained_activation_offloading=False, overlap_p2p_comm=True,
                    overlap_p2p_comm_warmup_flush=False, microbatch_group_size_per_vp_stage=None,
                    use_ring_exchange_p2p=False, pipeline_model_parallel_comm_backend=None,
                    overlap_param_gather_with_optimizer_step=False, wgrad_deferral_limit=0)
    for schedule in ("v-min", "v-half", "v-zb", "auto", "zb-1p"):
        check_arguments(_args(["--pipeline-schedule", schedule], **defaults))


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto", "zb-1p"])
def test_moe_is_accepted_with_the_tested_dispatchers(schedule):
    """MoE runs under every schedule of the plugin (tests/megatron/test_megatron_lm_moe.py); only what
    no test runs is refused (PIPELINE_REFUSALS)."""
    for dispatcher, balancing in (("alltoall", "aux_loss"), ("allgather", "seq_aux_loss"),
                                  ("allgather", "global_aux_loss"), ("alltoall", "none")):
        check_arguments(_args(["--pipeline-schedule", schedule], num_experts=8,
                              moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
                              moe_shared_expert_overlap=False,
                              moe_router_load_balancing_type=balancing))
    # Transformer Engine's grouped GEMM (TEGroupedMLP; tests/megatron/test_megatron_lm_te.py)
    check_arguments(_args(["--pipeline-schedule", schedule], num_experts=8,
                          moe_grouped_gemm=True, transformer_impl="transformer_engine",
                          moe_use_legacy_grouped_gemm=False))


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto", "zb-1p"])
def test_context_parallelism_is_accepted_and_named_as_a_stand_in(schedule):
    """--context-parallel-size 2 with every --cp-comm-type but hierarchical a2a+p2p, a list of
    them per layer, and --sft on the 0.19-era training code (whose parser has
    --dataloader-inter-document-masking) run under every schedule of the plugin
    (tests/megatron/test_megatron_lm_te.py); proven on TE's CPU stand-in only, so named at
    start-up and refused under --pipeline-strict."""
    from megatron_vshape.megatron.arguments import stand_in_notice

    for comm in (["p2p"], ["a2a"], ["all_gather"], ["p2p", "a2a"]):
        check_arguments(_args(["--pipeline-schedule", schedule], context_parallel_size=2,
                              cp_comm_type=comm))
    check_arguments(_args(["--pipeline-schedule", schedule], context_parallel_size=2, sft=True,
                          dataloader_inter_document_masking=False))
    check_arguments(_args(["--pipeline-schedule", schedule], context_parallel_size=1, sft=True))
    args = _args(["--pipeline-schedule", schedule], context_parallel_size=2)
    check_arguments(args)
    assert "--context-parallel-size > 1" in stand_in_notice(args)
    with pytest.raises(ValueError, match="with --pipeline-strict: --context-parallel-size > 1"):
        check_arguments(_args(["--pipeline-schedule", schedule, "--pipeline-strict"],
                              context_parallel_size=2))


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto", "zb-1p"])
@pytest.mark.parametrize("fp8", [dict(fp8="hybrid", fp8_recipe="delayed"),
                                 dict(fp8="e4m3", fp8_recipe="tensorwise"),
                                 dict(fp8="hybrid", fp8_recipe="tensorwise",
                                      first_last_layers_bf16=True,
                                      recompute_granularity="selective")])
def test_per_tensor_fp8_is_accepted_as_a_stand_in_setting(schedule, fp8):
    """--fp8-format with the delayed and tensorwise recipes runs under every schedule of the
    plugin on the CPU stand-in of TE's FP8 (tests/megatron/test_megatron_lm_te.py): accepted,
    named at start-up, refused under --pipeline-strict."""
    from megatron_vshape.megatron.arguments import stand_in_notice

    args = _args(["--pipeline-schedule", schedule], transformer_impl="transformer_engine", **fp8)
    check_arguments(args)
    assert "--fp8-format e4m3 / hybrid" in stand_in_notice(args)
    with pytest.raises(ValueError, match="with --pipeline-strict"):
        check_arguments(_args(["--pipeline-schedule", schedule, "--pipeline-strict"],
                              transformer_impl="transformer_engine", **fp8))


def test_tied_embeddings_save_fully_parallel_under_data_parallel():
    """Tied embeddings with DP > 1 save with megatron's fully parallel save under every
    schedule (a V keeps rank 0's copy of the embedding a replica: model.save_copy_as_replica);
    the features row that names it is a proven one."""
    from megatron_vshape.megatron.features import SETTINGS, Verdict

    tied = dict(save="ckpt", untie_embeddings_and_output_weights=False,
                ckpt_fully_parallel_save=True, tensor_model_parallel_size=1, world_size=8)
    for schedule in ("v-min", "v-half", "v-zb", "auto", "zb-1p", "1f1b"):
        check_arguments(_args(["--pipeline-schedule", schedule], **tied))
    [row] = [s for s in SETTINGS if s.flags.startswith("tied embeddings or --mtp-num-layers")]
    assert row.used(_args(["--pipeline-schedule", "v-half"], **tied))
    assert row.v is Verdict.REAL


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto", "zb-1p"])
def test_multi_token_prediction_is_accepted(schedule):
    """--mtp-num-layers runs under every schedule of the plugin, tied or untied
    (tests/megatron/test_megatron_lm_mtp.py), with DP > 1 and megatron's fully parallel save
    too (the MTP block's embedding copy stays a replica on rank 0, as a tied LM head's)."""
    mtp = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1, save="ckpt",
               untie_embeddings_and_output_weights=True, ckpt_fully_parallel_save=True,
               tensor_model_parallel_size=1, world_size=4)
    check_arguments(_args(["--pipeline-schedule", schedule], **mtp))
    check_arguments(_args(["--pipeline-schedule", schedule],
                          **dict(mtp, untie_embeddings_and_output_weights=False)))
    check_arguments(_args(["--pipeline-schedule", schedule], **dict(mtp, world_size=8)))


def test_the_papers_uneven_layer_counts_are_accepted():
    """30 layers on PP = 8 (k x p - 2): rank 0's chunks take the two missing layers."""
    check_arguments(_args(["--pipeline-schedule", "v-half"], pipeline_model_parallel_size=8))
    check_arguments(_args(["--pipeline-schedule", "interleaved-1f1b"],
                          num_virtual_stages_per_pipeline_rank=2))


# -- megatron's own choice without --pipeline-schedule, as stock pretrain_gpt.py -----------------
@pytest.mark.parametrize("megatron,schedule", [
    ({}, "1f1b"),
    ({"num_virtual_stages_per_pipeline_rank": 2}, "interleaved-1f1b"),
    ({"num_virtual_stages_per_pipeline_rank": 1}, "1f1b"),
    ({"num_layers": 32, "num_layers_per_virtual_pipeline_stage": 2}, "interleaved-1f1b"),
    ({"num_layers": 8, "num_layers_per_virtual_pipeline_stage": 2}, "1f1b"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|ttL"}, "1f1b"),
    ({"pipeline_model_parallel_layout": "Et*2|(tt|)*6tL"}, "interleaved-1f1b"),
])
def test_without_a_schedule_flag_megatron_chooses_as_stock_does(megatron, schedule):
    """No --pipeline-schedule: interleaved-1f1b where the flags make more than one stage per
    rank (megatron-core's own layout parser counts a layout's stages), else 1f1b."""
    args = _args(**megatron)
    check_arguments(args)
    assert args.pipeline_schedule == schedule and vshape_config(args).schedule == schedule


@pytest.mark.parametrize("schedule", ["1f1b", "zb-1p"])
def test_a_layout_of_exactly_pp_stages_is_not_virtual_pipelining(schedule):
    """4 stages on PP 4 is an uneven layout, not interleaving: one chunk per rank."""
    check_arguments(_args(["--pipeline-schedule", schedule],
                          pipeline_model_parallel_layout="Et|tt|tt|ttL"))
    with pytest.raises(ValueError, match="interleaved-1f1b"):
        check_arguments(_args(["--pipeline-schedule", schedule],
                              pipeline_model_parallel_layout="Et|t|t|t|t|t|t|tL"))


def test_every_refusal_that_applies_comes_in_one_error():
    """A recipe with four refused settings learns all four from one launch, each line naming
    its flag, and the plugin's own flags' misuse in the same list."""
    with pytest.raises(ValueError) as err:
        check_arguments(_args(["--pipeline-schedule", "v-half", "--pipeline-memory-limit", "0.5"],
                              num_experts=8, moe_token_dispatcher_type="flex",
                              moe_grouped_gemm=True, context_parallel_size=2,
                              cp_comm_type=["a2a+p2p"], tp_comm_overlap=True))
    lines = str(err.value).splitlines()
    assert lines[0].startswith("5 settings stop this run")
    needles = ["--moe-grouped-gemm", "--moe-token-dispatcher-type alltoall",
               "--cp-comm-type p2p, a2a or all_gather", "--tp-comm-overlap",
               "--pipeline-memory-limit"]
    assert len(lines) == 6 and all(line.startswith("- --pipeline-") for line in lines[1:])
    for needle in needles:
        assert sum(needle in line for line in lines[1:]) >= 1, needle


def test_stand_in_settings_are_named_and_refused_under_strict():
    """--sft is proven with a CPU stand-in of TE's packed attention only: accepted and named
    at start-up; --pipeline-strict refuses it, naming the test that proves it."""
    from megatron_vshape.megatron.arguments import stand_in_notice

    args = _args(["--pipeline-schedule", "v-half"], sft=True)
    check_arguments(args)
    notice = stand_in_notice(args)
    assert notice.startswith("[vshape] v-half: proven on CPU with stand-ins") and "--sft" in notice
    assert "--pipeline-strict" in notice
    assert stand_in_notice(_args(["--pipeline-schedule", "v-half"])) is None
    assert stand_in_notice(_args(["--pipeline-schedule", "1f1b"], sft=True)) is None
    with pytest.raises(ValueError) as err:
        check_arguments(_args(["--pipeline-schedule", "v-half", "--pipeline-strict"], sft=True))
    assert "with --pipeline-strict: --sft" in str(err.value)
    assert "test_megatron_lm_sft.py" in str(err.value)
    check_arguments(_args(["--pipeline-schedule", "1f1b", "--pipeline-strict"], sft=True))


def test_the_features_table_gives_every_refusal_a_way_out():
    """Every refused setting says what to do instead; every accepted one names its proof."""
    from megatron_vshape.megatron.features import SETTINGS, Verdict

    for row in SETTINGS:
        verdicts = (row.v, row.zb)
        if Verdict.REFUSED in verdicts:
            assert any(word in row.why for word in ("drop", "use ", "add ", "must be")), row.flags
        if any(v in (Verdict.REAL, Verdict.STAND_IN, Verdict.GPU) for v in verdicts):
            assert row.proven_by, row.flags


def test_inter_document_masking_is_refused_under_a_v():
    """0.19's --dataloader-inter-document-masking gives megatron's get_batch the documents'
    offsets; the V's batch reads them for --sft only, so a V refuses it (zb-1p keeps
    megatron's own get_batch)."""
    with pytest.raises(ValueError, match="--dataloader-inter-document-masking"):
        check_arguments(_args(["--pipeline-schedule", "v-half"],
                              dataloader_inter_document_masking=True))
    check_arguments(_args(["--pipeline-schedule", "zb-1p"],
                          dataloader_inter_document_masking=True))


# -- Megatron-LM's layer-placing flags on the V's stages (stage_layout.py) -----------------------
V_AND_ZB = ["v-min", "v-half", "v-zb", "auto", "zb-1p"]
ACCEPTED_PLACEMENTS = [
    # PP 2, 7 layers: (flags, the V's stages, megatron's 1F1B stages (zb-1p) or None)
    ({"pipeline_model_parallel_layout": "Et|ttt|ttt|L"}, (1, 3, 3, 0), None),
    ({"pipeline_model_parallel_layout": "E|tt|ttt|ttL"}, (0, 2, 3, 2), None),
    ({"pipeline_model_parallel_layout": "Et*2|t*3|(t|)*1tL"}, (2, 3, 1, 1), None),
    ({"pipeline_model_parallel_layout": "Ett|tttttL"}, None, (2, 5)),
    ({"decoder_first_pipeline_num_layers": 0, "decoder_last_pipeline_num_layers": 1},
     (0, 3, 3, 1), (0, 1)),
    ({"decoder_first_pipeline_num_layers": 1}, (1, 2, 2, 2), (1, 6)),
    ({"decoder_last_pipeline_num_layers": 4}, (1, 1, 1, 4), (3, 4)),
    ({"account_for_embedding_in_pipeline_split": True}, (1, 2, 2, 2), (3, 4)),
    ({"account_for_loss_in_pipeline_split": True}, (2, 2, 2, 1), (4, 3)),
]
"""zb-1p keeps megatron's own 1F1B meaning (Megatron-LM's validate_args and TransformerConfig
check them there, e.g. first = 0 is refused by megatron itself); the V reads them on its 2 x PP
stages."""


def _placed(schedule, flags, **megatron):
    fields = dict(pipeline_model_parallel_size=2, num_layers=7)
    fields.update(flags)
    fields.update(megatron)
    return _args(["--pipeline-schedule", schedule], **fields)


@pytest.mark.parametrize("schedule", V_AND_ZB)
@pytest.mark.parametrize("flags,v_stages,single", ACCEPTED_PLACEMENTS)
def test_layer_placing_flags_are_accepted(schedule, flags, v_stages, single):
    from megatron_vshape.megatron.stage_layout import v_stage_layout

    wanted = single if schedule == "zb-1p" else v_stages
    if wanted is None:
        with pytest.raises(ValueError, match="2 x PP stages|virtual pipeline"):
            check_arguments(_placed(schedule, flags))
        return
    args = _placed(schedule, flags)
    check_arguments(args)
    if schedule != "zb-1p":
        layout = v_stage_layout(args)
        assert layout.layers == v_stages and sum(v_stages) == 7
        assert layout.stages[0].embedding and layout.stages[-1].loss


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-zb", "auto"])
@pytest.mark.parametrize("flags,needle", [
    ({"pipeline_model_parallel_layout": "Ettt|ttttL"},
     "write 2 x PP stages separated by '|'"),
    ({"pipeline_model_parallel_layout": "Et|t|t|t|t|tL"}, "write 2 x PP stages"),
    ({"pipeline_model_parallel_layout": "|Ett|tttt|tL"},
     "the embedding is in stage 0 and the loss in stage 2p-1 = 3"),
    ({"pipeline_model_parallel_layout": "Et|ttttt||tL"},
     "V stages [2] hold no transformer layer"),
    ({"pipeline_model_parallel_layout": "E|tttt|ttt|L"},
     "rank 0 (stages 0 and 3) holds no transformer layer"),
    ({"pipeline_model_parallel_layout": "Et|ttt|tt|L"}, "must match num_layers 7"),
    ({"pipeline_model_parallel_layout": "Et|tt|ttt|tL", "decoder_first_pipeline_num_layers": 1},
     "drop --decoder-first-pipeline-num-layers"),
    ({"pipeline_model_parallel_layout": "Et|tt|ttt|tL",
      "account_for_loss_in_pipeline_split": True},
     "drop --account-for-loss-in-pipeline-split"),
    ({"decoder_first_pipeline_num_layers": 2},
     "num_layers - first - last is a positive multiple of 3"),
    ({"decoder_first_pipeline_num_layers": 0, "decoder_last_pipeline_num_layers": 0,
      "num_layers": 8}, "rank 0 (stages 0 and 3) holds no transformer layer"),
    ({"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 5},
     "at least one each"),
    ({"decoder_last_pipeline_num_layers": -1}, "must be >= 0"),
    ({"decoder_first_pipeline_num_layers": 1, "account_for_loss_in_pipeline_split": True},
     "place layers two ways: use one of them"),
    ({"account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True}, "use --num-layers 10"),
    ({"pipeline_model_parallel_layout": "Et|ttt|tt|tL", "num_virtual_stages_per_pipeline_rank": 2},
     "drop --num-layers-per-virtual-pipeline-stage"),
])
def test_layer_placing_flags_a_v_cannot_run_are_refused(schedule, flags, needle):
    """Each refusal names the flag and what to write instead."""
    with pytest.raises(ValueError) as err:
        check_arguments(_placed(schedule, flags))
    message = str(err.value)
    assert needle in message, message
    assert f"--pipeline-schedule {schedule}" in message


@pytest.mark.parametrize("schedule", ["1f1b", "zb-1p", "v-half"])
def test_a_layout_megatron_cannot_parse_is_a_clear_error(schedule):
    """megatron-core's parser's assertion, as an error naming the flag (under its own
    schedules too: the checks count the layout's stages first)."""
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-layout 'Et\|ttx\|ttt\|tL': "
                                         "Invalid layer character: x"):
        check_arguments(_placed(schedule, {"pipeline_model_parallel_layout": "Et|ttx|ttt|tL"}))


def test_multi_token_prediction_sits_in_the_last_v_stage():
    """MTP in a layout: stage 2p-1 only (rank 0's chunk 1, beside the loss), as megatron's own
    parser counts it against --mtp-num-layers."""
    from megatron_vshape.megatron.stage_layout import v_stage_layout

    args = _placed("v-half", {"pipeline_model_parallel_layout": "Et|ttt|tt|tmL"},
                   mtp_num_layers=1)
    check_arguments(args)
    layout = v_stage_layout(args)
    assert layout.stages[-1].mtp == 1 and layout.megatron_layout() == "Et|t*3|t*2|tmL"
    for bad, needle in (("Et|ttt|tmt|tL", "decoder layers must be placed before MTP"),
                        ("Et|ttt|tttm|L", "multi-token prediction sits in stage 2p-1")):
        with pytest.raises(ValueError, match=needle):
            check_arguments(_placed("v-half", {"pipeline_model_parallel_layout": bad},
                                    mtp_num_layers=1))
    with pytest.raises(ValueError, match="mtp"):
        check_arguments(_placed("v-half", {"pipeline_model_parallel_layout": "Et|ttt|tt|tL"},
                                mtp_num_layers=1))


def test_the_deepseek_v3_proxy_recipes_layout_places_a_v():
    """NVIDIA's DeepSeek-V3 proxy recipe (tests/data/recipes/): 8 stages on PP 4 is megatron's
    interleaved placement, and under a V the same string reads in V order, MTP beside the loss
    on rank 0 (its flex dispatcher stays refused: test_megatron_lm_recipes.py)."""
    from megatron_vshape.megatron.stage_layout import v_stage_layout

    args = _args(["--pipeline-schedule", "v-half"], num_layers=14, mtp_num_layers=1,
                 pipeline_model_parallel_layout="Et*2|(tt|)*5t|tmL")
    check_arguments(args)
    layout = v_stage_layout(args)
    assert layout.layers == (2, 2, 2, 2, 2, 2, 1, 1) and layout.stages[-1].mtp == 1
    assert layout.rank_layers(0) == 3 and layout.rank_layers(1) == 3


def test_the_default_split_is_unchanged_without_the_flags():
    """No layer-placing flag: schedule.placement's even split (rank 0's chunks give up the
    missing layers first), and --num-layers < 2 x PP stays refused only then."""
    from megatron_vshape.megatron.stage_layout import v_stage_layout

    assert v_stage_layout(_placed("v-half", {})).layers == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="--num-layers must be >= 2 x"):
        check_arguments(_placed("v-half", {}, num_layers=3))
    check_arguments(_placed("v-half", {"pipeline_model_parallel_layout": "E|t|t|tL"},
                            num_layers=3))


@pytest.mark.parametrize("flags", [flags for flags, stages, _ in ACCEPTED_PLACEMENTS if stages])
def test_a_v_layout_prints_as_the_layout_flag_that_gives_it_back(flags):
    """megatron_layout() (what the planner prints for a V) parses back to the same stages."""
    from megatron_vshape.megatron.stage_layout import v_stage_layout

    layout = v_stage_layout(_placed("v-half", flags))
    again = v_stage_layout(_placed("v-half", {
        "pipeline_model_parallel_layout": layout.megatron_layout()}))
    assert again == layout
