"""A big model over a slow access link, in steady training (root; the lab's `star` profile: h1 on
10 Mbit, h2 on 100 Mbit, h3 on 1 Gbit).

Three daemons train a zero-compute model of MB megabytes (`peerd bench size`'s trainer) with
D-PSGD on a ring for ITERATIONS iterations, default settings. Every iteration h1 sends its update
to both neighbours and receives theirs over its 10 Mbit link: 2 x MB each way, 80 s at 50 MB.
Prints one JSON line: the wall time, and per host its final state, mixes and partial mixes (and
why), the seconds between its iterations, and the neighbours its daemon marked silent.

    sudo .venv/bin/python docs/bench/experiments/big_model_slow_link.py [MB] [ITERATIONS] [daemon flags ...]
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from peerd.config import Config
from peerd.lab import churn, lab, profile

SCRIPT = Path(__file__).resolve().parents[3] / "peerd" / "train" / "benchsize.py"


def main() -> int:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 50.0
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    extra = tuple(sys.argv[3:])
    os.environ["PEERD_BENCH_BYTES"] = str(int(mb * 1e6))      # the daemons' trainers inherit it
    os.environ["PEERD_BENCH_ITERATIONS"] = str(iterations)
    train = ["--script", str(SCRIPT), "--world", "3", "--algo", "d-psgd", "--topology", "ring",
             "--iterations", str(iterations)]
    with tempfile.TemporaryDirectory(prefix="peerd-bigslow-") as tmp:
        d = Path(tmp) / "lab"
        lab.up(profile.load("star"), d, Config(lab_ready_timeout=90.0), daemon_args=extra)
        streams: dict[str, churn.TrainStream] = {}
        try:
            lb = lab.Lab(d)
            t0 = time.time()
            streams = {h: churn.TrainStream(lb, h, train) for h in lb.hosts}
            for s in streams.values():
                s.proc.wait(timeout=600 + 300 * iterations)
                s.thread.join(10)
            hosts = {}
            for h, s in streams.items():
                last = s.records[-1] if s.records else {}
                times, k = [], 0
                for r in s.records:
                    if r.get("iteration", 0) > k:
                        k = r["iteration"]
                        times.append(round(r["t"] - t0, 1))
                log = (d / h / "daemon.log").read_text(errors="replace")
                hosts[h] = {"exit": s.proc.returncode, "state": last.get("state"), "mixes": last.get("mixes"),
                            "partial_mixes": last.get("partial_mixes"), "message": last.get("message"),
                            "iteration_at_s": times,
                            "marked_silent": re.findall(r"no update from (\S+) for ([\d.]+)s at iteration (\d+)", log),
                            "updates_lost": len(re.findall(r"failed mid-stream: mixed without it", log)),
                            "pushes_cut": len(re.findall(r"update \d+ to \S+ failed: deadline_exceeded", log))}
            print(json.dumps({"model_mb": mb, "iterations": iterations, "daemon_args": extra,
                              "wall_s": round(time.time() - t0, 1), "hosts": hosts}))
        finally:
            for s in streams.values():
                s.proc.kill()
            lab.down(d, Config(), purge=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
