"""megatron-vshape: memory-controllable V-shape pipeline schedules for megatron-core.

Method: "Pipeline Parallelism with Controllable Memory" (Qi et al., arXiv 2405.15362).
"""
__version__ = "0.1.0"
__all__ = ["__version__", "install", "uninstall", "check_megatron_core_version"]


def install(config=None, **settings):
    """Route megatron's pipeline schedule choice through megatron-vshape.

    ``install(schedule="v-half")`` or ``install(VShapeConfig(...))``; see
    :mod:`megatron_vshape.megatron.install`. Imported lazily: the schedule core needs no torch.
    """
    from .megatron.install import VShapeConfig, install as _install

    return _install(config if config is not None else VShapeConfig(**settings))


def uninstall():
    """Give megatron its own ``get_forward_backward_func`` back."""
    from .megatron.install import uninstall as _uninstall

    _uninstall()


def check_megatron_core_version():
    """Raise unless the installed megatron-core is a supported release (0.16.x to 0.19.x), or
    warn where VSHAPE_ALLOW_UNSUPPORTED_MEGATRON=1; returns the version. :func:`install` calls
    it; see :mod:`megatron_vshape.megatron.versions`. Imports no megatron."""
    from .megatron.versions import check_megatron_core_version as _check

    return _check()
