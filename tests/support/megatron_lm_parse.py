"""Megatron-LM's argument parsing and validation, as ``scripts/pretrain_gpt_vshape.py`` runs
them, for many command lines in one process: no torch.distributed, no model.

tests/megatron/test_megatron_lm_recipes.py sends NVIDIA's recipes here (one process per
megatron-core version, with that version's training code on the path). Each command line goes
through what the script's start does before any process group exists: Megatron-LM's real
``parse_args`` with the script's ``extra_args_provider`` (the plugin's flags, and
nvidia-modelopt's where pretrain_gpt.py registers them), then the ``validate_args`` that
``patch_megatron_lm`` installs (the plugin's checks, Megatron-LM's own, the schedule installed).
The same command line also goes through stock pretrain_gpt.py's path (its own provider,
Megatron-LM's unwrapped validate_args), so a test can compare the two.

Protocol (``python -m support.megatron_lm_parse``): one JSON request on stdin::

    {"script": path,
     "recipes": [{"name", "argv", "env", "world_size", "droppable", "schedules"}]}

``argv``: the flags; ``env``: variables the recipe exports; ``world_size``: torchrun's
WORLD_SIZE (rank 0 is emulated); ``droppable``: options that may be unknown to this training
code (dropped with their values if the parser does not know them; any other word the parser
does not know then stops the recipe); ``schedules``: ``--pipeline-schedule`` values to run,
null for none. One JSON reply on stdout (:func:`serve`); an accepted run names the schedule
installed and, under a V, the layers of each V stage (``stage_layers``). The CPU patches are
support.megatron_lm_cpu's, plus the parser speed-up below; everything printed on the way goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import sys
import traceback
from importlib.metadata import version
from pathlib import Path

__all__ = ["serve", "ENV_HELD"]

ENV_HELD = ("CUDA_DEVICE_MAX_CONNECTIONS",)
"""Variables that Megatron-LM's validate_args reads and the launch environment sets
(support.megatron_lm_launch.megatron_lm_env): cleared, so each recipe has only its own."""


def _memoize_field_docstrings() -> None:
    """Speed only: ArgumentGroupFactory reads and parses each config dataclass's source for
    its fields' help texts on every parse_args (core_v0.16.1 training/argument_utils.py:68,
    0.19 :92, calling _get_field_docstrings at :209 / :233): about 0.15 s of each parse.
    Memoized per class; the parser built is the same."""
    from megatron.training import argument_utils

    factory = argument_utils.ArgumentGroupFactory
    original = factory._get_field_docstrings
    if getattr(original, "vshape_memo", False):
        return
    memo = {}

    @functools.wraps(original)
    def field_docstrings(self, src_cfg_class):
        if src_cfg_class not in memo:
            memo[src_cfg_class] = original(self, src_cfg_class)
        return dict(memo[src_cfg_class])

    field_docstrings.vshape_memo = True
    factory._get_field_docstrings = field_docstrings


class _Setup:
    """Megatron-LM imported and patched once: the script's and stock's providers, the
    wrapped and the original validate_args."""

    def __init__(self, script: str):
        from support.megatron_lm_cpu import install_megatron_lm_cpu_patches

        install_megatron_lm_cpu_patches()
        _memoize_field_docstrings()
        import pretrain_gpt
        from megatron.training import arguments

        from megatron_vshape.megatron.megatron_lm_patch import patch_megatron_lm

        spec = importlib.util.spec_from_file_location("pretrain_gpt_vshape", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.arguments, self.script = arguments, module
        self.has_modelopt = bool(getattr(pretrain_gpt, "has_nvidia_modelopt", False))
        self.script_provider = module._extra_args_provider(pretrain_gpt)
        self.stock_provider = pretrain_gpt.add_modelopt_args if self.has_modelopt else None
        patch_megatron_lm()
        self.validate = arguments.validate_args
        self.stock_validate = self.validate.vshape_original

    def unknown(self, argv: list, provider) -> list:
        """What the parser parse_args builds leaves unrecognised in ``argv``."""
        parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
        parser = self.arguments.add_megatron_arguments(parser)
        if provider is not None:
            parser = provider(parser)
        return parser.parse_known_args(argv)[1]


def _groups(argv: list) -> list:
    """``argv`` as option groups: an option and the words after it up to the next option."""
    groups = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


@contextlib.contextmanager
def _environment(env: dict, world_size: int):
    """The recipe's exported variables and torchrun's WORLD_SIZE / RANK for rank 0, then the
    process environment as it was."""
    saved = dict(os.environ)
    for name in ENV_HELD:
        os.environ.pop(name, None)
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _failure(err: BaseException) -> dict:
    """An exception as the reply records it: its kind, message and innermost frame. A
    SystemExit is argparse's error (its message went to stderr)."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    kind = type(err).__name__
    if isinstance(err, ValueError) and frame.name == "check_arguments" and \
            frame.filename.endswith(os.path.join("megatron_vshape", "megatron", "arguments.py")):
        kind = "plugin"
    return {"outcome": kind, "message": str(err),
            "where": f"{Path(frame.filename).name}:{frame.lineno}"}


def _run(setup: _Setup, argv: list, provider, validate) -> tuple:
    """parse_args (reading sys.argv, as Megatron-LM does) and validate_args: (reply, args)."""
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            args = setup.arguments.parse_args(provider)
            validate(args, dict(setup.script._ARGS_DEFAULTS))
    except (Exception, SystemExit) as err:  # noqa: BLE001 -- every failure is the reply
        return _failure(err), None
    return {"outcome": "accepted"}, args


def _installed() -> dict:
    """The schedule the plugin installed in Megatron-LM's training loop."""
    from megatron.training import training

    getter = training.get_forward_backward_func
    config = getattr(getter, "config", None)
    layers = getattr(config, "stage_layers", None)
    return {"installed": getattr(config, "schedule", None),
            "ours": getattr(getter, "ours", None) is not None,
            "stage_layers": list(layers) if layers is not None else None}


class _Reading:
    """An argument namespace that notes every field read from it."""

    def __init__(self, args):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "fields", set())

    def __getattr__(self, name):
        self.fields.add(name)
        return getattr(self._args, name)


def _used_rows(args) -> tuple:
    """features.py's rows whose ``used`` holds on ``args`` (after Megatron-LM's validate_args),
    and the fields each row's ``used`` read."""
    from megatron_vshape.megatron.features import SETTINGS

    used, read = [], {}
    for row in SETTINGS:
        reading = _Reading(args)
        if row.used(reading):
            used.append(row.flags)
        read[row.flags] = sorted(reading.fields)
    return used, read


def _recipe(setup: _Setup, recipe: dict) -> dict:
    argv, reply = recipe["argv"], {"name": recipe["name"]}
    with _environment(recipe["env"], recipe["world_size"]):
        reply["unknown"] = setup.unknown(argv, setup.script_provider)
        reply["unknown_stock"] = setup.unknown(argv, setup.stock_provider)
        if reply["unknown"]:
            reply["as_is"] = _run(setup, argv, setup.stock_provider, setup.stock_validate)[0]
        dropped = {w for w in reply["unknown"] if w in recipe["droppable"]}
        argv = [w for group in _groups(argv) if group[0] not in dropped for w in group]
        stray = setup.unknown(argv, setup.script_provider)
        if stray:
            reply["stopped"] = stray
            return reply
        reply["stock"], stock_args = _run(setup, argv, setup.stock_provider, setup.stock_validate)
        if stock_args is not None:
            reply["used"], reply["read"] = _used_rows(stock_args)
        reply["runs"] = {}
        for schedule in recipe["schedules"]:
            flags = argv + (["--pipeline-schedule", schedule] if schedule else [])
            run, args = _run(setup, flags, setup.script_provider, setup.validate)
            if args is not None:
                run.update(_installed(), pipeline_schedule=args.pipeline_schedule)
            reply["runs"][schedule or "default"] = run
    return reply


def _fields(setup: _Setup) -> list:
    """The fields of the namespace parse_args returns for the script's parser (no flags)."""
    with _environment({}, 1):
        sys.argv = ["pretrain_gpt.py"]
        with contextlib.redirect_stdout(sys.stderr):
            return sorted(vars(setup.arguments.parse_args(setup.script_provider)))


def serve() -> None:
    """Answer one request (module doc): megatron-core's version, whether modelopt's flags are
    registered, the parser's fields, and per recipe what its flags met."""
    protocol, sys.stdout = sys.stdout, sys.stderr
    request = json.load(sys.stdin)
    setup = _Setup(request["script"])
    import megatron_vshape

    reply = {"megatron_core": version("megatron-core"), "has_nvidia_modelopt": setup.has_modelopt,
             "plugin": megatron_vshape.__file__,
             "fields": _fields(setup),
             "recipes": [_recipe(setup, recipe) for recipe in request["recipes"]]}
    json.dump(reply, protocol)
    protocol.flush()


if __name__ == "__main__":
    serve()
