"""What this host sends its neighbours: updates, token grants and trainer notices, one ordered
queue per destination.

Updates to one neighbour go in order through its queue (updates arrive in iteration order, and a
notice never overtakes the last update before it), every one of them, unless coalescing is on
(`train_coalesce_updates`) and the policy allows it (`Policy.coalesces`: Hop's backup and
staleness modes, whose receivers take a neighbour's next update in place of one they never got):
then a newer update replaces an older one still waiting in the queue. Over a slow link that keeps a
receiver's view of its neighbours' iterations current, which Hop's skipping needs.

A neighbour found down gets a fresh queue: what was queued for it is abandoned (nothing queued is
owed to a down peer: on its return it gets our newest update).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, NamedTuple

import grpc

from peerd.net.dataplane import Outgoing, TransferError
from peerd.node.run.bounds import transfer_allowance
from peerd.node.run.context import RunContext
from peerd.node.run.snapshots import Snapshots
from peerd.sync import events as ev
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")


class Update(NamedTuple):
    kind: str
    k: int
    data: Outgoing


class Grant(NamedTuple):
    n: int


class Notice(NamedTuple):
    state: int
    k: int


class Newest:
    """Coalescing: the one queue entry that always holds the newest update not yet taken."""

    def __init__(self, update: Update) -> None:
        self.update = update


Item = Update | Grant | Notice | Newest


class Outbound:
    def __init__(self, ctx: RunContext, snapshots: Snapshots, coalesce: bool,
                 spawn: Callable[..., asyncio.Task]) -> None:
        self.ctx = ctx
        self.snapshots = snapshots
        self.coalesce = coalesce
        self.spawn = spawn
        self.queues: dict[int, asyncio.Queue] = {}
        self.senders: dict[int, asyncio.Task] = {}   # the task draining each queue
        self.newest: dict[int, Newest] = {}          # coalescing: dst -> its entry not yet taken
        self.deferred: list[ev.Send] = []            # sends asked for before we had parameters
        self.notices_pending = 0                     # our notices queued or in flight (a drain waits for them)
        self.finished: Notice | None = None          # our FINISHED, once announced: a returning peer gets it too

    def send(self, a: ev.Send, once: bool = False) -> None:
        """Queue update a.k to a.dst. `once`: a push outside the policy (our newest to a returning
        peer), skipped if the peer already had that iteration and counted as sent, so that the
        policy's own Send of it on the peer's re-admission does not push the same model again."""
        snaps = self.snapshots
        if snaps.buffer(a.k, a.live) is None:
            # Asked before our trainer published anything (a peer started first), or for our
            # newest once its slot went back to the trainer: send our next parameters as soon as
            # they exist (a neighbour takes a newer update in place of one it never got).
            if a.live or a.k == ev.CURRENT or a.k > snaps.live_k:
                self.deferred.append(a)
            elif a.k == snaps.live_k:
                self.deferred.append(ev.Send(a.dst, ev.CURRENT))
            return
        k = snaps.resolve(a.k, a.live)
        if once and not self.ctx.policy.note_sent(a.dst, k):
            return
        snaps.hold(k, snaps.sending)
        update = Update(self.ctx.kind("model"), k, snaps.outgoing[k])
        if not self.coalesce:
            self._queue(a.dst).put_nowait(update)
            return
        entry = self.newest.get(a.dst)
        if entry is not None:      # an older update to dst waits in its queue: the newer one goes instead
            self._settle(entry.update)
            entry.update = update
            return
        entry = self.newest[a.dst] = Newest(update)
        self._queue(a.dst).put_nowait(entry)

    def send_deferred(self) -> None:
        """Our first (or next) parameters exist: the sends that waited for them go now."""
        deferred, self.deferred = self.deferred, []
        for send in deferred:
            self.send(send)

    def grant(self, dst: int, n: int) -> None:
        self._queue(dst).put_nowait(Grant(n))

    def announce(self, state: int, k: int | None = None) -> None:
        """Tell every other host of the run, each behind the updates already queued for it. `k`
        (default: our iteration) is the notice's iteration; for ABSENT, the newest update of ours
        the notice may still be followed by."""
        notice = Notice(state, self.ctx.policy.k if k is None else k)
        if state == pb.TrainerNotice.STATE_FINISHED:
            self.finished = notice
        for dst in self.ctx.others():
            self.notices_pending += 1
            self._queue(dst).put_nowait(notice)

    def tell_finished(self, dst: int) -> None:
        """A peer back after it was found down: what was queued for it was abandoned (reset), our
        FINISHED with it; without it the peer would wait on us until its silent bound."""
        if self.finished is not None:
            self.notices_pending += 1
            self._queue(dst).put_nowait(self.finished)

    def idle(self) -> bool:
        """No push or notice of ours queued or in flight."""
        return not self.snapshots.sending and not self.notices_pending

    def _queue(self, dst: int) -> asyncio.Queue:
        """One ordered sender per destination: updates arrive in iteration order."""
        q = self.queues.get(dst)
        if q is None:
            q = self.queues[dst] = asyncio.Queue()
            self.senders[dst] = self.spawn(self._sender(dst, q), f"sender {dst}")
        return q

    def reset(self, dst: int) -> None:
        """The peer is down (dead, left, restarted, flagged): abandon what we were sending it.
        A push in flight over a cut link waits out its whole transfer deadline (tens of seconds)
        and each queued one after it would too; anything sent after the peer's return (the
        greeting first) must not queue behind them, so the next send starts a fresh queue."""
        task, q = self.senders.pop(dst, None), self.queues.pop(dst, None)
        if task is not None:
            task.cancel()            # its `finally` settles the item in flight
        while q is not None and not q.empty():
            item = q.get_nowait()
            self._settle(item.update if isinstance(item, Newest) else item)
        self.newest.pop(dst, None)

    def _settle(self, item: Item) -> None:
        """An item left its queue (sent, failed or abandoned): drop it from the pending counts."""
        if isinstance(item, Notice):
            self.notices_pending -= 1
        elif isinstance(item, Update):
            self.snapshots.release(item.k, self.snapshots.sending)

    async def _sender(self, dst: int, q: asyncio.Queue) -> None:
        peers = self.ctx.env.peers
        while True:
            item = await q.get()
            if isinstance(item, Newest):           # coalescing: whatever update is newest now
                if self.newest.get(dst) is item:
                    del self.newest[dst]
                item = item.update
            node = self.ctx.nodes[dst]   # read per item: a vacant rank may be taken by a joiner
            try:
                member = self.ctx.env.membership.get(node) if node else None
                if member is None:
                    continue
                if isinstance(item, Grant):
                    await peers.grant_tokens(member.address, item.n, self.ctx.policy.k)
                elif isinstance(item, Notice):
                    await peers.notice_trainer(member.address, self.ctx.tag, item.state, item.k)
                else:
                    # Over a slow link the floor rate's deadline alone cut updates at 94 % in the
                    # lab (two senders sharing a 10 Mbit downlink get 5 Mbit each)
                    allowance = transfer_allowance(self.ctx.env, item.data.layout.nbytes, node, to_node=True)
                    await peers.push_tensor(member.address, node, item.data, iteration=item.k, kind=item.kind,
                                            compression=self.ctx.spec.options.get("compress") or None,
                                            allowance=allowance)
            except (TransferError, grpc.aio.AioRpcError) as e:
                what = type(item).__name__.lower() if not isinstance(item, Update) else f"update {item.k}"
                log.info("%s to %s failed: %s", what, node,
                         e.code().name if isinstance(e, grpc.aio.AioRpcError) else e)
            finally:
                self._settle(item)
