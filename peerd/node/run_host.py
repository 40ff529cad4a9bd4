"""The daemon's side of training runs: the current run, what reaches it, and how it ends.

One run at a time per daemon. A peer's update that arrives before our run started waits for it
(its stream held, up to `train_attach_wait`) so that ours sums it as it arrives; one that comes
earlier still is held whole (up to `train_early_updates`) and replayed when ours starts; updates
of another run (its tag differs) are dropped. A peer that sends bad updates (peerd.node.offences)
is flagged: the run treats it as down for the cool-down (no policy waits on updates that are
refused), then as up again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from peerd.net.dataplane import Received, Sink, Snapshot
from peerd.net.membership import State, Transition
from peerd.node.offences import PeerOffences
from peerd.node.run.env import RunEnv
from peerd.node.run.joining import Rankings
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import RunSpec

log = logging.getLogger("peerd.daemon")

RUN_KINDS = ("model", "carry")     # data-plane kinds that belong to a run (tagged "kind:<tag>")


class RunHost:
    def __init__(self, env: RunEnv, offences: PeerOffences, event: Callable[..., None]) -> None:
        self.env = env
        self.offences = offences
        self.event = event                       # the daemon's event log
        self.training: TrainingRun | None = None
        self.waiting: RunSpec | None = None      # a `peerd train` here waits for its run to form (joining.place)
        self.last_state: dict | None = None      # state() of the last run that ended (`peerd plan` reads it)
        self.rankings = Rankings()
        self._early: list[Received] = []         # peers' updates that arrived before our run started
        self._run_started = asyncio.Event()      # set while a run is on (or once stopped: nothing to wait for)
        self._down_incarnation: dict[str, int] = {}   # a peer's incarnation when the run saw it go
        self.stopped = False

    # --- runs -----------------------------------------------------------------------------------
    def start_run(self, run: TrainingRun) -> None:
        self.training = run
        self._run_started.set()
        early, self._early = self._early, []
        for rec in early:
            if rec.kind.partition(":")[2] == run.tag:
                run.on_received(rec)
            else:
                rec.release()

    def end_run(self, run: TrainingRun) -> None:
        if self.training is run:
            self.last_state = run.state()
            self.training = None
            if not self.stopped:
                self._run_started.clear()

    async def stop(self) -> None:
        if self.training is not None:
            await self.training.stop()
        for rec in self._early:
            rec.release()
        self._early.clear()
        self.stopped = True
        self._run_started.set()

    def force_stop(self) -> None:
        if self.training is not None:
            self.training.force_stop()

    # --- the data plane ---------------------------------------------------------------------------
    def on_received(self, rec: Received) -> None:
        base, _, tag = rec.kind.partition(":")
        if base in RUN_KINDS:
            run = self.training
            if run is not None:
                if tag == run.tag:
                    run.on_received(rec)
                else:
                    rec.release()  # a late update of an earlier run
                return
            if len(self._early) < self.env.cfg.train.early_updates:
                self._early.append(rec)  # the peer's run started before ours; replayed at start
                return
        rec.release()

    def pull_source(self, requester: str, kind: str, min_iteration: int) -> Snapshot | None:
        run = self.training
        if run is not None and kind == run.kind("model"):
            return run.serve_pull(requester, min_iteration)
        return None

    async def sink_for(self, header, peer: str) -> Sink | None:
        """A push the run sums as it arrives instead of receiving it whole (the data plane asks).
        A model update that comes before our run started (the neighbour's `peerd train` ran first)
        waits for it, its stream held: received whole, it would cost a model of memory per early
        neighbour. One deadline, train_attach_wait, covers the run's start and its trainer's attach."""
        wait = self.env.cfg.train.attach_wait
        deadline = asyncio.get_running_loop().time() + wait
        if self.training is None and header.kind.partition(":")[0] == "model" and self.env.cfg.train.sum_on_arrival:
            try:
                await asyncio.wait_for(self._run_started.wait(), wait)
            except TimeoutError:
                return None
        run = self.training
        if run is not None and header.kind == run.kind("model"):
            return await run.sink_for(header, max(0.0, deadline - asyncio.get_running_loop().time()))
        return None

    def screen(self, peer: str, kind: str) -> str | None:
        """Model updates of a peer flagged for bad updates are refused at their header."""
        if kind.partition(":")[0] not in RUN_KINDS:
            return None
        left = self.offences.flagged_for(peer)
        return f"peer {peer} is flagged for bad updates; ignored for {left:.0f}s more" if left else None

    def report_offence(self, peer: str, what: str) -> None:
        """A bad update from `peer` (dropped where it was found). Flagged: the run treats the peer
        as down for the cool-down, then as up."""
        if not self.offences.record(peer, what):
            return
        cooldown = self.env.cfg.train.peer_cooldown
        self.event("flagged", peer=peer, what=what, cooldown=cooldown)
        if self.training is not None:
            self.training.peer_down(peer)
        asyncio.get_running_loop().call_later(cooldown + 0.05, self._readmit, peer)

    def _readmit(self, peer: str) -> None:
        if self.stopped or self.offences.flagged_for(peer):
            return  # shut down, or flagged again meanwhile (that flag has its own timer)
        self.event("readmitted", peer=peer)
        if self.training is not None and self.env.alive(peer):
            self.training.peer_up(peer)

    # --- membership -------------------------------------------------------------------------------
    def on_transition(self, tr: Transition) -> None:
        run = self.training
        if run is None:
            return
        member = self.env.membership.get(tr.node_id)
        if tr.new in (State.DEAD, State.LEFT, None):
            if member is not None:
                self._down_incarnation[tr.node_id] = member.incarnation
            run.peer_down(tr.node_id)
        elif tr.new is State.ALIVE and tr.old in (State.DEAD, State.LEFT):
            was = self._down_incarnation.pop(tr.node_id, None)
            run.peer_up(tr.node_id, restarted=member is not None and was is not None and member.incarnation > was)

    def on_restart(self, node_id: str, old: int, new: int) -> None:
        """A peer back as a new incarnation while still alive: to the run, a crash and a return."""
        run = self.training
        if run is not None:
            log.info("peer %s restarted (incarnation %d -> %d)", node_id, old, new)
            run.peer_down(node_id)
            run.peer_up(node_id, restarted=True)

    # --- a peer's calls about runs ----------------------------------------------------------------
    def update_arriving(self, sender: str) -> None:
        if self.training is not None:
            self.training.liveness.update_arriving(sender)

    def update_lost(self, sender: str, kind: str, k: int) -> None:
        if self.training is not None:
            self.training.liveness.update_lost(sender, kind, k)

    def on_tokens(self, sender: str, n: int) -> None:
        if self.training is not None:
            self.training.on_tokens(sender, n)

    def on_trainer_notice(self, sender: str, tag: str, state: int, k: int) -> int:
        run = self.training
        if run is None or tag != run.tag:
            return -1
        return run.on_notice(sender, state, k)
