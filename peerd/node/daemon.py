"""The peerd daemon: the composition root of one host's node.

It builds the node's components and wires them, each taking only what it needs:

    channels.ChannelPool            one gRPC channel per peer address
    peer_client.PeerClient          every Peer RPC we make, signed and bounded
    membership_service              Hello, heartbeats, gossip, Leave; the failure detector's loop
    links_service.LinkService       link probes, the link matrix and its gossip
    mdns_service                    discovery on the local network
    tunnels                         reverse connections for hosts peers cannot dial (NAT), relays
    run_host.RunHost                the current training run (peerd.node.run) and what reaches it
    peer_service / control_service  the gRPC servers' handlers (Peer on TCP, Control on a unix socket)

All waits are bounded by Config values.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import logging
import os
import signal
import socket
import time

import grpc

from peerd import PROTOCOL_VERSION, __version__, workers
from peerd.config import Config
from peerd.net import pki
from peerd.net.auth import AuthInterceptor, Authenticator, RefusalGate, secrets_of
from peerd.net.dataplane import PULL_METHOD, PUSH_METHOD, DataPlane, grpc_options
from peerd.net.discovery import DiscoveryError
from peerd.net.wirecheck import is_loopback_host, is_unspecified_host, strict_json_value
from peerd.node import capabilities, mdns_service, swarm_view
from peerd.node.channels import ChannelPool, Tls
from peerd.node.control_service import ControlService
from peerd.node.convert import revocation_from_pb, split_host_port
from peerd.node.events import EventLog
from peerd.node.identity import REVOKED_FILE, DataDir, slot_dir
from peerd.node.links_service import LinkService
from peerd.node.loopwatch import LoopWatch
from peerd.node.membership_service import Identity, MembershipService, make_table
from peerd.node.metrics import MetricsError, MetricsServer
from peerd.node.offences import PeerOffences
from peerd.node.peer_client import PeerClient
from peerd.node.peer_service import PeerService
from peerd.node.run.env import RunEnv
from peerd.node.run_host import RunHost
from peerd.node.tunnels import Tunnels
from peerd.v1 import control_pb2 as cpb

log = logging.getLogger("peerd.daemon")

PEER_SERVICE = "peerd.v1.Peer"
CONTROL_SERVICE = "peerd.v1.Control"
UNIX_PATH_MAX = 107
FLOOD_CALLS = 10            # refused calls within one heartbeat interval that count as a flood


def release_memory() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim; nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
        self.started_mono = time.monotonic()
        self.caps = capabilities.detect(site=cfg.node.site, relay=cfg.node.relay)
        self.me: Identity | None = None
        self.members: MembershipService | None = None
        self.links: LinkService | None = None
        self.runs: RunHost | None = None
        self.dataplane: DataPlane | None = None
        self.gate: RefusalGate | None = None
        self.offences: PeerOffences | None = None
        self.channels: ChannelPool | None = None
        self.discovery = None                       # MdnsDiscovery while mDNS runs
        self.events: EventLog | None = None
        self.tls: Tls | None = None
        self._flooded = False
        self.tls_on = False
        self.trust_name = ""
        self.loop_watch = LoopWatch()
        self.metrics: MetricsServer | None = None   # --metrics-port: Prometheus endpoint (peerd.node.metrics)
        self._server: grpc.aio.Server | None = None
        self._loopback_server: grpc.aio.Server | None = None   # plaintext on loopback beside a TLS wildcard
        self._tunnel_server: grpc.aio.Server | None = None     # where our tunnels connect (peerd.node.tunnels)
        self.tunnels: Tunnels | None = None
        self._interceptor: AuthInterceptor | None = None
        self._control: grpc.aio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        sock = cfg.control_socket
        if len(str(sock)) > UNIX_PATH_MAX:
            raise StartupError(f"control socket path {sock} is {len(str(sock))} characters; unix sockets "
                               f"allow {UNIX_PATH_MAX}: choose a shorter --data-dir")
        self.data.open()
        creds, trust, revoked = self._identity()
        node_id, incarnation = creds.node_id, self.data.next_incarnation()
        self._remove_stale_slots(node_id)
        auth = Authenticator(creds, trust, revoked, cfg.auth.max_skew, cfg.auth.replay_cache, cfg.auth.max_sources)
        self.tls = Tls(cfg.auth.tls, trust.pem, creds.key_pem, creds.cert_pem)
        self.gate = RefusalGate(cfg.auth.refusal_burst, cfg.auth.refusal_rate, cfg.auth.max_sources,
                                cfg.auth.log_every)
        table = make_table(node_id, cfg)
        self.events = EventLog(self.data.path / "events.jsonl", node_id)
        self.offences = PeerOffences(cfg.train.peer_max_offences, cfg.train.peer_cooldown, cfg.membership.max_peers)
        # The run host is built next (it needs the data plane); these calls reach it once it exists.
        self.dataplane = DataPlane(cfg, node_id, cfg.node.run_id, on_received=lambda rec: runs.on_received(rec),
                                   source=lambda *a: runs.pull_source(*a))
        self.links = LinkService(cfg, node_id, table, self.dataplane.seal)
        self.channels = ChannelPool(cfg.node, grpc_options(cfg), self.tls)
        client = PeerClient(cfg, node_id, auth, self.channels, self.dataplane, self.links.observe_push)
        self.links.client = client
        env = RunEnv(cfg=cfg, node_id=node_id, data_dir=self.data.path, caps=self.caps, membership=table,
                     peers=client, link_matrix=self.links.matrix, offences=self.offences,
                     set_layout=self.dataplane.set_layout, report_offence=lambda peer, what: runs.report_offence(peer, what))
        self.runs = runs = RunHost(env, self.offences, self.events)
        self.dataplane.screen = runs.screen
        self.dataplane.on_offence = runs.report_offence

        self._interceptor = AuthInterceptor(auth, self.gate, max_request=cfg.node.max_control_message_bytes,
                                            streamed=frozenset({PUSH_METHOD}), unbound=frozenset({PULL_METHOD}))
        address = self._bind()
        self.me = Identity(node_id, incarnation, address, cfg.node.run_id, self.caps)
        self.members = MembershipService(cfg, self.me, table, client, auth, self.channels, self.links)
        self.tunnels = tunnels = Tunnels(cfg, self.channels, auth, table)
        tunnels.keeper.local = self._bind_tunnel_port()
        self.members.listeners += [self._log_transition, self.links.on_transition, runs.on_transition,
                                   tunnels.on_transition]
        self.members.on_restart = runs.on_restart
        self.members.on_dial_back = tunnels.keeper.on_dial_back
        self.members.on_dial_failed = tunnels.relays.on_dial_failed
        self.dataplane.activity.fn = self.members.activity
        self.dataplane.update_activity.fn = runs.update_arriving
        self.dataplane.on_update_lost = runs.update_lost
        self.dataplane.sink_for = runs.sink_for
        handlers = {**PeerService(cfg, self.members, runs, tunnels.hub).method_handlers(),
                    **self.dataplane.method_handlers()}
        for server in self._peer_servers():
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PEER_SERVICE, handlers),))

        self._control = grpc.aio.server(options=grpc_options(cfg))
        control = ControlService(runs, self.status_message, self.links.links_reply, stop=self.stop,
                                 swarm=lambda: swarm_view.swarm_reply(
                                     self.status_message, self.links.links_reply, runs, table, client, node_id,
                                     cfg.node.run_id, cfg.node.swarm_timeout),
                                 revoke=self.revoke)
        self._control.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(CONTROL_SERVICE, control.method_handlers()),))
        sock.unlink(missing_ok=True)
        if not self._control.add_insecure_port(f"unix://{sock}"):
            raise StartupError(f"cannot create control socket {sock}")
        for server in self._peer_servers():
            await server.start()
        await self._control.start()
        os.chmod(sock, 0o600)
        if cfg.node.metrics_port:
            try:
                self.metrics = MetricsServer(self)
            except MetricsError as e:
                raise StartupError(f"{e} (--metrics-port, --metrics-address)") from None
        now = time.monotonic()
        for seed in cfg.node.peers:
            table.add_candidate(seed, "seed", now, permanent=True)
        self.events("start", address=address, incarnation=incarnation, loop=loop_name())
        log.info("node %s (incarnation %d) serving peers on %s (%s), control on %s, loop %s, run %r; members are "
                 "certified by %s", node_id, incarnation, address, "TLS" if self.tls_on else "plaintext", sock,
                 loop_name(), cfg.node.run_id, self.trust_name)
        self._spawn(self.loop_watch.run(), "loop watch")
        self._spawn(self.members.run(), "membership")
        self._spawn(self._flush_refusals(), "refusal log")
        self._spawn(self.links.run(), "link probes")
        self._spawn(self._discover(), "mdns")

    def _identity(self) -> tuple[pki.Credentials, pki.ClusterTrust, pki.Revocations]:
        """This node's key and certificate, the CAs it trusts, the revocations it knows. With
        --tls-cert/--tls-key/--tls-ca: the operator's CA; else the CA derived from the secret, which
        certifies the data dir's node key."""
        n, path = self.cfg.node, self.data.path
        try:
            if n.tls_cert:
                trust = pki.ClusterTrust.from_files(n.tls_ca)
                creds = pki.Credentials.from_files(n.tls_cert, n.tls_key, trust)
                self.data.record_node_id(creds.node_id)
                self.trust_name = f"CA {n.tls_ca}"
            else:
                trust = pki.ClusterTrust.from_secrets(secrets_of(self._secret))
                creds = pki.Credentials.issued(trust, self.data.node_key())
                self.trust_name = "the cluster secret"
            revoked = pki.Revocations(trust, path / REVOKED_FILE, self.cfg.auth.max_revocations)
        except pki.PkiError as e:
            raise StartupError(str(e)) from None
        if creds.node_id in revoked:
            rev = revoked.by_node[creds.node_id]
            raise StartupError(f"this node ({creds.node_id}) is revoked ({rev.reason or 'no reason given'}); give it a "
                               f"new key with `peerd keys rotate --data-dir {path}`")
        return creds, trust, revoked

    def server_options(self, plaintext_loopback: bool = False) -> list:
        """The data plane's options, and bounds on what one connection may have in flight.

        A plaintext port on loopback (with --tls auto) gets a fixed receive window per stream
        (`auth_plaintext_window`) instead of gRPC's BDP-grown one: whoever can reach it, any user of
        the host, can send a call's body before it is refused, and windows grown to megabytes let
        128 concurrent refused calls hold ~1 GB. On loopback a small window costs little throughput
        (no round trip to wait for); on other links BDP probing stays: they are TLS, where nobody
        without a certificate of the cluster gets a stream at all."""
        options = [*grpc_options(self.cfg), ("grpc.max_concurrent_streams", self.cfg.auth.max_streams_per_connection)]
        if plaintext_loopback:
            options = [o for o in options if o[0] != "grpc.http2.bdp_probe"]
            options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", self.cfg.auth.plaintext_window)]
        return options

    def _new_server(self, plaintext_loopback: bool) -> grpc.aio.Server:
        return grpc.aio.server(interceptors=[self._interceptor], options=self.server_options(plaintext_loopback),
                               maximum_concurrent_rpcs=self.cfg.auth.max_concurrent_calls)

    def _peer_servers(self) -> list[grpc.aio.Server]:
        return [s for s in (self._server, self._loopback_server, self._tunnel_server) if s is not None]

    def _bind_tunnel_port(self) -> str:
        """The Peer service again, on an ephemeral loopback port, where the tunnels we keep to peers
        that cannot dial us connect (peerd.node.tunnels): TLS when our Peer port is TLS, since
        the peers dial our address as TLS through the tunnel. None with --reachable yes."""
        if self.cfg.node.reachable == "yes":
            return ""
        self._tunnel_server = server = self._new_server(False)
        port = server.add_secure_port("127.0.0.1:0", self.tls.server_credentials()) if self.tls_on \
            else server.add_insecure_port("127.0.0.1:0")
        if not port:
            raise StartupError("cannot listen on a loopback port for tunnels (--reachable yes turns them off)")
        return f"127.0.0.1:{port}"

    def _bind(self) -> str:
        """Listen on cfg.node.listen (with TLS unless loopback, or as --tls says); the address peers
        dial (the advertised one, or the bound one)."""
        n = self.cfg.node
        host, port = split_host_port(n.listen, allow_zero=True)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if port and (held := port_held(host, port)):
            raise StartupError(f"cannot listen on {n.listen}: {held} (another peerd, or another program, "
                               f"listens there: `ss -ltnp sport = :{port}` names it)")
        self.tls_on = self.tls.wanted(host)
        self._server = server = self._new_server(not self.tls_on and is_loopback_host(host))
        try:
            bound = server.add_secure_port(bind, self.tls.server_credentials()) if self.tls_on \
                else server.add_insecure_port(bind)
        except RuntimeError as e:
            raise StartupError(f"cannot listen on {n.listen}: {e}") from None
        if not bound:
            raise StartupError(f"cannot listen on {n.listen} (address in use or not on this host?)")
        if self.tls_on and is_unspecified_host(host) and not self.tls.wanted("127.0.0.1"):
            # Every interface with TLS, and loopback in plaintext as auto says, by a server of its
            # own (its own window): daemons on this host dial 127.0.0.1, and the more specific
            # socket takes those connections. (gRPC listens dual-stack on a wildcard where it can.)
            self._loopback_server = loop = self._new_server(True)
            v4 = _try_bind(loop, f"127.0.0.1:{bound}")
            v6 = _try_bind(loop, f"[::1]:{bound}") if has_ipv6_loopback() else 0
            if not (v4 or v6):
                self._loopback_server = None
                log.warning("could not also listen in plaintext on 127.0.0.1:%d: daemons on this host must dial "
                            "a non-loopback address of it (or run with --tls on everywhere)", bound)
        address = n.advertise_address or f"{bind.rsplit(':', 1)[0]}:{bound}"
        if self.channels.secure(address) != self.tls_on:
            log.warning("peers dial %s %s but this daemon listens %s on %s: set --tls on (or off) on every "
                        "daemon, or advertise an address of the same kind", address,
                        "with TLS" if self.channels.secure(address) else "in plaintext",
                        "with TLS" if self.tls_on else "in plaintext", n.listen)
        return address

    def revoke(self, request: cpb.RevokeRequest) -> tuple[bool, str]:
        """A revocation from `peerd keys revoke`: (added, why not)."""
        rev = revocation_from_pb(request)
        if rev.node in self.members.revoked:
            return False, ""
        if not self.members.revoked.trust.verify_revocation(rev):
            return False, "the revocation is not signed by this cluster's CA (another secret or CA key?)"
        if rev.node == self.me.node_id:
            log.warning("this node is revoked: it keeps running until it stops, and will not start again")
        return bool(self.members.revoke([rev], "from `peerd keys revoke`")), ""

    async def _discover(self) -> None:
        disc, why = mdns_service.plan(self.cfg, self.me, self.members.table)
        if disc is None:
            log.info("%s", why)
            return
        self.discovery = disc          # set first: shutdown stops it even while it starts
        try:
            await disc.start()
        except DiscoveryError as e:
            self.discovery = None
            log.warning("mDNS discovery is off: %s; --peer seeds and gossip still work", e)

    async def _flush_refusals(self) -> None:
        """Summary lines for refused sources (a flood that stopped still gets its summary); and
        once a flood has stopped, the memory its refused calls held goes back to the system
        (glibc keeps freed memory in its arenas otherwise: a flood's peak stayed the daemon's size)."""
        seen = 0
        while True:
            self.gate.flush()
            refused = self.gate.refused + self.gate.rate_limited
            if refused == seen and self._flooded:
                release_memory()
                self._flooded = False
            elif refused - seen >= FLOOD_CALLS:
                self._flooded = True
            seen = refused
            await asyncio.sleep(self.cfg.membership.heartbeat_interval)

    def _log_transition(self, tr) -> None:
        old = tr.old.value if tr.old else "new"
        new = tr.new.value if tr.new else "forgotten"
        self.events("peer", peer=tr.node_id, old=old, new=new)

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
                await asyncio.wait_for(self.shutdown(), self.cfg.node.shutdown_timeout)
            except TimeoutError:
                log.warning("shutdown took longer than shutdown_timeout (%.1fs); forcing the rest",
                            self.cfg.node.shutdown_timeout)
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
        if self.runs is not None:
            parting.append(self.runs.stop())
        if self.discovery is not None:
            parting.append(self.discovery.stop())   # goodbye packets; bounded by mdns_stop_timeout
        if self.members is not None and self._server is not None:
            parting.append(self.members.leave())
        if self.metrics is not None:
            parting.append(self.metrics.stop())
        await asyncio.gather(*parting, return_exceptions=True)
        self.discovery = None
        if self.links is not None:
            self.links.close()
        if self.members is not None:
            self.members.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=cfg.node.shutdown_grace)
        if self.tunnels is not None:
            await self.tunnels.close()
        for server in (self._server, self._loopback_server, self._tunnel_server, self._control):
            if server is not None:
                await server.stop(cfg.node.shutdown_grace)
        if self.channels is not None:
            await self.channels.close()
        if self.dataplane is not None:
            self.dataplane.close()
        if self._control is not None:
            cfg.control_socket.unlink(missing_ok=True)
        if self.events is not None:
            self.events.close()
        self.data.close()
        log.info("node %s stopped", self.me.node_id if self.me else "?")

    def _remove_stale_slots(self, node_id: str) -> None:
        """Shared-memory slots of this node's earlier incarnations (a daemon killed with SIGKILL
        cannot remove its own). Safe: the data dir's exclusive lock says no other daemon with this
        node id runs."""
        old = self.data.path / "node_id.v1"
        ids = [node_id] + ([old.read_text().strip()] if old.exists() else [])
        stale = [p for i in ids if i for p in slot_dir(self.data.path).glob(f"peerd-{i}-*")]
        for p in stale:
            p.unlink(missing_ok=True)
        if stale:
            log.info("removed %d shared-memory slot file(s) left by an earlier run of this node", len(stale))

    def _force_stop(self) -> None:
        """What must not outlive us when the orderly shutdown ran out of time: the trainer, its
        shared-memory slots, the control socket."""
        if self.runs is not None:
            self.runs.force_stop()
        if self._control is not None:
            self.cfg.control_socket.unlink(missing_ok=True)
        if self.events is not None:
            self.events.close(forced=True)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed: %r", task.get_name(), task.exception(), exc_info=task.exception())

    # --- observability ------------------------------------------------------------------------
    def status_message(self) -> cpb.StatusReply:
        now = time.monotonic()
        table, runs = self.members.table, self.runs
        peers = [cpb.PeerStatus(node_id=m.node_id, address=m.address, state=m.state.value,
                                last_heartbeat_age_s=now - m.last_heard, rtt_ms=m.rtt_s * 1000,
                                incarnation=m.incarnation, device_kind=m.capabilities.get("device_kind", ""),
                                direct=True, **dict(zip(("bad_updates", "flagged_for_s", "last_offence"),
                                                        self.offences.view(m.node_id))))
                 for m in sorted(table.members.values(), key=lambda m: m.node_id)]
        seeds = [cpb.SeedStatus(address=c.address, node_id=c.node_id, failures=c.failures, last_error=c.last_error)
                 for c in table.candidates.values() if c.permanent]
        gate = self.gate.state()
        return cpb.StatusReply(seeds=seeds, node_id=self.me.node_id, address=self.me.address, run_id=self.cfg.node.run_id,
                               uptime_s=now - self.started_mono, protocol_version=PROTOCOL_VERSION,
                               peerd_version=__version__, event_loop=loop_name(), incarnation=self.me.incarnation,
                               peers=peers, data_dir=str(self.data.path), tls=self.tls_on,
                               tls_mode=self.cfg.auth.tls, revoked_nodes=len(self.members.revoked),
                               trust=self.trust_name,
                               training_json=strict_json(runs.training.state()) if runs.training is not None else "",
                               last_training_json=strict_json(runs.last_state) if runs.last_state is not None else "",
                               refused_calls=gate["refused"], rate_limited_calls=gate["rate_limited"],
                               rate_limit_entries=gate["rate_limit_entries"], refusal_log_lines=gate["log_lines"],
                               loop_lag_p99_ms=1000 * self.loop_watch.quantile(0.99),
                               loop_lag_max_ms=1000 * self.loop_watch.worst,
                               loop_lag_own_p99_ms=1000 * self.loop_watch.quantile(0.99, own=True),
                               loop_cpu_wait_s=self.loop_watch.cpu_wait_s,
                               suspect_events=self.members.suspect_events,
                               metrics_url=self.metrics.url if self.metrics is not None else "",
                               **self.tunnels.status())


def has_ipv6_loopback() -> bool:
    """Whether ::1 exists here. Where it does not (a container without IPv6), grpc's own bind
    attempt prints an error line at every daemon start ("Failed to add port ... [::1]") before it
    fails; a plain socket asks quietly."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def port_held(host: str, port: int) -> str:
    """Why `host:port` cannot be ours ("" when it can). gRPC binds with SO_REUSEPORT, so a second
    daemon of the same user on a port in use would bind too, and the kernel would deal the
    connections between the two; a socket without SO_REUSEPORT is refused while anyone listens
    there. With SO_REUSEADDR, as gRPC's own: connections of a killed daemon left in TIME_WAIT on
    the port do not count (a restart after SIGKILL must bind). Errors other than "in use" are left
    to gRPC's own bind."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return ""
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "address already in use"
    return ""


def _try_bind(server: grpc.aio.Server, address: str) -> int:
    """The port bound, or 0 where the address does not exist here (a container without IPv6
    has no [::1]: grpc raises there instead of returning 0)."""
    try:
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0


MMAP_THRESHOLD_MAX = 32 << 20   # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def tune_malloc(frame_bytes: int) -> None:
    """Tensor frames (`frame_bytes` of data each) are bytes objects made and freed by the thousand
    per model, on both sides of every stream. glibc's malloc would raise its mmap threshold past them
    (a dynamic adjustment) and keep freed frames in up to 8 arenas per core: a daemon of a 100 MB
    model held hundreds of MB it was not using. A fixed threshold turns the adjustment off, and two
    arenas bound what is kept. The threshold sits above a frame, so frames are reused from the heap:
    below it (256 KiB, as first set here) every frame was a fresh mmap whose pages the kernel faulted
    in and zeroed: ~45 % of the event loop's samples were memcpy (py-spy, 4 daemons on a complete
    graph of 100 MB models); above it the same runs took 1.2-1.5x less time per iteration at the
    same peak memory (docs/benchmarks.md). Linux/glibc only; a no-op elsewhere."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8
    libc.mallopt(M_MMAP_THRESHOLD, min(MMAP_THRESHOLD_MAX, max(4 << 20, 2 * frame_bytes)))
    libc.mallopt(M_ARENA_MAX, 2)


def strict_json(value) -> str:
    """JSON that strict parsers take: NaN and infinities (a diverged loss) become null."""
    return json.dumps(strict_json_value(value), default=str, allow_nan=False)


def run_daemon(cfg: Config, secret: bytes) -> int:
    """Run the daemon on the configured event loop; returns the process exit code."""
    tune_malloc(cfg.dataplane.chunk_bytes)
    # Files the daemon and its trainer create (shared-memory slots, checkpoints, logs) are the
    # user's alone: the control socket is already 600, so nobody else could use them anyway.
    os.umask(0o077)
    factory = None
    if cfg.node.event_loop in ("auto", "uvloop"):
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:
            if cfg.node.event_loop == "uvloop":
                raise StartupError("--event-loop uvloop: uvloop is not installed") from None
            log.warning("uvloop is not installed; running on the stock asyncio loop")

    import torch

    torch.set_num_threads(1)  # the mix is a few large ops; more threads fight the trainer for cores

    async def main() -> None:
        workers.configure(cfg.node.worker_nice)
        # asyncio.to_thread's pool, as big as asyncio's own default, at the workers' priority
        asyncio.get_running_loop().set_default_executor(workers.pool(min(32, (os.cpu_count() or 1) + 4),
                                                                     "peerd-work"))
        await Daemon(cfg, secret).run()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    return 0
