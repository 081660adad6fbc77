"""A tiny megatron-core GPT for CPU runs: the demo (``vshape demo``) and the gloo tests.

Comparing a V schedule with megatron's own 1F1B needs the *same* model built with different
layers on different ranks, and the same data everywhere:

- :func:`init_by_name` gives every parameter values that depend only on its global name
  (layer numbers are global, see :func:`global_named_parameters`), so any placement starts
  from identical weights;
- :func:`batches` is a function of the step and data-parallel rank only;
- :func:`forward_step` is a Megatron-LM style forward_step_func (tokens in, loss function out),
  with megatron's per-token loss reporting when ``per_token`` is set.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial

import torch

__all__ = ["TinyGPT", "batches", "forward_step", "init_by_name", "global_named_parameters",
           "global_grads", "loss_value", "mean_loss", "per_token_loss", "EMBEDDING_COPY"]


@dataclass(frozen=True)
class TinyGPT:
    """Shape of the model and of one microbatch (local spec, fp32, no dropout)."""

    num_layers: int = 8
    hidden_size: int = 16
    num_attention_heads: int = 2
    ffn_hidden_size: int | None = None
    """None: 4 x hidden_size."""
    vocab_size: int = 64
    seq_length: int = 8
    micro_batch_size: int = 2

    @classmethod
    def from_model(cls, model, micro_batch_size: int = 2) -> "TinyGPT":
        """The shape of a planner :class:`..plan.model.ModelConfig` (bundled or a file), so that
        what runs is what the planner predicts for."""
        return cls(num_layers=model.num_layers, hidden_size=model.hidden_size,
                   num_attention_heads=model.num_attention_heads, ffn_hidden_size=model.ffn,
                   vocab_size=model.vocab_size, seq_length=model.seq_length,
                   micro_batch_size=micro_batch_size)

    def transformer_config(self, pp: int, tp: int = 1, **overrides):
        """megatron's TransformerConfig for this model on ``pp`` x ``tp`` ranks (CPU, fp32)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        values = dict(num_layers=self.num_layers, hidden_size=self.hidden_size,
                      num_attention_heads=self.num_attention_heads,
                      ffn_hidden_size=self.ffn_hidden_size, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=pp,
                      tensor_model_parallel_size=tp, pipeline_dtype=torch.float32, bf16=False,
                      fp16=False, params_dtype=torch.float32, batch_p2p_sync=False)
        values.update(overrides)
        return TransformerConfig(**values)

    def provider(self, tied: bool = True):
        """``model_provider(config=, pre_process=, post_process=, vp_stage=, pg_collection=)``."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return partial(GPTModel, transformer_layer_spec=get_gpt_layer_local_spec(),
                       vocab_size=self.vocab_size, max_sequence_length=self.seq_length,
                       share_embeddings_and_output_weights=tied)


def batches(model: TinyGPT, num_microbatches: int, step: int) -> list[dict]:
    """Random token microbatches, a function of ``step`` only (seed it with the DP rank too)."""
    gen = torch.Generator().manual_seed(1000 + step)
    seq, mbs = model.seq_length, model.micro_batch_size
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, model.vocab_size, (mbs, seq + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(mbs, seq),
                    "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous()})
    return out


def forward_step(data_iterator, model, per_token: bool = False):
    """Megatron-LM's forward_step contract: (output, loss function of the output)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(per_token_loss if per_token else mean_loss, batch["loss_mask"])


def mean_loss(mask, output):
    """The masked mean of the per-token losses, as megatron-core's examples report it."""
    losses = output.float().view(-1)
    loss = torch.sum(losses * mask.view(-1)) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def per_token_loss(mask, output):
    """Megatron-LM's pretrain_gpt loss: (sum, token count, {"lm loss": [sum, count]})."""
    losses = output.float().view(-1)
    loss = torch.sum(losses * mask.view(-1))
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1),
                                                    num_tokens.view(1).float()])}


def loss_value(report: dict) -> float:
    """A microbatch's reported loss (mean, or per-token sum / count)."""
    value = report["lm loss"].view(-1)
    return float(value[0] / value[1]) if value.numel() == 2 else float(value[0])


EMBEDDING_COPY = "embedding_copy"
"""The name prefix of a multi-token prediction stage's copy of the embedding (megatron keeps
one on the MTP stage unless it is the first; the V's is on rank 0 beside the original)."""


def global_named_parameters(chunks):
    """(name with global layer numbers, parameter) over a rank's chunks (1F1B and V alike); an
    MTP stage's copy of the embedding is named ``embedding_copy.*`` (:data:`EMBEDDING_COPY`)."""
    from megatron.core.utils import unwrap_model

    for chunk in unwrap_model(list(chunks)):
        numbers = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
        copy = getattr(chunk, "mtp_process", False) and not chunk.pre_process
        for name, p in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(numbers[int(parts[2])])
            if copy and parts[0] == "embedding":
                parts[0] = EMBEDDING_COPY
            yield ".".join(parts), p


def global_grads(chunks) -> dict:
    """{global name: gradient} (``main_grad`` under DDP) over a rank's chunks."""
    out = {}
    for key, p in global_named_parameters(chunks):
        grad = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad
        if grad is not None:
            out[key] = grad.detach().clone()
    return out


def init_by_name(chunks, tied: bool) -> None:
    """Give every parameter values that depend only on its global name (see module doc)."""
    for key, p in global_named_parameters(chunks):
        if tied and key == "output_layer.weight":
            key = "embedding.word_embeddings.weight"
        if key.startswith(EMBEDDING_COPY + "."):
            key = "embedding" + key[len(EMBEDDING_COPY):]
        gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        values = 0.05 * torch.randn(p.shape, generator=gen)
        if "norm" in key and key.endswith("weight"):
            values += 1.0
        with torch.no_grad():
            p.copy_(values)
