"""Objectives for the simulator: real optimisation problems, deterministic by seed.

Quadratic (separable least squares): worker i holds f_i(x) = 1/2 sum_p h_ip (x_p - c_ip)^2 with
h_ip in [1, cond] and c_i = c + hetero * noise_i (non-i.i.d. shards: the workers disagree, so
consensus matters). The global objective is f = mean_i f_i with the closed-form optimum
x* = sum_i h_i c_i / sum_i h_i. Gradients are elementwise, so 1024 workers x 10k parameters fit in
memory and time; stochastic gradients add noise drawn from a fixed bank (cheap, deterministic).

Loss reported: relative suboptimality (f(x) - f*) / (f(x0) - f*) of the average model x.
"""
from __future__ import annotations

import numpy as np


class Quadratic:
    name = "quadratic"

    def __init__(self, n: int, p: int, *, seed: int = 0, cond: float = 4.0, hetero: float = 1.0,
                 noise: float = 0.01, bank: int = 64) -> None:
        if n < 1 or p < 1:
            raise ValueError(f"n, p: need >= 1 workers and parameters, got n={n} p={p}")
        rng = np.random.default_rng(seed)
        self.n, self.p = n, p
        self.h = rng.uniform(1.0, cond, (n, p))
        self.c = rng.normal(0.0, 1.0, (1, p)) + hetero * rng.normal(0.0, 1.0, (n, p))
        self.noise = noise
        self.bank = rng.normal(0.0, 1.0, (bank, p)) * noise if noise > 0 else None
        hs = self.h.sum(0)
        hc = (self.h * self.c).sum(0)
        hc2 = (self.h * self.c * self.c).sum(0)
        self._q = (hs / n, hc / n, hc2 / n)
        self.x_star = hc / hs
        self.f_star = self._f(self.x_star)
        self.x0 = np.zeros(p)
        self.f0 = self._f(self.x0) - self.f_star

    def _f(self, x: np.ndarray) -> float:
        a, b, c = self._q
        return float(0.5 * np.sum(a * x * x - 2 * b * x + c))

    def loss(self, x: np.ndarray) -> float:
        """Relative suboptimality of x (1.0 at x0, 0.0 at the optimum)."""
        return max(0.0, self._f(x) - self.f_star) / self.f0

    def grad(self, i: int, x: np.ndarray, draw: int) -> np.ndarray:
        g = self.h[i] * (x - self.c[i])
        if self.bank is not None:
            g += self.bank[draw % len(self.bank)]
        return g

    def max_lr(self) -> float:
        return 1.0 / float(self.h.max())
