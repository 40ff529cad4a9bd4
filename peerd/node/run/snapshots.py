"""This host's published parameters: one snapshot per iteration, kept while anyone may read it.

Publish(k) either copies the trainer's slot into a snapshot (a pass off the loop), or, where the
policy never serves pulls (`in_slot`), takes the slot itself as the snapshot: the trainer does not
write it before its Mix(k) is answered, and before that answer `release_slot(k)` copies it into a
snapshot buffer only if a push of it still streams (the stream then goes on from the copy:
peerd.net.tensorwire.Movable), else lets it go. Either way it is measured (the update checks
compare a neighbour's norm with ours); pushes, carried pulls and answered pulls stream from it. A snapshot is retired when
`keep` newer ones exist (what the policy declares it may still send: `Policy.own_snapshots`), and
its buffer is reused for a later publish only when no push or pull of it is in flight: a pull over
a slow link outlasts those iterations, and a buffer overwritten under its stream fails the
receiver's checksum.
"""
from __future__ import annotations

import asyncio
import collections
import time

import torch

from peerd.net import tensorwire as tw
from peerd.net.dataplane import Outgoing
from peerd.node.run.passes import Passes
from peerd.sync import events as ev

POOL = 1     # retired buffers kept for the next publishes (one that was streaming when retired)


def _copy_and_measure(snap: torch.Tensor, slot: torch.Tensor, wire: tw.Layout) -> tw.ParamStats:
    snap.copy_(slot)
    return tw.param_stats(wire, snap)


def _measure(slot: torch.Tensor, wire: tw.Layout) -> tw.ParamStats:
    return tw.param_stats(wire, slot)


class Snapshots:
    def __init__(self, keep: int, passes: Passes, in_slot: bool = False) -> None:
        self.keep = keep
        self.passes = passes
        self.in_slot = in_slot                             # snapshots may stay in the trainer's slot
        self.slot_held: set[int] = set()                   # iterations whose snapshot is the slot itself
        self.live_k = -1                                   # the newest published iteration
        self.own: dict[int, torch.Tensor] = {}             # by iteration
        self.outgoing: dict[int, Outgoing] = {}            # the same, ready to push (checksummed once)
        self.stats: dict[int, tw.ParamStats] = {}          # the same, measured at publish
        self.mass: dict[int, float] = {}                   # the same: the trainer's weight for it (1: none given)
        self.sending: collections.Counter[int] = collections.Counter()   # pushes queued or streaming (carries too)
        self.serving: collections.Counter[int] = collections.Counter()   # pulls being answered
        self.pool: list[torch.Tensor] = []
        self.allocated = 0                                 # buffers made (a pooled one taken is not counted)

    async def take(self, k: int, slot: torch.Tensor, wire: tw.Layout, mass: float = 1.0,
                   ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        """Snapshot the trainer's slot as iteration k (the copy and its stats off the loop). The
        snapshots the policy no longer needs are retired first, so that an idle one's buffer takes
        the copy: one model's worth of memory, not two, when nothing of the last one streams.
        `mass` and `ranges` travel with its pushes (peerd.net.dataplane.Outgoing)."""
        self.retire(self.keep - 1)
        if self.in_slot:
            stats = await self.passes.submit(_measure, slot, wire)
            self.own[k] = slot
            self.outgoing[k] = Outgoing.from_buffer(slot, wire, movable=True)
            self.slot_held.add(k)
        else:
            snap = self._buffer(slot.numel())
            stats = await self.passes.submit(_copy_and_measure, snap, slot, wire)
            self.own[k] = snap
            self.outgoing[k] = Outgoing.from_buffer(snap, wire)
        self.stats[k] = stats
        self.mass[k] = mass
        self.outgoing[k].mass, self.outgoing[k].ranges = mass, ranges
        self.live_k = k
        self.retire(self.keep)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.pool:
            return self.pool.pop()
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    async def release_slot(self, k: int, wait: float = 0.0) -> None:
        """The trainer may write the slot of iteration k once this returns (its Mix(k) is about to be
        answered). A push or pull of k still streaming gets up to `wait` seconds to end (pushes to
        the neighbours whose updates we just mixed usually end about as theirs did), then goes on
        from a copy; nobody streaming, the snapshot is let go (a later send of our newest waits
        for the next publish)."""
        if k not in self.slot_held:
            return
        deadline = time.monotonic() + wait
        while (self.sending.get(k) or self.serving.get(k)) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self.slot_held.discard(k)
        slot = self.own.get(k)
        if slot is None:
            return
        if self.sending.get(k) or self.serving.get(k):
            snap = self._buffer(slot.numel())
            await self.passes.submit(snap.copy_, slot)
            self.outgoing[k].move_to(snap)
            self.own[k] = snap
        else:
            del self.own[k], self.outgoing[k]

    def resolve(self, k: int, live: bool = False) -> int:
        """The iteration an action means: the newest one for a live send or CURRENT."""
        return self.live_k if (live or k == ev.CURRENT) else k

    def buffer(self, k: int, live: bool = False) -> torch.Tensor | None:
        return self.own.get(self.resolve(k, live))

    def live_stats(self) -> tw.ParamStats | None:
        return self.stats.get(self.live_k)

    def hold(self, k: int, what: collections.Counter[int]) -> None:
        what[k] += 1

    def release(self, k: int, what: collections.Counter[int]) -> None:
        what[k] -= 1
        if what[k] <= 0:
            del what[k]

    def retire(self, keep: int) -> None:
        """Keep the `keep` newest snapshots; the others' buffers go to the pool unless streaming."""
        for k in sorted(self.own)[:len(self.own) - keep]:
            snap = self.own.pop(k)
            del self.outgoing[k]
            self.stats.pop(k, None)
            self.mass.pop(k, None)
            if k in self.slot_held:         # the trainer's slot, not ours to pool
                self.slot_held.discard(k)
                continue
            # Reused only when no push or pull of it is in flight; a pass that reads it (a mix)
            # was submitted before, and the copy into it comes after (the passes run in order).
            if not self.sending.get(k) and not self.serving.get(k):
                self.pool.append(snap)
        del self.pool[POOL:]
