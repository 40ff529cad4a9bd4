"""The trainer side of `peerd bench control`: cost of Publish and Mix through the daemon for a
model of a given size, when the neighbours' updates are already there. The parameters live in
the daemon's slot 0 as the DecentralizedOptimizer keeps them (PEERD_BENCH_HOSTED=0: in a private
buffer, copied into a slot at every publish); the mix is copied into them, standing for the update
x_{k+1} = mix_k - lr*d, which reads the mix and writes the parameters in one pass as well.

Run by the daemon (`peerd train --script`); prints one JSON line per timed iteration.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

from peerd.train import attach
from peerd.train.flat import flatten_module


def main() -> int:
    params = int(os.environ.get("PEERD_BENCH_PARAMS", "25000000"))
    iterations = int(os.environ.get("PEERD_BENCH_ITERATIONS", "6"))
    settle = float(os.environ.get("PEERD_BENCH_SETTLE", "1.5"))
    torch.set_num_threads(1)
    exchange = attach()
    width = int(params ** 0.5)
    torch.manual_seed(0)
    model = nn.Linear(width, width, bias=False)
    flat = flatten_module(model)
    start = exchange.attach(flat.layout)
    if os.environ.get("PEERD_BENCH_HOSTED", "1") == "1":
        flat.rehome(exchange.param_home(flat.device))   # as DecentralizedOptimizer does: publish copies nothing
    x = torch.randn(64, width)
    for k in range(start, start + iterations):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        step = time.perf_counter() - t0
        t1 = time.perf_counter()
        exchange.publish(k, flat.buffer)
        publish = time.perf_counter() - t1
        time.sleep(settle)  # let the neighbours' updates arrive: measure the mix, not the wait
        t2 = time.perf_counter()
        res = exchange.mix(k)
        if res.params is not None:
            flat.buffer.copy_(res.params)
        mix = time.perf_counter() - t2
        print(json.dumps({"iteration": k, "bytes": flat.layout.total_bytes, "step_s": step,
                          "publish_s": publish, "mix_s": mix, "mixed": res.used}), flush=True)
        exchange.report(k + 1, 0.0)
    exchange.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
