"""The trainer's side of a run: Attach, Publish, Mix, Directives (the Control service's calls).

Parameters never travel over protobuf here: the trainer and the daemon share two memory-mapped
slot files (peerd.node.run.mixer). Publish(k, slot) is answered at once and snapshotted right after,
off the loop (the trainer computes meanwhile; it does not write that slot again before the reply
to its Mix(k), which waits for the snapshot). Mix(k, slot) waits as the policy says, then finds
the weighted sum in the slot. Metrics ride on MixRequest (no RPC per iteration).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable

from peerd.net.copies import check_ranges
from peerd.net.dataplane import MAX_MASS
from peerd.net.tensorwire import WireError
from peerd.node.identity import slot_dir
from peerd.node.run.bounds import largest_mix_bound
from peerd.node.run.context import RunContext
from peerd.node.run.liveness import PeerLiveness
from peerd.node.run.mixer import Mixer
from peerd.node.run.outbound import Outbound
from peerd.node.run.progress import Progress, Timings
from peerd.node.run.resume import Resume
from peerd.node.run.snapshots import Snapshots
from peerd.node.run.spec import RunError
from peerd.sync import events as ev
from peerd.train.flat import Layout, LayoutMismatch
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")


class TrainerApi:
    def __init__(self, ctx: RunContext, *, mixer: Mixer, snapshots: Snapshots, outbound: Outbound,
                 liveness: PeerLiveness, resume: Resume, progress: Progress, changed: asyncio.Event,
                 done: asyncio.Event, feed: Callable[[ev.Event], None], replay_early: Callable[[], None],
                 mixed: Callable[[int, set[int]], None], timings: Timings) -> None:
        self.ctx = ctx
        self.attaches = 0                 # Attach calls so far (a trainer that never makes one is named)
        self.mixer = mixer
        self.snapshots = snapshots
        self.outbound = outbound
        self.liveness = liveness
        self.resume = resume
        self.progress = progress
        self.changed = changed
        self.done = done
        self.feed = feed
        self.replay_early = replay_early       # updates that came before the layout was known
        self.mixed = mixed                     # a mix was answered: (iteration, the sources in it)
        self.timings = timings
        self.waiters: dict[int, asyncio.Future] = {}   # k -> the trainer's pending Mix(k)
        self.skip_after: dict[int, int] = {}   # k -> the iteration the trainer continues at after mix k
        self.pending_publish: tuple[int, int] | None = None
        self.publishing: asyncio.Task | None = None    # the snapshot of the last publish, in progress
        self._answering: set[int] = set()              # mixes whose delivery to the slot is under way
        self.subscribers: set[asyncio.Queue] = set()   # the trainer's Directives streams
        self.paused = False
        self.stop_requested = False
        self.stop_reason = ""

    # --- attach -------------------------------------------------------------------------------
    async def attach(self, req: cpb.AttachRequest) -> cpb.AttachReply:
        self.attaches += 1
        layout = Layout.build((e.name, e.dtype, tuple(e.shape)) for e in req.layout)
        if req.total_bytes and req.total_bytes != layout.total_bytes:
            raise LayoutMismatch(f"total size {req.total_bytes} bytes announced, the layout needs "
                                 f"{layout.total_bytes}")
        mixer = self.mixer
        if mixer.layout is not None:
            layout.check(mixer.layout, here="in this trainer", there="in the run")
        else:
            mixer.set_layout(layout, slot_dir(self.ctx.env.data_dir))
            self.replay_early()
        if mixer.acc is not None:
            mixer.acc.stop()   # a restarted trainer: the slots are its own until it publishes
        for k in list(self.snapshots.slot_held):
            # A trainer that crashed before its Mix(k) was answered left snapshot k in its slot,
            # which the new one writes at once: a push still streaming it goes on from a copy.
            await self.snapshots.release_slot(k)
        policy = self.ctx.policy
        start = max(policy.k + 1, 0)
        if self.progress.restarts and policy.k >= 0:
            start = max(start, await self.resume.resume_point())
        rank, world = self.ctx.data_shard()
        return cpb.AttachReply(node_id=self.ctx.env.node_id, session_id=self.ctx.session,
                               slot_paths=[str(p) for p in mixer.slot_paths], start_iteration=start,
                               rank=rank, world=world,
                               mix_timeout_s=largest_mix_bound(self.ctx.env, layout.total_bytes))

    # --- publish ------------------------------------------------------------------------------
    def publish(self, req: cpb.PublishRequest) -> None:
        if self.mixer.layout is None:
            raise RunError("publish before attach")
        if req.slot >= len(self.mixer.slots):
            raise RunError(f"slot {req.slot} does not exist")
        k = req.iteration
        if k <= self.snapshots.live_k or (self.pending_publish and k <= self.pending_publish[0]):
            raise RunError(f"iteration {k} published after {self.snapshots.live_k}")
        mass = req.mass or 1.0
        if not (math.isfinite(mass) and 0 < mass <= MAX_MASS):
            raise RunError(f"mass {req.mass}: want a weight in (0, {MAX_MASS:g}]")
        try:
            ranges = check_ranges(req.ranges, self.mixer.wire) if req.ranges else None
        except WireError as e:
            raise RunError(str(e)) from None
        # Answer first, snapshot right after (off the loop): the trainer goes on computing while
        # the daemon copies the slot; its Mix(k) waits for the copy.
        self.pending_publish = (k, req.slot)
        self.publishing = asyncio.get_running_loop().create_task(self._complete_publish(k, req.slot, mass, ranges))

    async def published(self) -> None:
        """Wait for the last publish's snapshot (and its events) to be done."""
        if self.publishing is not None:
            await asyncio.shield(self.publishing)

    async def _complete_publish(self, k: int, slot: int, mass: float = 1.0,
                                ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        t0 = time.perf_counter()
        await self.snapshots.take(k, self.mixer.slots[slot], self.mixer.wire, mass, ranges)
        self.timings.add("snapshot", time.perf_counter() - t0)
        self.pending_publish = None
        self.liveness.published()
        self.progress.published(k)
        self.outbound.send_deferred()
        self.feed(ev.Published(k))
        for src, kj in self.liveness.resynced().items():
            self.feed(ev.PeerUp(src, kj))
        self.mixer.published(k, slot, lambda k: self.feed(ev.MixRequested(k)))

    # --- mix ----------------------------------------------------------------------------------
    def waiting(self, k: int) -> bool:
        """The trainer waits for mix k (its Mix(k) is pending, unanswered)."""
        fut = self.waiters.get(k)
        return fut is not None and not fut.done()

    async def mix(self, req: cpb.MixRequest) -> cpb.MixReply:
        k = req.iteration
        if self.mixer.layout is None:
            raise RunError("mix before attach")
        if k in self.waiters:
            raise RunError(f"mix of iteration {k} already requested")
        await self.published()
        if req.HasField("metric"):
            self.on_metric(req.metric)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[k] = fut
        self.mixer.mix_slot = req.slot
        if self.stop_requested:
            self.release(k)
        elif k == self.mixer.eager_k:
            self.answer(k)                   # requested at publish; answered now if computed
        else:
            self.feed(ev.MixRequested(k))
        if not fut.done():
            self.liveness.arm_silent(k)
        timeout = self.liveness.mix_bound()
        try:
            reply = await asyncio.wait_for(fut, timeout)
            # the trainer may write its published slot once answered
            await self.snapshots.release_slot(k, self.ctx.cfg.train.slot_wait)
            return reply
        except asyncio.TimeoutError:
            raise RunError(f"mix of iteration {k} not ready after {timeout:.0f}s: "
                           f"{self.ctx.policy.state().get('waiting', '')}") from None
        finally:
            self.waiters.pop(k, None)
            self.liveness.disarm_silent()

    def answer(self, k: int) -> None:
        """Answer the trainer's Mix(k) once its mix is computed and in the trainer's slot."""
        if not self.waiting(k) or k in self._answering:
            return
        delivering = self.mixer.deliver(k)
        if delivering is None:
            return
        self._answering.add(k)
        delivering.add_done_callback(lambda f: self._delivered(k, f))

    def _delivered(self, k: int, f: asyncio.Future) -> None:
        self._answering.discard(k)
        if not self.waiting(k):
            return                            # released (a stop) or given up meanwhile
        if f.exception() is not None:
            self.waiters[k].set_exception(RunError(f"mix of iteration {k} failed: {f.exception()}"))
            return
        mix, sources = f.result()
        self.progress.peers_in_last_mix = max(0, len(sources) - 1)
        self.mixed(k, sources)
        skip = self.skip_after.pop(k, 0)
        # No entries: nothing could be mixed and the trainer keeps its own x_k.
        nodes = self.ctx.nodes
        entries = [cpb.MixEntry(src=nodes[s], iteration=max(i, 0), weight=w) for s, i, w in mix.entries] \
            if sources else []
        self.waiters[k].set_result(cpb.MixReply(iteration=k, skip_to=skip, entries=entries))

    def answer_ready(self) -> None:
        for k in list(self.mixer.ready):
            self.answer(k)

    def release(self, k: int) -> None:
        """Answer mix k with nothing mixed: the trainer keeps its own x_k."""
        if self.waiting(k):
            self.waiters[k].set_result(cpb.MixReply(iteration=k))

    def skip(self, a: ev.Skip) -> None:
        self.skip_after[self.ctx.policy.k] = a.to
        self.progress.skipped += max(0, a.to - self.ctx.policy.k - 1)

    def on_metric(self, m: cpb.Metric) -> None:
        self.progress.on_metric(m)
        self.changed.set()

    # --- directives ---------------------------------------------------------------------------
    async def direct(self, d: cpb.Directive) -> int:
        """Deliver a directive to the subscribed trainer(s); returns how many got it.

        PAUSE announces this host ABSENT (its neighbours go on without it); RESUME asks the
        neighbours for their iteration and resumes there (the directive's iteration), as a restart
        does, so the neighbours that ran on are not held at the gap bound."""
        kind = cpb.Directive
        if d.kind == kind.KIND_PAUSE and not self.paused:
            self.paused = True
            if self.progress.state not in ("failed", "stopping"):
                self.progress.state = "paused"
            # The trainer pauses at its next iteration boundary, so it may publish once more
            # (k + 1) after this notice; that update must not re-admit it at the neighbours
            # (re-admitted and then silent, it would cost them a wait and partial mixes).
            self.outbound.announce(pb.TrainerNotice.STATE_ABSENT, self.ctx.policy.k + 1)
        elif d.kind == kind.KIND_RESUME and self.paused:
            self.paused = False
            if self.progress.state == "paused":
                self.progress.state = "training"
            d = cpb.Directive(kind=d.kind, reason=d.reason,
                              iteration=max(d.iteration, await self.resume.resume_point(), self.ctx.policy.k + 1))
        elif d.kind == kind.KIND_STOP:
            self.stop_requested = True
            self.stop_reason = d.reason
            # The trainer stops at its next iteration boundary; a mix it waits for (on neighbours
            # that are stopping too) must not hold it there: it keeps its own parameters.
            for k in list(self.waiters):
                self.release(k)
        for q in self.subscribers:
            q.put_nowait(d)
        self.progress.message = f"{kind.Kind.Name(d.kind).removeprefix('KIND_').lower()} sent to the trainer"
        self.changed.set()
        return len(self.subscribers)

    async def directives(self, context) -> Any:
        """The trainer's subscription: directives until the run ends or the trainer goes away."""
        q: asyncio.Queue = asyncio.Queue()
        if self.stop_requested:   # a trainer (re)started after the stop was sent gets it too
            q.put_nowait(cpb.Directive(kind=cpb.Directive.KIND_STOP, reason="the run was stopped"))
        self.subscribers.add(q)
        try:
            while not self.done.is_set():
                try:
                    yield await asyncio.wait_for(q.get(), self.ctx.cfg.train.progress_interval)
                except asyncio.TimeoutError:
                    continue
        finally:
            self.subscribers.discard(q)

    def fail_waiters(self, error: Exception) -> None:
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_exception(error)
