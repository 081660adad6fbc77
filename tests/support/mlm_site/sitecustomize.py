"""Applies the Megatron-LM CPU patches and the probe in every process of a plain ``torchrun``
(support.megatron_lm_tier.under_torchrun puts this folder first on PYTHONPATH for that one run
of each real-loop tier, core_v0.16.1's and the 0.19 era's)."""
from support.megatron_lm_cpu import configure_run, install_megatron_lm_cpu_patches
from support.megatron_lm_probe import install_probe

install_megatron_lm_cpu_patches()
configure_run()
install_probe()
