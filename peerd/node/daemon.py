"""The peerd daemon: composition root of one host's node.

It serves the Peer service on TCP (authenticated), the Control service on a unix socket in the data
dir, keeps the membership table (peerd.net.membership) fed with direct contacts, and gossips the
table in heartbeats. Candidates come from --peer seeds, gossip and mDNS (mdns_service.py); link
estimates are measured and gossiped by links_service.py, whose matrix is `Daemon.link_matrix`.
All waits are bounded by Config values.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import grpc

from peerd import PROTOCOL_VERSION, __version__
from peerd.config import Config
from peerd.net.auth import AuthInterceptor, Authenticator, NONCE_KEY, REPLY_MAC_KEY, RefusalGate
from peerd.net.dataplane import DataPlane, Outgoing, Received, Snapshot, grpc_options, rpc
from peerd.net.discovery import DiscoveryError
from peerd.net.links import LinkMatrix
from peerd.net.membership import GossipMark, Member, Membership, State, Timing, Transition
from peerd.node import capabilities, mdns_service
from peerd.node.control_service import ControlService
from peerd.node.convert import caps_from_pb, caps_to_pb, member_to_pb, rows_from_pb, split_host_port
from peerd.node.identity import DataDir, atomic_write, slot_dir
from peerd.node.offences import PeerOffences
from peerd.node.links_service import LinkService
from peerd.node.peer_service import PeerService, hello_refusal
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.daemon")

PEER_SERVICE = "peerd.v1.Peer"
CONTROL_SERVICE = "peerd.v1.Control"
UNIX_PATH_MAX = 107


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


def loop_name() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__qualname__}"


class Daemon:
    def __init__(self, cfg: Config, secret: bytes) -> None:
        self.cfg = cfg
        self.data = DataDir(cfg.data_path)
        self._secret = secret
        self.node_id = ""
        self.incarnation = 0
        self.address = ""
        self.started_mono = time.monotonic()
        self.caps = capabilities.detect(site=cfg.site)
        self.membership: Membership | None = None
        self.auth: Authenticator | None = None
        self.gate: RefusalGate | None = None
        self.offences: PeerOffences | None = None  # bad updates per peer; flagged peers
        self._server: grpc.aio.Server | None = None
        self._control: grpc.aio.Server | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task] = set()
        self._in_flight: set[str] = set()
        self._stop = asyncio.Event()
        self._hb_seq = 0
        self._events = None
        self._logged_refusals: dict[str, float] = {}
        self.dataplane: DataPlane | None = None
        self.links: LinkService | None = None
        self.link_matrix: LinkMatrix | None = None  # the swarm's link estimates, for the sync policies
        self.discovery = None                       # MdnsDiscovery while mDNS runs
        self.training = None                        # the TrainingRun of `peerd train`, when one is active
        self.rankings: dict = {}                    # founders -> (ranks, last asked): see joining.ranking
        self.last_training_state: dict | None = None   # state() of the last run that ended
        self._early: list[Received] = []       # peers' updates that arrived before our run started

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        sock = cfg.control_socket
        if len(str(sock)) > UNIX_PATH_MAX:
            raise StartupError(f"control socket path {sock} is {len(str(sock))} characters; unix sockets "
                               f"allow {UNIX_PATH_MAX}: choose a shorter --data-dir")
        self.data.open()
        self.node_id = self.data.node_id()
        self.incarnation = self.data.next_incarnation()
        self._remove_stale_slots()
        self.auth = Authenticator(self._secret, self.node_id, cfg.auth_max_skew, cfg.auth_replay_cache)
        self.gate = RefusalGate(cfg.auth_refusal_burst, cfg.auth_refusal_rate, cfg.auth_max_sources,
                                cfg.auth_log_every)
        self.membership = Membership(self.node_id, Timing(
            suspect_after=cfg.suspect_after, dead_after=cfg.dead_after,
            forget_dead_after=cfg.forget_dead_after, retry_base=cfg.heartbeat_interval,
            retry_max=cfg.connect_retry_max, max_peers=cfg.max_peers,
            full_interval=cfg.peer_gossip_full_interval))
        self._events = open(self.data.path / "events.jsonl", "a", buffering=1)
        self.links = LinkService(self)
        self.link_matrix = self.links.matrix

        self._server = grpc.aio.server(interceptors=[AuthInterceptor(self.auth, self.gate)], options=grpc_options(cfg))
        self.dataplane = DataPlane(cfg, self.node_id, cfg.run_id, on_received=self._on_received,
                                   source=self._pull_source)
        self.offences = PeerOffences(cfg.peer_max_offences, cfg.peer_cooldown, cfg.max_peers)
        self.dataplane.screen = self._screen
        self.dataplane.on_offence = self.offence
        handlers = {**PeerService(self).method_handlers(), **self.dataplane.method_handlers()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PEER_SERVICE, handlers),))
        host, port = split_host_port(cfg.listen, allow_zero=True)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if cfg.tls_cert:
                bound = self._server.add_secure_port(bind, self._server_credentials())
            else:
                bound = self._server.add_insecure_port(bind)
        except RuntimeError as e:
            raise StartupError(f"cannot listen on {cfg.listen}: {e}") from None
        if not bound:
            raise StartupError(f"cannot listen on {cfg.listen} (address in use or not on this host?)")
        self.address = cfg.advertise_address or (f"{bind.rsplit(':', 1)[0]}:{bound}")

        self._control = grpc.aio.server(options=grpc_options(cfg))
        self._control.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(CONTROL_SERVICE, ControlService(self).method_handlers()),))
        sock.unlink(missing_ok=True)
        if not self._control.add_insecure_port(f"unix://{sock}"):
            raise StartupError(f"cannot create control socket {sock}")
        await self._server.start()
        await self._control.start()
        os.chmod(sock, 0o600)
        now = time.monotonic()
        for seed in cfg.peers:
            self.membership.add_candidate(seed, "seed", now, permanent=True)
        self._event("start", address=self.address, incarnation=self.incarnation, loop=loop_name())
        log.info("node %s (incarnation %d) serving peers on %s, control on %s, loop %s, run %r",
                 self.node_id, self.incarnation, self.address, sock, loop_name(), cfg.run_id)
        self._spawn(self._membership_loop(), "membership")
        self._spawn(self.links.run(), "link probes")
        self._spawn(self._discover(), "mdns")

    async def _discover(self) -> None:
        disc, why = mdns_service.plan(self)
        if disc is None:
            log.info("%s", why)
            return
        self.discovery = disc          # set first: shutdown stops it even while it starts
        try:
            await disc.start()
        except DiscoveryError as e:
            self.discovery = None
            log.warning("mDNS discovery is off: %s; --peer seeds and gossip still work", e)

    async def run(self) -> None:
        """Start, serve until SIGINT/SIGTERM or stop(), then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            # The handlers stay during shutdown: a second Ctrl+C must not cut it short mid-way.
            try:
                await asyncio.wait_for(self.shutdown(), self.cfg.shutdown_timeout)
            except TimeoutError:
                log.warning("shutdown took longer than shutdown_timeout (%.1fs); forcing the rest",
                            self.cfg.shutdown_timeout)
                self._force_stop()
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    def stop(self) -> None:
        self._stop.set()

    async def shutdown(self) -> None:
        """Tell peers we leave, stop serving, close sockets, remove the control socket."""
        cfg = self.cfg
        # Independent, so at once: stop the trainer, say goodbye on mDNS, tell peers we leave.
        parting = []
        if self.training is not None:
            parting.append(self.training.stop())
        if self.discovery is not None:
            parting.append(self.discovery.stop())   # goodbye packets; bounded by mdns_stop_timeout
        if self.membership is not None and self._server is not None:
            targets = [m for m in self.membership.members.values() if m.state in (State.ALIVE, State.SUSPECT)]
            if targets:
                parting.append(asyncio.wait([asyncio.ensure_future(self._say_leave(m)) for m in targets],
                                            timeout=cfg.leave_timeout))
        await asyncio.gather(*parting, return_exceptions=True)
        self.discovery = None
        if self.links is not None:
            self.links.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=cfg.shutdown_grace)
        for server in (self._server, self._control):
            if server is not None:
                await server.stop(cfg.shutdown_grace)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        for rec in self._early:
            rec.release()
        self._early.clear()
        if self.dataplane is not None:
            self.dataplane.close()
        if self._control is not None:
            self.cfg.control_socket.unlink(missing_ok=True)
        if self._events is not None:
            self._event("stop")
            self._events.close()
            self._events = None
        self.data.close()
        log.info("node %s stopped", self.node_id)

    def _remove_stale_slots(self) -> None:
        """Shared-memory slots of this node's earlier incarnations (a daemon killed with SIGKILL
        cannot remove its own). Safe: the data dir's exclusive lock says no other daemon with this
        node id runs."""
        stale = list(slot_dir(self.data.path).glob(f"peerd-{self.node_id}-*"))
        for p in stale:
            p.unlink(missing_ok=True)
        if stale:
            log.info("removed %d shared-memory slot file(s) left by an earlier run of this node", len(stale))

    def _force_stop(self) -> None:
        """What must not outlive us when the orderly shutdown ran out of time: the trainer, its
        shared-memory slots, the control socket."""
        run = self.training
        if run is not None:
            if run.trainer is not None and run.trainer.poll() is None:
                run.trainer.kill()
            for p in run.slot_paths:
                p.unlink(missing_ok=True)
        if self._control is not None:
            self.cfg.control_socket.unlink(missing_ok=True)
        if self._events is not None:
            self._event("stop", forced=True)
            self._events.close()
            self._events = None

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed: %r", task.get_name(), task.exception(), exc_info=task.exception())

    def _server_credentials(self) -> grpc.ServerCredentials:
        cfg = self.cfg
        key, cert = Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes()
        ca = Path(cfg.tls_ca).read_bytes() if cfg.tls_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            cfg = self.cfg
            if cfg.tls_cert:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=Path(cfg.tls_ca).read_bytes() if cfg.tls_ca else None,
                    private_key=Path(cfg.tls_key).read_bytes(), certificate_chain=Path(cfg.tls_cert).read_bytes())
                channel = grpc.aio.secure_channel(address, creds, options=grpc_options(cfg))
            else:
                channel = grpc.aio.insecure_channel(address, options=grpc_options(cfg))
            self._channels[address] = channel
        return channel

    def _drop_channel(self, address: str, unless_ready: bool = False) -> None:
        """Forget our channel to `address` (the next call dials afresh) and close it, failing the
        calls still on it. A cut link leaves its TCP connection open but dead: every call on it
        hangs until its own deadline, until keepalive (keepalive_interval + keepalive_timeout)
        gives up on it; and a channel whose connection attempts failed during an outage waits out
        gRPC's reconnect back-off (up to minutes) after the outage. A peer found dead, or back,
        is dialled on a fresh connection instead."""
        channel = self._channels.get(address)
        if channel is None or (unless_ready and
                               channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY):
            return
        del self._channels[address]
        self._spawn(channel.close(), f"close channel {address}")

    def _event(self, kind: str, **fields) -> None:
        if self._events is not None:
            self._events.write(json.dumps({"t": time.time(), "node": self.node_id, "event": kind, **fields}) + "\n")

    # --- membership ---------------------------------------------------------------------------
    def _log_transition(self, tr: Transition | None, how: str = "") -> None:
        if tr is None:
            return
        m = self.membership.get(tr.node_id)
        where = f" at {m.address}" if m else ""
        old = tr.old.value if tr.old else "new"
        new = tr.new.value if tr.new else "forgotten"
        level = logging.WARNING if tr.new in (State.DEAD,) else logging.INFO
        log.log(level, "peer %s%s: %s -> %s%s", tr.node_id, where, old, new, f" ({how})" if how else "")
        self._event("peer", peer=tr.node_id, old=old, new=new, how=how)
        self.links.on_state(tr.node_id, tr.new)
        if m is not None and tr.new is State.DEAD:
            self._drop_channel(m.address)
        elif m is not None and tr.new is State.ALIVE and tr.old in (State.DEAD, State.LEFT):
            self._drop_channel(m.address, unless_ready=True)
        if self.training is not None:
            if tr.new in (State.DEAD, State.LEFT, None):
                self.training.peer_down(tr.node_id)
            elif tr.new is State.ALIVE and tr.old in (State.DEAD, State.LEFT):
                self.training.peer_up(tr.node_id)

    def hello_message(self) -> pb.Hello:
        return pb.Hello(node_id=self.node_id, protocol_version=PROTOCOL_VERSION, run_id=self.cfg.run_id,
                        address=self.address, capabilities=caps_to_pb(self.caps), incarnation=self.incarnation)

    def peer_table(self) -> list[pb.PeerInfo]:
        """The whole peer table, for a Hello reply."""
        return [member_to_pb(m) for m in self.membership.members.values()]

    def peer_news(self, peer: str, way: str) -> tuple[list[pb.PeerInfo], GossipMark]:
        """Peer-table rows for one heartbeat ("hb") or reply ("reply") to `peer`: what is news to
        it, with the mark to pass to membership.gossiped once delivered."""
        rows, mark = self.membership.gossip_rows(peer, way, time.monotonic())
        return [member_to_pb(m) for m in rows], mark

    def hello_refusal(self, request: pb.Hello):
        reason = hello_refusal(self.node_id, self.cfg.run_id, request)
        if reason:
            return reason
        existing = self.membership.get(request.node_id)
        if (existing is not None and existing.state is State.ALIVE and request.incarnation <= existing.incarnation
                and existing.address != request.address
                and time.monotonic() - existing.last_heard < self.cfg.suspect_after):
            return (grpc.StatusCode.ALREADY_EXISTS,
                    f"duplicate node id {request.node_id}: it is alive at {existing.address} "
                    f"(incarnation {existing.incarnation}); two daemons share a node id (copied data dir?)")
        return None

    def _restarted(self, node_id: str, incarnation: int | None) -> None:
        """A peer back as a new incarnation before the failure detector saw it gone: to a training
        run that is a crash and a return (its state there starts over)."""
        m = self.membership.get(node_id)
        if (self.training is not None and m is not None and incarnation is not None
                and incarnation > m.incarnation and m.state in (State.ALIVE, State.SUSPECT)):
            log.info("peer %s restarted (incarnation %d -> %d)", node_id, m.incarnation, incarnation)
            self.training.peer_down(node_id)
            self.training.peer_up(node_id)

    def on_admit(self, node_id: str, address: str, run_id: str, incarnation: int, caps: dict, how: str) -> None:
        self._restarted(node_id, incarnation)
        tr = self.membership.admit(node_id, address, run_id, incarnation, caps, time.monotonic())
        self._log_transition(tr, how)

    def on_heartbeat(self, node_id: str, incarnation: int, address: str | None, rows: list[dict]) -> None:
        now = time.monotonic()
        if self.membership.get(node_id) is not None:
            self._restarted(node_id, incarnation)
            self._log_transition(self.membership.heard_from(node_id, now, incarnation), "heartbeat")
        elif address:
            # We do not know it (we restarted, or forgot it): greet it before trusting it.
            self.membership.add_candidate(address, "heartbeat", now, node_id=node_id)
        self.membership.merge_gossip(rows, now)

    def on_leave(self, node_id: str, incarnation: int, reason: str) -> None:
        self._log_transition(self.membership.left(node_id, incarnation, time.monotonic()),
                             f"said goodbye{': ' + reason if reason else ''}")

    async def _membership_loop(self) -> None:
        cfg = self.cfg
        while True:
            now = time.monotonic()
            for tr in self.membership.tick(now):
                self._log_transition(tr, "no contact" if tr.new in (State.SUSPECT, State.DEAD) else "")
            for m in self.membership.to_contact(now):
                self._contact(m.node_id, self._heartbeat(m))
            for cand in self.membership.due_candidates(now):
                self._contact(cand.address, self._hello(cand.address, cand.source))
            self.gate.flush()
            await asyncio.sleep(cfg.heartbeat_interval)

    def _contact(self, key: str, coro) -> None:
        """One outstanding contact per peer or address: a slow peer never piles up calls."""
        if key in self._in_flight:
            coro.close()
            return
        self._in_flight.add(key)
        task = self._spawn(coro, f"contact {key}")
        task.add_done_callback(lambda _t: self._in_flight.discard(key))

    def _refused(self, address: str, err: grpc.aio.AioRpcError) -> None:
        now = time.monotonic()
        if now - self._logged_refusals.get(address, -1e18) >= self.cfg.auth_log_every:
            self._logged_refusals[address] = now
            hint = " (check --secret-file / PEERD_SECRET: all daemons need the same secret)" \
                if err.code() == grpc.StatusCode.UNAUTHENTICATED else ""
            log.warning("peer at %s refused us: %s%s", address, err.details(), hint)

    async def _hello(self, address: str, source: str) -> None:
        method = f"/{PEER_SERVICE}/SayHello"
        metadata = self.auth.sign(method)
        nonce = dict(metadata)[NONCE_KEY]
        stub = self._channel(address).unary_unary(method, request_serializer=pb.Hello.SerializeToString,
                                                  response_deserializer=pb.HelloReply.FromString)
        now = time.monotonic()
        try:
            call = stub(self.hello_message(), metadata=metadata, timeout=self.cfg.rpc_timeout)
            reply: pb.HelloReply = await rpc(call)
            initial = dict(await call.initial_metadata() or ())
        except grpc.aio.AioRpcError as err:
            self.membership.candidate_failed(address, time.monotonic())
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                self._refused(address, err)
            else:
                cand = self.membership.candidates.get(address)
                if cand is not None and cand.failures == 1:
                    log.info("cannot reach %s %s yet: %s (retrying with back-off up to %.0fs)",
                             source, address, err.code().name, self.cfg.connect_retry_max)
            return
        node = reply.node
        if not self.auth.verify_reply(node.node_id, nonce, initial.get(REPLY_MAC_KEY)):
            self.membership.candidate_failed(address, now)
            log.warning("peer at %s answered Hello without proof of the cluster secret; not adopted", address)
            return
        refusal = hello_refusal(self.node_id, self.cfg.run_id, node)
        if refusal:
            self.membership.drop_candidate(address)
            log.warning("not adopting %s at %s: %s", node.node_id, address, refusal[1])
            return
        # Dial it where we reached it: its own claim may name an interface we cannot route to.
        self.on_admit(node.node_id, address, node.run_id, node.incarnation, caps_from_pb(node.capabilities),
                      how=f"Hello to {source}")
        self.membership.heard_from(node.node_id, time.monotonic(), rtt_s=time.monotonic() - now)
        self.membership.merge_gossip(rows_from_pb(reply.peers), time.monotonic())

    async def _heartbeat(self, m: Member) -> None:
        method = f"/{PEER_SERVICE}/SendHeartbeat"
        self._hb_seq += 1
        links, mark = self.links.gossip(m.node_id, "hb")
        peers, peers_mark = self.peer_news(m.node_id, "hb")
        msg = pb.Heartbeat(node_id=self.node_id, incarnation=self.incarnation, seq=self._hb_seq,
                           peers=peers, address=self.address, links=links)
        stub = self._channel(m.address).unary_unary(method, request_serializer=pb.Heartbeat.SerializeToString,
                                                    response_deserializer=pb.HeartbeatReply.FromString)
        sent = time.monotonic()
        try:
            reply = await rpc(stub(msg, metadata=self.auth.sign(method), timeout=self.cfg.rpc_timeout))
        except grpc.aio.AioRpcError as err:
            self.membership.contact_failed(m.node_id, time.monotonic())
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self._refused(m.address, err)
            return
        now = time.monotonic()
        if reply.node_id != m.node_id:
            # Another daemon now answers at this address; the old one is gone from here.
            self.membership.contact_failed(m.node_id, now)
            self.membership.add_candidate(m.address, "heartbeat", now)
            return
        self._restarted(m.node_id, reply.incarnation)
        self._log_transition(self.membership.heard_from(m.node_id, now, reply.incarnation, now - sent),
                             "heartbeat answered")
        self.membership.merge_gossip(rows_from_pb(reply.peers), now)
        self.membership.gossiped(m.node_id, "hb", peers_mark)
        self.links.gossiped(m.node_id, "hb", mark)
        self.links.observe_heartbeat(m.node_id, now - sent)
        self.links.merge(m.node_id, reply.links)

    async def _say_leave(self, m: Member) -> None:
        method = f"/{PEER_SERVICE}/SayLeave"
        stub = self._channel(m.address).unary_unary(method, request_serializer=pb.Leave.SerializeToString,
                                                    response_deserializer=pb.LeaveReply.FromString)
        try:
            await rpc(stub(pb.Leave(node_id=self.node_id, incarnation=self.incarnation, reason="shutdown"),
                           metadata=self.auth.sign(method), timeout=self.cfg.leave_timeout))
        except grpc.aio.AioRpcError:
            pass  # best effort: the failure detector covers peers we could not tell

    # --- data plane ---------------------------------------------------------------------------
    def _on_received(self, rec: Received) -> None:
        base, _, tag = rec.kind.partition(":")
        if base in ("model", "carry"):
            if self.training is not None:
                if tag == self.training.tag:
                    self.training.on_received(rec)
                else:
                    rec.release()  # a late update of an earlier run
                return
            if len(self._early) < self.cfg.train_early_updates:
                self._early.append(rec)  # the peer's run started before ours; replayed at start
                return
        rec.release()

    def offence(self, peer: str, what: str) -> None:
        """A bad update from `peer` (dropped where it was found). Flagged: the run treats the peer
        as down for the cool-down (no policy waits on updates that are refused), then as up."""
        if not self.offences.record(peer, what):
            return
        self._event("flagged", peer=peer, what=what, cooldown=self.cfg.peer_cooldown)
        if self.training is not None:
            self.training.peer_down(peer)
        asyncio.get_running_loop().call_later(self.cfg.peer_cooldown + 0.05, self._readmit, peer)

    def _readmit(self, peer: str) -> None:
        if self.offences is None or self.offences.flagged_for(peer):
            return  # shut down, or flagged again meanwhile (that flag has its own timer)
        self._event("readmitted", peer=peer)
        m = self.membership.get(peer)
        if self.training is not None and m is not None and m.state in (State.ALIVE, State.SUSPECT):
            self.training.peer_up(peer)

    def _screen(self, peer: str, kind: str) -> str | None:
        """Model updates of a peer flagged for bad updates are refused at their header."""
        if kind.partition(":")[0] not in ("model", "carry"):
            return None
        left = self.offences.flagged_for(peer)
        return f"peer {peer} is flagged for bad updates; ignored for {left:.0f}s more" if left else None

    def _pull_source(self, requester: str, kind: str, min_iteration: int) -> Snapshot | None:
        if self.training is not None and kind == self.training.kind("model"):
            return self.training.serve_pull(requester)
        return None

    async def push_tensor(self, address: str, node: str, data: Outgoing, *, iteration: int, kind: str):
        method = "/peerd.v1.Peer/PushTensor"
        result = await self.dataplane.push(self._channel(address), node, data, metadata=self.auth.sign(method),
                                           iteration=iteration, kind=kind)
        self.links.observe_push(node, result)
        return result

    async def pull_tensor(self, address: str, node: str, kind: str = "model") -> Received:
        method = "/peerd.v1.Peer/PullTensor"
        return await self.dataplane.pull(self._channel(address), node, metadata=self.auth.sign(method), kind=kind)

    async def grant_tokens(self, address: str, n: int, iteration: int) -> None:
        method = f"/{PEER_SERVICE}/GrantTokens"
        stub = self._channel(address).unary_unary(method, request_serializer=pb.TokenGrant.SerializeToString,
                                                  response_deserializer=pb.TokenReply.FromString)
        await rpc(stub(pb.TokenGrant(sender=self.node_id, run_id=self.cfg.run_id, tokens=n, iteration=max(iteration, 0)),
                       metadata=self.auth.sign(method), timeout=self.cfg.rpc_timeout))

    async def notice_trainer(self, address: str, tag: str, state: int, iteration: int) -> int:
        """Tell a peer our trainer's state in run `tag`; returns the peer's iteration (-1: none)."""
        method = f"/{PEER_SERVICE}/NoticeTrainer"
        stub = self._channel(address).unary_unary(method, request_serializer=pb.TrainerNotice.SerializeToString,
                                                  response_deserializer=pb.TrainerNoticeReply.FromString)
        reply = await rpc(stub(pb.TrainerNotice(sender=self.node_id, run_id=self.cfg.run_id, tag=tag, state=state,
                                                iteration=max(iteration, 0)),
                               metadata=self.auth.sign(method), timeout=self.cfg.rpc_timeout))
        return reply.iteration

    def on_trainer_notice(self, n: pb.TrainerNotice) -> int:
        run = self.training
        if run is None or n.tag != run.tag:
            return -1
        return run.on_notice(n.sender, n.state, n.iteration)

    def on_tokens(self, sender: str, n: int) -> None:
        if self.training is not None:
            self.training.on_tokens(sender, n)

    def start_run(self, run) -> None:
        self.training = run
        early, self._early = self._early, []
        for rec in early:
            if rec.kind.partition(":")[2] == run.tag:
                run.on_received(rec)
            else:
                rec.release()

    def end_run(self, run) -> None:
        if self.training is run:
            self.last_training_state = run.state()   # `peerd plan` reads its step times after the run
            self.training = None

    # --- observability ------------------------------------------------------------------------
    def status_message(self) -> cpb.StatusReply:
        now = time.monotonic()
        peers = [cpb.PeerStatus(node_id=m.node_id, address=m.address, state=m.state.value,
                                last_heartbeat_age_s=now - m.last_heard, rtt_ms=m.rtt_s * 1000,
                                incarnation=m.incarnation, device_kind=m.capabilities.get("device_kind", ""),
                                direct=True, **dict(zip(("bad_updates", "flagged_for_s", "last_offence"),
                                                        self.offences.view(m.node_id))))
                 for m in sorted(self.membership.members.values(), key=lambda m: m.node_id)]
        gate = self.gate.state()
        return cpb.StatusReply(node_id=self.node_id, address=self.address, run_id=self.cfg.run_id,
                               uptime_s=now - self.started_mono, protocol_version=PROTOCOL_VERSION,
                               peerd_version=__version__, event_loop=loop_name(), incarnation=self.incarnation,
                               peers=peers, data_dir=str(self.data.path), tls=bool(self.cfg.tls_cert),
                               training_json=json.dumps(self.training.state(), default=str)
                               if self.training is not None else "",
                               last_training_json=json.dumps(self.last_training_state, default=str)
                               if self.last_training_state is not None else "",
                               refused_calls=gate["refused"], rate_limited_calls=gate["rate_limited"],
                               rate_limit_entries=gate["rate_limit_entries"], refusal_log_lines=gate["log_lines"])

    def links_message(self) -> cpb.LinksReply:
        return self.links.links_reply()


def run_daemon(cfg: Config, secret: bytes) -> int:
    """Run the daemon on the configured event loop; returns the process exit code."""
    factory = None
    if cfg.event_loop in ("auto", "uvloop"):
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            if cfg.event_loop == "uvloop":
                raise StartupError("--event-loop uvloop: uvloop is not installed") from None
            log.warning("uvloop is not installed; running on the stock asyncio loop")
    daemon = None

    import torch

    torch.set_num_threads(1)  # the mix is a few large ops; more threads fight the trainer for cores

    async def main() -> None:
        nonlocal daemon
        daemon = Daemon(cfg, secret)
        await daemon.run()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    return 0
