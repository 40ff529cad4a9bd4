"""The membership protocol: Hello, heartbeats with gossip, Leave, and the failure detector's loop.

The table and its rules are pure (peerd.net.membership); this module talks to peers: it contacts
seeds and candidates (Hello, whose reply is signed by the node that answered: peerd.net.auth),
heartbeats every member it must (each heartbeat and reply carry peer-table news, link-matrix
gossip and node revocations), answers the same calls from peers (peerd.node.peer_service hands
them here), and tells its listeners of every state change (the link service, the training run,
the event log).

Revocations (peerd.net.pki) spread epidemically: each heartbeat and reply carries a digest of the
revocations its sender knows, and all of them whenever the other side's digest (as last seen)
differs, so a revocation given to one daemon (`peerd keys revoke`) reaches every daemon it can
reach within a few heartbeat intervals per hop. A revoked node is dropped from the table at once
(to a run: a dead peer), its calls and replies are refused, and gossip about it is ignored.

Incarnations a peer announces (Hello, heartbeat, reply, gossip row) above this host's clock plus
`auth_max_skew` (in milliseconds: peerd.node.identity) are refused or ignored.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import grpc

from peerd import PROTOCOL_VERSION
from peerd.config import Config
from peerd.net.auth import RECEIVER_KEY, Authenticator
from peerd.net.membership import GossipMark, Member, Membership, State, Timing, Transition
from peerd.net.pki import Revocation, is_node_id
from peerd.net.wirecheck import clip, is_loopback_host
from peerd.node.channels import ChannelPool, host_of
from peerd.node.convert import caps_from_pb, caps_to_pb, member_to_pb, revocation_from_pb, revocation_to_pb, rows_from_pb
from peerd.node.peer_client import PeerClient
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.daemon")


class LinkGossip(Protocol):
    """What heartbeats carry for the link service (peerd.node.links_service.LinkService)."""

    def gossip(self, peer: str, way: str) -> tuple[list[pb.LinkEntry], float]: ...
    def gossiped(self, peer: str, way: str, mark: float) -> None: ...
    def merge(self, peer: str, entries: Iterable[pb.LinkEntry]) -> None: ...
    def observe_heartbeat(self, peer: str, rtt_s: float) -> None: ...


@dataclass
class Identity:
    """Who this daemon is, as it introduces itself."""
    node_id: str
    incarnation: int
    address: str
    run_id: str
    caps: dict = field(default_factory=dict)


def hello_refusal(self_id: str, run_id: str, request: pb.Hello,
                  max_incarnation: int | None = None) -> tuple[grpc.StatusCode, str] | None:
    """Why a Hello cannot be accepted, independent of the table (None when it can)."""
    if request.protocol_version != PROTOCOL_VERSION:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not supported "
                f"(this daemon speaks {PROTOCOL_VERSION}); upgrade the older daemon")
    if request.node_id == self_id:
        return (grpc.StatusCode.ALREADY_EXISTS,
                f"duplicate node id {self_id}: another daemon uses this node id (copied data dir?)")
    if request.run_id != run_id:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"run id {clip(request.run_id, 64)} differs from this daemon's run id {run_id!r}")
    if max_incarnation is not None and request.incarnation > max_incarnation:
        return (grpc.StatusCode.INVALID_ARGUMENT,
                f"incarnation {request.incarnation} is beyond this host's clock plus the skew bound "
                f"({max_incarnation}); is the peer's clock far ahead?")
    return None


def connect_hint(details: str, secure: bool) -> str:
    """What a failed first contact most likely means, from gRPC's error details."""
    if "andshake" in details or "CERTIFICATE" in details:
        return ("; the TLS handshake failed: it is no daemon of this cluster (another secret or CA), or it "
                "listens in plaintext (--tls must agree)")
    if not secure and "Socket closed" in details:
        return "; it closed the connection: does it listen with TLS (--tls on, or auto off loopback)?"
    return ""


def make_table(node_id: str, cfg: Config) -> Membership:
    m = cfg.membership
    return Membership(node_id, Timing(suspect_after=m.suspect_after, dead_after=m.dead_after,
                                      forget_dead_after=m.forget_dead_after, retry_base=m.heartbeat_interval,
                                      retry_max=m.connect_retry_max, max_peers=m.max_peers,
                                      full_interval=m.peer_gossip_full_interval))


class MembershipService:
    def __init__(self, cfg: Config, me: Identity, table: Membership, client: PeerClient, auth: Authenticator,
                 channels: ChannelPool, links: LinkGossip) -> None:
        self.cfg = cfg
        self.me = me
        self.table = table
        self.client = client
        self.auth = auth
        self.channels = channels
        self.links = links
        self.listeners: list[Callable[[Transition], None]] = []   # every state change, in order
        # a live peer came back as a new incarnation: (node, old incarnation, new)
        self.on_restart: Callable[[str, int, int], None] = lambda node, old, new: None
        # a peer answered our Hello: (node, its address, whether it could dial us back, pb.DialBack)
        self.on_dial_back: Callable[[str, str, int], None] = lambda node, address, result: None
        # our Hello to a node known by id (gossip, mDNS) did not reach it: (node, address)
        # our Hello or heartbeat to (node, address) failed in transport: a relay may route it
        self.on_dial_failed: Callable[[str, str], None] = lambda node, address: None
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._leaving = False     # set by leave(): no more heartbeats or hellos after the goodbye
        self._hb_seq = 0
        self._logged_refusals: dict[str, float] = {}
        self.revoked = auth.revoked
        self._their_digest: dict[str, bytes] = {}     # peer -> the revocations digest it last sent us
        self.suspect_events = 0      # peers marked suspect or dead (a starved loop shows here)

    # --- what we say about ourselves and the table ----------------------------------------------
    def hello_message(self) -> pb.Hello:
        me = self.me
        return pb.Hello(node_id=me.node_id, protocol_version=PROTOCOL_VERSION, run_id=me.run_id,
                        address=me.address, capabilities=caps_to_pb(me.caps), incarnation=me.incarnation)

    def peer_table(self) -> list[pb.PeerInfo]:
        """The whole peer table, for a Hello reply."""
        return [member_to_pb(m) for m in self.table.members.values()]

    def max_incarnation(self) -> int:
        """The highest incarnation a peer may announce now: our clock plus the skew bound, in ms."""
        return int((time.time() + self.cfg.auth.max_skew) * 1000)

    def rows(self, peers) -> list[dict]:
        """Gossip rows worth merging: bounded incarnations, valid node ids, nobody revoked."""
        bound = self.max_incarnation()
        return [r for r in rows_from_pb(peers)
                if is_node_id(r["node_id"]) and r["incarnation"] <= bound and r["node_id"] not in self.revoked]

    def merge_rows(self, peers, now: float) -> None:
        me = host_of(self.me.address)
        bad = self.table.merge_gossip(self.rows(peers), now, allow_loopback=is_loopback_host(me),
                                      max_new=self.cfg.membership.gossip_new_candidates)
        if bad:
            log.debug("skipped %d gossip rows with addresses no daemon should dial", bad)

    # --- revocations ------------------------------------------------------------------------------
    def revocations(self) -> list[pb.Revocation]:
        return [revocation_to_pb(r) for r in self.revoked.all()]

    def revocation_news(self, peer: str) -> tuple[bytes, list[pb.Revocation]]:
        """Our digest, and all our revocations when `peer`'s digest (as last seen) is not ours."""
        digest = self.revoked.digest
        return digest, self.revocations() if digest and self._their_digest.get(peer) != digest else []

    def learn_revocations(self, peer: str, digest: bytes, revs) -> None:
        if len(self._their_digest) > 4 * self.cfg.membership.max_peers:
            self._their_digest.clear()
        self._their_digest[peer] = bytes(digest[:32])
        if revs:
            self.revoke([revocation_from_pb(r) for r in list(revs)[:self.revoked.capacity]], f"from {peer}")

    def revoke(self, revs: list[Revocation], how: str) -> list[Revocation]:
        """Keep the new, verified revocations; drop their nodes from the table and their channels."""
        new = self.revoked.add(revs)
        for rev in new:
            m = self.table.get(rev.node)
            log.warning("node %s is revoked (%s, %s): it is no member any more%s", rev.node,
                        rev.reason or "no reason given", how, f" (it was {m.state.value} at {m.address})" if m else "")
            if m is not None:
                self.channels.drop(m.address)
            self.transition(self.table.forget(rev.node), "revoked")
        return new

    def peer_news(self, peer: str, way: str) -> tuple[list[pb.PeerInfo], GossipMark]:
        """Peer-table rows for one heartbeat ("hb") or reply ("reply") to `peer`: what is news to
        it, with the mark to pass to table.gossiped once delivered."""
        rows, mark = self.table.gossip_rows(peer, way, time.monotonic())
        return [member_to_pb(m) for m in rows], mark

    def transition(self, tr: Transition | None, how: str = "") -> None:
        if tr is None:
            return
        m = self.table.get(tr.node_id)
        where = f" at {m.address}" if m else ""
        old = tr.old.value if tr.old else "new"
        new = tr.new.value if tr.new else "forgotten"
        level = logging.WARNING if tr.new in (State.DEAD,) else logging.INFO
        if tr.new in (State.SUSPECT, State.DEAD):
            self.suspect_events += 1
        log.log(level, "peer %s%s: %s -> %s%s", tr.node_id, where, old, new, f" ({how})" if how else "")
        if m is not None and tr.new is State.DEAD:
            self.channels.drop(m.address)
        elif m is not None and tr.new is State.ALIVE and tr.old in (State.DEAD, State.LEFT):
            self.channels.drop(m.address, unless_ready=True)
        for listener in self.listeners:
            listener(tr)

    # --- calls from peers (peerd.node.peer_service) ---------------------------------------------
    def hello_refusal(self, request: pb.Hello) -> tuple[grpc.StatusCode, str] | None:
        reason = hello_refusal(self.me.node_id, self.me.run_id, request, self.max_incarnation())
        if reason:
            return reason
        existing = self.table.get(request.node_id)
        if (existing is not None and existing.state is State.ALIVE and request.incarnation <= existing.incarnation
                and existing.address != request.address
                and time.monotonic() - existing.last_heard < self.cfg.membership.suspect_after):
            return (grpc.StatusCode.ALREADY_EXISTS,
                    f"duplicate node id {request.node_id}: it is alive at {existing.address} "
                    f"(incarnation {existing.incarnation}); two daemons share a node id (copied data dir?)")
        return None

    def _restarted(self, node_id: str, incarnation: int | None) -> None:
        """A peer back as a new incarnation before the failure detector saw it gone: to a training
        run that is a crash and a return (its state there starts over)."""
        m = self.table.get(node_id)
        if (m is not None and incarnation is not None and incarnation > m.incarnation
                and m.state in (State.ALIVE, State.SUSPECT)):
            self.on_restart(node_id, m.incarnation, incarnation)

    def on_admit(self, node_id: str, address: str, run_id: str, incarnation: int, caps: dict, how: str) -> None:
        self._restarted(node_id, incarnation)
        tr = self.table.admit(node_id, address, run_id, incarnation, caps, time.monotonic())
        self.transition(tr, how)

    def on_heartbeat(self, request: pb.Heartbeat, address: str | None) -> pb.HeartbeatReply:
        """A peer's heartbeat: its news in, ours out. (peerd.node.peer_service refused it if its
        incarnation was beyond max_incarnation.)"""
        node_id, now = request.node_id, time.monotonic()
        if self.table.get(node_id) is not None:
            self._restarted(node_id, request.incarnation)
            self.transition(self.table.heard_from(node_id, now, request.incarnation), "heartbeat")
        elif address:
            # We do not know it (we restarted, or forgot it): greet it before trusting it.
            self.table.add_candidate(address, "heartbeat", now, node_id=node_id)
        self.learn_revocations(node_id, request.revocations_digest, request.revocations)
        self.merge_rows(request.peers, now)
        self.links.merge(node_id, [e for e in request.links if is_node_id(e.measurer) and is_node_id(e.target)])
        links, mark = self.links.gossip(node_id, "reply")
        self.links.gossiped(node_id, "reply", mark)   # no acknowledgement: the full refresh repairs losses
        peers, peers_mark = self.peer_news(node_id, "reply")
        self.table.gossiped(node_id, "reply", peers_mark)
        digest = self.revoked.digest
        revs = self.revocations() if digest != request.revocations_digest else []
        return pb.HeartbeatReply(node_id=self.me.node_id, incarnation=self.me.incarnation, peers=peers, links=links,
                                 revocations_digest=digest, revocations=revs)

    def activity(self, node_id: str) -> None:
        """Bytes from `node_id` are arriving on a data stream: that is life too (a heartbeat may
        be late behind a busy machine; a peer that delivers is not dead)."""
        if self.table.get(node_id) is not None:
            self.transition(self.table.heard_from(node_id, time.monotonic()), "data arriving")

    def on_leave(self, node_id: str, incarnation: int, reason: str) -> None:
        self.transition(self.table.left(node_id, incarnation, time.monotonic()),
                        f"said goodbye{': ' + reason if reason else ''}")

    # --- our side ---------------------------------------------------------------------------------
    async def run(self) -> None:
        interval = self.cfg.membership.heartbeat_interval
        while True:
            now = time.monotonic()
            for tr in self.table.tick(now):
                self.transition(tr, "no contact" if tr.new in (State.SUSPECT, State.DEAD) else "")
            if self._leaving:
                return
            for m in self.table.to_contact(now):
                self._contact(m.node_id, self._heartbeat(m))
            for cand in self.table.due_candidates(now):
                self._contact(cand.address, self._hello(cand.address, cand.source, cand.node_id))
            await asyncio.sleep(interval)

    def _contact(self, key: str, coro) -> None:
        """One outstanding contact per peer or address: a slow peer never piles up calls."""
        if key in self._in_flight:
            coro.close()
            return
        self._in_flight.add(key)
        task = asyncio.get_running_loop().create_task(coro, name=f"contact {key}")
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            self._in_flight.discard(key)
            if not t.cancelled() and t.exception() is not None:
                log.error("contact %s failed: %r", key, t.exception(), exc_info=t.exception())
        task.add_done_callback(done)

    def _refused(self, address: str, err: grpc.aio.AioRpcError) -> str:
        """Log a refusal of our Hello (at most every auth_log_every per address); returns why."""
        now = time.monotonic()
        hint = " (check --secret-file / PEERD_SECRET: all daemons need the same secret)" \
            if err.code() == grpc.StatusCode.UNAUTHENTICATED else ""
        why = f"refused us: {err.details()}{hint}"
        if now - self._logged_refusals.get(address, -1e18) >= self.cfg.auth.log_every:
            self._logged_refusals[address] = now
            log.warning("peer at %s %s", address, why)
        return why

    async def _hello(self, address: str, source: str, node: str = "") -> None:
        now = time.monotonic()
        try:
            reply, signer = await self.client.hello(address, self.hello_message(), node=node)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
                              grpc.StatusCode.INVALID_ARGUMENT):
                self.table.candidate_failed(address, time.monotonic(), self._refused(address, err))
                return
            hint = connect_hint(err.details() or "", self.channels.secure(address))
            self.table.candidate_failed(address, time.monotonic(),
                                        f"cannot reach it: {err.code().name}: {clip(err.details() or '', 160)}{hint}")
            self.on_dial_failed(node, address)
            cand = self.table.candidates.get(address)
            if cand is not None and cand.failures == 1:
                log.info("cannot reach %s %s yet: %s%s (retrying with back-off up to %.0fs)",
                         source, address, err.code().name, hint, self.cfg.membership.connect_retry_max)
            return
        node = reply.node
        if signer != node.node_id:
            why = f"answered Hello as {clip(node.node_id, 40)} but signed as {signer}"
            self.table.candidate_failed(address, now, why)
            log.warning("peer at %s %s; not adopted", address, why)
            return
        refusal = hello_refusal(self.me.node_id, self.me.run_id, node, self.max_incarnation())
        caps, why = caps_from_pb(node.capabilities) if not refusal else ({}, refusal[1])
        if why:
            self.table.drop_candidate(address, time.monotonic(), f"not adopted: {why}")
            log.warning("not adopting %s at %s: %s", node.node_id, address, why)
            return
        self.revoke([revocation_from_pb(r) for r in list(reply.revocations)[:self.revoked.capacity]],
                    f"from {node.node_id}")
        # Dial it where we reached it: its own claim may name an interface we cannot route to.
        self.on_admit(node.node_id, address, node.run_id, node.incarnation, caps, how=f"Hello to {source}")
        self.table.heard_from(node.node_id, time.monotonic(), rtt_s=time.monotonic() - now)
        self.on_dial_back(node.node_id, address, reply.dial_back)
        self.merge_rows(reply.peers, time.monotonic())

    async def _heartbeat(self, m: Member) -> None:
        self._hb_seq += 1
        links, mark = self.links.gossip(m.node_id, "hb")
        peers, peers_mark = self.peer_news(m.node_id, "hb")
        digest, revs = self.revocation_news(m.node_id)
        msg = pb.Heartbeat(node_id=self.me.node_id, incarnation=self.me.incarnation, seq=self._hb_seq,
                           peers=peers, address=self.me.address, links=links, revocations_digest=digest,
                           revocations=revs)
        sent = time.monotonic()
        try:
            reply = await self.client.heartbeat(m.address, msg, m.node_id)
        except grpc.aio.AioRpcError as err:
            now = time.monotonic()
            self.table.contact_failed(m.node_id, now)
            other = dict(err.trailing_metadata() or ()).get(RECEIVER_KEY, "")
            if err.code() == grpc.StatusCode.UNAUTHENTICATED and other and other != m.node_id:
                # Another daemon now answers at this address; the old one is gone from here.
                self.table.add_candidate(m.address, "heartbeat", now)
            elif err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._refused(m.address, err)
            else:   # alive through its own calls to us (say through a relay) yet not dialable by us
                self.on_dial_failed(m.node_id, m.address)
            return
        now = time.monotonic()
        if reply.node_id != m.node_id or reply.incarnation > self.max_incarnation():
            self.table.contact_failed(m.node_id, now)
            return
        self._restarted(m.node_id, reply.incarnation)
        self.transition(self.table.heard_from(m.node_id, now, reply.incarnation, now - sent), "heartbeat answered")
        self.learn_revocations(m.node_id, reply.revocations_digest, reply.revocations)
        self.merge_rows(reply.peers, now)
        self.table.gossiped(m.node_id, "hb", peers_mark)
        self.links.gossiped(m.node_id, "hb", mark)
        self.links.observe_heartbeat(m.node_id, now - sent)
        self.links.merge(m.node_id, [e for e in reply.links if is_node_id(e.measurer) and is_node_id(e.target)])

    async def leave(self) -> None:
        """Tell every live peer we leave (best effort, bounded by leave_timeout). Heartbeats and
        hellos stop first: one that a peer processes after our goodbye would say we are back."""
        self._leaving = True
        self.stop()
        targets = [m for m in self.table.members.values() if m.state in (State.ALIVE, State.SUSPECT)]
        if targets:
            await asyncio.wait([asyncio.ensure_future(self._say_leave(m)) for m in targets],
                               timeout=self.cfg.membership.leave_timeout)

    async def _say_leave(self, m: Member) -> None:
        try:
            await self.client.leave(m.address, pb.Leave(node_id=self.me.node_id, incarnation=self.me.incarnation,
                                                        reason="shutdown"), m.node_id)
        except grpc.aio.AioRpcError:
            pass  # best effort: the failure detector covers peers we could not tell

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
