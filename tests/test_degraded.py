"""Never silent: a host that mixes without a neighbour says so. One host of a D-PSGD ring really
stops (SIGSTOP of its daemon and trainer, no goodbye): the survivors go on without it once the
failure detector finds it dead, count every mix that left it out, show it in their progress, and
end "degraded" (`peerd train` exits 3), never a plain "done"."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.test_training import start_train, swarm
from tests.daemons import wait_for

pytestmark = pytest.mark.slow


def test_a_neighbour_that_stops_makes_the_survivors_end_degraded(daemons):
    ds = swarm(daemons, 3, "g")
    args = ["--task", "svm", "--world", "3", "--algo", "d-psgd", "--iterations", "200", "--step-time", "0.03"]
    procs = [start_train(d, *args) for d in ds]
    victim = ds[2]
    stopped = False
    try:
        wait_for(lambda: (victim.status() or {}).get("training_json") and
                 json.loads(victim.status()["training_json"])["policy"]["iteration"] >= 5, 90, "iteration 5")
        os.killpg(victim.proc.pid, signal.SIGSTOP)      # daemon and trainer freeze: no notice, no goodbye
        stopped = True
        for p in procs[:2]:
            out, err = p.communicate(timeout=240)
            records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            last = records[-1]
            assert p.returncode == 3, f"exit {p.returncode}: {err[-500:]}\n{records[-2:]}"
            assert last["state"] == "degraded" and "DEGRADED" in last["message"], last
            assert last["partial_mixes"] > last["mixes"] / 2, last
            assert any(r.get("partial_mixes", 0) > 0 for r in records[:-1]), "progress said nothing before the end"
    finally:
        if stopped:
            os.killpg(victim.proc.pid, signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
