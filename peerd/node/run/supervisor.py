"""The trainer process: started with spawn/exec (never fork), restarted from its last checkpoint
when it crashes (without leaving the swarm), stopped in order when the run ends."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

from peerd.net.wirecheck import clip
from peerd.node.run.context import RunContext
from peerd.node.run.outbound import Outbound
from peerd.node.run.progress import MixLedger, Progress
from peerd.node.run.trainer_api import TrainerApi
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")
ATTACH_HINT_AFTER = 20.0   # seconds after which a script that has not attached is named (a hint, not a bound)

# `peerd train` options the built-in trainer takes as its own flags (--key-name VALUE)
WORKER_OPTIONS = ("lr", "momentum", "optimizer", "batch_size", "accum_iter", "step_time", "slow_prob", "slow_factor",
                  "model_size", "context", "eval_tokens", "device", "init",
                  "outer", "inner_steps", "round_seconds", "fragments", "overlap", "outer_lr", "outer_momentum")


class TrainerSupervisor:
    def __init__(self, ctx: RunContext, api: TrainerApi, outbound: Outbound, progress: Progress,
                 changed: asyncio.Event, done: asyncio.Event, checkpoint_dir: Path,
                 fail: Callable[[str], None], ledger: MixLedger) -> None:
        self.ctx = ctx
        self.api = api
        self.outbound = outbound
        self.progress = progress
        self.changed = changed
        self.done = done
        self.checkpoint_dir = checkpoint_dir
        self.fail = fail
        self.ledger = ledger
        self.process: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        s = self.ctx.spec
        if s.script:
            return [sys.executable, *s.script]
        cap = s.iterations * s.world if s.swarm_budget else s.iterations
        argv = [sys.executable, "-m", "peerd.train.worker", "--task", s.task, "--iterations", str(cap),
                "--seed", str(s.seed), "--eval-every", str(s.eval_every)]
        if s.non_iid:
            argv.append("--non-iid")
        for key in WORKER_OPTIONS:
            if key in s.options:
                argv += [f"--{key.replace('_', '-')}", s.options[key]]
        if s.options.get("trace") == "true":
            argv.append("--trace")
        return argv

    def cwd(self) -> str | None:
        """A script runs where `peerd train` ran (its relative paths are the user's); a built-in
        trainer where the daemon runs."""
        return self.ctx.spec.options.get("cwd") if self.ctx.spec.script else None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        rank, world = self.ctx.data_shard()
        cfg = self.ctx.cfg
        env.update(PEERD_CONTROL_SOCKET=str(cfg.control_socket), PEERD_SESSION=self.ctx.session,
                   PEERD_RANK=str(rank), PEERD_WORLD=str(world), PEERD_SLOWDOWN=str(self.ctx.spec.slowdown),
                   PEERD_CHECKPOINT_DIR=str(self.checkpoint_dir), PEERD_RUN_ID=cfg.node.run_id,
                   PEERD_PAUSE_TIMEOUT=str(cfg.train.pause_timeout),
                   PEERD_ATTACH_TIMEOUT=str(cfg.train.attach_timeout),
                   PEERD_CHECKPOINT_EVERY=str(cfg.train.checkpoint_every))
        return env

    async def supervise(self) -> None:
        """Run the trainer to completion, restarting it from its checkpoint when it crashes."""
        p, cfg = self.progress, self.ctx.cfg.train
        if p.state == "failed":              # an internal error before the trainer started
            self.done.set()
            self.changed.set()
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        p.state = "training"
        self.changed.set()
        while True:
            log_path = self.ctx.env.data_dir / f"trainer-{self.ctx.session}.log"
            with open(log_path, "ab") as logf:
                # subprocess uses vfork+exec: no fork handlers run in a child of a process whose
                # gRPC threads are busy (a plain fork there can crash or hang the child).
                if p.state in ("stopping", "failed"):
                    break  # stop() came while we waited: never start a trainer nobody will stop
                # Its own process group: Ctrl+C at the daemon's terminal reaches the daemon only,
                # which stops the trainer in order (a trainer killed first looked like a crash).
                self.process = subprocess.Popen(self.argv(), env=self.env(), stdout=logf, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, process_group=0, cwd=self.cwd())
                log.info("trainer pid %d started (rank %d of %d, %s, %s); log %s", self.process.pid,
                         self.ctx.rank, self.ctx.n, self.ctx.spec.algorithm,
                         self.ctx.spec.task or " ".join(self.ctx.spec.script), log_path)
                hint = asyncio.get_running_loop().call_later(
                    ATTACH_HINT_AFTER, self._not_attached, self.process.pid, self.api.attaches, log_path) \
                    if self.ctx.spec.script else None
                code = await asyncio.to_thread(self.process.wait)
                if hint is not None:
                    hint.cancel()
            if p.state == "failed":   # the run failed meanwhile (internal_error): no restart, no "done"
                break
            if code == 0:
                self._finished()
                break
            if p.state == "stopping":
                break
            if self.api.stop_requested:   # it was told to stop: a restart would train on, unasked
                self.fail(f"trainer exited {code} after the stop directive (not restarted); see {log_path}")
                self.outbound.announce(pb.TrainerNotice.STATE_FINISHED)
                break
            self.outbound.announce(pb.TrainerNotice.STATE_ABSENT)
            p.restarts += 1
            why = last_error(log_path)
            if p.restarts > cfg.max_restarts:
                self.fail(f"trainer exited {code} ({why}) and was restarted {p.restarts - 1} times; see {log_path}")
                break
            p.state = "restarting"
            saved = any(self.checkpoint_dir.glob("*.pt"))
            p.message = (f"trainer exited {code} ({why}); restarting ({p.restarts} of {cfg.max_restarts}) "
                         + ("from its last checkpoint" if saved else "from the start: it wrote no checkpoint")
                         + f"; its log: {log_path}")
            log.warning("trainer exited %d (%s); restarting (%d of %d)", code, why, p.restarts, cfg.max_restarts)
            self.changed.set()
            await asyncio.sleep(cfg.restart_delay)
            if p.state in ("stopping", "failed"):
                break
            p.state, p.message = "training", f"trainer restarted ({p.restarts} of {cfg.max_restarts})"
        self.done.set()
        self.changed.set()

    def _not_attached(self, pid: int, attaches: int, log_path: Path) -> None:
        """A script has run ATTACH_HINT_AFTER seconds without attaching: say what it may lack."""
        if self.api.attaches == attaches and self.process is not None and self.process.poll() is None:
            self.progress.message = (f"the script (pid {pid}) has not attached after {ATTACH_HINT_AFTER:.0f} s: "
                                     f"does it call peerd.train.attach()? its log: {log_path}")
            log.warning("%s", self.progress.message)
            self.changed.set()

    def _finished(self) -> None:
        """The trainer exited 0: done, or degraded when most of its mixes left out a neighbour."""
        p, ledger = self.progress, self.ledger
        p.state = "done"
        p.message = (self.api.stop_reason or "trainer stopped by a directive") if self.api.stop_requested \
            else "trainer finished"
        if ledger.mostly_partial(self.ctx.cfg.train.degraded_share):
            p.state = "degraded"
            p.message = (f"DEGRADED: {ledger.partial} of {ledger.total} mixes left out a neighbour "
                         f"({ledger.note()}); this host trained mostly alone ({p.message})")
            log.error("%s", p.message)
        elif ledger.after_all_finished:
            spec = self.ctx.spec
            hint = "`--budget swarm` keeps the hosts training until the swarm's total is done" \
                if spec.algorithm in ("netmax", "ad-psgd") and not spec.swarm_budget else ""
            p.message += "; " + ledger.alone_note(hint)
            log.info("%s", p.message)
        self.outbound.announce(pb.TrainerNotice.STATE_FINISHED)

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), grace)
            except asyncio.TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)

    def kill(self) -> None:
        """What must not outlive a forced daemon stop."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


def last_error(log_path: Path, tail_bytes: int = 8192) -> str:
    """The last line of a trainer's log that names an exception ("ValueError: ..."), else its last
    line: what a crashed script said, shown where the user looks (progress), not only in the log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    if not lines:
        return "it printed nothing"
    named = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", ln)]
    return clip((named or lines)[-1], 160)
