"""Which neighbours the run waits for: membership turned into run events, absent trainers, silence.

- Peers the failure detector marks dead (or that leave) are PeerDown for the policy, so no policy
  waits on a dead peer. A peer that comes back is PeerUp only once its run is back too (its first
  update for this run reaches us, tagged with its iteration; its RESUMING notice when its join
  pull is done; under a pull policy its first pull): a host whose daemon is up but whose trainer
  is still starting, or still pulling the swarm's parameters to join, is not waited on. Our newest
  update is pushed to a returning peer (outside the policy), so that two sides of a healed
  partition, each holding the other dead, re-admit each other.
- A live daemon whose trainer does not contribute is "absent", also PeerDown: its daemon announces
  a crashed trainer (ABSENT) and a finished one (FINISHED) at once; the neighbour counts as
  absent once the updates it sent before its notice are mixed (`settle_leaving`). Without a
  notice (a hung trainer, a lost message) a neighbour waited on for `train_silent_peer_timeout`
  (plus two of our own iterations, and its update's transfer allowance, peerd.node.run.bounds) is
  absent until its next update. So no host waits on a silent neighbour longer than that bound.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from typing import Callable

from peerd.net.dataplane import Received
from peerd.node.run.bounds import mix_bound, transfer_bound
from peerd.node.run.context import RunContext
from peerd.node.run.outbound import Outbound
from peerd.node.run.snapshots import Snapshots
from peerd.sync import events as ev
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")

# A neighbour from whom bytes of an update arrived this recently is sending, however long its
# update takes (4 x the data plane's ACTIVITY_EVERY: a stalled stream stops counting within it),
# or within the time ARRIVING_CHUNKS chunks take at dataplane_min_rate where that is longer: bytes
# show up a whole chunk (1 MiB) at a time, and on a 10 Mbit link two or three streams share, one
# gets a chunk through every 2-4 s (in the lab, updates streaming in were marked silent).
ARRIVING_WINDOW = 2.0
ARRIVING_CHUNKS = 4
ITERATIONS_KEPT = 5   # our last iterations' durations, whose median is our pace


class PeerLiveness:
    def __init__(self, ctx: RunContext, feed: Callable[[ev.Event], None], outbound: Outbound,
                 snapshots: Snapshots, is_waiting: Callable[[int], bool], model_bytes: Callable[[], int]) -> None:
        self.ctx = ctx
        self.feed = feed
        self.outbound = outbound
        self.snapshots = snapshots
        self.is_waiting = is_waiting          # the trainer still waits for mix k
        self.model_bytes = model_bytes
        self.absent: dict[int, str] = {}      # not contributing: "restarting", "finished", "silent"
        self.absent_at: dict[int, int] = {}   # a "restarting" notice's iteration: older updates were sent before it
        self.leaving: dict[int, str] = {}     # announced "finished" or "restarting", an update of theirs still to be mixed
        self.returning: set[str] = set()      # peers back in membership, not yet back in this run
        self.readmitted: dict[int, int] = {}  # re-admitted at this iteration, until its next update
        self.resync: dict[int, int] = {}      # after our restart: neighbours' iterations, applied at publish
        self._silent_timer: asyncio.TimerHandle | None = None
        self._silent_since = 0.0              # when the wait the silent timer bounds began (or its last check)
        self._waited_since: dict[int, float] = {}   # per neighbour waited on: since when
        self._last_publish = 0.0
        self._bytes_at: dict[int, float] = {}  # when bytes of an update from each neighbour last arrived
        self._intervals: collections.deque[float] = collections.deque(maxlen=ITERATIONS_KEPT)  # between publishes

    # --- membership -------------------------------------------------------------------------------
    def peer_down(self, node_id: str) -> None:
        src = self.ctx.rank_of(node_id)
        if src < 0 or src == self.ctx.rank:
            return
        if self.absent.get(src) != "finished":
            self.absent.pop(src, None)   # the failure detector's word supersedes a notice
        self.outbound.reset(src)
        self.readmitted.pop(src, None)
        if self.leaving.get(src) == "finished":
            return                       # it left once finished: what it sent is still mixed
        self.leaving.pop(src, None)
        self.feed(ev.PeerDown(src))

    def peer_up(self, node_id: str, restarted: bool = False) -> None:
        """Not yet: the peer's daemon is back, its run may not be. Our newest update goes to it at
        once (after a healed partition each side holds the other dead and sends it nothing),
        unless it `restarted` (a new incarnation): its run starts anew and reaches us when its join
        pull is done (its RESUMING notice) or with its first update, and a push now would share its
        link with that pull (on a slow link, a join pull took 3x as long beside two neighbours'
        pushes)."""
        src = self.ctx.rank_of(node_id)
        if src < 0 or src == self.ctx.rank:
            return
        self.returning.add(node_id)
        if self.snapshots.live_k >= 0 and not restarted:
            self.outbound.send(ev.Send(src, ev.CURRENT), once=True)   # our newest, as soon as it is held
        self.outbound.tell_finished(src)                               # behind it, when our trainer is done

    def back_in_run(self, node_id: str, k: int) -> None:
        """A returning peer's run reached us (an update or a pull): re-admit it at iteration k."""
        if node_id in self.returning:
            src = self.ctx.rank_of(node_id)
            self.leaving.pop(src, None)
            if self.absent.get(src) == "finished":
                del self.absent[src]      # a finished host back in the run trains again
            self.returning.discard(node_id)
            log.info("peer %s is back in the run at iteration %d", node_id, k)
            self.feed(ev.PeerUp(src, max(k, 0)))

    def check_readmission(self, src: int, rec: Received) -> None:
        """Re-admit a returning peer at its update's iteration, and check that iteration against
        the next update: a push cut off by a partition may reach us after the heal (TCP delivers
        what was in flight once the path is back, though its sender gave up on it), so the first
        update of a returning peer can be one from before the cut. Re-admitted at that old
        iteration, Hop's token edge would hold us until the peer "caught up" to where it already
        is; a jump past it in the next update re-admits the peer where it really is."""
        if rec.sender in self.returning:
            self.back_in_run(rec.sender, rec.iteration)
            self.readmitted[src] = rec.iteration
        elif (k0 := self.readmitted.pop(src, None)) is not None and rec.iteration > k0 + 1:
            log.info("peer %s re-admitted at iteration %d by a stale update; it is at %d", rec.sender, k0,
                     rec.iteration)
            self.feed(ev.PeerUp(src, rec.iteration))

    # --- absent trainers --------------------------------------------------------------------------
    def set_absent(self, src: int, why: str) -> None:
        if src == self.ctx.rank or self.absent.get(src) == why:
            return
        was = src in self.absent or src in self.ctx.policy.dead
        self.absent[src] = why
        log.info("neighbour %s is %s: not waited for", self.ctx.nodes[src], why)
        if not was:
            self.feed(ev.PeerDown(src))

    def heard_from(self, src: int, k: int) -> None:
        """An update of iteration k came from `src`: an absent (restarting or silent) neighbour
        contributes again."""
        if self.leaving.get(src) == "restarting" and k > self.absent_at.get(src, -1):
            del self.leaving[src]        # back before what it sent last was mixed
            self.set_absent(src, "restarting")
        why = self.absent.get(src)
        if why not in ("restarting", "silent"):
            return
        if why == "restarting" and k <= self.absent_at.get(src, -1):
            return   # sent before its notice, overtaken by it on another stream: not back yet
        del self.absent[src]
        node = self.ctx.nodes[src]
        log.info("neighbour %s contributes again from iteration %d", node, k)
        # A peer also back in membership is re-admitted once, by back_in_run.
        if self.ctx.env.alive(node) and node not in self.returning:
            self.feed(ev.PeerUp(src, k))

    def on_notice(self, sender: str, state: int, k: int) -> None:
        """A neighbour's trainer stopped (at its iteration k), resumes or finished."""
        src = self.ctx.rank_of(sender)
        if src < 0 or src == self.ctx.rank:
            return
        if state == pb.TrainerNotice.STATE_ABSENT:
            self.absent_at[src] = k
            self.leave(src, "restarting")
        elif state == pb.TrainerNotice.STATE_RESUMING:
            self.absent_at.pop(src, None)   # it may resume from a checkpoint older than k
            # A joiner says so once its join pull is done and its trainer about to start
            # (Resume.join_swarm): its run is back, at about our iteration (it starts at the
            # lowest of its neighbours'). Our newest goes to it now, over a link its pull no
            # longer needs.
            self.back_in_run(sender, self.ctx.policy.k)
            # Its new daemon may have had no run when our FINISHED came (dropped there): again.
            self.outbound.tell_finished(src)
        elif state == pb.TrainerNotice.STATE_FINISHED:
            self.leave(src, "finished")

    def leave(self, src: int, why: str) -> None:
        """`src`'s trainer stopped (`why`: "restarting", "finished"): absent once what it sent is mixed."""
        if self.absent.get(src) == why:
            return
        self.leaving[src] = why
        self.settle_leaving()

    def settle_leaving(self) -> None:
        """A neighbour whose trainer stopped counts as absent (PeerDown) once no mix of ours can
        use what it sent. Its updates came before its notice (one ordered queue per receiver), but
        the mix they belong to may still wait on a slower neighbour: dropped at the notice, the
        last one was left out of that mix. Also at once when the policy waits on it: by that
        order, what it waits for will not come. Called after every batch of the policy's actions."""
        policy = self.ctx.policy
        for src in [s for s in self.leaving if not policy.holds(s) or s in policy.waiting.on]:
            why = self.leaving.pop(src, None)     # None: settled by the PeerDown of the one before
            if why is not None:
                self.set_absent(src, why)

    def update_lost(self, node: str, kind: str, k: int) -> None:
        """Neighbour `node`'s update of iteration k failed mid-stream (cut by its deadline over a
        slow link, stalled): its sender does not push it again. A mix waiting on it would wait out
        the silent bound for nothing (two of our iterations: minutes when they are long). The mix
        of k goes without it, now or when our trainer asks for it; the neighbour stays one (no
        re-linking of the graph around it, which its other neighbours would not do) and the mix of
        k + 1 waits for its next update."""
        src = self.ctx.rank_of(node)
        if kind != self.ctx.kind("model") or src < 0 or src == self.ctx.rank:
            return
        if self.is_waiting(k) and src in self.ctx.policy.waiting.on:
            log.warning("the update of iteration %d from %s failed mid-stream: mixed without it", k, node)
        self.feed(ev.UpdateLost(src, k))

    def why_missing(self, src: int, k: int) -> str:
        """Why neighbour `src` is not in the mix of k: its absence ("restarting", "finished", "silent"),
        its update "lost" on the way, "dead" (membership), "flagged" (bad updates), else "not waited"
        (the policy's choice)."""
        node = self.ctx.nodes[src]
        if self.ctx.policy.excused(src, k):
            return "lost"
        if src in self.absent:
            return self.absent[src]
        if not self.ctx.env.alive(node):
            return "dead"
        if self.ctx.env.offences.flagged_for(node):
            return "flagged"
        return "not waited"

    def all_gone(self) -> bool:
        """Every other host of the run finished or is not alive."""
        return all("finished" in (self.absent.get(i), self.leaving.get(i)) or not self.ctx.env.alive(self.ctx.nodes[i])
                   for i in self.ctx.others())

    def resynced(self) -> dict[int, int]:
        """After a restart: the neighbours' iterations, to feed as PeerUp at our first publish."""
        resync, self.resync = self.resync, {}
        return resync

    # --- silence ----------------------------------------------------------------------------------
    def update_arriving(self, node: str) -> None:
        """Bytes of an update from `node` are arriving (the data plane says so every ACTIVITY_EVERY s)."""
        src = self.ctx.rank_of(node)
        if src >= 0:
            self._bytes_at[src] = time.monotonic()

    def still_arriving(self, src: int, waited: float, now: float) -> bool:
        """An update from `src` streams in right now: it is slow, not silent. Waited on for at
        most three quarters of the trainer's own mix bound (the trainer must not time out first)."""
        recent = now - self._bytes_at.get(src, -1e18) <= self.arriving_window()
        return recent and waited < 0.75 * self.mix_bound()

    def arriving_window(self) -> float:
        dp = self.ctx.cfg.dataplane
        return max(ARRIVING_WINDOW, ARRIVING_CHUNKS * dp.chunk_bytes / dp.min_rate)

    def mix_bound(self) -> float:
        """Longest a trainer's Mix waits: train_mix_timeout, the longest transfer of a neighbour's
        update (peerd.node.run.bounds) and two of our own iterations."""
        others = [self.ctx.nodes[i] for i in self.ctx.others()]
        return mix_bound(self.ctx.env, self.model_bytes(), others) + self.iteration_allowance()

    def published(self, now: float | None = None) -> None:
        """Our trainer published: the time between publishes is this run's iteration (a DiLoCo
        round of many inner steps may last minutes)."""
        now = time.monotonic() if now is None else now
        if self._last_publish:
            self._intervals.append(now - self._last_publish)
        self._last_publish = now

    def iteration_allowance(self) -> float:
        """Two of our own iterations: a neighbour whose iterations last as long as ours is slow, not
        silent (added to the silent bound and to train_mix_timeout). An iteration is the median of
        the last few: one that waited out a crashed neighbour is not this run's pace, and taken as
        it is would stretch the next wait by twice that stall."""
        return 2 * statistics.median(self._intervals) if self._intervals else 0.0

    def silent_bound(self) -> float:
        return self.ctx.cfg.train.silent_peer_timeout + self.iteration_allowance()

    def arm_silent(self, k: int, after: float | None = None) -> None:
        """Check mix k's waits after `after` seconds; None: a fresh wait, the base bound from now."""
        if self._silent_timer is not None:
            self._silent_timer.cancel()
        if after is None:
            self._silent_since = time.monotonic()
            self._waited_since = {}
            after = self.silent_bound()
        self._silent_timer = asyncio.get_running_loop().call_later(after, self._silent_check, k)

    def disarm_silent(self) -> None:
        if self._silent_timer is not None:
            self._silent_timer.cancel()
            self._silent_timer = None

    def _silent_check(self, k: int) -> None:
        """Mix k has waited `train_silent_peer_timeout`: stop waiting for the peers it waits on whose
        transfer allowance is spent too; check the others again when theirs is."""
        self._silent_timer = None
        if not self.is_waiting(k):
            return
        policy = self.ctx.policy
        if policy.waiting.reason == "pull":
            # A pull's wait has its own, shorter bound (train_pull_timeout -> PullFailed), which
            # does not exclude the peer for good: pull policies get no unasked-for updates that
            # would ever mark a "silent" peer present again.
            self.arm_silent(k)
            return
        now = time.monotonic()
        base = self.silent_bound()
        left = []
        for src in list(policy.waiting.on):
            # Waited on since this wait began, or since the last check for one the policy took up later.
            waited = now - self._waited_since.setdefault(src, self._silent_since)
            # Nothing arrives from it: its allowance, but not the Mix's whole bound (a hung trainer
            # holds us no longer than half of train_mix_timeout).
            remaining = transfer_bound(self.ctx.env, base, self.model_bytes(), self.ctx.nodes[src],
                                       cap=self.ctx.cfg.train.mix_timeout / 2) - waited
            if remaining > 1e-3:
                left.append(remaining)       # its update may still be on the way over a slow link
                continue
            if self.still_arriving(src, waited, now):
                left.append(self.arriving_window())  # its bytes are coming in: check again then
                continue
            log.warning("no update from %s for %.1fs at iteration %d: not waited for until it sends one",
                        self.ctx.nodes[src], waited, k)
            self.set_absent(src, "silent")
        self._silent_since = now
        if not self.is_waiting(k):
            return
        if left:
            self.arm_silent(k, after=min(left))
        else:   # still waiting (on someone else now): check again after the bound
            self.arm_silent(k)
