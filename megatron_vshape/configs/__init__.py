"""The model, grid and profile files that ship with megatron-vshape, found by name or by path.

    configs/models/NAME.yaml     a GPT's shape: vshape plan | profile | demo --model NAME, a grid's
                                 model
    configs/grid/NAME.yaml       a grid search: vshape grid NAME, vshape paper NAME ...
    configs/profiles/NAME.yaml   measured per-layer costs: vshape plan --profile NAME

They live at the repository's top level (``configs/``), where users read and edit them. A wheel
carries the same folder as package data, ``megatron_vshape/configs/bundled/`` (setup.py maps it
there), so a bare name works from any folder, in a checkout and in an installed wheel alike.
:func:`find_config` is the one lookup: an existing file is taken as it is; a bare name (no folder;
``.yaml`` optional) is looked up in :data:`CONFIG_DIR`; anything else is a ``ValueError`` that
lists the names there are.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_DIR", "KINDS", "config_names", "find_config"]

_HERE = Path(__file__).resolve().parent
_INSTALLED = _HERE / "bundled"
"""Where a wheel's build puts the top-level configs/ (setup.py's ``package_dir``)."""
_CHECKOUT = _HERE.parents[1] / "configs"
"""The repository's own folder, for a checkout or an editable install (nothing is copied).
Looked at second: beside an installed package, ``site-packages/configs`` may be anyone's."""
CONFIG_DIR = _INSTALLED if _INSTALLED.is_dir() else _CHECKOUT
"""Where the bundled files lie: one folder per kind."""
KINDS = {"models": "model config", "grid": "grid file", "profiles": "profile"}
"""Each kind's folder and what an error calls one of its files."""
_SUFFIXES = (".yaml", ".yml")


def _folder(kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"unknown config kind {kind!r}; valid choices: {', '.join(KINDS)}")
    return CONFIG_DIR / kind


def config_names(kind: str) -> tuple[str, ...]:
    """The bare names of the bundled files of ``kind`` ("models", "grid" or "profiles")."""
    return tuple(sorted(path.stem for path in _folder(kind).glob("*.yaml")))


def find_config(kind: str, name_or_path: str | Path, base: Path | None = None) -> Path:
    """The file ``name_or_path`` means: itself where it exists (relative paths taken from
    ``base``, default the current folder), else the bundled ``CONFIG_DIR/kind/NAME.yaml`` for a
    bare name (``gpt-9.6b`` or ``gpt-9.6b.yaml``).

    Raises ``ValueError`` naming the available bundled names when it is neither.
    """
    folder = _folder(kind)
    given = Path(name_or_path)
    path = base / given if base is not None else given
    if path.is_file():
        return path
    if given.parts == (given.name,) and given.name:  # a bare name, no folder
        stem = given.stem if given.suffix in _SUFFIXES else given.name
        bundled = folder / f"{stem}.yaml"
        if bundled.is_file():
            return bundled
    raise ValueError(f"{KINDS[kind]} {str(path)!r} does not exist: neither a file nor a bundled "
                     f"name; bundled {kind}: {', '.join(config_names(kind))} (in {folder})")
