"""The daemon's link service: measure this host's links, gossip the swarm's link matrix.

The pure pieces are peerd.net.links (LinkTable: estimates and when to probe; LinkMatrix: the
swarm's view) and peerd.net.linkprobe (probe_loop). This module feeds them from the daemon:

- Whom: every admitted peer while alive or suspect. A dead or departed peer is not probed; its
  estimate is parked and comes back if the peer does within link_forget_after, so a restart or a
  short partition costs no new warm-up. A peer the failure detector forgets leaves the matrix
  (its row and its column).
- RTT: every answered heartbeat is a sample (a round trip on the same channel; queueing included,
  which the table's windowed minimum copes with), and the table's own Ping probes fill gaps.
- Bandwidth: probes are pushed over the data plane with kind "probe", the path model data takes
  (same channel, chunking and flow control); the receiving daemon releases them at once. The
  payload is random bytes (a compressing tunnel must not flatter the link) whose crc32 is
  computed before the clock starts, so the time is the transfer's alone. Each bulk probe starts
  after a random delay of up to link_probe_jitter: hosts started together would otherwise probe
  in lock-step, and probes sharing a bottleneck (a site's uplink) each measure a fraction of it. Pushes of real data
  (PushResult) are samples too.
- Gossip: each heartbeat, and each reply, carries our own row plus the entries updated since the
  previous one to that peer (acknowledged heartbeats only); every link_gossip_full_interval it
  carries the whole matrix, so a lost message, a restarted peer or an old entry learned late
  (its age predates the last delta) still arrives. At most link_gossip_max_entries per message.
- `matrix` is kept current after every sample: sync policies read it (`expected_times`).

One clock for everything the table and matrix are given: time.monotonic.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import random
import time
from typing import Awaitable, Callable, Iterable, Protocol

import torch

from peerd.config import Config
from peerd.net import tensorwire as tw
from peerd.net.dataplane import Outgoing, PushResult
from peerd.net.linkprobe import probe_loop
from peerd.net.links import RTT, LinkEstimate, LinkMatrix, LinkTable, Probe
from peerd.net.membership import Membership, State, Transition
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb


class ProbeCalls(Protocol):
    """The calls a probe makes (peerd.node.peer_client.PeerClient)."""

    async def ping(self, address: str, msg: pb.PingRequest, timeout: float) -> pb.PingReply: ...

    async def push_tensor(self, address: str, node: str, data: Outgoing, *, iteration: int, kind: str,
                          observe: bool = True, **options) -> PushResult: ...

log = logging.getLogger("peerd.links")

PROBE_KIND = "probe"
ENTRY_FIELDS = ("measurer", "target", "capacity_bytes_s", "capacity_age_s", "throughput_bytes_s",
                "throughput_spread_bytes_s", "rtt_s", "rtt_spread_s", "samples", "age_s")
PAYLOAD_SIZES = 8            # probe payloads (views of one buffer) kept with their checksums
PAYLOAD_KEEP_BYTES = 8 << 20  # the largest payload kept between probes


class LinkService:
    def __init__(self, cfg: Config, node_id: str, members: Membership,
                 seal: Callable[[Outgoing], Awaitable[int]]) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.members = members
        self.seal = seal               # checksum a payload once, before any timed push of it
        self.client: ProbeCalls | None = None   # set by the daemon once its peer client exists
        self.table = LinkTable(self.node_id, self.cfg)
        self.matrix = LinkMatrix(self.node_id, self.cfg)
        self._parked: dict[str, tuple[LinkEstimate, float]] = {}
        self._delta_since: dict[tuple[str, str], float] = {}     # (peer, way) -> our clock of the last gossip
        self._full_at: dict[tuple[str, str], float] = {}
        self._refusals_logged: dict[str, float] = {}
        self._random: torch.Tensor | None = None
        self._payloads: collections.OrderedDict[int, Outgoing] = collections.OrderedDict()
        self._nonce = int.from_bytes(os.urandom(6), "big")
        self._stop = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------------------
    async def run(self) -> None:
        """Probe until close(); every probe is bounded by its deadline (see linkprobe)."""
        await probe_loop(self.table, self._run_probe, self._stop, clock=time.monotonic,
                         tick_max=self.cfg.membership.heartbeat_interval, on_update=lambda _p, _k: self._absorb())

    def close(self) -> None:
        self._stop.set()

    # --- peers -----------------------------------------------------------------------------
    def on_transition(self, tr: Transition) -> None:
        self.on_state(tr.node_id, tr.new)

    def on_state(self, peer: str, new: State | None) -> None:
        """The failure detector moved `peer` to `new` (None: forgotten)."""
        now = time.monotonic()
        if new in (State.ALIVE, State.SUSPECT):
            if peer in self.table.links:
                return
            try:
                self.table.add_peer(peer)
            except ValueError as e:
                log.warning("not measuring the link to %s: %s", peer, e)
                return
            parked = self._parked.pop(peer, None)
            if parked is not None and now - parked[1] < self.cfg.links.forget_after:
                self.table.links[peer] = parked[0]          # same link, same estimate: no new warm-up
        elif new in (State.DEAD, State.LEFT):
            est = self.table.estimate(peer)
            self.table.remove_peer(peer)
            if est is not None and est.samples:
                self._parked[peer] = (est, now)
        else:
            self.table.remove_peer(peer)
            self._parked.pop(peer, None)
            self.matrix.remove_node(peer)
            for way in ("hb", "reply"):
                self._delta_since.pop((peer, way), None)
                self._full_at.pop((peer, way), None)
            self._refusals_logged.pop(peer, None)
        self._absorb()

    # --- samples from the daemon's own traffic ------------------------------------------------
    def observe_heartbeat(self, peer: str, rtt_s: float) -> None:
        if self.table.observe_rtt(peer, rtt_s, time.monotonic(), probe=False):
            self._absorb()

    def observe_push(self, peer: str, result: PushResult) -> None:
        """A data-plane push of real data finished: its wire bytes and time are a bandwidth sample."""
        if self.table.observe_transfer(peer, result.wire_bytes, result.seconds, time.monotonic()):
            self._absorb()

    def _absorb(self) -> None:
        self.matrix.absorb(self.table)

    # --- probes -------------------------------------------------------------------------------
    async def _run_probe(self, p: Probe) -> float:
        m = self.members.get(p.peer)
        if m is None or m.state not in (State.ALIVE, State.SUSPECT):
            raise LookupError(f"{p.peer} is not alive")
        if p.kind == RTT:
            self._nonce += 1
            nonce = self._nonce
            t0 = time.monotonic()
            reply = await self.client.ping(m.address, pb.PingRequest(nonce=nonce, payload=bytes(p.size_bytes)),
                                           timeout=p.deadline_s)
            took = time.monotonic() - t0
            if reply.nonce != nonce:
                raise ValueError(f"Ping answered with nonce {reply.nonce}, sent {nonce}")
            return took
        data = await self._payload(p.size_bytes)
        # Hosts that start together would probe in lock-step, and probes through a shared bottleneck
        # (a site uplink) would each measure a fraction of it: start at a random moment instead.
        await asyncio.sleep(random.uniform(0.0, min(self.cfg.links.probe_jitter, p.deadline_s / 4)))
        t0 = time.monotonic()
        await self.client.push_tensor(m.address, p.peer, data, iteration=0, kind=PROBE_KIND, observe=False,
                                      compression="none", checksum=data.checksum, timeout=p.deadline_s)
        took = time.monotonic() - t0
        log.debug("bw probe to %s: %d bytes in %.4f s (%.1f Mbit/s gross)", p.peer, p.size_bytes, took,
                  p.size_bytes * 8 / took / 1e6)
        return took

    async def _payload(self, nbytes: int) -> Outgoing:
        """`nbytes` of random data with its checksum, ready to push (views of one shared buffer:
        payloads above PAYLOAD_KEEP_BYTES repeat it). The small ones are kept with their checksums;
        a big one is checksummed for each probe (big probes are rare once the links are measured)."""
        out = self._payloads.get(nbytes)
        if out is not None:
            self._payloads.move_to_end(nbytes)
            return out
        if nbytes > PAYLOAD_KEEP_BYTES:
            if self._random is None or self._random.numel() < PAYLOAD_KEEP_BYTES:
                self._random = await asyncio.to_thread(_random_bytes, PAYLOAD_KEEP_BYTES)
                self._payloads.clear()
            out = Outgoing(tw.Layout.flat(nbytes, PROBE_KIND), _tiled(tw.byte_view(self._random), nbytes),
                           (self._random,))
            await self.seal(out)
            return out
        if self._random is None or self._random.numel() < nbytes:
            size = min(max(nbytes, 1 << (nbytes - 1).bit_length()), PAYLOAD_KEEP_BYTES)
            self._random = await asyncio.to_thread(_random_bytes, size)
            self._payloads.clear()
        out = Outgoing.from_buffer(self._random[:nbytes], tw.Layout.flat(nbytes, PROBE_KIND))
        await self.seal(out)                         # the checksum, outside the timed transfer
        self._payloads[nbytes] = out
        while len(self._payloads) > PAYLOAD_SIZES:
            self._payloads.popitem(last=False)
        return out

    # --- gossip -------------------------------------------------------------------------------
    def gossip(self, peer: str, way: str) -> tuple[list[pb.LinkEntry], float]:
        """Entries for one heartbeat ("hb") or reply ("reply") to `peer`, and the mark to pass to
        `gossiped` once it was delivered."""
        cfg = self.cfg
        now = time.monotonic()
        self._expire(now)
        key = (peer, way)
        limit = cfg.links.gossip_max_entries
        if now - self._full_at.get(key, -math.inf) >= cfg.links.gossip_full_interval:
            self._full_at[key] = now
            entries = self.matrix.to_entries(now, limit=limit)
        else:
            since = self._delta_since.get(key, -math.inf)
            entries = self.matrix.to_entries(now, limit=limit, newer_than=since)
        return [pb.LinkEntry(**e) for e in entries], now

    def gossiped(self, peer: str, way: str, mark: float) -> None:
        self._delta_since[(peer, way)] = mark

    def merge(self, peer: str, entries: Iterable[pb.LinkEntry]) -> None:
        """Fold in a peer's gossip (it authenticated; what it says is still checked entry by entry)."""
        now = time.monotonic()
        rows = [{f: getattr(e, f) for f in ENTRY_FIELDS} for e in entries]
        if not rows:
            return
        _, refused = self.matrix.merge(rows, now)
        if refused and now - self._refusals_logged.get(peer, -math.inf) >= self.cfg.auth.log_every:
            self._refusals_logged[peer] = now
            log.warning("refused %d link entries gossiped by %s: %s", len(refused), peer, refused[0])

    def _expire(self, now: float) -> None:
        self.matrix.expire(now)
        limit = now - self.cfg.links.forget_after
        for peer in [p for p, (_, at) in self._parked.items() if at < limit]:
            del self._parked[peer]

    # --- observability ------------------------------------------------------------------------
    def links_reply(self) -> cpb.LinksReply:
        now = time.monotonic()
        self._expire(now)
        own = self.table.links
        return cpb.LinksReply(node_id=self.node_id, links=[
            cpb.LinkMeasurement(**e, probe_phase=self.table.phase(e["target"])
                                if e["measurer"] == self.node_id and e["target"] in own else "")
            for e in self.matrix.to_entries(now)])


def _random_bytes(n: int) -> torch.Tensor:
    """n random bytes (a compressing tunnel must not flatter the link), made in place: no second
    copy of a 64 MiB payload at its creation."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "big"))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _tiled(block: memoryview, nbytes: int) -> list[memoryview]:
    """A big probe's payload: views of the kept random block, repeated (a period of
    PAYLOAD_KEEP_BYTES is beyond what a link's compression could exploit). No copy: drawing 64 MiB
    of random numbers for each big probe cost a loopback daemon a tenth of its CPU while a 100 MB
    model trained, and a 64 MiB buffer made for each probe is memory the model needs."""
    whole, rest = divmod(nbytes, len(block))
    return [block] * whole + ([block[:rest]] if rest else [])
