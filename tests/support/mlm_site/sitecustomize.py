"""Applies the Megatron-LM CPU patches and the probe in every process of a plain ``torchrun``
(tests/test_megatron_lm_e2e.py puts this folder first on PYTHONPATH for that one run)."""
from support.megatron_lm_cpu import configure_run, install_megatron_lm_cpu_patches
from support.megatron_lm_probe import install_probe

install_megatron_lm_cpu_patches()
configure_run()
install_probe()
