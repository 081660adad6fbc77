"""transformer_engine.pytorch.ops: TE v2.11's operation-based API (ops/__init__.py). Not
imitated: megatron-core names its classes in annotations at import (0.16.1
extensions/transformer_engine.py:1916, :2044 ``te.pytorch.ops.Sequential`` /
``FusibleOperation``) and builds them only for TEFusedMLP / TEActivationOp
(--use-te-activation-func and the fused-MLP specs), so every name resolves to a class that
refuses to be built."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*args, **kwargs):
        raise NotImplementedError(f"the CPU stand-in of Transformer Engine does not imitate "
                                  f"transformer_engine.pytorch.ops.{name}")

    return type(name, (), {"__init__": refuse, "__module__": __name__})
