"""Loopback daemons: `peerd train --budget swarm` makes the run's iterations a budget for its hosts
together (world x iterations): a fast host goes on while a slow one catches up, and every host stops
once the sum is reached."""
from __future__ import annotations

import subprocess

import pytest

from peerd.node.localswarm import peerd_cmd
from peerd.node.run.spec import RunError, RunSpec
from peerd.v1 import control_pb2 as cpb
from tests.daemons import daemons  # noqa: F401  (fixture)
from tests.test_training import finish, start_train, swarm

ITERATIONS, STEP, SLOW = 60, 0.05, 4


def test_swarm_budget_lets_the_fast_host_do_the_slow_ones_share(daemons):  # noqa: F811
    ds = swarm(daemons, 2, "b", extra=["--train-budget-interval", "0.2"])
    args = ["--task", "svm", "--world", "2", "--iterations", str(ITERATIONS), "--algo", "netmax",
            "--step-time", str(STEP), "--eval-every", "1000", "--budget", "swarm"]
    fast, slow = finish([start_train(ds[0], *args, "--slowdown", "1"),
                         start_train(ds[1], *args, "--slowdown", str(SLOW))])
    done = {name: r[-1] for name, r in (("fast", fast), ("slow", slow))}
    print({k: (v["state"], v["iteration"], v["message"]) for k, v in done.items()})
    assert all(v["state"] == "done" for v in done.values()), done
    assert all("budget" in v["message"] for v in done.values()), done      # stopped by the budget, not the cap
    total = done["fast"]["iteration"] + done["slow"]["iteration"]
    # The count is of iterations published (each host's current one counts); each host polls every
    # 0.2 s and stops at its next step: together 25 it/s, so a few past the sum.
    assert 2 * ITERATIONS - 2 <= total <= 2 * ITERATIONS + 25, done
    assert done["fast"]["iteration"] > ITERATIONS > done["slow"]["iteration"], done


def test_budget_is_host_or_swarm():
    p = subprocess.run(peerd_cmd("train", "--task", "svm", "--world", "1", "--budget", "all"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--budget" in p.stderr, p.stderr
    with pytest.raises(RunError, match="budget: expected host or swarm"):
        RunSpec.from_request(cpb.TrainRequest(task="svm", world=1, options={"budget": "all"}), 1.0)
