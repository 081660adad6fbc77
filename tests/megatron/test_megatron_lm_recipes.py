"""NVIDIA's own Megatron-LM recipes through scripts/pretrain_gpt_vshape.py's argument parsing
and validation: which the script accepts under megatron's own schedules (no
``--pipeline-schedule``, ``1f1b``) and under each of the plugin's (zb-1p, v-min, v-half, v-zb,
auto), and that every refusal is one of the settings that stay refused.

The recipes are flag lists in tests/data/recipes/ (one file per recipe; README.md there says how
they were extracted from Megatron-LM's examples and release configs). Each goes through the
mechanical changes below (:func:`command_line`): its data flags replaced by mock data and a
null tokenizer, at least two pipeline stages, WORLD_SIZE for enough 8-GPU H100 nodes. Then
support.megatron_lm_parse runs, in one process per megatron-core version, Megatron-LM's real
parse_args with the script's extra_args_provider and the validate_args that patch_megatron_lm
installs, and the same flags through stock pretrain_gpt.py's path, without torch.distributed
or a model: about 10-20 s per environment on 2 cores. Both CI environments run this file:
megatron-core 0.16.1 with Megatron-LM core_v0.16.1, and 0.19.2 with the 0.19-era training code
(marker ``megatron_versions``)::

    python -m pytest -q -s tests/megatron/test_megatron_lm_recipes.py      # prints the counts
    MEGATRON_LM=../shared/megatron-lm-0.19 python -m pytest -q -m megatron_versions \
        tests/megatron/test_megatron_lm_recipes.py                          # megatron-core 0.19.2

Everything expected is data, so that the work lifting a refusal (grouped GEMM, MTP under a V,
context parallelism, FP8) changes only these tables: :data:`STAYS_REFUSED` (the refused rows of
features.py the recipes hit, with why each stays refused) and :data:`COUNTS`; what a training
code lacks or rejects is :data:`NEWER_FLAGS`, :data:`MODELOPT_FLAGS`, :data:`WORD_SPLIT` and
:data:`STOCK_REJECTS`; :data:`ADJUSTED` and :data:`INTERLEAVED` describe the recipes.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import megatron_vshape
from megatron_vshape.megatron.features import SETTINGS, Family, Verdict, family_of
from support.megatron_lm_launch import MEGATRON_LM, REPO, megatron_lm_env, unpaired_reason

pytestmark = [pytest.mark.megatron_versions, pytest.mark.slow]

DATA = Path(__file__).resolve().parents[1] / "data" / "recipes"
SCRIPT = REPO / "scripts" / "pretrain_gpt_vshape.py"
SOURCE = {"repo": "NVIDIA/Megatron-LM", "commit": "d98e8a64ddf34856e74b24714e3bedb2f5a39553"}
"""Where every recipe comes from (README.md)."""

SCHEDULES = (None, "1f1b", "zb-1p", "v-min", "v-half", "v-zb", "auto")
"""None: no --pipeline-schedule, megatron's own choice (stock pretrain_gpt.py's behaviour)."""
PLUGIN = tuple(s for s in SCHEDULES if s is not None and family_of(s) is not None)
V_NAMES = tuple(s for s in PLUGIN if family_of(s) is Family.V)

# -- the mechanical changes (README.md, "What the test changes") ---------------------------------
DATA_FLAGS = frozenset({
    "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
    "--data-cache-path", "--per-split-data-args-path", "--data-args-path", "--mock-data",
    "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file", "--vocab-size",
    "--tiktoken-pattern", "--tensorboard-dir", "--wandb-project", "--wandb-entity",
    "--wandb-exp-name", "--wandb-save-dir"})
"""Data, tokenizer and logging-destination flags: dropped, with their values."""
CHECKPOINT_FLAGS = frozenset({"--save", "--load"})
"""Kept (a row of features.py reads whether a run saves), with this path as the value."""
CHECKPOINT = "/nonexistent/vshape-recipes/checkpoints"
MOCK_VOCAB = "32000"
"""The null tokenizer's vocabulary where a recipe gives no --vocab-size of its own (no check
reads it)."""
GPUS_PER_NODE = 8

ADJUSTED = {
    "gptoss_02_train": ({"--pipeline-model-parallel-size": "4"},
                        "PP_SIZE=${WORLD_SIZE} (8 GPUs) does not divide its 12 layers: stock "
                        "pretrain_gpt.py stops at 'Number of layers should be divisible by the "
                        "pipeline-model-parallel size' (core_v0.16.1 arguments.py:570); 4 is "
                        "the largest PP up to 8 that divides 12"),
}
"""The only per-recipe change: (flag values set, why). Every other recipe only gets
--pipeline-model-parallel-size 2 where it has none or 1."""

# -- what this training code lacks -------------------------------------------------------------
NEWER_FLAGS = {
    "--step-batch-size-schedule": ("0.16", "a batch-size ramp by consumed samples, after "
                                   "core_v0.16.1"),
    "--eval-global-batch-size": ("0.16", "a validation batch size of its own, after "
                                 "core_v0.16.1"),
    "--megatron-fsdp-grad-comm-dtype": ("0.16", "Megatron-FSDP's dtype options, after "
                                        "core_v0.16.1"),
    "--megatron-fsdp-main-grads-dtype": ("0.16", "Megatron-FSDP's dtype options, after "
                                         "core_v0.16.1"),
}
"""Flags of the recipes (Megatron-LM main) that older training code does not parse: (the last
supported release lacking it, what it is). Stock pretrain_gpt.py of that code stops at them
("unrecognized arguments"); the test asserts that, then drops them with their values and goes
on (none changes how a pipeline schedule runs)."""
MODELOPT_FLAGS = frozenset({"--export-force-local-attention", "--enable-gpt-oss",
                            "--modelopt-enabled", "--export-te-mcore-model"})
"""nvidia-modelopt's flags (megatron/post_training/arguments.py), registered by pretrain_gpt.py
only where ``has_nvidia_modelopt`` (core_v0.16.1's post-training code imports without
modelopt; the 0.19 era's needs the ``modelopt`` package). Where they are not registered, stock
pretrain_gpt.py rejects a recipe using them, and so does the script: the recipe stops there."""

WORD_SPLIT = {
    "gpt3_175b": ("--step-batch-size-schedule",
                  "the script keeps --step-batch-size-schedule \"0:16 2.4B:320 ... 12B:1536\" in "
                  "an array it expands unquoted, so bash passes six words: a parser that knows "
                  "the flag takes the first and stops at the other five (unrecognized "
                  "arguments), stock pretrain_gpt.py as much as the script"),
}
"""Recipes whose launch splits one flag value into several words: (the flag, why). Where the
training code knows the flag the recipe stops at the stray words; where it lacks it
(:data:`NEWER_FLAGS`) they go with it."""

STOCK_REJECTS = {
    "megatron_fsdp_deepseek_v3": (
        "Number of layers should be divisible by the pipeline-model-parallel size",
        "DeepSeek-V3's 61 layers (a prime) on the PP 2 the test sets (the recipe has no "
        "pipeline parallelism): megatron's own schedules need PP to divide the layers, or "
        "--decoder-first/last-pipeline-num-layers"),
}
"""Recipes stock pretrain_gpt.py rejects after the changes: {name: (words of its error,
why)}. Not run further: the plugin's schedules are compared with what stock accepts."""

INTERLEAVED = frozenset({
    "gpt3_15b_8t_release_gb200", "gpt3_15b_8t_release_sm_gb200",
    "mixtral_8x7b_tp1pp4ep8vpp8_release", "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release",
    "deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release_sm"})
"""Recipes with virtual pipeline stages (--num-layers-per-virtual-pipeline-stage, or a
--pipeline-model-parallel-layout of more stages than PP): megatron's interleaved 1F1B runs them
when no --pipeline-schedule is given. The deepseekv3 *_gb_200_* recipes' layout has exactly PP
stages: 1F1B."""

# -- what stays refused --------------------------------------------------------------------------
FLEX = "--moe-token-dispatcher-type flex"
LAYOUT_STAGES = "--pipeline-model-parallel-layout of other than 2 x PP stages"
VPP_FLAGS = "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank"
VIRTUAL = ("virtual pipelining (more than one stage per rank, or a layout of more than PP "
           "stages)")
FP8_PARAMS = "--fp8-param-gather"
FP8_GROUPED = "--fp8-format with --moe-grouped-gemm"
TP_OVERLAP = "--tp-comm-overlap"
FSDP = "--use-torch-fsdp2, --use-megatron-fsdp"
MODELOPT = "nvidia-modelopt: a ModelOpt checkpoint, --export-kd-teacher-load (distillation)"

STAYS_REFUSED = (FLEX, LAYOUT_STAGES, VPP_FLAGS, VIRTUAL, FP8_PARAMS, FP8_GROUPED, TP_OVERLAP,
                 FSDP, MODELOPT)
"""features.py's refused rows (by their ``flags``) that NVIDIA's recipes use; why each stays
refused is the row's own ``why`` (``vshape features --refused``), printed with the counts. A
recipe refused for any other row fails the test, and so does a row here that a recipe uses
without being refused for it (lifted: remove it here, and update :data:`COUNTS`)."""

COUNTS = {
    "0.16": {"recipes": 19, "reached": 19, "stock": 18, "1f1b": 13, "zb-1p": 7, "v-min": 7,
             "v-half": 7, "v-zb": 7, "auto": 7,
             "refused under V": {FLEX: 4, LAYOUT_STAGES: 2, VPP_FLAGS: 3,
                                 FP8_PARAMS: 3, FP8_GROUPED: 1, TP_OVERLAP: 2, FSDP: 1,
                                 MODELOPT: 1},
             "refused under zb-1p": {VIRTUAL: 5, FLEX: 4, FP8_PARAMS: 3, FP8_GROUPED: 1,
                                     TP_OVERLAP: 2, FSDP: 1, MODELOPT: 1}},
    "0.19": {"recipes": 19, "reached": 16, "stock": 15, "1f1b": 10, "zb-1p": 6, "v-min": 6,
             "v-half": 6, "v-zb": 6, "auto": 6,
             "refused under V": {FLEX: 4, LAYOUT_STAGES: 2, VPP_FLAGS: 3,
                                 FP8_PARAMS: 2, TP_OVERLAP: 2, FSDP: 1},
             "refused under zb-1p": {VIRTUAL: 5, FLEX: 4, FP8_PARAMS: 2,
                                     TP_OVERLAP: 2, FSDP: 1}},
}
"""Per training code: recipes in total; reached (parsed, past :data:`MODELOPT_FLAGS` and
:data:`WORD_SPLIT`); accepted by stock pretrain_gpt.py (the same as with no
--pipeline-schedule); accepted under 1f1b, zb-1p and each V; and per refused row the recipes
stock accepts that it stops under a V, and under zb-1p."""


@dataclass(frozen=True)
class Recipe:
    name: str
    source: dict
    env: dict
    flags: tuple
    """The flags as groups: an option and its values."""


@lru_cache(maxsize=None)
def recipes() -> tuple:
    found = []
    for path in sorted(DATA.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        found.append(Recipe(path.stem, data["source"], data["env"],
                            tuple(tuple(group) for group in data["flags"])))
    return tuple(found)


def _value(groups, option, default=None):
    values = [group[1] for group in groups if group[0] == option]
    return values[-1] if values else default


def _with(groups, option, value) -> list:
    """``groups`` with ``option`` set to ``value`` (its last occurrence replaced, or added)."""
    kept = [group for group in groups if group[0] != option]
    return kept + [(option, value)]


def mock_data(groups) -> list:
    """Data flags out, checkpoints to a placeholder path, mock data and a null tokenizer in."""
    vocab = _value(groups, "--vocab-size", MOCK_VOCAB)
    changed = [(g[0], CHECKPOINT) if g[0] in CHECKPOINT_FLAGS else g for g in groups
               if g[0] not in DATA_FLAGS]
    return changed + [("--mock-data",), ("--tokenizer-type", "NullTokenizer"),
                      ("--vocab-size", vocab)]


def pipelined(name: str, groups) -> list:
    """:data:`ADJUSTED`'s values, then at least two pipeline stages."""
    for option, value in ADJUSTED.get(name, ({}, ""))[0].items():
        groups = _with(groups, option, value)
    if int(_value(groups, "--pipeline-model-parallel-size", "1")) < 2:
        groups = _with(groups, "--pipeline-model-parallel-size", "2")
    return groups


def world_size(groups) -> int:
    """The fewest 8-GPU nodes' GPUs that TP x PP x CP and expert-TP x EP x PP divide."""
    size = {option: int(_value(groups, option, "1")) for option in (
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
        "--context-parallel-size", "--expert-model-parallel-size")}
    tp, pp = size["--tensor-model-parallel-size"], size["--pipeline-model-parallel-size"]
    etp = int(_value(groups, "--expert-tensor-parallel-size", str(tp)))
    return math.lcm(GPUS_PER_NODE, tp * pp * size["--context-parallel-size"],
                    etp * size["--expert-model-parallel-size"] * pp)


def command_line(recipe: Recipe) -> tuple:
    """(argv, WORLD_SIZE) of a recipe after the mechanical changes."""
    groups = pipelined(recipe.name, mock_data(recipe.flags))
    argv = [word for group in groups for word in group]
    return argv, world_size(groups)


# -- the run ---------------------------------------------------------------------------------------
def _training_code() -> str:
    """'0.16' to '0.20': the supported pair this environment is (:data:`PAIRS`), else skip."""
    reason = unpaired_reason(PAIRS)
    if reason is not None:
        pytest.skip(f"{reason} (each release with its own Megatron-LM tag's code)")
    return ".".join(version("megatron-core").split(".")[:2])


PAIRS = (("0.16", False), ("0.17", False), ("0.18", True), ("0.19", True), ("0.20", True))
"""(megatron-core release, whether its training code takes a config container) of the
supported pairs: 0.18 introduced the container; 0.20 is main's (core and code of one commit)."""


def _request(code: str) -> dict:
    droppable = sorted(flag for flag, (last, _) in NEWER_FLAGS.items()
                       if _release(code) <= _release(last))
    cases = []
    for recipe in recipes():
        argv, size = command_line(recipe)
        cases.append({"name": recipe.name, "argv": argv, "env": recipe.env, "world_size": size,
                      "droppable": droppable, "schedules": list(SCHEDULES)})
    return {"script": str(SCRIPT), "recipes": cases}


def _release(text: str) -> tuple:
    return tuple(int(part) for part in text.split("."))


@pytest.fixture(scope="module")
def parsed():
    """One worker process for every recipe under every schedule."""
    code = _training_code()
    env = megatron_lm_env([REPO])
    result = subprocess.run([sys.executable, "-m", "support.megatron_lm_parse"],
                            input=json.dumps(_request(code)), capture_output=True, text=True,
                            cwd=REPO, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    reply = json.loads(result.stdout)
    assert Path(reply["plugin"]) == Path(megatron_vshape.__file__), "another checkout's plugin"
    reply["code"] = code
    reply["by_name"] = {r["name"]: r for r in reply["recipes"]}
    return reply


# -- reading the replies ---------------------------------------------------------------------------
ROWS = {row.flags: row for row in SETTINGS}


def refused_rows(message: str, schedule: str) -> list:
    """The rows of features.py an error of the plugin's checks names, by their ``flags``."""
    return [row.flags for row in SETTINGS
            if f"--pipeline-schedule {schedule} {row.why}" in message]


def problem_count(message: str) -> int:
    """How many problems one error of check_arguments lists (a header counts them)."""
    match = re.match(r"(\d+) settings stop this run", message)
    return int(match.group(1)) if match else 1


def has_fields(row, code: str, modelopt: bool) -> bool:
    """Whether this training code's parser should have every field the row reads."""
    if row.since == "modelopt":
        present = modelopt
    else:
        present = not row.since or _release(code) >= _release(row.since)
    return present and (not row.until or _release(code) <= _release(row.until))


def _options(recipe: Recipe) -> set:
    return {group[0] for group in recipe.flags}


def _lacking(code: str, modelopt: bool) -> set:
    """The recipes' options this training code's parser lacks."""
    newer = {flag for flag, (last, _) in NEWER_FLAGS.items()
             if _release(code) <= _release(last)}
    return newer | (set() if modelopt else MODELOPT_FLAGS)


def _expected_stop(recipe: Recipe, code: str, modelopt: bool) -> list:
    """The words a recipe stops at here: nvidia-modelopt's flags (with their values) where
    they are not registered, the stray words of :data:`WORD_SPLIT` where the flag is known."""
    lacking = _lacking(code, modelopt)
    words = [w for group in recipe.flags if group[0] in lacking & MODELOPT_FLAGS for w in group]
    split = WORD_SPLIT.get(recipe.name, (None,))[0]
    if split is not None and split not in lacking:
        words += [w for group in recipe.flags if group[0] == split for w in group[2:]]
    return words


def _reached(parsed) -> list:
    """(recipe, reply) of the recipes whose flags this training code parses (after
    :data:`NEWER_FLAGS` are dropped)."""
    return [(recipe, parsed["by_name"][recipe.name]) for recipe in recipes()
            if "stopped" not in parsed["by_name"][recipe.name]]


def _stock_accepted(parsed) -> list:
    return [(recipe, reply) for recipe, reply in _reached(parsed)
            if reply["stock"]["outcome"] == "accepted"]


def _refusals(reply: dict, schedule: str) -> list:
    run = reply["runs"][schedule]
    return [] if run["outcome"] == "accepted" else refused_rows(run["message"], schedule)


# -- the tests -------------------------------------------------------------------------------------
def test_recipe_files_hold_flags_and_their_source():
    """Every recipe names its source at the one commit, holds option groups only, and after
    the mechanical changes no placeholder of a path is left."""
    assert len(recipes()) == 19
    for recipe in recipes():
        assert {k: recipe.source[k] for k in SOURCE} == SOURCE, recipe.name
        assert recipe.source["path"].endswith((".sh", "model_config.yaml")), recipe.name
        assert all(group[0].startswith("--") for group in recipe.flags), recipe.name
        assert all(isinstance(v, str) for v in recipe.env.values()), recipe.name
        argv, size = command_line(recipe)
        assert "$" not in " ".join(argv), (recipe.name, argv)
        assert size % GPUS_PER_NODE == 0
    for flags in STAYS_REFUSED:
        assert flags in ROWS, f"STAYS_REFUSED names no row of features.py: {flags!r}"
        assert Verdict.REFUSED in (ROWS[flags].v, ROWS[flags].zb)


def test_flags_the_training_code_lacks_stop_stock_and_the_script_alike(parsed):
    """The script parses exactly what stock pretrain_gpt.py parses: a recipe flag this code
    lacks is unknown to both, stock stops at it ("unrecognized arguments"). Flags newer than
    this code are dropped and the recipe goes on; nvidia-modelopt's, where pretrain_gpt.py does
    not register them, stop the recipe: stock rejects it too."""
    code, modelopt = parsed["code"], parsed["has_nvidia_modelopt"]
    lacking = _lacking(code, modelopt)
    for recipe in recipes():
        reply = parsed["by_name"][recipe.name]
        unknown, stop = _options(recipe) & lacking, _expected_stop(recipe, code, modelopt)
        assert {w for w in reply["unknown"] if w.startswith("--")} == unknown, recipe.name
        assert reply["unknown"] == reply["unknown_stock"], recipe.name
        if reply["unknown"]:
            assert reply["as_is"]["outcome"] == "SystemExit", (recipe.name, reply["as_is"])
        assert reply.get("stopped", []) == stop, recipe.name
        if stop:
            why = ("nvidia-modelopt's flags are not registered" if set(stop) & MODELOPT_FLAGS
                   else WORD_SPLIT[recipe.name][0] + " split into words")
            print(f"{recipe.name}: rejected by stock pretrain_gpt.py too ({code}: {why}): "
                  f"unrecognized {stop}")


def test_without_a_schedule_the_script_runs_what_stock_runs(parsed):
    """No --pipeline-schedule: the same verdict as stock pretrain_gpt.py, megatron's own
    schedule installed (interleaved 1F1B with virtual pipeline stages, else 1F1B, also for a
    layout of exactly PP stages); --pipeline-schedule 1f1b the same, refused only where the
    flags ask for virtual stages."""
    for recipe, reply in _reached(parsed):
        stock, default = reply["stock"], reply["runs"]["default"]
        rejected = STOCK_REJECTS.get(recipe.name)
        if rejected is not None:
            assert stock["outcome"] != "accepted" and rejected[0] in stock["message"], stock
        else:
            assert stock["outcome"] == "accepted", (recipe.name, stock)
        assert default["outcome"] == stock["outcome"], (recipe.name, default, stock)
        if default["outcome"] != "accepted":
            assert default["message"] == stock["message"]
            continue
        want = "interleaved-1f1b" if recipe.name in INTERLEAVED else "1f1b"
        assert (default["pipeline_schedule"], default["installed"], default["ours"]) == \
            (want, want, False), recipe.name
        one = reply["runs"]["1f1b"]
        if recipe.name in INTERLEAVED:
            assert one["outcome"] == "plugin" and one["message"].startswith(
                "--pipeline-schedule 1f1b runs one chunk per rank"), (recipe.name, one)
        else:
            assert (one["outcome"], one["installed"], one["ours"]) == ("accepted", "1f1b", False)


def test_plugin_schedules_accept_what_stock_accepts_but_settings_that_stay_refused(parsed):
    """Every recipe stock accepts runs under zb-1p and every V, or is refused by the plugin's
    checks (never by a Megatron-LM check stock passed) for rows of :data:`STAYS_REFUSED` only;
    every row there that a recipe uses here still refuses it (test_counts holds which rows
    each training code's recipes hit); the four V schedules agree."""
    hit, used = set(), set()
    for recipe, reply in _stock_accepted(parsed):
        used.update(reply["used"])
        for schedule in PLUGIN:
            run, rows = reply["runs"][schedule], _refusals(reply, schedule)
            if run["outcome"] == "accepted":
                assert (run["installed"], run["ours"]) == (schedule, True), (recipe.name, run)
            else:
                assert run["outcome"] == "plugin" and rows, (recipe.name, schedule, run)
            unlisted = set(rows) - set(STAYS_REFUSED)
            assert not unlisted, f"{recipe.name} under {schedule}: refused for {unlisted}"
            hit.update(rows)
        assert len({tuple(_refusals(reply, s)) for s in V_NAMES}) == 1, recipe.name
    stale = {flags for flags in STAYS_REFUSED if flags in used and flags not in hit}
    assert not stale, f"recipes use these, and are no longer refused for them: {stale}"


def test_one_error_lists_every_refused_setting_a_recipe_uses(parsed):
    """A refused recipe gets one error listing every refused row it uses: the rows features.py
    finds used on the arguments as Megatron-LM's validate_args leaves them (stock), e.g. the
    DeepSeek-V3 proxy's layout, fully parallel save with MTP, and flex dispatcher under a V."""
    for recipe, reply in _stock_accepted(parsed):
        for schedule in PLUGIN:
            family, run = family_of(schedule), reply["runs"][schedule]
            want = sorted(f for f in reply["used"] if ROWS[f].verdict(family) is Verdict.REFUSED)
            rows = _refusals(reply, schedule)
            assert sorted(rows) == want, (recipe.name, schedule, run)
            if rows:
                assert problem_count(run["message"]) == len(rows), (recipe.name, run)
    deepseek = parsed["by_name"]["deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release"]
    assert set(_refusals(deepseek, "v-half")) == {FLEX}  # its layout: 2 x PP stages, V order
    gb200 = parsed["by_name"]["deepseekv3_proxy_flex_tp2pp2emp16etp1cp1_gb_200_release"]
    assert set(_refusals(gb200, "v-half")) == {LAYOUT_STAGES, FLEX}  # PP stages: 1F1B's
    assert set(_refusals(deepseek, "zb-1p")) == {VIRTUAL, FLEX}


def counts(parsed) -> dict:
    """:data:`COUNTS`' numbers for this training code."""
    reached, accepted = _reached(parsed), _stock_accepted(parsed)

    def under(schedule):
        return sum(r["runs"][schedule]["outcome"] == "accepted" for _, r in accepted)

    found = {"recipes": len(recipes()), "reached": len(reached), "stock": len(accepted),
             "1f1b": under("1f1b"), **{s: under(s) for s in PLUGIN}}
    for family, schedule in (("V", "v-half"), ("zb-1p", "zb-1p")):
        rows = Counter(f for _, reply in accepted for f in _refusals(reply, schedule))
        found[f"refused under {family}"] = dict(sorted(rows.items()))
    return found


def test_counts(parsed):
    """The numbers of the report (printed), as expected for this training code."""
    if parsed["code"] not in COUNTS:
        pytest.skip(f"the recipes are counted on {sorted(COUNTS)}, not {parsed['code']}")
    found = counts(parsed)
    print(f"\nNVIDIA's Megatron-LM recipes under megatron-core {parsed['megatron_core']} "
          f"({MEGATRON_LM}):")
    for key, value in found.items():
        print(f"  {key}: {value}")
    print("  why each stays refused:")
    for flags in STAYS_REFUSED:
        print(f"    {flags}: {ROWS[flags].why}")
    assert found == COUNTS[parsed["code"]]
    listed = {flags for table in COUNTS.values() for key in ("refused under V",
              "refused under zb-1p") for flags in table[key]}
    assert listed == set(STAYS_REFUSED), "STAYS_REFUSED and COUNTS name other rows"


@pytest.mark.megatron_matrix
def test_every_field_a_row_reads_is_in_megatron_lms_parser(parsed):
    """features.py's ``reads`` against the namespace Megatron-LM's parse_args returns here:
    every field present where the row's ``since``/``until`` say so (and some absent where they
    say not), and every field a row's ``used`` read on the recipes listed in its ``reads``. A
    renamed flag upstream would otherwise switch a refusal off silently."""
    code, modelopt, fields = parsed["code"], parsed["has_nvidia_modelopt"], set(parsed["fields"])
    for row in SETTINGS:
        missing = [name for name in row.reads if name not in fields]
        if has_fields(row, code, modelopt):
            assert not missing, f"{row.flags!r} reads {missing}, not in Megatron-LM's parser"
        else:
            assert missing, f"{row.flags!r}: since={row.since!r} until={row.until!r}, yet " \
                            f"every field is in {code}'s parser"
    read = {}
    for _, reply in _reached(parsed):
        for flags, names in (reply.get("read") or {}).items():
            read.setdefault(flags, set()).update(names)
    unlisted = {row.flags: sorted(read[row.flags] - set(row.reads)) for row in SETTINGS
                if not read[row.flags] <= set(row.reads)}
    assert not unlisted, f"rows whose used() reads fields their reads do not list: {unlisted}"
