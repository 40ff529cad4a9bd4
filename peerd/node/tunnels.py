"""Reverse connections for hosts that peers cannot dial (behind NAT or a firewall that drops
inbound connections), and relays between two such hosts (docs/nat.md).

Tunnels. A host B that a peer A cannot dial (A said so in its Hello reply: its dial-back to B's
address failed; or B runs with --reachable no) keeps a few idle `Tunnel` calls open to A
(TunnelKeeper). Each call stands for one TCP connection: A listens on an ephemeral loopback port
for B (TunnelHub) and its ChannelPool dials B's address there, so nothing above the pool changes:
heartbeats, pushes, pulls and probes go to B as they go to any peer. When A's gRPC connects to
that port, A answers one of B's idle calls with `go`; B connects the call to its own tunnel port (a
Peer server on loopback, TLS when B's Peer port is TLS), opens a new idle call, and both ends copy
the connection's bytes until either side closes.

Relays. Two hosts B and C behind different NATs cannot dial each other either way. A reachable
host R started with --relay (its Capabilities say so) holds both their tunnels, since R could not
dial them back. When C's Hello to B fails, C routes B's address to a loopback port of its own
(RelayRoutes); each connection there becomes a Tunnel call to R naming B as `target`, which R
joins to one of B's idle calls at R. R copies bytes it cannot read: the calls inside are TLS from
C's gRPC to B's tunnel port.

One call per connection keeps gRPC's flow control per connection and the control and data
channels on separate TCP connections (each idle call has its own). The calls inside are signed by
their senders and, between non-loopback addresses, carried over TLS end to end, so neither the
tunnel nor a relay adds trust. A lost tunnel is a lost connection, which the existing retries and
the failure detector already handle. Idle calls are bounded by the data plane's keepalive;
opening one, and a connection waiting for one, by rpc_timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from peerd.config import Config
from peerd.net.auth import Authenticator
from peerd.net.membership import Membership
from peerd.net.wirecheck import split_address
from peerd.node.channels import ChannelPool
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.tunnel")

TUNNEL_METHOD = "/peerd.v1.Peer/Tunnel"
MAX_SPARES_PER_PEER = 32       # idle tunnel calls a hub holds for one peer (tunnel_spares is at most 16)


async def dial_back(address: str, timeout: float) -> int:
    """Whether a TCP connection to `address` opens within `timeout` (pb.DialBack): what a Hello's
    caller learns of its reachability (a listening port behind NAT or a firewall that drops inbound
    connections does not answer). Only the connection is tried: nothing is sent on it."""
    hp = split_address(address)
    if hp is None:
        return pb.DIAL_BACK_FAILED
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*hp), timeout)
    except (OSError, asyncio.TimeoutError):
        return pb.DIAL_BACK_FAILED
    writer.close()
    return pb.DIAL_BACK_REACHED


@dataclass
class TunnelStats:
    connections: int = 0          # connections carried (relayed ones counted at the relay)
    bytes: int = 0                # bytes carried, both ways


@dataclass
class Pipe:
    """One end of a carried connection: a socket, or a Tunnel call's messages."""
    read: Callable[[], Awaitable[bytes | None]]      # None: the end closed
    write: Callable[[bytes], Awaitable[None]]
    close: Callable[[], None] = lambda: None


def socket_pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunk: int) -> Pipe:
    """The reader's buffer limit should be `chunk` (start_server/open_connection's `limit`): a
    read returns what is buffered, and fuller reads mean fewer tunnel messages per byte."""
    async def read() -> bytes | None:
        return await reader.read(chunk) or None

    async def write(data: bytes) -> None:
        writer.write(data)
        await writer.drain()
    return Pipe(read, write, writer.close)


def call_pipe(read_frame: Callable[[], Awaitable], write_frame: Callable[[pb.TunnelFrame], Awaitable]) -> Pipe:
    async def read() -> bytes | None:
        while True:
            frame = await read_frame()
            if frame is None or frame is grpc.aio.EOF:
                return None
            if frame.data:
                return frame.data

    async def write(data: bytes) -> None:
        await write_frame(pb.TunnelFrame(data=data))
    return Pipe(read, write)


async def splice(a: Pipe, b: Pipe, stats: TunnelStats) -> None:
    """Copy each end's bytes to the other until either closes, then close both (gRPC's
    connections do not half-close)."""
    async def copy(src: Pipe, dst: Pipe) -> None:
        while (data := await src.read()) is not None:
            stats.bytes += len(data)
            await dst.write(data)
    stats.connections += 1
    ways = {asyncio.ensure_future(copy(a, b)), asyncio.ensure_future(copy(b, a))}
    try:
        await asyncio.wait(ways, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in ways:
            t.cancel()
        for t in ways:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for end in (a, b):
            with contextlib.suppress(Exception):
                end.close()


def _open_call(pool: ChannelPool, auth: Authenticator, address: str, node: str) -> tuple[grpc.aio.Channel, object]:
    """A Tunnel call to `node` at `address`, on a connection of its own."""
    channel = pool.open(address)
    call = channel.stream_stream(TUNNEL_METHOD, request_serializer=pb.TunnelFrame.SerializeToString,
                                 response_deserializer=pb.TunnelFrame.FromString)(
        metadata=auth.sign(TUNNEL_METHOD, node, None))
    return channel, call


@dataclass
class _Spare:
    """An idle call of `node`, waiting to carry the next connection to it; `taken` gets the
    other end (a Pipe) and a future to resolve when the connection is over."""
    node: str
    taken: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class TunnelHub:
    """The reachable end: serves peers' Tunnel calls, routes our dials of them through them, and
    relays between two of them with --relay."""

    def __init__(self, cfg: Config, pool: ChannelPool, address_of: Callable[[str], str | None]) -> None:
        self.cfg = cfg
        self.pool = pool
        self.address_of = address_of                      # a member's address, from the membership table
        self.stats = TunnelStats()
        self.relayed = TunnelStats()
        self.relaying = 0                                 # relayed connections open now
        self._spares: dict[str, list[_Spare]] = {}
        self._listeners: dict[str, tuple[asyncio.Server, str]] = {}   # node -> (listener, routed address)
        self._waiters: dict[str, asyncio.Event] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def tunnelled(self) -> list[str]:
        """Peers we reach through their tunnels."""
        return sorted(self._listeners)

    def holds(self, node: str) -> bool:
        return node in self._listeners

    async def serve(self, node: str, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """One Tunnel call of `node`: idle until a connection to it needs it, then that connection;
        or, naming a target, a connection to be relayed to that target."""
        first = await anext(request_iterator, None)
        if first is None:
            return
        if first.target:
            await self._relay(node, first.target, call_pipe(lambda: anext(request_iterator, None), context.write),
                              context)
            return
        address = self.address_of(node)
        if address is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: Tunnel from {node}, which is no member here: say Hello first")
        if len(self._spares.get(node, [])) >= MAX_SPARES_PER_PEER:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peerd: {MAX_SPARES_PER_PEER} idle tunnels of {node} open here already")
        await self._listen(node, address)
        spare = _Spare(node)
        self._spares.setdefault(node, []).append(spare)
        self._waiters.setdefault(node, asyncio.Event()).set()
        ended = asyncio.ensure_future(anext(request_iterator, None))   # the caller closing it idle
        ended.add_done_callback(lambda t: t.cancelled() or t.exception())   # an ended call's error is no news
        try:
            await asyncio.wait({spare.taken, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not spare.taken.done():
                spare.taken.cancel()
            with contextlib.suppress(ValueError):
                self._spares.get(node, []).remove(spare)
        if spare.taken.cancelled() or not spare.taken.done():
            ended.cancel()
            return
        other, over, stats = spare.taken.result()
        try:
            if ended.done() and (ended.cancelled() or ended.exception() is not None or ended.result() is None):
                other.close()        # it closed just as it was taken
                return
            pending: asyncio.Future | None = ended

            async def read():
                # The read already waiting is the call's first after `go`: cancelling a read of
                # a gRPC request stream would end the call.
                nonlocal pending
                if pending is not None:
                    first_read, pending = pending, None
                    return await first_read
                return await anext(request_iterator, None)
            await context.write(pb.TunnelFrame(go=True))
            await splice(call_pipe(read, context.write), other, stats)
        finally:
            if not over.done():
                over.set_result(None)

    async def _relay(self, caller: str, target: str, mine: Pipe, context: grpc.aio.ServicerContext) -> None:
        n = self.cfg.node
        if not n.relay:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "peerd: this daemon does not relay (--relay)")
        if n.relay_budget_bytes and self.relayed.bytes >= n.relay_budget_bytes:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peerd: relay budget of {n.relay_budget_bytes} bytes spent")
        if self.relaying >= n.relay_max_connections:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peerd: {self.relaying} relayed connections open (relay_max_connections)")
        spare = await self._take(target)
        if spare is None:
            log.info("relay from %s to %s: no idle tunnel of the target within %.0fs", caller, target,
                     self.cfg.node.rpc_timeout)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peerd: no tunnel of {target[:40]} here to relay to")
        over = asyncio.get_running_loop().create_future()
        spare.taken.set_result((mine, over, self.relayed))
        self.relaying += 1
        try:
            await context.write(pb.TunnelFrame(go=True))      # the caller: connected
            await over
        finally:
            self.relaying -= 1

    async def _listen(self, node: str, address: str) -> None:
        """A loopback port for `node`'s connections; the pool dials its address there."""
        async with self._locks.setdefault(node, asyncio.Lock()):   # its spares arrive together
            held = self._listeners.get(node)
            if held is not None and held[1] == address:
                return
            if held is not None:
                self.forget(node)

            async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                spare = await self._take(node)
                if spare is None:
                    log.info("no tunnel of %s free within %.1fs: connection refused", node, self.cfg.node.rpc_timeout)
                    writer.close()
                    return
                spare.taken.set_result((socket_pipe(reader, writer, self.cfg.node.tunnel_chunk_bytes),
                                        asyncio.get_running_loop().create_future(), self.stats))
            server = await asyncio.start_server(accepted, "127.0.0.1", 0, limit=self.cfg.node.tunnel_chunk_bytes)
            self._listeners[node] = (server, address)
            self.pool.route(address, f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
            log.info("peer %s at %s cannot be dialled from here: reaching it through its tunnels", node, address)

    async def _take(self, node: str) -> _Spare | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.node.rpc_timeout
        while True:
            for spare in self._spares.get(node, []):
                if not spare.taken.done():
                    self._spares[node].remove(spare)
                    return spare
            left = deadline - loop.time()
            if left <= 0:
                return None
            event = self._waiters.setdefault(node, asyncio.Event())
            event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), left)

    def forget(self, node: str) -> None:
        """`node` is gone (left, forgotten): its listener closes and the pool dials it directly again."""
        held = self._listeners.pop(node, None)
        if held is not None:
            server, address = held
            server.close()
            self.pool.route(address, None)
        for spare in self._spares.pop(node, []):
            spare.taken.cancel()

    async def close(self) -> None:
        for node in list(self._listeners):
            self.forget(node)


class TunnelKeeper:
    """The end peers cannot dial: keeps `tunnel_spares` idle Tunnel calls open to each peer that
    said so, and connects each call that gets `go` to our own tunnel port."""

    def __init__(self, cfg: Config, pool: ChannelPool, auth: Authenticator) -> None:
        self.cfg = cfg
        self.pool = pool
        self.auth = auth
        self.local = ""                                   # our tunnel port: host:port on loopback
        self.stats = TunnelStats()
        self.dial_backs: dict[str, int] = {}              # node -> its last dial-back of us (pb.DialBack)
        self._peers: dict[str, str] = {}                  # node -> address we keep tunnels to
        self._tasks: dict[str, set[asyncio.Task]] = {}
        self._delay: dict[str, float] = {}

    def kept(self) -> list[str]:
        """Peers we keep tunnels to."""
        return sorted(self._peers)

    def on_dial_back(self, node: str, address: str, result: int) -> None:
        """A peer answered our Hello, saying whether it could dial us: keep tunnels to it when it
        could not (or always, with reachable = no; never with yes). A peer we reached through a
        tunnel or a relay cannot hold ours: it is no more reachable than we are."""
        if self.pool.routed(address):
            return
        if result != pb.DIAL_BACK_UNSPECIFIED:
            self.dial_backs[node] = result
        mode = self.cfg.node.reachable
        if mode == "no" or (mode == "auto" and result == pb.DIAL_BACK_FAILED):
            self.want(node, address)
        elif mode == "auto" and result == pb.DIAL_BACK_REACHED:
            self.drop(node)

    def reachability(self) -> str:
        """Can peers dial this host: "yes", "no", "partly" (some can), "unknown" (nobody said yet);
        as set when --reachable is yes or no."""
        mode = self.cfg.node.reachable
        if mode != "auto":
            return f"{mode} (set)"
        results = set(self.dial_backs.values())
        if not results:
            return "unknown"
        if results == {pb.DIAL_BACK_REACHED}:
            return "yes"
        return "no" if results == {pb.DIAL_BACK_FAILED} else "partly"

    def dial_back_counts(self) -> tuple[int, int]:
        values = list(self.dial_backs.values())
        return values.count(pb.DIAL_BACK_REACHED), values.count(pb.DIAL_BACK_FAILED)

    def want(self, node: str, address: str) -> None:
        if not self.local or self._peers.get(node) == address:
            return
        self.drop(node)
        self._peers[node] = address
        log.info("peer %s cannot dial this host: keeping %d tunnels to it at %s", node, self.cfg.node.tunnel_spares,
                 address)
        for _ in range(self.cfg.node.tunnel_spares):
            self._spawn(node)

    def drop(self, node: str) -> None:
        self._peers.pop(node, None)
        for t in self._tasks.pop(node, set()):
            t.cancel()

    def _spawn(self, node: str) -> None:
        task = asyncio.get_running_loop().create_task(self._spare(node), name=f"tunnel to {node}")
        self._tasks.setdefault(node, set()).add(task)
        task.add_done_callback(lambda t: self._tasks.get(node, set()).discard(t))

    async def _spare(self, node: str) -> None:
        address = self._peers.get(node)
        if address is None:
            return
        channel, call = _open_call(self.pool, self.auth, address, node)
        taken = False
        try:
            await asyncio.wait_for(call.write(pb.TunnelFrame()), self.cfg.node.rpc_timeout)
            frame = await call.read()      # idle until `go`; keepalive ends it if the link dies
            if frame is grpc.aio.EOF or not frame.go:
                raise ConnectionError(f"tunnel closed by {node} ({await call.code()})")
            taken = True
            self._delay.pop(node, None)
            if node in self._peers:
                self._spawn(node)          # a new idle call for the next connection
            host, _, port = self.local.rpartition(":")
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port),
                                                                        limit=self.cfg.node.tunnel_chunk_bytes),
                                                    self.cfg.node.rpc_timeout)
            await splice(socket_pipe(reader, writer, self.cfg.node.tunnel_chunk_bytes),
                         call_pipe(call.read, call.write), self.stats)
        except (grpc.aio.AioRpcError, ConnectionError, OSError, asyncio.TimeoutError) as e:
            if not taken and node in self._peers:
                delay = min(max(self._delay.get(node, 0.0) * 2, self.cfg.node.tunnel_retry),
                            self.cfg.membership.connect_retry_max)
                self._delay[node] = delay
                what = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e) or type(e).__name__
                log.debug("tunnel to %s: %s; again in %.1fs", node, what, delay)
                await asyncio.sleep(delay)
                if node in self._peers:
                    self._spawn(node)
        finally:
            call.cancel()
            await channel.close()

    async def close(self) -> None:
        for node in list(self._peers):
            self.drop(node)


class RelayRoutes:
    """Peers we cannot dial and who hold no tunnel to us: reached through a relay (a member whose
    capabilities say --relay) that holds their tunnels. Set up when our Hello or heartbeat to one fails."""

    def __init__(self, cfg: Config, pool: ChannelPool, auth: Authenticator, hub: TunnelHub,
                 relays: Callable[[str], list[tuple[str, str]]]) -> None:
        self.cfg = cfg
        self.pool = pool
        self.auth = auth
        self.hub = hub
        self.relays = relays                          # relays(target) -> [(relay node, its address)]
        self.stats = TunnelStats()
        self._routes: dict[str, tuple[asyncio.Server, str]] = {}   # target -> (listener, its address)
        self._good: dict[str, str] = {}               # target -> the relay that last carried a connection
        self._tasks: set[asyncio.Task] = set()

    def relayed(self) -> list[str]:
        return sorted(self._routes)

    def on_dial_failed(self, node: str, address: str) -> None:
        """Our Hello or heartbeat to `node` at `address` failed: where relays exist and nothing
        routes it yet, route it through them. (A heartbeat counts: a peer whose own Hello reached
        us through a relay is alive before any Hello of ours to it could fail.)"""
        if (not node or node in self._routes or self.hub.holds(node) or self.pool.routed(address)
                or not self.relays(node)):
            return
        self._spawn(self._route(node, address), f"relay route {node}")

    def on_alive(self, node: str) -> None:
        """A peer we route through a relay is alive: it may simply have been down when our Hello
        failed, and be dialable again (a reachable host holds no tunnel at any relay, so the relay
        route would never reach it)."""
        if node in self._routes:
            self._spawn(self._direct_again(node), f"direct check {node}")

    async def _direct_again(self, node: str) -> None:
        held = self._routes.get(node)
        if held is not None and await dial_back(held[1], self.cfg.node.dial_back_timeout) == pb.DIAL_BACK_REACHED:
            log.info("peer %s at %s answers directly again: no relay for it", node, held[1])
            self.forget(node)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _route(self, node: str, address: str) -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            mine = socket_pipe(reader, writer, self.cfg.node.tunnel_chunk_bytes)
            relays = self.relays(node)
            relays.sort(key=lambda r: r[0] != self._good.get(node))
            for relay, relay_address in relays:
                channel, call = _open_call(self.pool, self.auth, relay_address, relay)
                try:
                    await asyncio.wait_for(call.write(pb.TunnelFrame(target=node)), self.cfg.node.rpc_timeout)
                    frame = await asyncio.wait_for(call.read(), 2 * self.cfg.node.rpc_timeout)
                    if frame is grpc.aio.EOF or not frame.go:
                        raise ConnectionError(f"{relay} did not connect us ({await call.code()})")
                    self._good[node] = relay
                    await splice(mine, call_pipe(call.read, call.write), self.stats)
                    return
                except (grpc.aio.AioRpcError, ConnectionError, OSError, asyncio.TimeoutError) as e:
                    what = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    log.info("relay %s to %s: %s", relay, node, what)   # a connection lost: worth a line
                finally:
                    call.cancel()
                    await channel.close()
            writer.close()
            await self._direct_again(node)     # no relay holds its tunnels: maybe it needs none
        if node in self._routes or self.hub.holds(node) or self.pool.routed(address):
            return
        server = await asyncio.start_server(accepted, "127.0.0.1", 0, limit=self.cfg.node.tunnel_chunk_bytes)
        self._routes[node] = (server, address)
        self.pool.route(address, f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        log.info("peer %s at %s cannot be dialled and keeps no tunnel to this host: reaching it through relays %s",
                 node, address, ", ".join(r for r, _ in self.relays(node)))

    def forget(self, node: str) -> None:
        held = self._routes.pop(node, None)
        if held is not None:
            server, address = held
            server.close()
            if not self.hub.holds(node):
                self.pool.route(address, None)

    async def close(self) -> None:
        for node in list(self._routes):
            self.forget(node)
        for t in list(self._tasks):
            t.cancel()


class Tunnels:
    """A daemon's three parts of reaching past NAT, wired to its membership table: the hub (peers'
    tunnels to us, relaying), the keeper (our tunnels to peers), the relay routes."""

    def __init__(self, cfg: Config, pool: ChannelPool, auth: Authenticator, table: Membership) -> None:
        self.cfg = cfg
        self.table = table
        self.pool = pool
        self.hub = TunnelHub(cfg, pool, lambda node: (m := table.get(node)) and m.address)
        self.keeper = TunnelKeeper(cfg, pool, auth)
        self.relays = RelayRoutes(cfg, pool, auth, self.hub, self._relays_for)

    def _relays_for(self, target: str) -> list[tuple[str, str]]:
        """Live members that relay and that we dial directly."""
        return [(m.node_id, m.address) for m in self.table.members.values()
                if m.capabilities.get("relay") and m.node_id != target and m.state.value == "alive"
                and not self.pool.routed(m.address)]

    def on_transition(self, tr) -> None:
        """A peer that left or was forgotten needs no tunnels either way; with --reachable no, every
        live peer gets ours (also one that said Hello to us first, so was never asked to dial back)."""
        if tr.new is None or tr.new.value == "left":
            self.keeper.drop(tr.node_id)
            self.hub.forget(tr.node_id)
            self.relays.forget(tr.node_id)
        elif tr.new.value == "alive":
            self.relays.on_alive(tr.node_id)
        if tr.new is not None and tr.new.value == "alive" and self.cfg.node.reachable == "no":
            m = self.table.get(tr.node_id)
            if m is not None and not self.pool.routed(m.address):   # a relayed peer cannot hold ours
                self.keeper.want(tr.node_id, m.address)

    def status(self) -> dict:
        """The StatusReply fields of reachability, tunnels and relaying."""
        reached, failed = self.keeper.dial_back_counts()
        carried = (self.keeper.stats, self.hub.stats, self.relays.stats)
        return dict(reachability=self.keeper.reachability(), tunnels_to=self.keeper.kept(),
                    tunnels_from=self.hub.tunnelled(), dial_backs_reached=reached, dial_backs_failed=failed,
                    tunnelled_connections=sum(s.connections for s in carried),
                    tunnelled_bytes=sum(s.bytes for s in carried), relayed_to=self.relays.relayed(),
                    relay=self.cfg.node.relay, relayed_connections=self.hub.relayed.connections,
                    relayed_bytes=self.hub.relayed.bytes)

    async def close(self) -> None:
        await self.keeper.close()
        await self.hub.close()
        await self.relays.close()
