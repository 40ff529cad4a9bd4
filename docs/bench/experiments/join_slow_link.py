"""A host rejoins a running swarm over a slow access link (root; the lab's `star` profile: h1 on
10 Mbit, h2 on 100 Mbit, h3 on 1 Gbit).

Three daemons train a zero-compute model of MB megabytes (`peerd bench size`'s trainer) with
D-PSGD on a ring. Once the run is under way h1 is killed (a crash); h2 and h3 train on. When they
are JOIN_LEAD iterations further, h1's daemon restarts and `peerd train` runs there again: its
trainer's Attach pulls a neighbour's parameters over h1's 10 Mbit link. Prints one JSON line: the
pulls h1's daemon made (MB, from whom, seconds), those that failed (from whom, the bound in
seconds, why), where h1 started from (its join note), the megabytes h1's interfaces received
from its restart to its first iteration, the seconds until h1 had done MIXES more iterations
(each a mix with neighbours over its slow link), and the longest time h2 and h3 went without an
iteration from h1's restart to its first iteration (the join held them back) and from then until
its MIXES more (D-PSGD waits on the slow link each iteration).

    sudo .venv/bin/python docs/bench/experiments/join_slow_link.py [MB] [--algo=d-psgd] [--daemon-arg=...]

`--daemon-arg=--train-transfer-slack=0` gives the join pull only its fixed bound
(`train_join_pull_timeout`, 10 s), as before the bound grew with the model's transfer time.
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
from peerd.node.localswarm import wait_until

FAST = ("--heartbeat-interval", "0.3", "--suspect-after", "1.0", "--dead-after", "2.0",
        "--rpc-timeout", "1.0")
JOIN_LEAD = 8
MIXES = 2          # h1's iterations after it joined: mixes with its neighbours over the slow link
SCRIPT = Path(__file__).resolve().parents[3] / "peerd" / "train" / "benchsize.py"


def wait(pred, timeout: float, what: str):
    if not wait_until(pred, timeout, 0.3):
        raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def received_bytes(lb: lab.Lab, host: str) -> int:
    """Bytes the host's interfaces have received (its namespace's counters, loopback left out)."""
    p = lb.run(host, ["sh", "-c", "for d in /sys/class/net/*; do [ \"${d##*/}\" = lo ] || cat $d/statistics/rx_bytes; "
                      "done"], timeout=30)
    return sum(int(x) for x in p.stdout.split())


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    extra = tuple(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--daemon-arg="))
    algo = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--algo=")), "d-psgd")
    mb = float(args[0]) if args else 20.0
    os.environ["PEERD_BENCH_BYTES"] = str(int(mb * 1e6))      # the daemons' trainers inherit it
    os.environ["PEERD_BENCH_ITERATIONS"] = "100000"
    train = ["--script", str(SCRIPT), "--world", "3", "--algo", algo, "--topology", "ring",
             "--iterations", "100000"]
    with tempfile.TemporaryDirectory(prefix="peerd-join-") as tmp:
        d = Path(tmp) / "lab"
        lab.up(profile.load("star"), d, Config(lab_ready_timeout=90.0), daemon_args=(*FAST, *extra))
        streams: dict[str, churn.TrainStream] = {}
        try:
            lb = lab.Lab(d)
            streams = {h: churn.TrainStream(lb, h, train) for h in lb.hosts}
            wait(lambda: all(s.iteration() >= 1 for s in streams.values()), 300, "every host's first iteration")
            churn.kill_host(d, "h1")
            streams.pop("h1").finish(10)
            base = min(streams[h].iteration() for h in ("h2", "h3"))
            wait(lambda: min(streams[h].iteration() for h in ("h2", "h3")) >= base + JOIN_LEAD, 300,
                 f"h2 and h3 to train {JOIN_LEAD} iterations on")
            rx0 = received_bytes(lb, "h1")
            churn.restart_host(d, "h1")
            t0, wall0 = time.monotonic(), time.time()
            streams["h1"] = churn.TrainStream(lb, "h1", train)
            wait(lambda: streams["h1"].iteration() >= 1, 600, "h1's first iteration after the restart")
            first, wall1 = time.monotonic() - t0, time.time()
            rx = received_bytes(lb, "h1") - rx0
            joined_at = streams["h1"].iteration()
            wait(lambda: streams["h1"].iteration() >= joined_at + MIXES, 600, f"h1's {MIXES} mixes after it joined")
            mixed = time.monotonic() - t0
            wall2 = time.time()
            stalls = {h: [round(churn.longest_stall(streams[h].records, a, b), 1) for a, b in ((wall0, wall1), (wall1, wall2))]
                      for h in ("h2", "h3")}
            log = (d / "h1" / "daemon.log").read_text(errors="replace")
            pulled = re.findall(r"join: (\d+) MB of parameters from (\S+) in ([\d.]+) s", log)
            failed = re.findall(r"join: no parameters from (\S+) within (\d+) s \((\w+)\)", log)
            notes = [r.get("message", "") for r in streams["h1"].records if "parameters" in r.get("message", "")
                     or "checkpoint" in r.get("message", "")]
            print(json.dumps({"model_mb": mb, "algo": algo, "daemon_args": extra, "restart_to_first_iteration_s": round(first, 1),
                              "h1_received_mb_until_then": round(rx / 1e6, 1),
                              f"restart_to_{MIXES}_more_iterations_s": round(mixed, 1),
                              "longest_stall_of_the_others_s_join_then_after": stalls,
                              "pulled": pulled, "failed_pulls": failed, "join_note": notes[:1]}))
        finally:
            for s in streams.values():
                s.proc.kill()
            lab.down(d, Config(), purge=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
