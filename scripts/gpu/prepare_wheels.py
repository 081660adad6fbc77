"""Prepare, on a machine with PyPI, the wheels a lent GPU needs for ``vshape gpu-check``.

    python scripts/gpu/prepare_wheels.py [--output gpu-wheels] [--dry-run]

The lent machine has Python 3.12 and a CUDA torch (with numpy) but no megatron-core and no
network: what it needs travels with the call, in a git-ignored folder at the repository root
(``gpu-wheels/``, named in the device call's ``carry``; docs/gpu-check.md has the command).
This writes there megatron-core (0.19.2, and 0.16.1 for the second check) for CPython 3.12 on
manylinux x86-64, the pure-Python or abi3
packages the check imports that the machine may lack, and this project's wheel (whose declared
requirements make the offline install fail loudly if a wheel is missing). The total must stay
well under the call's 64 MiB, which it checks. ``--dry-run`` prints the pip commands and
downloads nothing. This project's wheel is built from a copy of its release files
(``RELEASE_FILES``), never from the working tree's ``build/``.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = "gpu-wheels"
"""At the repository root, ignored by git (.gitignore), carried by the device call."""
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MEGATRON_CORE = "megatron-core==0.19.2"
REQUIREMENTS = (MEGATRON_CORE, "PyYAML", "tqdm", "psutil", "packaging>=24.2", "einops")
"""What gpu-check imports beyond torch and numpy: megatron-core and its undeclared psutil, the
plugin's PyYAML and tqdm, megatron-core's packaging (>= 24.2, newer than some base images'),
einops (megatron-core's optional modules import it)."""
INSTALL = ("megatron-vshape", MEGATRON_CORE, "PyYAML", "tqdm", "psutil", "packaging", "einops")
"""What the device installs from the folder (docs/gpu-check.md's command names each)."""
OTHER_MEGATRON_CORE = "megatron-core==0.16.1"
"""The other supported release, downloaded beside (a second pip call: one call cannot take two
versions of a package); docs/gpu-check.md's second command installs it instead."""
RELEASE_FILES = ("setup.py", "pyproject.toml", "README.md", "LICENSE", "megatron_vshape", "configs")
"""What this project's wheel is built from. The wheel is built from a copy of them: built in
the working tree, setuptools reuses its ignored ``build/lib``, so modules moved or deleted since
an earlier build would ship in the wheel (they did: a renamed package's old folder)."""
LIMIT_BYTES = 48 * 2**20
"""The call carries 64 MiB with the working tree; leave the tree 16 MiB."""


def download_command(folder: Path, requirements=REQUIREMENTS) -> list[str]:
    """pip download of ``requirements`` as binary wheels for the device's Python and
    platform."""
    words = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", PYTHON_VERSION, "--implementation", "cp",
             "--dest", str(folder)]
    for platform in PLATFORMS:
        words += ["--platform", platform]
    return words + list(requirements)


def wheel_command(folder: Path, source: Path) -> list[str]:
    """pip wheel of this project from ``source``, a copy of its release files (pure Python:
    one wheel for every Python)."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(folder),
            str(source)]


def release_copy(dest: Path) -> Path:
    """``RELEASE_FILES`` of the working tree copied to ``dest`` (no ``__pycache__``)."""
    for name in RELEASE_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, dest / name)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(ROOT / DEFAULT_DIR), metavar="DIR",
                        help=f"where the wheels go (default <repository>/{DEFAULT_DIR})")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the pip commands; download nothing")
    args = parser.parse_args(argv)
    folder = Path(args.output)
    with tempfile.TemporaryDirectory(prefix="vshape-release-") as scratch:
        source = Path(scratch) / "src"
        commands = [download_command(folder), download_command(folder, (OTHER_MEGATRON_CORE,)),
                    wheel_command(folder, source)]
        for command in commands:
            print(shlex.join(command))
        if args.dry_run:
            return 0
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("megatron_vshape-*.whl"):  # the tree's version, not an old one
            stale.unlink()
        release_copy(source)
        for command in commands:
            subprocess.run(command, check=True)
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:7.2f} MiB  in {len(wheels)} wheels under {folder}")
    if total > LIMIT_BYTES:
        print(f"error: {total / 2**20:.1f} MiB is over {LIMIT_BYTES / 2**20:.0f} MiB: the device "
              "call carries 64 MiB with the working tree; remove old wheels from the folder",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
