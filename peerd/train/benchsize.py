"""The trainer side of `peerd bench size`: a zero-compute trainer (publish, mix, copy back) of a
flat float32 model of PEERD_BENCH_BYTES bytes, as DecentralizedOptimizer hosts it (in slot 0).

Run by the daemon (`peerd train --script`); prints one JSON line per iteration and, at the end,
one line with its peak resident memory.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from peerd.train import attach
from peerd.train.flat import Layout


def peak_rss_bytes(pid: int | str = "self") -> int:
    """VmHWM of a process (Linux), bytes; 0 where unknown."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> int:
    nbytes = int(os.environ.get("PEERD_BENCH_BYTES", str(100 << 20)))
    iterations = int(os.environ.get("PEERD_BENCH_ITERATIONS", "10"))
    torch.set_num_threads(1)
    exchange = attach()
    layout = Layout.build([("w", "float32", (nbytes // 4,))])
    start = exchange.attach(layout)
    buf = exchange.param_home(torch.device("cpu"))
    if buf is None:
        buf = torch.empty(layout.total_bytes, dtype=torch.uint8)
    torch.manual_seed(exchange.rank)
    layout.typed(buf)[0].normal_()
    for k in range(start, start + iterations):
        t0 = time.perf_counter()
        exchange.publish(k, buf)
        t1 = time.perf_counter()
        res = exchange.mix(k)
        t2 = time.perf_counter()
        if res.params is not None:
            buf.copy_(res.params)
        t3 = time.perf_counter()
        print(json.dumps({"iteration": k, "t": time.time(), "publish_s": t1 - t0, "mix_s": t2 - t1,
                          "copy_s": t3 - t2, "used": res.used}), flush=True)
        exchange.report(k + 1, 0.0)
    print(json.dumps({"peak_rss_bytes": peak_rss_bytes()}), flush=True)
    exchange.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
