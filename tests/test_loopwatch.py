"""The event-loop lag watch tells the daemon's own lag (a callback holding the loop) from time its
loop thread waited, runnable, for a CPU on a host with more busy threads than cores."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from peerd.node.loopwatch import LoopWatch


def test_a_callback_that_holds_the_loop_is_the_loops_own_lag():
    async def main() -> LoopWatch:
        watch = LoopWatch(interval=0.02)
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.1)
        time.sleep(0.3)                      # a whole-buffer pass on the loop thread
        await asyncio.sleep(0.1)
        task.cancel()
        return watch

    watch = asyncio.run(main())
    assert watch.worst >= 0.25
    assert watch.quantile(1.0) >= 0.25
    assert watch.quantile(1.0, own=True) >= 0.25     # sleeping is not waiting for a CPU


# Runs in its own process, pinned to one CPU with three busy processes: the loop's thread is
# runnable most of the time and waits its turn.
CONTENDED = textwrap.dedent("""
    import asyncio, json, os, subprocess, sys, time
    from peerd.node.loopwatch import LoopWatch
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    spin = "import os, time\\nos.sched_setaffinity(0, {%d})\\nt = time.time() + 4\\nwhile time.time() < t: pass" % cpu
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]

    async def main():
        watch = LoopWatch(interval=0.02)
        task = asyncio.ensure_future(watch.run())
        end = time.monotonic() + 2.5
        while time.monotonic() < end:           # the loop busy in 2 ms callbacks, as under traffic
            t = time.thread_time() + 0.002
            while time.thread_time() < t:
                pass
            await asyncio.sleep(0)
        task.cancel()
        return watch

    try:
        w = asyncio.run(main())
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(json.dumps({"counts": w.counts_cpu_wait, "cpu_wait_s": w.cpu_wait_s, "samples": len(w.samples),
                      "p50": w.quantile(0.5), "own_p50": w.quantile(0.5, own=True)}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel counts no run-queue wait")
def test_waiting_for_a_cpu_is_told_apart_from_the_loops_own_lag():
    import json
    out = subprocess.run([sys.executable, "-c", CONTENDED], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["counts"] and r["samples"] > 5
    # Four runnable tasks on one CPU: the loop's thread waits for it most of the time
    assert r["cpu_wait_s"] > 0.5, r
    # and that wait is not counted as the loop's own lag
    assert r["own_p50"] < r["p50"], r
