"""Directives through real daemons: `peerd ctl checkpoint|pause|resume|skip-to|stop` reach the
trainer over the control API's Directives stream and are honoured at an iteration boundary."""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest
import torch

from peerd.node.localswarm import peerd_cmd
from tests.daemons import wait_for
from tests.test_training import STALL_BOUND, STALL_SLACK, longest_stall, start_train, swarm

pytestmark = pytest.mark.slow


class Follow:
    """`peerd train --json` records of one host, read as they come."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.records: list[dict] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.records.append(json.loads(line))

    @property
    def last(self) -> dict:
        return self.records[-1] if self.records else {"state": "", "iteration": 0}


def ctl(d, *args: str) -> str:
    out = subprocess.run(peerd_cmd("ctl", *args, "--data-dir", str(d.data_dir)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def trainer_log(d) -> str:
    return "".join(p.read_text() for p in d.data_dir.glob("trainer-*.log"))


@pytest.mark.timeout(600)   # about a minute on an idle machine; daemons and trainers start slowly under load
def test_directives_checkpoint_pause_resume_skip_stop(daemons):
    a, b = swarm(daemons, 2, "d", extra=["--train-silent-peer-timeout", str(STALL_BOUND)])
    procs = [start_train(d, "--task", "svm", "--world", "2", "--iterations", "1000000", "--algo", "hop-backup",
                         "--eval-every", "0") for d in (a, b)]
    fa, fb = Follow(procs[0]), Follow(procs[1])
    try:
        wait_for(lambda: fa.last["iteration"] >= 10 and fb.last["iteration"] >= 10, 120, "both hosts training")

        # checkpoint now: the trainer writes one at the iteration it had reached
        ctl(b, "checkpoint")
        m = wait_for(lambda: re.search(r"checkpoint now \(iteration (\d+)\)", trainer_log(b)), 30, "the checkpoint")
        ckpt = next(b.data_dir.glob("checkpoints/*/latest.pt"))
        assert torch.load(ckpt, weights_only=True)["iteration"] >= int(m.group(1))

        # pause: b stops advancing, a goes on without waiting for it
        ctl(b, "pause")
        wait_for(lambda: fb.last["state"] == "paused", 30, "b paused")
        time.sleep(1.0)
        b_paused, a_before = fb.last["iteration"], fa.last["iteration"]
        # a goes on: at once when b's ABSENT notice is through, at the latest after the silent-peer
        # bound (the longest stall is asserted at the end).
        wait_for(lambda: fa.last["iteration"] >= a_before + 10, STALL_BOUND + STALL_SLACK + 3.0,
                 "the other host to go on without the paused one")
        assert fb.last["iteration"] <= b_paused + 1, "a paused trainer went on"

        # resume: b continues at a's iteration (a ran on), not where it paused
        a_at_resume = fa.last["iteration"]
        ctl(b, "resume")
        wait_for(lambda: fb.last["state"] == "training" and fb.last["iteration"] >= a_at_resume, 30,
                 f"b resumed at a's iteration {a_at_resume}")
        assert "KIND_RESUME: continuing at iteration" in trainer_log(b)

        # skip-to: b jumps forward
        target = fb.last["iteration"] + 200
        ctl(b, "skip-to", str(target))
        wait_for(lambda: fb.last["iteration"] >= target, 30, f"b at iteration {target}")

        # stop: clean exit after a final checkpoint, on both hosts
        for d in (a, b):
            ctl(d, "stop")
        for p in procs:
            assert p.wait(60) == 0
        for f in (fa, fb):
            f.thread.join(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for d, f in ((a, fa), (b, fb)):
        assert f.last["state"] == "done" and "stopped by a directive" in f.last["message"], f.last
        final = int(re.findall(r"stop at iteration (\d+)", trainer_log(d))[-1])
        ckpt = next(d.data_dir.glob("checkpoints/*/latest.pt"))
        assert torch.load(ckpt, weights_only=True)["iteration"] == final
    stall, where = longest_stall(fa.records)
    print(f"host a's longest stall while b paused/resumed: {stall:.2f}s at iteration {where}")
    assert stall <= STALL_BOUND + STALL_SLACK, (stall, where)
