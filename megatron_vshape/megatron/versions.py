"""Which megatron-core releases the plugin supports: the one place that says so.

The plugin reaches into megatron-core beyond its public API (the schedule functions' keyword
contract, ``get_forward_backward_func``'s bindings, the layer-placement functions, the linear
layers' autograd Function, DDP's delayed weight-gradient hooks, dist_checkpointing's keys;
every such name is listed in touch_points.py and checked after the version), so
a release is supported only where the megatron-core tier (tests marked ``megatron_versions``)
has run against it:

    series  releases            why
    0.16    0.16.0, 0.16.1      the tier's first environment (0.16.1); 0.16.0 differs in no
                                file the plugin uses (diffed: the async checkpoint worker's
                                cleanup, the Mamba block)
    0.17    0.17.0, 0.17.1      the matrix tier (0.17.1 with Megatron-LM core_v0.17.1, whose
                                pretrain() still parses the flags itself, as 0.16's); 0.17.0
                                differs in no way the plugin uses (diffed: NVFP4 optimizer
                                shards, HybridEP options, TE extra state unpickled safely)
    0.18    0.18.0 - 0.18.2     the matrix tier (0.18.2 with core_v0.18.2, the first training
                                code with a config container; its pretrain() takes the model
                                provider third, 0.19's by keyword); 0.18.0 and 0.18.1 differ from
                                0.18.2 in package_info and a model-parallel config default only
    0.19    0.19.0 - 0.19.2     the second environment (0.19.2); 0.19.0 and 0.19.1 (yanked
                                upstream as a wrong version) differ from 0.19.2 in no file the
                                plugin uses (diffed: FP8/FP4 contexts, inference endpoints, MTP
                                layer)

The matrix tier (.ci/megatron-versions, tests marked ``megatron_matrix``) runs the demo, every
schedule in the real loop, the distributed optimizer, MoE with EP, a resume across schedules,
the version gate and the refusal-flag check; the 0.19 environment runs every test marked
``megatron_versions``. 0.20 is megatron-core main's series, unreleased: the matrix tier runs
on Megatron-LM main d98e8a6 (its megatron-core says 0.20.0), so a 0.20.x release is let in on
its release day, with a one-line warning naming that commit, until a 0.20 release is tested
(:data:`PREVIEW_SERIES`). 0.15 and older and 0.21 on are not tested in CI, so not supported
(0.15: see :data:`SUPPORTED_SERIES`); pre-releases (``rc``, ``dev``) are not releases of a
series.
``VSHAPE_ALLOW_UNSUPPORTED_MEGATRON=1`` lets :func:`check_megatron_core_version` pass with a
logged warning instead, at the user's risk.

The version is read without importing megatron-core (which needs triton at import from 0.17
on, and whose import would already run code the check is meant to vet): from the
``megatron/core/package_info.py`` Python would import, else the installed distribution's
metadata.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path
from typing import Mapping

__all__ = ["SUPPORTED_SERIES", "PREVIEW_SERIES", "OVERRIDE_ENV", "UnsupportedMegatronError",
           "installed_megatron_core_version", "is_supported", "is_preview",
           "check_megatron_core_version",
           "package_info_version"]

log = logging.getLogger(__name__)

SUPPORTED_SERIES = ((0, 16), (0, 17), (0, 18), (0, 19))
"""(major, minor) of the supported megatron-core series; any release (no pre-release) of
them. 0.15 is left out although the CPU demo trains equal to 1F1B on 0.15.3 (its layer
placement, linear Function and DDP hooks match 0.16's): no CI environment runs the tier on
it, its ``get_forward_backward_func()`` takes no arguments (the unit tests call it with
(pp, vp)), and no Megatron-LM training code of its era is here to test the training glue."""

PREVIEW_SERIES = {(0, 20): "Megatron-LM main d98e8a6 (2026-08-22)"}
"""(major, minor) of an unreleased series -> the main commit the matrix tier ran on. Its
releases pass :func:`check_megatron_core_version` with a warning naming that commit: main's
megatron-core already says the series' version, so the day it is released users may install it
before CI has run on the release itself. A series moves to :data:`SUPPORTED_SERIES` once a
release of it is tested."""

OVERRIDE_ENV = "VSHAPE_ALLOW_UNSUPPORTED_MEGATRON"
"""Set to 1 to run on an unsupported megatron-core anyway (a warning is logged)."""

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([^'\"\s#]*)['\"]?", re.M)


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is not a supported release (and no override is set)."""


def supported_description() -> str:
    """The supported series in words, for messages."""
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_SERIES)


def installed_megatron_core_version() -> str | None:
    """The megatron-core version this process uses (None: not installed), without the local
    ``+<git sha>`` part a source checkout appends. Read from the imported module when megatron
    is already imported, else from the package_info.py an import would load, else from the
    distribution's metadata."""
    version = _imported_version() or package_info_version() or _metadata_version()
    return None if version is None else version.split("+", 1)[0]


def _imported_version() -> str | None:
    module = sys.modules.get("megatron.core.package_info")
    return getattr(module, "__version__", None)


def package_info_version() -> str | None:
    """MAJOR.MINOR.PATCH+PRE_RELEASE from megatron/core/package_info.py, not executed (it
    runs git in a checkout)."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "package_info.py"
        if path.is_file():
            fields = dict(_FIELD.findall(path.read_text(encoding="utf-8")))
            if {"MAJOR", "MINOR", "PATCH"} <= set(fields):
                return (f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"
                        f"{fields.get('PRE_RELEASE', '')}")
    return None


def _metadata_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a release ("0.19.2", "0.19.2+1a2b3c4"); None for anything else."""
    match = _RELEASE.match(version.split("+", 1)[0])
    return None if match is None else (int(match[1]), int(match[2]))


def is_supported(version: str) -> bool:
    """Whether ``version`` (e.g. "0.19.2") is a release of a supported series."""
    return _series(version) in SUPPORTED_SERIES


def is_preview(version: str) -> bool:
    """Whether ``version`` is a release of :data:`PREVIEW_SERIES` (tested on main only)."""
    return _series(version) in PREVIEW_SERIES


def check_megatron_core_version(version: str | None = None,
                                environ: Mapping[str, str] | None = None) -> str:
    """Refuse an unsupported megatron-core before the plugin patches it; returns the version.

    ``version`` defaults to the installed one; ``environ`` to ``os.environ``. Raises
    :class:`UnsupportedMegatronError` naming the version found, the supported ones and the
    override; with ``VSHAPE_ALLOW_UNSUPPORTED_MEGATRON=1`` logs a warning instead. A release of
    a :data:`PREVIEW_SERIES` passes with a warning naming the main commit it was tested on.
    Called by :func:`megatron_vshape.install` and by the Megatron-LM glue.
    """
    environ = os.environ if environ is None else environ
    found = installed_megatron_core_version() if version is None else version
    if found is None:
        raise ImportError(f"megatron-core is not installed; megatron-vshape supports "
                          f"{supported_description()}: pip install 'megatron-core==0.16.*'")
    if is_supported(found):
        return found
    if is_preview(found):
        series = ".".join(map(str, _series(found)))
        log.warning("megatron-core %s: megatron-vshape has tested %s only on %s, not on a %s "
                    "release yet", found, series, PREVIEW_SERIES[_series(found)], series)
        return found
    message = (f"megatron-core {found} is not supported by megatron-vshape (supported: "
               f"{supported_description()} releases)")
    if environ.get(OVERRIDE_ENV, "") == "1":
        log.warning("%s; running anyway because %s=1: V schedules may fail or compute wrong "
                    "gradients on it", message, OVERRIDE_ENV)
        return found
    raise UnsupportedMegatronError(
        f"{message}. Install a supported release (pip install 'megatron-core==0.19.2' or "
        f"'megatron-core==0.16.1'), or set {OVERRIDE_ENV}=1 to run on {found} at your own risk")
