"""The relayed link's measured capacity over time, in the three-sites-nat lab (b and c each behind
a NAT of their own, a relaying; every site link shaped to 50 Mbit). As root:

    .venv/bin/python docs/bench/experiments/relay_capacity.py SECONDS [DAEMON FLAG ...]

e.g. `... relay_capacity.py 120 --tunnel-chunk-bytes 1048576` for the old 1 MiB tunnel messages.
Prints, for b -> c and c -> b, the highest capacity seen and every reading (s since full
membership, capacity, throughput, Mbit/s), read from `peerd links` every 5 s.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from peerd.config import Config
from peerd.lab import lab, profile


def main(seconds: float, flags: list[str]) -> None:
    d = Path(tempfile.mkdtemp()) / "lab"
    lab.up(profile.load("three-sites-nat"), d, Config().replace(lab_ready_timeout=90.0),
           daemon_args=("--heartbeat-interval", "0.5", "--link-probe-seconds", "2", *flags))
    try:
        lb = lab.Lab(d)

        def cli(h: str, *args: str) -> dict | None:
            p = lb.run(h, [sys.executable, "-m", "cli.main", *args, "--json"], timeout=60)
            return json.loads(p.stdout) if p.returncode == 0 else None
        ids, t0 = {}, time.monotonic()
        while not ids and time.monotonic() - t0 < 90:
            st = {h: cli(h, "status") for h in lb.hosts}
            if all(s and sum(p["state"] == "alive" for p in s["peers"]) == 2 for s in st.values()):
                ids = {h: s["node_id"] for h, s in st.items()}
            time.sleep(1)
        if not ids:
            raise SystemExit("no full membership within 90 s")
        t1, seen = time.monotonic(), {}
        while time.monotonic() - t1 < seconds:
            for a, b in (("h2", "h3"), ("h3", "h2")):
                for r in (cli(a, "links") or {"links": []})["links"]:
                    if r["measurer"] == ids[a] and r["target"] == ids[b]:
                        seen.setdefault(f"{a}->{b}", []).append(
                            (round(time.monotonic() - t1), round(r["capacity_mbit_s"] or 0, 1),
                             round(r["throughput_mbit_s"] or 0, 1)))
            time.sleep(5)
        for k, v in seen.items():
            print(k, "highest capacity", max(c for _, c, _ in v), "readings", v)
    finally:
        lab.down(d, Config(), purge=False)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2:])
