"""How late the daemon's event loop runs: a timer that should fire every `interval` seconds, and
how much later it does. A loop busy with a whole-buffer pass shows here first (and heartbeats
starve next), so the daemon reports the lag in `peerd status` and its metrics.

A late timer has two causes that call for different fixes: the daemon's own work (a long callback,
the GIL held by another of its threads) or a host with more runnable threads than cores, where the
loop's thread is ready but waits for a CPU. On Linux the kernel counts that run-queue wait per
thread (/proc/thread-self/schedstat), so each sample is also kept without it: the "own" lag."""
from __future__ import annotations

import asyncio
import collections
import threading
import time


def _run_queue_seconds(path: str) -> float | None:
    """Seconds the thread of `path` has waited, runnable, for a CPU; None where not counted."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LoopWatch:
    def __init__(self, interval: float = 0.05, window: int = 1200) -> None:
        self.interval = interval
        self.samples: collections.deque[float] = collections.deque(maxlen=window)   # seconds late
        self.own: collections.deque[float] = collections.deque(maxlen=window)       # late less run-queue wait
        self.worst = 0.0
        self.cpu_wait_s = 0.0          # the loop thread's run-queue wait since start (0 where not counted)
        self.counts_cpu_wait = False

    async def run(self) -> None:
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        waited = _run_queue_seconds(path)
        self.counts_cpu_wait = waited is not None
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval)
            late = max(0.0, time.perf_counter() - t0 - self.interval)
            now_waited = _run_queue_seconds(path) if self.counts_cpu_wait else None
            cpu_wait = 0.0 if now_waited is None or waited is None else max(0.0, now_waited - waited)
            waited = now_waited
            self.cpu_wait_s += cpu_wait
            self.samples.append(late)
            self.own.append(max(0.0, late - cpu_wait))
            self.worst = max(self.worst, late)

    def quantile(self, q: float, own: bool = False) -> float:
        """Seconds late at quantile q of the recent samples (0 before any); `own`: less the
        time the loop's thread waited for a CPU (the same as the total where that is not counted)."""
        samples = self.own if own else self.samples
        if not samples:
            return 0.0
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
