"""The start-up checks of patch_megatron_lm: the megatron-core version first (versions.py), and
that Megatron-LM's loop will call the plugin's schedule (check_schedule_binding), against
stand-ins of megatron.training.training.

The real training code passes it in both real-loop tiers (tests/megatron/test_megatron_lm_e2e.py,
tests/megatron/test_megatron_lm_019.py, which look for its log line); here each way the binding can be
wrong is made on purpose, and the check must stop with what it found and what is supported.
No megatron import is needed.
"""
import sys
import types

import pytest

from megatron_vshape.megatron.install import ForwardBackwardGetter, VShapeConfig
from megatron_vshape.megatron.megatron_lm_patch import SUPPORTED, check_schedule_binding

_LOOP = '''
def train():
    return get_forward_backward_func()


def evaluate():
    return get_forward_backward_func(schedule_pg_collection=None)
'''
"""train() and evaluate() as Megatron-LM writes them: the module-global name, called."""


def megatrons_own(*args, **kwargs):
    """Stands in for megatron-core's get_forward_backward_func."""
    return "megatron's own schedule"


def _training(monkeypatch, source: str = _LOOP, binding=None):
    """A stand-in megatron.training.training built from ``source``, with ``binding`` as its
    get_forward_backward_func, in sys.modules for the duration of the test."""
    module = types.ModuleType("megatron.training.training")
    exec(compile(source, "<stand-in training.py>", "exec"), module.__dict__)
    module.get_forward_backward_func = binding
    monkeypatch.setitem(sys.modules, "megatron.training.training", module)
    return module


def test_the_installed_wrapper_passes(monkeypatch, caplog):
    config = VShapeConfig(schedule="v-half")
    _training(monkeypatch, binding=ForwardBackwardGetter(megatrons_own, config))
    with caplog.at_level("INFO", logger="megatron_vshape"):
        check_schedule_binding(config)
    assert "train() and evaluate() get their schedule from the plugin's" in caplog.text


def test_megatrons_own_function_is_refused_naming_it_and_the_supported_versions(monkeypatch):
    _training(monkeypatch, binding=megatrons_own)
    with pytest.raises(RuntimeError) as error:
        check_schedule_binding(VShapeConfig(schedule="v-half"))
    message = str(error.value)
    assert "--pipeline-schedule v-half" in message
    assert "megatron.training.training.train resolves get_forward_backward_func to" in message
    assert f"{__name__}.megatrons_own, not the plugin's wrapper" in message
    assert SUPPORTED in message and "core_v0.16.1" in message and "0.19.2" in message


def test_a_wrapper_of_another_configuration_is_refused(monkeypatch):
    other = VShapeConfig(schedule="v-zb")
    _training(monkeypatch, binding=ForwardBackwardGetter(megatrons_own, other))
    with pytest.raises(RuntimeError, match="a wrapper of schedule 'v-zb', not the one installed "
                                           r"\('v-half'\)"):
        check_schedule_binding(VShapeConfig(schedule="v-half"))


def test_a_local_import_is_refused(monkeypatch):
    """A Megatron-LM whose evaluate() imports the function itself bypasses the module global
    the plugin replaces, even when that global is the plugin's wrapper."""
    source = _LOOP.replace("def evaluate():\n", "def evaluate():\n    from megatron.core."
                           "pipeline_parallel import get_forward_backward_func\n")
    config = VShapeConfig(schedule="zb-1p")
    _training(monkeypatch, source, binding=ForwardBackwardGetter(megatrons_own, config))
    with pytest.raises(RuntimeError, match=r"training\.evaluate imports "
                                           "get_forward_backward_func itself"):
        check_schedule_binding(config)


def test_a_loop_that_never_asks_is_refused(monkeypatch):
    source = _LOOP.replace("return get_forward_backward_func()", "return None")
    config = VShapeConfig(schedule="auto")
    _training(monkeypatch, source, binding=ForwardBackwardGetter(megatrons_own, config))
    with pytest.raises(RuntimeError, match=r"training\.train does not call "
                                           "get_forward_backward_func"):
        check_schedule_binding(config)


def test_megatrons_own_schedules_need_no_check(monkeypatch, caplog):
    """1f1b runs megatron's own schedule whatever the binding: nothing to refuse."""
    _training(monkeypatch, binding=megatrons_own)
    with caplog.at_level("INFO", logger="megatron_vshape"):
        check_schedule_binding(VShapeConfig(schedule="1f1b"))
    assert "get their schedule from the plugin's" not in caplog.text


def test_patch_megatron_lm_refuses_an_unsupported_megatron_core_first(monkeypatch):
    """patch_megatron_lm asks versions.check_megatron_core_version before it imports or
    patches anything of Megatron-LM's."""
    from megatron_vshape.megatron import versions
    from megatron_vshape.megatron.megatron_lm_patch import patch_megatron_lm

    monkeypatch.setattr(versions, "installed_megatron_core_version", lambda: "0.21.0")
    monkeypatch.delenv(versions.OVERRIDE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # importing it would fail
    with pytest.raises(versions.UnsupportedMegatronError, match=r"megatron-core 0\.21\.0 is not "
                                                                "supported"):
        patch_megatron_lm()


def test_yaml_config_is_refused_where_megatron_lm_validates_it(monkeypatch):
    """--yaml-cfg replaces the command-line flags and skips validate_args (the plugin's hook):
    patch_megatron_lm makes validate_yaml, wherever Megatron-LM looks it up, refuse it."""
    from megatron_vshape.megatron.megatron_lm_patch import refuse_yaml_config

    modules = {}
    for name in ("megatron.training.yaml_arguments", "megatron.training.initialize"):
        modules[name] = types.ModuleType(name)
        modules[name].validate_yaml = lambda args, defaults={}: args
        monkeypatch.setitem(sys.modules, name, modules[name])
    refuse_yaml_config()
    refuse_yaml_config()  # idempotent
    for module in modules.values():
        with pytest.raises(ValueError, match="does not support --yaml-cfg.*pass the flags on the "
                                             "command line"):
            module.validate_yaml(types.SimpleNamespace(yaml_cfg="run.yaml"))
