"""The `gpt` task: a GPT-style byte-level language model on the Python standard library's source.

    peerd train --task gpt --world 4 [--model-size tiny|small|base] [--device auto|cpu|cuda]

Model: peerd.train.gpt (presets: tiny 0.45M parameters for tests, small 25.5M, the default, base
99.8M). Corpus: peerd.train.corpus (the stdlib's own ``*.py`` files minus test suites, about 11 MB
here; split into train/validation by a hash of each file's path; each host trains on its own
disjoint set of files). Tokenization: bytes, so that

- there is nothing to train, cache or ship, every file round-trips exactly (any encoding), and
  the vocabulary (256) costs 0.1-0.5 % of the parameters;
- bits per byte is the loss in bits: ``bpb = loss / ln 2``, for the validation loss the trainer
  reports and for any number printed from it (`peerd train`, records, `peerd report`).

A small BPE would see about 3x more text per position for the same compute; at these model sizes
and run lengths the byte-level model's simplicity and exact bits-per-byte win (docs/real-size.md).

Evaluation: ``evaluate(model)`` returns the mean next-byte loss (nats) and bits per byte over a
fixed set of validation windows (``eval_tokens`` bytes, evenly spread over the validation files,
the same on every host and for every run). ``baseline(shard)``: the bits per byte of a unigram
model (byte frequencies of the host's training shard, add-one smoothed) on the same windows, the
floor a language model must beat by a wide margin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from peerd.train import corpus as corpus_mod
from peerd.train.gpt import GPT, lm_loss, param_count, preset

LN2 = math.log(2.0)


def encode(text: str | bytes) -> torch.Tensor:
    """Byte ids (int64) of ``text`` (UTF-8 for a str)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """The text of byte ids (invalid UTF-8 shown as U+FFFD)."""
    t = torch.as_tensor(ids)
    return bytes(t.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / LN2


@dataclass
class LMShard:
    rank: int
    world: int
    non_iid: bool
    files: list[corpus_mod.FileEntry]
    windows: corpus_mod.Windows

    def __len__(self) -> int:
        return self.windows.total


class StdlibGPT:
    """The `gpt` task (see the module docstring). ``configure(model_size=..., context=...,
    eval_tokens=...)`` returns a task with those options."""
    name = "gpt"
    metric = "loss"
    LR = {"tiny": 3e-3, "small": 1e-3, "base": 6e-4}
    BATCH = {"tiny": 16, "small": 8, "base": 4}
    EVAL_TOKENS = {"tiny": 32768, "small": 8192, "base": 8192}

    def __init__(self, model_size: str = "small", context: int | None = None, eval_tokens: int | None = None,
                 cache_dir: str | Path | None = None) -> None:
        self.model_size, self.context, self._eval_tokens = model_size, context, eval_tokens
        self.cfg = preset(model_size, context)
        self.eval_tokens = int(eval_tokens or self.EVAL_TOKENS.get(model_size, 8192))
        if self.eval_tokens < self.cfg.context:
            raise ValueError(f"eval_tokens {self.eval_tokens} is below one context ({self.cfg.context})")
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.defaults: dict[str, Any] = dict(inner="adam", lr=self.LR.get(model_size, 1e-3), betas=(0.9, 0.95),
                                             weight_decay=0.0, batch_size=self.BATCH.get(model_size, 8))
        self._corpus: corpus_mod.Corpus | None = None
        self._eval: tuple[torch.Tensor, torch.Tensor] | None = None

    OPTIONS = ("model_size", "context", "eval_tokens", "cache_dir")

    def configure(self, **options: Any) -> "StdlibGPT":
        unknown = set(options) - set(self.OPTIONS)
        if unknown:
            raise ValueError(f"task gpt: unknown option(s) {sorted(unknown)}; it takes {list(self.OPTIONS)}")
        kw = dict(model_size=self.model_size, context=self.context, eval_tokens=self._eval_tokens,
                  cache_dir=self.cache_dir)
        kw.update({k: v for k, v in options.items() if v is not None})
        return StdlibGPT(**kw)

    def describe(self) -> str:
        c = self.cfg
        return (f"gpt {self.model_size}: {param_count(c):,} parameters ({c.layers} layers x {c.dim}, "
                f"{c.heads} heads, context {c.context}), byte-level")

    # -- the task interface -------------------------------------------------------------------
    def corpus(self) -> corpus_mod.Corpus:
        if self._corpus is None:
            self._corpus = corpus_mod.load(cache_dir=self.cache_dir)
        return self._corpus

    def param_bytes(self) -> int:
        return 4 * param_count(self.cfg)

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(self.cfg)

    def shard(self, rank: int, world: int, non_iid: bool = False, seed: int = 0) -> LMShard:
        c = self.corpus()
        files = c.shard(rank, world, non_iid)
        return LMShard(rank, world, non_iid, files, corpus_mod.Windows(c.data, files, self.cfg.context))

    def batches(self, shard: LMShard, batch_size: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        g = np.random.default_rng([seed, shard.rank, 20240935])
        while True:
            yield shard.windows.sample(g, batch_size)

    @staticmethod
    def _device(model: nn.Module) -> torch.device:
        return next(model.parameters()).device

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        dev = self._device(model)
        return lm_loss(model, batch[0].to(dev, non_blocking=True), batch[1].to(dev, non_blocking=True))

    def eval_windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._eval is None:
            c = self.corpus()
            val = corpus_mod.Windows(c.data, c.split(True), self.cfg.context)
            self._eval = val.spread(self.eval_tokens // self.cfg.context)
        return self._eval

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: int = 16) -> dict[str, float]:
        """{"loss": mean next-byte loss in nats, "bpb": bits per byte} on the validation windows."""
        x, y = self.eval_windows()
        dev = self._device(model)
        total, n = 0.0, 0
        for i in range(0, len(x), batch):
            xb, yb = x[i:i + batch].to(dev), y[i:i + batch].to(dev)
            total += lm_loss(model, xb, yb).item() * yb.numel()
            n += yb.numel()
        loss = total / n
        return {"loss": loss, "bpb": bits_per_byte(loss)}

    def baseline(self, shard: LMShard) -> dict[str, float]:
        """The unigram model of this shard's bytes on the validation windows, in bits per byte."""
        _, y = self.eval_windows()
        return {"unigram_bpb": corpus_mod.unigram_bits(shard.windows.byte_counts(), y)}


@torch.no_grad()
def sample(model: nn.Module, prompt: str, length: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    """``prompt`` continued by ``length`` bytes drawn from the model."""
    g = torch.Generator().manual_seed(seed)
    ctx = model.cfg.context
    dev = next(model.parameters()).device
    ids = encode(prompt).tolist() or [corpus_mod.EOF_BYTE]
    for _ in range(length):
        x = torch.tensor([ids[-ctx:]], device=dev)
        logits = model(x)[0, -1].float().cpu() / max(temperature, 1e-6)
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
    return decode(ids)
