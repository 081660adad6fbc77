"""scripts/pretrain_gpt_vshape.py's flags: parsing, and bad combinations refused at parsing.

Fast unit tests of the checks: Megatron-LM's argument namespace is stood in for by the fields
the checks read, with Megatron-LM's defaults. Through Megatron-LM's real parse_args and
validate_args the same refusals are run by tests/test_megatron_lm_e2e.py.
"""
import argparse

import pytest

from megatron_vshape.megatron.megatron_lm import add_arguments, check_arguments, vshape_config
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
    (["--pipeline-schedule", "v-half"], {"pipeline_model_parallel_layout": "Et|tL"},
     "stage s lives on rank s % p"),
    (["--pipeline-schedule", "v-half"], {"account_for_loss_in_pipeline_split": True},
     "num_layers = k x PP - 2"),
    (["--pipeline-schedule", "auto"], {"num_experts": 8}, "MoE (--num-experts)"),
    (["--pipeline-schedule", "v-half"], {"context_parallel_size": 2}, "--context-parallel-size 1"),
    (["--pipeline-schedule", "v-half"], {"use_legacy_models": True}, "drop --use-legacy-models"),
    (["--pipeline-schedule", "v-half"], {"use_torch_fsdp2": True}, "drop --use-torch-fsdp2"),
    (["--pipeline-schedule", "v-half"], {"delay_wgrad_compute": True},
     "drop it"),
    (["--pipeline-schedule", "interleaved-1f1b"], {},
     "needs --num-virtual-stages-per-pipeline-rank"),
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


def test_the_papers_uneven_layer_counts_are_accepted():
    """30 layers on PP = 8 (k x p - 2): rank 0's chunks take the two missing layers."""
    check_arguments(_args(["--pipeline-schedule", "v-half"], pipeline_model_parallel_size=8))
    check_arguments(_args(["--pipeline-schedule", "interleaved-1f1b"],
                          num_virtual_stages_per_pipeline_rank=2))
