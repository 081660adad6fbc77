"""transformer_engine.common: the recipes (TE v2.11 transformer_engine/common/recipe/)."""
from . import recipe  # noqa: F401
