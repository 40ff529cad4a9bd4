"""Who is in each host's mixes up to the last one: every algorithm on 3 daemons on loopback, a
ring, one slow host (rank 0 sleeps SLOW_S seconds before each publish), a zero-compute trainer of
1 MB and 12 iterations (`peerd bench size`'s, slowed). Prints per algorithm each `peerd train`'s
exit code, final state and partial mixes, and each host's trainer's `used` per iteration (itself
and the neighbours its mix had). For the synchronous algorithms every mix has every neighbour it
waits for (3 on a ring, 2 with SGP's one in-neighbour, at least 2 in Hop's backup mode, which may
leave one out by design), the last mix too. The asynchronous ones (AD-PSGD, NetMax) run per-host
budgets: once the fast hosts finish, the slow one mixes alone (not partial: they finished).

    .venv/bin/python docs/bench/experiments/end_of_run.py [ALGORITHM ...]
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peerd.net.auth import new_secret
from peerd.node.localswarm import LocalDaemon, peerd_cmd

ROOT = Path(__file__).resolve().parents[3]
ALGORITHMS = ["d-psgd", "hop", "aau", "sgp", "hop-backup", "hop-staleness", "ad-psgd", "netmax"]
FAST = ["--heartbeat-interval", "0.2", "--suspect-after", "1.0", "--dead-after", "2.0",
        "--link-probe-max-bytes", str(1 << 20)]
ITERATIONS = 12


def slow_trainer(path: Path) -> Path:
    """benchsize.py with rank 0 sleeping SLOW_S (default 0.3) s and the others 0.02 s per step."""
    src = (ROOT / "peerd" / "train" / "benchsize.py").read_text()
    step = "        exchange.publish(k, buf)\n"
    assert step in src
    sleep = ('        time.sleep(float(os.environ.get("SLOW_S", "0.3")) if exchange.rank == 0 else 0.02)\n')
    path.write_text(src.replace(step, sleep + step, 1))
    return path


def main(algorithms: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="peerd-end-of-run-"))
    secret = root / "secret"
    secret.write_text(new_secret())
    secret.chmod(0o600)
    script = slow_trainer(root / "slowtrainer.py")
    os.environ.update({"PEERD_BENCH_BYTES": str(1 << 20), "PEERD_BENCH_ITERATIONS": str(ITERATIONS)})
    hosts: list[LocalDaemon] = []
    try:
        for i in range(3):
            hosts.append(LocalDaemon(root / f"h{i}", secret, [hosts[0].address] if hosts else [], extra=FAST).start())
            hosts[-1].wait_ready(60)
        time.sleep(3)
        for algo in algorithms:
            for d in hosts:
                for f in d.data_dir.glob("trainer-*.log"):
                    f.rename(f.with_name(f"{algo}-{f.name}"))   # the previous algorithm's
            procs = [subprocess.Popen(peerd_cmd("train", "--data-dir", str(d.data_dir), "--script", str(script),
                                                "--world", "3", "--algo", algo, "--topology", "ring",
                                                "--iterations", str(ITERATIONS), "--json"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d in hosts]
            ends = []
            for p in procs:
                out, _ = p.communicate(timeout=300)
                last = ([json.loads(x) for x in out.splitlines() if x.startswith("{")] or [{}])[-1]
                ends.append({"exit": p.returncode, "state": last.get("state"), "partial": last.get("partial_mixes")})
            used = {}
            for i, d in enumerate(hosts):
                log = next(d.data_dir.glob("trainer-*.log")).read_text()
                used[f"h{i}"] = [json.loads(x)["used"] for x in log.splitlines() if x.startswith('{"iteration"')]
            print(json.dumps({"algorithm": algo, "ends": ends, "used": used}), flush=True)
            time.sleep(2)
    finally:
        for d in hosts:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ALGORITHMS)
