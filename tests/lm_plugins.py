"""Plug-ins for padded, masked language-model batches in the Hugging Face convention (tests/loop/test_loss_sums.py).

`masked_lm`: sequences of random length, each a prompt whose labels are -100 followed by a response; items
are dicts of 1-D tensors of their own length, which the default collate pads (input_ids with 0, labels with
-100, an attention mask). Micro-batches therefore count very different numbers of tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class MaskedSequences(Dataset):
    uses_global_rng = False

    def __init__(self, size: int, vocab: int, max_len: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(size):
            length = int(torch.randint(4, max_len + 1, (), generator=gen))
            prompt = int(torch.randint(1, length - 1, (), generator=gen))
            ids = torch.randint(1, vocab, (length,), generator=gen)
            labels = ids.clone()
            labels[:prompt] = -100
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def masked_lm(cfg):
    return (MaskedSequences(cfg.dataset_size, cfg.vocab_size, cfg.seq_len, cfg.seed),
            MaskedSequences(cfg.eval_size, cfg.vocab_size, cfg.seq_len, cfg.seed + 1) if cfg.eval_size else None)


class MeanLoss:
    """The per-micro-batch mean a task that returns a plain scalar computes (what HF models' `out.loss` is)."""

    unit = "tokens"

    def loss(self, model, batch):
        labels = batch["labels"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100), {}


def mean_loss(cfg):
    return MeanLoss()


class UnnamedTokens(MaskedSequences):
    """Dict items whose tokens are not under `input_ids`: a usage error for the language_model task."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.items[index]["input_ids"][:4]}


def unnamed_tokens(cfg):
    return UnnamedTokens(cfg.dataset_size, cfg.vocab_size, cfg.seq_len, cfg.seed), None


class NoLogits(torch.nn.Module):
    """A model whose output is a dict without `logits`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None):
        return {"scores": self.embed(input_ids)}


def no_logits_model(cfg):
    return NoLogits(cfg.vocab_size)


class Bigram(torch.nn.Module):
    """A language model that reads each token alone (no positions, no attention)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None):
        return self.embed(input_ids)


def bigram_model(cfg):
    return Bigram(cfg.vocab_size)
