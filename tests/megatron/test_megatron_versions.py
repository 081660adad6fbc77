"""The megatron-core version check (megatron/versions.py) and install()'s use of it.

The version is monkeypatched: supported releases pass, others raise naming the version found,
the supported series and the override, and VSHAPE_ALLOW_UNSUPPORTED_MEGATRON=1 turns the error
into a logged warning; 0.20.x (megatron-core main's series) passes with one warning naming the
main commit it was tested on. The reading itself is checked against the installed distribution.
"""
import importlib.metadata
import logging

import pytest

from megatron_vshape.megatron import versions
from megatron_vshape.megatron.versions import (OVERRIDE_ENV, UnsupportedMegatronError,
                                               check_megatron_core_version, is_preview,
                                               is_supported)

pytestmark = [pytest.mark.megatron_versions, pytest.mark.megatron_matrix]


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0",
                                     "0.18.2", "0.19.0", "0.19.1", "0.19.2",
                                     "0.19.2+1a2b3c4"])
def test_supported_releases_pass(version):
    assert is_supported(version)
    assert check_megatron_core_version(version, environ={}) == version


@pytest.mark.parametrize("version", ["0.15.3", "0.21.0", "0.21.1", "1.16.0", "1.20.0",
                                     "0.19.0rc1", "0.20.0rc1", "0.16.0.dev0", "garbage"])
def test_unsupported_versions_raise_naming_found_supported_and_override(version):
    assert not is_supported(version) and not is_preview(version)
    with pytest.raises(UnsupportedMegatronError) as err:
        check_megatron_core_version(version, environ={OVERRIDE_ENV: "0"})
    message = str(err.value)
    assert f"megatron-core {version} is not supported" in message
    assert "0.16.x, 0.17.x, 0.18.x, 0.19.x" in message
    assert f"{OVERRIDE_ENV}=1" in message


@pytest.mark.parametrize("version", ["0.20.0", "0.20.3", "0.20.0+d98e8a6"])
def test_main_series_passes_with_one_warning_naming_the_main_commit(version, caplog):
    """0.20 is let in for its release day: one warning line, naming main's commit, and no
    override needed."""
    assert is_preview(version) and not is_supported(version)
    with caplog.at_level(logging.WARNING, logger=versions.__name__):
        assert check_megatron_core_version(version, environ={}) == version
    (record,) = [r for r in caplog.records if r.name == versions.__name__]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "\n" not in message
    assert f"megatron-core {version}" in message and "main d98e8a6" in message
    assert "not on a 0.20 release" in message


def test_override_warns_and_returns_the_version(caplog):
    with caplog.at_level(logging.WARNING, logger=versions.__name__):
        assert check_megatron_core_version("0.21.0", environ={OVERRIDE_ENV: "1"}) == "0.21.0"
    (record,) = [r for r in caplog.records if r.name == versions.__name__]
    assert record.levelno == logging.WARNING
    assert "0.21.0 is not supported" in record.getMessage()
    assert OVERRIDE_ENV in record.getMessage()


def test_missing_megatron_core_is_an_import_error(monkeypatch):
    monkeypatch.setattr(versions, "installed_megatron_core_version", lambda: None)
    with pytest.raises(ImportError, match="megatron-core is not installed.*0.16.x, 0.17.x, 0.18.x, 0.19.x"):
        check_megatron_core_version(environ={})


def test_installed_version_is_the_distributions():
    """Both readings (the package_info.py an import would load, read as text, and the
    distribution's metadata) agree with what CI installed, and it is supported."""
    pytest.importorskip("torch")  # the megatron tier's environments
    try:
        expected = importlib.metadata.version("megatron-core").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed")
    assert versions.package_info_version() == expected
    assert versions.installed_megatron_core_version() == expected
    assert is_supported(expected) or is_preview(expected), \
        f"CI runs megatron-core {expected}: not a supported release"


def test_install_checks_the_version_first(monkeypatch):
    """install() refuses an unsupported megatron-core before wrapping anything; the override
    lets it install (with a warning)."""
    pytest.importorskip("torch")
    from support.megatron_cpu import importorskip_megatron

    importorskip_megatron()
    import megatron.core.pipeline_parallel.schedules as schedules

    import megatron_vshape

    original = schedules.get_forward_backward_func
    monkeypatch.setattr(versions, "installed_megatron_core_version", lambda: "0.21.0")
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    with pytest.raises(UnsupportedMegatronError, match="megatron-core 0.21.0 is not supported"):
        megatron_vshape.install(schedule="v-half")
    assert schedules.get_forward_backward_func is original  # nothing was wrapped
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    try:
        megatron_vshape.install(schedule="v-half")
        assert schedules.get_forward_backward_func is not original
    finally:
        megatron_vshape.uninstall()
    assert schedules.get_forward_backward_func is original
