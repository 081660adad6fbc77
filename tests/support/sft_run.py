"""Run scripts/pretrain_gpt_vshape.py with ``--sft`` (packed sequences) on CPU.

    support.megatron_lm_launch.Launcher().run(<this file>, <pretrain_gpt flags> --sft ...)

Megatron-LM's SFT path needs two things a CPU checkout does not have; this script stands them
in, then runs the training script as ``__main__`` exactly as the launcher would:

1. Packed attention. megatron-core's local-spec ``DotProductAttention`` refuses packed
   sequences (core/transformer/dot_product_attention.py:153 asserts packed_seq_params is None:
   "use TEDotProductAttention"), and Transformer Engine needs a GPU. The stand-in computes what
   TE's "thd" attention computes: causal attention within each document of the pack (offsets
   ``cu_seqlens_q``), none across documents, by megatron's own unfused softmax with a
   block-diagonal causal mask. With ``VSHAPE_SFT_STRICT=1`` an attention call in training
   without packed_seq_params fails, naming the stage: every stage must know the documents.
2. SFT data. Megatron-LM's ``SFTDataset`` (training/datasets/sft_dataset.py) reads jsonl
   conversations with HuggingFace ``datasets`` and tokenizes them with ``SFTTokenizer``
   (``transformers`` and a tokenizer from the Hub). :class:`TinySFTDataset` keeps its packing
   (``__getitem__``: documents, EOD, padding, cu_seqlens, max_seqlen, the loss mask of prompts
   and padding) and replaces only the conversations (made up, seeded by index, 2-4 documents
   per pack of ``--seq-length`` 16) and the tokenizer (characters to ids, prompts masked).
   ``--mock-data`` selects it (pretrain_gpt.py:300 picks SFTDataset for ``--sft``; the mock
   builder asks it for a low-level dataset of path None).
"""
from __future__ import annotations

import dataclasses
import os
import random
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_gpt_vshape.py"
STRICT = "VSHAPE_SFT_STRICT"
CONVERSATIONS = 256

SFT_GPT = (
    "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 8 "
    "--lr 1e-3 --min-lr 1e-4 --seed 1234 --attention-dropout 0 --hidden-dropout 0 "
    "--sft --mock-data --no-create-attention-mask-in-dataloader "
    "--tokenizer-type NullTokenizer --vocab-size 128 --split 98,1,1 "
    "--transformer-impl local --no-gradient-accumulation-fusion --use-cpu-initialization "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --distributed-backend gloo --log-interval 1 "
    "--eval-interval 2 --eval-iters 1 --num-workers 0 "
    "--pipeline-model-parallel-size 2").split()
"""tests/megatron/test_megatron_lm_e2e.py's tiny GPT with --sft: one pack per microbatch (megatron
packs into --micro-batch-size 1), no attention mask from the data loader (SFTDataset makes
none), PP 2. Megatron-LM core_v0.16.1's own get_batch gives packed_seq_params to its first and
last pipeline stages only, so its 1f1b is the reference at PP 2, where every stage is one of
those."""


def _block_causal_mask(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[1, 1, t, t], True where attention is masked out: later tokens and other documents."""
    offsets = cu_seqlens.reshape(-1).to(torch.int64)
    position = torch.arange(tokens, device=offsets.device)
    document = torch.bucketize(position, offsets[1:], right=True)
    other = document[:, None] != document[None, :]
    later = position[None, :] > position[:, None]
    return (other | later)[None, None]


def _packed_attention(original):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            if os.environ.get(STRICT) == "1" and self.training:
                raise AssertionError(f"attention of layer {self.layer_number} ran without "
                                     "packed_seq_params under --sft")
            return original(self, query, key, value, attention_mask,
                            attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        # "thd": [t, heads, dim] (attention.py squeezed the batch of one pack)
        mask = _block_causal_mask(packed_seq_params.cu_seqlens_q, query.shape[0])
        return original(self, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                        attn_mask_type=attn_mask_type, attention_bias=attention_bias)
    forward.vshape_stand_in = True
    return forward


def install_packed_attention() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not getattr(DotProductAttention.forward, "vshape_stand_in", False):
        DotProductAttention.forward = _packed_attention(DotProductAttention.forward)


class _ChatTokenizer:
    """What SFTDataset asks of SFTTokenizer: tokenize_conversation, eod, pad."""

    def __init__(self, base):
        self._base = base
        self.eod = base.eod
        self.pad = base.eod - 1
        self._vocab = base.eod - 2

    def __getattr__(self, name):
        return getattr(self._base, name)

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        from megatron.training.datasets.sft_dataset import IGNORE_INDEX

        tokens, targets = [], []
        for message in conversation:
            ids = [ord(c) % self._vocab for c in message["content"]]
            tokens += ids
            targets += ids if message["role"] == "assistant" else [IGNORE_INDEX] * len(ids)
        return np.array(tokens), np.array(targets)


def _conversation(index: int) -> list:
    """2-4 documents, 16 tokens in all at most (with their EODs): SFTDataset pads the rest."""
    rng = random.Random(index)
    letters = "abcdefghijklmnopqrstuvwxyz"
    messages, room = [], 16
    for _ in range(rng.randint(2, 4)):
        if room < 4:
            break
        size = rng.randint(3, min(7, room))
        prompt = rng.randint(1, size - 2)
        text = "".join(rng.choice(letters) for _ in range(size - 1))
        messages += [{"role": "system", "content": text[:prompt]},
                     {"role": "assistant", "content": text[prompt:]}]
        room -= size
    return messages


def _tiny_sft_dataset():
    from megatron.training.datasets.sft_dataset import SFTDataset

    class TinySFTDataset(SFTDataset):
        """SFTDataset's packing over made-up conversations (module doc)."""

        def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
            config = dataclasses.replace(config, tokenizer=_ChatTokenizer(config.tokenizer))
            super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return [_conversation(i) for i in range(CONVERSATIONS)]

    return TinySFTDataset


def main() -> None:
    import pretrain_gpt

    install_packed_attention()
    pretrain_gpt.SFTDataset = _tiny_sft_dataset()
    sys.argv[0] = str(SCRIPT)
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
