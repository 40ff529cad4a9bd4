"""Emulated compute for experiments: how long a training step takes on a host.

The built-in models compute in about a millisecond; benchmarks stretch each step (with `sleep`, so
many emulated hosts share a 2-core machine without becoming CPU-bound) to make compute, not the
per-iteration overhead, the unit of time:

- `step_time` T > 0 pads each step to T seconds (a fixed, load-independent base); T = 0 keeps the
  step's real compute time as the base (a plain `--slowdown`);
- `slowdown` F multiplies the base: a permanent straggler;
- with probability `slow_prob` an iteration is `slow_factor` times slower again (random
  slowdowns); the draws are a pure function of (seed, rank, iteration), so every contender of a
  benchmark sees the same slow iterations on the same rank.
"""
from __future__ import annotations

import random
import time


class Pace:
    def __init__(self, step_time: float = 0.0, slowdown: float = 1.0, slow_prob: float = 0.0,
                 slow_factor: float = 1.0, seed: int = 0, rank: int = 0) -> None:
        if step_time < 0 or slowdown < 1 or not 0 <= slow_prob <= 1 or slow_factor < 1:
            raise ValueError(f"pace: step_time {step_time} must be >= 0, slowdown {slowdown} >= 1, "
                             f"slow_prob {slow_prob} in [0, 1], slow_factor {slow_factor} >= 1")
        self.step_time, self.slowdown = step_time, slowdown
        self.slow_prob, self.slow_factor = slow_prob, slow_factor
        self.seed, self.rank = seed, rank

    def factor(self, iteration: int) -> float:
        """This iteration's total slowdown factor (deterministic in seed, rank, iteration)."""
        f = self.slowdown
        if self.slow_prob > 0 and random.Random(f"{self.seed}:{self.rank}:{iteration}").random() < self.slow_prob:
            f *= self.slow_factor
        return f

    def target(self, iteration: int, compute: float) -> float:
        """Seconds the step of `iteration` should take in all, given its real compute time."""
        return max(self.step_time, compute) * self.factor(iteration) if self.step_time else \
            compute * self.factor(iteration)

    def pad(self, iteration: int, started: float) -> float:
        """Sleep until the step begun at perf_counter() `started` has taken its target time;
        return the step's emulated compute seconds."""
        compute = time.perf_counter() - started
        rest = self.target(iteration, compute) - compute
        if rest > 0:
            time.sleep(rest)
        return time.perf_counter() - started
