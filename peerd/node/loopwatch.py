"""How late the daemon's event loop runs: a timer that should fire every `interval` seconds, and
how much later it does. A loop busy with a whole-buffer pass shows here first (and heartbeats
starve next), so the daemon reports the lag in `peerd status` and its metrics."""
from __future__ import annotations

import asyncio
import collections
import time


class LoopWatch:
    def __init__(self, interval: float = 0.05, window: int = 1200) -> None:
        self.interval = interval
        self.samples: collections.deque[float] = collections.deque(maxlen=window)   # seconds late
        self.worst = 0.0

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval)
            late = max(0.0, time.perf_counter() - t0 - self.interval)
            self.samples.append(late)
            self.worst = max(self.worst, late)

    def quantile(self, q: float) -> float:
        """Seconds late at quantile q of the recent samples (0 before any)."""
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
