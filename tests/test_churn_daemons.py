"""Churn through real daemons on loopback (issue 8, items 1-2): a host killed mid-run stops nobody;
restarted with its data dir, it joins the running swarm from a neighbour's parameters."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest

from tests.daemons import wait_for
from tests.test_training import start_train

pytestmark = pytest.mark.slow

DEAD_AFTER = 2.0          # tests.daemons.FAST


class Records:
    """Reads one `peerd train --json` stream in a thread, keeping every record."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.records = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.records.append(json.loads(line))

    def iteration(self) -> int:
        return max((r.get("iteration", 0) for r in self.records), default=0)

    def finish(self, timeout: float) -> list[dict]:
        self.proc.wait(timeout=timeout)
        self.thread.join(5)
        return self.records


def longest_stall(records: list[dict], t0: float, t1: float) -> float:
    """Longest wall time between two iteration advances within [t0, t1]."""
    last_t, last_k, worst = t0, None, 0.0
    for r in records:
        t = r.get("wall_time", 0)
        if not t0 <= t <= t1 or "iteration" not in r:
            continue
        if last_k is None or r["iteration"] > last_k:
            worst = max(worst, t - last_t)
            last_t, last_k = t, r["iteration"]
    return max(worst, t1 - last_t)


def states(d) -> dict[str, str]:
    """Peer states, or {} while `peerd status` is slower than its bound (a loaded machine)."""
    try:
        return d.peer_states()
    except subprocess.TimeoutExpired:
        return {}


def swarm(daemons, n: int, prefix: str):
    ds = [daemons(f"{prefix}0")]
    for i in range(1, n):
        ds.append(daemons(f"{prefix}{i}", seeds=[ds[0].address]))
    ids = {d.node_id for d in ds}
    wait_for(lambda: all(states(d) == {o: "alive" for o in ids - {d.node_id}} for d in ds), 90, "a full swarm")
    return ds


def test_killed_host_stalls_nobody_and_rejoins_from_a_neighbour(daemons):
    ds = swarm(daemons, 4, "c")
    args = ["--task", "digits", "--world", "4", "--iterations", "400", "--algo", "hop", "--eval-every", "100"]
    runs = [Records(start_train(d, *args)) for d in ds]
    victim = ds[3]
    wait_for(lambda: runs[0].iteration() >= 40, 120, "iteration 40")
    t_kill = time.time()
    victim.kill(signal.SIGKILL)                     # daemon and trainer: a host gone at once
    runs[3].proc.wait(20)
    k_kill = max(r.iteration() for r in runs[:3])
    wait_for(lambda: min(r.iteration() for r in runs[:3]) >= k_kill + 15 and time.time() - t_kill > DEAD_AFTER + 2,
             60, "the others to go on")
    t_back = time.time()
    for r in runs[:3]:
        stall = longest_stall(r.records, t_kill, t_back)
        # The failure-detection bound plus one progress interval and a loaded machine's slack.
        assert stall < DEAD_AFTER + 3.0, (stall, r.records[-1])
    k_before = min(r.iteration() for r in runs[:3])
    victim.start()
    victim.wait_ready()
    back = Records(start_train(victim, *args))
    wait_for(lambda: any("started from" in r.get("message", "") for r in back.records), 60,
             "the restarted host to start from a neighbour's parameters")
    note = next(r["message"] for r in back.records if "started from" in r.get("message", ""))
    k_join = int(note.split("iteration ")[1].split(":")[0])
    assert k_join >= k_before, (note, k_before)
    out = [r.finish(300) for r in [*runs[:3], back]]
    for records in out:
        assert records[-1]["state"] == "done" and records[-1]["metric"] >= 0.8, records[-1]
    # The restarted host computed only the iterations after the join, and mixed with its neighbours.
    assert back.records[-1]["iteration"] >= 395 and max(r["peers_in_last_mix"] for r in back.records) >= 1
