"""A GPT model's shape, as a model YAML (bundled: ``configs/models/NAME.yaml``) gives it, and
what follows from it.

One YAML file per model: the fields of :class:`ModelConfig`. The planner predicts memory and
time from these numbers; the grid and the launchers turn them into Megatron-LM flags
(:meth:`ModelConfig.megatron_args`), so a model is described once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..configs import find_config

__all__ = ["ModelConfig", "load_model_config"]


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (GPT) as Megatron-LM builds it."""

    name: str
    """Short name, e.g. ``gpt-9.6b`` (the file's stem by default)."""
    num_layers: int
    """Transformer layers. The paper's advice for V schedules: k * p - 2, so that rank 0,
    which also holds the embedding and the LM head, runs two layers fewer."""
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    """MLP width; None: 4 x hidden_size."""
    num_query_groups: int | None = None
    """Grouped-query attention groups; None: multi-head attention (one group per head)."""
    kv_channels: int | None = None
    """Width of one attention head (``--kv-channels``); None: hidden_size / heads. Gemma-2
    sets it apart: 16 heads of 256 over a hidden size of 3584, so queries are 4096 wide."""
    vocab_size: int = 51200
    """Padded vocabulary size (Megatron-LM pads the tokenizer's to a multiple of 128 x TP)."""
    seq_length: int = 2048
    """Default sequence length (a plan or a grid may override it)."""
    max_position_embeddings: int | None = None
    """None: seq_length."""
    untie_embeddings_and_output_weights: bool = False
    swiglu: bool = False
    num_experts: int | None = None
    """Mixture of Experts: routed experts in every layer's MLP (``--num-experts``); None: a
    dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to (``--moe-router-topk``)."""
    moe_ffn_hidden_size: int | None = None
    """Width of one routed expert's MLP (``--moe-ffn-hidden-size``); None: ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total width of the shared experts every token also runs
    (``--moe-shared-expert-intermediate-size``); None: no shared expert."""
    description: str = ""
    """Where the shape comes from (e.g. how the layer count was derived)."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                      "seq_length"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name!r}: {field} must be >= 1, got "
                                 f"{getattr(self, field)}")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"model {self.name!r}: kv_channels must be >= 1, got "
                             f"{self.kv_channels}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model {self.name!r}: hidden_size {self.hidden_size} must be a "
                             f"multiple of num_attention_heads {self.num_attention_heads}")
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ValueError(f"model {self.name!r}: num_attention_heads must be a multiple of "
                             f"num_query_groups {groups}")
        if self.num_experts is not None and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"model {self.name!r}: moe_router_topk must be between 1 and "
                             f"num_experts {self.num_experts}, got {self.moe_router_topk}")
        if self.num_experts is not None and self.num_experts < 2:
            raise ValueError(f"model {self.name!r}: num_experts must be >= 2 (or left out for "
                             f"a dense MLP), got {self.num_experts}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_width(self) -> int:
        """Queries' (and the attention projection's input) width: heads x head width."""
        return self.num_attention_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn(self) -> int:
        """One routed expert's MLP width."""
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def shared_ffn(self) -> int:
        """The shared experts' total MLP width (0: none)."""
        return self.moe_shared_expert_intermediate_size or 0

    def expert_parameters(self) -> int:
        """One layer's routed experts (no biases, as megatron-core builds MoE experts); 0 for
        a dense model. They are sharded over expert parallelism, not TP."""
        if not self.moe:
            return 0
        return self.num_experts * (3 if self.swiglu else 2) * self.hidden_size * self.expert_ffn

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer: QKV and output projections, the MLP (two
        matrices, three with SwiGLU; MoE: router, routed and shared experts), biases and two
        layernorms."""
        h, f, q = self.hidden_size, self.ffn, self.query_width
        kv = 2 * self.query_groups * self.head_dim
        attention = h * (q + kv) + (q + kv) + q * h + h
        if self.moe:
            mlp = h * self.num_experts + (3 if self.swiglu else 2) * h * self.shared_ffn
            return attention + mlp + self.expert_parameters() + 4 * h
        mlp = (3 if self.swiglu else 2) * h * f + (2 if self.swiglu else 1) * f + h
        return attention + mlp + 4 * h

    def embedding_parameters(self) -> int:
        """Word and position embeddings, the final layernorm and (untied) the LM head."""
        h = self.hidden_size
        words = self.vocab_size * h
        positions = (self.max_position_embeddings or self.seq_length) * h
        head = words if self.untie_embeddings_and_output_weights else 0
        return words + positions + 2 * h + head

    def parameters(self) -> int:
        return self.num_layers * self.layer_parameters() + self.embedding_parameters()

    def megatron_args(self, seq_length: int | None = None) -> list[str]:
        """Megatron-LM flags that build this model."""
        seq = seq_length or self.seq_length
        args = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                "--num-attention-heads", str(self.num_attention_heads),
                "--ffn-hidden-size", str(self.ffn), "--seq-length", str(seq),
                "--max-position-embeddings", str(max(seq, self.max_position_embeddings or 0))]
        if self.kv_channels:
            args += ["--kv-channels", str(self.kv_channels)]
        if self.num_query_groups:
            args += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.untie_embeddings_and_output_weights:
            args.append("--untie-embeddings-and-output-weights")
        if self.swiglu:
            args.append("--swiglu")
        if self.moe:
            args += ["--num-experts", str(self.num_experts), "--moe-router-topk",
                     str(self.moe_router_topk), "--moe-ffn-hidden-size", str(self.expert_ffn)]
            if self.shared_ffn:
                args += ["--moe-shared-expert-intermediate-size", str(self.shared_ffn)]
        return args

    def with_overrides(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_TYPE_WORDS = {"int": "a whole number", "int | None": "a whole number or null",
               "bool": "true or false", "str": "text"}
"""ModelConfig's field types in a user's words (a YAML key's value is checked against them)."""


def _of_type(annotation: str, value) -> bool:
    if value is None:
        return annotation.endswith("| None")
    if annotation.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"bool": bool, "str": str}[annotation])


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a model YAML: a path, or a bundled model's bare name (``gpt-9.6b``: the package's
    configs/models/NAME.yaml, :func:`megatron_vshape.configs.find_config`); unknown keys are an
    error that lists the valid ones."""
    import yaml

    path = find_config("models", path)
    where = f"model config {str(path)!r}"
    fields = dataclasses.fields(ModelConfig)
    valid = {f.name for f in fields}
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.name != "name"]
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{where} is not YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of ModelConfig fields, got "
                         f"{'an empty file' if data is None else type(data).__name__}; "
                         f"required: {', '.join(required)}")
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; valid keys: "
                         f"{', '.join(sorted(valid))}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where}: missing required keys {missing} (required: "
                         f"{', '.join(required)})")
    types = {f.name: f.type for f in fields}  # text: this module's annotations are postponed
    for key, value in data.items():
        if not _of_type(types[key], value):
            raise ValueError(f"{where}: {key} must be {_TYPE_WORDS[types[key]]}, got {value!r}")
    data.setdefault("name", path.stem)
    return ModelConfig(**data)
