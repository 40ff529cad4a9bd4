"""A GPT-style decoder-only transformer over bytes (vocabulary 256), in size presets.

Pre-LayerNorm blocks (causal self-attention through ``scaled_dot_product_attention``, which picks
a flash kernel on CPU and GPU, then a 4x GELU MLP), learned positions, the output head tied to the
token embedding, GPT-2's initialisation (normal 0.02, residual projections scaled by 1/sqrt(2L)).
No dropout: decentralized runs compare optimisation, and the corpus is far larger than a run sees.

Presets (``PRESETS``; ``param_count`` gives the exact number without building the model):

    tiny    2 layers x 128,  4 heads, context 128:     445,952 parameters (tests)
    small   8 layers x 512,  8 heads, context 256:  25,482,240 parameters (the default)
    base   14 layers x 768, 12 heads, context 512:  99,821,568 parameters
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256   # bytes


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    dim: int
    heads: int
    context: int
    vocab: int = VOCAB

    def __post_init__(self) -> None:
        if min(self.layers, self.dim, self.heads, self.context, self.vocab) < 1:
            raise ValueError(f"GPT config: every size must be >= 1, got {self}")
        if self.dim % self.heads:
            raise ValueError(f"GPT config: dim {self.dim} is not a multiple of heads {self.heads}")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(layers=2, dim=128, heads=4, context=128),
    "small": GPTConfig(layers=8, dim=512, heads=8, context=256),
    "base": GPTConfig(layers=14, dim=768, heads=12, context=512),
}


def preset(name: str, context: int | None = None) -> GPTConfig:
    """The named preset, with its context replaced when ``context`` is given."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}: one of {list(PRESETS)}") from None
    return replace(cfg, context=context) if context else cfg


def param_count(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)``: embeddings (the head is tied), 12 d^2 + 13 d per block, final norm."""
    d = cfg.dim
    return cfg.vocab * d + cfg.context * d + cfg.layers * (12 * d * d + 13 * d) + 2 * d


def step_flops(cfg: GPTConfig, tokens: int) -> float:
    """Rough floating-point operations of one training step over ``tokens`` positions (forward and
    backward: 6 per parameter per token, plus attention's 12 * layers * dim * context)."""
    return 6.0 * param_count(cfg) * tokens + 12.0 * cfg.layers * cfg.dim * cfg.context * tokens


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.context, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.apply(self._init)
        for blk in self.blocks:   # GPT-2: residual projections scaled down with depth
            for lin in (blk.proj, blk.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for byte ids (batch, time), time <= context."""
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context {self.cfg.context}")
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            h = blk(h)
        return F.linear(self.norm(h), self.tok.weight)   # head tied to the embedding


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats (bits per byte: divide by ln 2)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def time_steps(cfg: GPTConfig, batch: int, steps: int = 4, threads: int = 1) -> list[float]:
    """Seconds of each of ``steps`` training steps (forward, backward, an Adam step) on random bytes."""
    import time
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randint(0, cfg.vocab, (batch, cfg.context))
    y = torch.randint(0, cfg.vocab, (batch, cfg.context))
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        lm_loss(model, x, y).backward()
        opt.step()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m peerd.train.gpt [SIZE:BATCHxCONTEXT ...]: per-step compute of the presets."""
    import argparse
    import statistics
    ap = argparse.ArgumentParser(prog="python -m peerd.train.gpt", description=main.__doc__)
    ap.add_argument("runs", nargs="*", default=["tiny:16x128", "small:8x256", "small:4x256", "small:2x128",
                                               "base:4x512", "base:2x256"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="timed steps; the first is left out of the median")
    args = ap.parse_args(argv)
    print(f"| size | parameters | batch x context | tokens | step s (median of {args.steps - 1}) | tokens/s |"
          f" threads |\n|---|---|---|---|---|---|---|")
    for run in args.runs:
        name, _, shape = run.partition(":")
        b, _, t = shape.partition("x")
        cfg = preset(name, int(t))
        s = statistics.median(time_steps(cfg, int(b), args.steps, args.threads)[1:])
        print(f"| {name} | {param_count(cfg):,} | {b} x {t} | {int(b) * int(t)} | {s:.3f} | "
              f"{int(b) * int(t) / s:,.0f} | {args.threads} |", flush=True)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
