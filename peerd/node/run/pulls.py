"""Pulls (NetMax, AD-PSGD): this host's pulls of a peer's parameters, the answers it serves, and
the pull times it feeds a policy that plans with link estimates.

A pull is answered within `train_pull_timeout` (plus the transfer allowance,
peerd.node.run.bounds) or the policy hears PullFailed and pulls another peer (or steps locally):
a pull a peer cannot answer (no parameters yet, not attached, run ended, a failed transfer, a
lost reply) is never retried forever nor waited on until the trainer's `train_mix_timeout`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from typing import Callable

import grpc

from peerd.net.dataplane import Outgoing, Received, Snapshot, TransferError
from peerd.node.run.bounds import mix_bound, transfer_allowance, transfer_bound
from peerd.node.run.context import RunContext
from peerd.node.run.snapshots import Snapshots
from peerd.sync import events as ev

log = logging.getLogger("peerd.train")

PULL_SAMPLES = 9       # a peer's pull time: the median of its last this many answered pulls
PULL_SAMPLES_MIN = 3   # answered pulls from a peer before they replace the link matrix's time


class Pulls:
    def __init__(self, ctx: RunContext, snapshots: Snapshots, feed: Callable[[ev.Event], None],
                 deliver: Callable[[Received], None], model_bytes: Callable[[], int],
                 spawn: Callable[..., asyncio.Task]) -> None:
        self.ctx = ctx
        self.snapshots = snapshots
        self.feed = feed
        self.deliver = deliver                 # a pulled update goes where a pushed one goes
        self.model_bytes = model_bytes
        self.spawn = spawn
        self.answers: dict[tuple[int, int], asyncio.Event] = {}   # (dst, k): a carried pull's answer
        self.times: collections.defaultdict[int, list[float]] = collections.defaultdict(list)  # answered pulls
        self.estimates_fed = 0

    # --- our pulls ----------------------------------------------------------------------------
    def start(self, a: ev.Pull) -> None:
        self.spawn(self._pull(a.dst, a.carry_k, self.ctx.policy.k), f"pull {a.dst}")

    def answered_by(self, src: int) -> None:
        """`src` pushed us an update: that answers a carried pull of ours waiting on it."""
        for (dst, _), answered in self.answers.items():
            if dst == src:
                answered.set()

    async def _pull(self, dst: int, carry_k: int, k: int) -> None:
        """The policy's Pull(dst) issued at iteration k. Its answer (the pulled parameters, or for a
        carried pull the peer's pushed reply) must arrive within the bound; otherwise (failed,
        refused, NOT_FOUND throughout, or answered with nothing: a peer not attached yet, or whose
        run ended) the policy hears PullFailed and pulls another peer or steps locally."""
        env, node = self.ctx.env, self.ctx.nodes[dst]
        member = env.membership.get(node)
        key = (dst, k)
        t0 = time.monotonic()
        base = self.ctx.cfg.train.pull_timeout
        # Half of the Mix's bound: a failed pull and the next one fit in it.
        cap = mix_bound(env, self.model_bytes(), [self.ctx.nodes[i] for i in self.ctx.others()]) / 2
        bound = transfer_bound(env, base, self.model_bytes(), node, cap)
        snaps = self.snapshots
        try:
            if member is None:
                raise TransferError("peer_down", f"{node} is not a member")
            async with asyncio.timeout(bound):
                if carry_k != ev.CURRENT and carry_k in snaps.outgoing:
                    answered = self.answers[key] = asyncio.Event()
                    # Counted as a push: over a slow link the carry outlasts the iterations after
                    # which the snapshot is retired, and a recycled buffer fails the checksum.
                    snaps.hold(carry_k, snaps.sending)
                    try:
                        await env.peers.push_tensor(member.address, node, snaps.outgoing[carry_k],
                                                    iteration=carry_k, kind=self.ctx.kind("carry"))
                    finally:
                        snaps.release(carry_k, snaps.sending)
                    await answered.wait()
                else:
                    rec, t0 = await self._pull_until_served(node)
                    log.debug("pull %d from %s: iteration %d, %d bytes in %.3fs", k, node, rec.iteration,
                              rec.wire_bytes, time.monotonic() - t0)
                    self.deliver(rec)
                # From the request that was answered: not the wait for a peer's first parameters.
                self.times[dst].append(time.monotonic() - t0)
            return
        except (TransferError, grpc.aio.AioRpcError) as e:
            log.info("pull from %s failed: %s", node, e)
        except TimeoutError:
            capped = bound < base + transfer_allowance(env, self.model_bytes(), node)
            log.info("pull from %s unanswered after %.1fs%s", node, bound,
                     " (the bound's cap, half of the trainer's mix bound: raise train_mix_timeout for a "
                     "model this big on this link)" if capped else "")
        finally:
            self.answers.pop(key, None)
        self.feed(ev.PullFailed(dst, k))

    async def _pull_until_served(self, node: str) -> tuple[Received, float]:
        """A peer that has no parameters yet (its trainer is starting) answers NOT_FOUND: ask
        again, backing off, while it is alive (the caller bounds the whole). Returns the answer
        and when the answered request started."""
        env = self.ctx.env
        delay = 0.02
        while True:
            member = env.membership.get(node)
            if not env.alive(node):
                raise TransferError("peer_down", f"{node} is not alive")
            try:
                t0 = time.monotonic()
                return await env.peers.pull_tensor(member.address, node, kind=self.ctx.kind("model")), t0
            except TransferError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    # --- peers' pulls of us ---------------------------------------------------------------------
    def serve(self, answer: ev.Send) -> Snapshot | None:
        """The policy's answer to a peer's pull, streamed from our snapshot; None when that
        iteration is no longer held."""
        snaps = self.snapshots
        buf = snaps.buffer(answer.k, answer.live)
        if buf is None:
            log.debug("pull from %s: iteration %d no longer held", self.ctx.nodes[answer.dst], answer.k)
            return None
        held = snaps.resolve(answer.k, answer.live)
        # Not recycled while it streams: a pull over a slow link outlasts the iterations after
        # which an own snapshot is retired, and a reused buffer fails the puller's checksum.
        snaps.hold(held, snaps.serving)
        # Through the pushes' view of it: one in the trainer's slot is movable, and release_slot
        # moves it to a copy before the trainer writes the slot again.
        own = snaps.outgoing[held]
        data = Outgoing(own.layout, own.pieces, own.keep)
        return Snapshot(answer.k if answer.k >= 0 else snaps.live_k, data,
                        done=lambda: snaps.release(held, snaps.serving))

    # --- link estimates ---------------------------------------------------------------------------
    def estimates(self, compute_s) -> list[list[float]] | None:
        """NetMax's t[i][m] from the daemon's link matrix: the pull's round trip against this
        host's measured compute (every row: other hosts' compute is not known here)."""
        matrix = self.ctx.env.link_matrix
        nbytes = self.model_bytes()
        if matrix is None or not nbytes or compute_s.n == 0:
            return None
        compute = compute_s.mean
        times = matrix.pull_times(self.ctx.nodes, nbytes, compute)
        if times is not None:
            # Our own row from our answered pulls where we have them (the paper's monitor measures
            # the iteration times): the matrix's RTT + bytes / capacity missed the pull's real cost
            # across a slow cut by ~2x (window growth, several hosts pulling over one link).
            for j, ts in self.times.items():
                if len(ts) >= PULL_SAMPLES_MIN:
                    times[self.ctx.rank][j] = max(compute, statistics.median(ts[-PULL_SAMPLES:]))
        return times

    async def feed_estimates(self, compute_s) -> None:
        """Every train_estimates_interval: the link matrix's times to the policy (NetMax solves its
        peer probabilities from them). The solve runs in a thread first (the policy then finds it
        cached), so the event loop never waits on it."""
        policy = self.ctx.policy
        while True:
            # Every second until the first estimates are in, then every interval: each solve costs
            # tenths of a second of CPU per host, and the links do not change faster than that.
            await asyncio.sleep(self.ctx.cfg.train.estimates_interval if self.estimates_fed else 1.0)
            times = self.estimates(compute_s)
            if times is None:
                continue
            work = policy.estimates_work(times)
            if work is not None:
                await asyncio.to_thread(work)
            self.feed(ev.LinkEstimates(times))
            self.estimates_fed += 1
            if work is not None:
                log.info("link estimates: pull times %s s; peer probabilities %s",
                         [round(x, 3) for x in times[self.ctx.rank]], policy.state().get("row"))

    def summary(self) -> str:
        return "; ".join(f"{dst}: {len(ts)}, {statistics.median(ts):.3f}, {sorted(ts)[int(0.9 * len(ts))]:.3f}"
                         for dst, ts in sorted(self.times.items()))
