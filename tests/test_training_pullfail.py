"""Loopback daemons: a NetMax or AD-PSGD pull that is never answered stalls the puller at most
train_pull_timeout, not until its trainer's train_mix_timeout nor a silent-peer timeout.

Host 1's daemon is alive and in the run, its trainer frozen before it attaches, so every pull
host 0 sends it is answered NOT_FOUND, and every carried AD-PSGD pull refused (what a peer whose
trainer has not attached, or whose run ended, does)."""
from __future__ import annotations

import re

import pytest

from tests.daemons import daemons  # noqa: F401  (fixture)
from tests.test_training import STALL_SLACK, IdleMember, finish, longest_stall, start_train, swarm

PULL_TIMEOUT = 1.0
SILENT = 30.0   # far above: on main the pull was released only by this (or train_mix_timeout)


@pytest.mark.parametrize("algo", ["netmax", "ad-psgd"])
def test_unanswered_pull_is_bounded_by_train_pull_timeout(daemons, algo):  # noqa: F811
    ds = swarm(daemons, 2, "p", extra=["--train-pull-timeout", str(PULL_TIMEOUT), "--train-pull-backoff", "2",
                                       "--train-silent-peer-timeout", str(SILENT), "--train-drain-timeout", "2"])
    # Ranks go by node id: the smaller one is rank 0, AD-PSGD's active (pulling) worker.
    host, other = sorted(ds, key=lambda d: d.node_id)
    args = ["--task", "svm", "--world", "2", "--iterations", "120", "--algo", algo, "--step-time", "0.05",
            "--eval-every", "120"]
    idle = IdleMember(other, *args)
    try:
        train = start_train(host, *args)
        idle.freeze()
        (records,) = finish([train])
    finally:
        idle.close()
    assert records[-1]["state"] == "done" and records[-1]["iteration"] >= 119, records[-1]
    stall, where = longest_stall(records)
    # longest_stall starts at iteration 1; the first pull (at iteration 0) must be bounded too.
    training = [r["t"] for r in records if r["state"] == "training"]
    first = next(r["t"] for r in records if r["state"] in ("training", "done") and r["iteration"] >= 1)
    print(f"first record in training to iteration 1: {first - training[0]:.2f}s (trainer start included)")
    retried = len(re.findall(r"pull from \S+ (?:failed|unanswered)", host.log_path.read_text()))
    print(f"longest stall {stall:.2f}s at iteration {where} (bound {PULL_TIMEOUT}s); {retried} pulls given up")
    assert stall <= PULL_TIMEOUT + STALL_SLACK, (stall, where)
    # Iteration 0 includes the trainer's start (seconds, machine-dependent), so it gets a coarse
    # bound: the unbounded pull of before held it for SILENT (NetMax with SILENT 20 s: 23.2 s
    # before, 3-5 s now; AD-PSGD's first publish also waits for its join attempt: 9 s under load).
    assert first - training[0] < SILENT / 2, first - training[0]
    assert retried >= 2, "the failed peer was not pulled again after train_pull_backoff"
