"""Reverse connections (peerd.node.tunnels) between real daemons on loopback: a host started
with `--reachable no` keeps tunnels to its peers, and they reach it only through them. (The NAT'd
lab, where peers truly cannot dial it, and training through tunnels and a relay, are in
tests/test_nat_lab.py.)"""
from __future__ import annotations

import asyncio

import pytest

from peerd.node.tunnels import Pipe, TunnelStats, splice
from tests.daemons import control_status, wait_for
from tests.test_training import swarm

pytestmark = pytest.mark.slow


def test_a_host_that_says_it_cannot_be_dialled_is_reached_through_its_tunnels(daemons):
    ds = swarm(daemons, 3, "t", extra=[])
    # a third host, started last, declares itself unreachable: the others route it through tunnels
    nat = daemons("t-nat", seeds=[ds[0].address], extra=["--reachable", "no"])
    everyone = [*ds, nat]
    ids = {d.node_id for d in everyone}
    wait_for(lambda: all(set(d.peer_states()) == ids - {d.node_id} and
                         set(d.peer_states().values()) == {"alive"} for d in everyone), 30, "a full swarm")
    st = wait_for(lambda: (s := control_status(nat)) and len(s["tunnels_to"]) == 3 and s, 30,
                  "tunnels kept to all three peers")
    assert st["reachability"] == "no (set)"
    for d in ds:
        s = wait_for(lambda: (s := control_status(d)) and nat.node_id in s["tunnels_from"] and s, 30,
                     f"{d.node_id} routing the unreachable host through its tunnels")
        assert s["dial_backs_failed"] == 0 and not s["tunnels_to"], s
    # a host that said Hello to others was dialled back (the seed only received Hellos)
    assert control_status(ds[1])["reachability"] == "yes"
    # heartbeats flow through the tunnels: the connections are carried, the host stays alive
    assert wait_for(lambda: int(control_status(nat)["tunnelled_connections"]) >= 3, 20, "connections tunnelled")


def test_a_relay_route_is_dropped_once_the_peer_answers_directly_again():
    """A Hello that failed because the peer was down routes it through a relay; when it is alive
    again and dialable, the route goes (a reachable host holds no tunnel at any relay, so the
    relay could never reach it)."""
    import asyncio

    from peerd.config import Config
    from peerd.node.channels import ChannelPool
    from peerd.node.tunnels import RelayRoutes, TunnelHub
    cfg = Config()
    node = "a" * 32

    async def go():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = ChannelPool(cfg.node, [], None)
        hub = TunnelHub(cfg, pool, lambda n: None)
        routes = RelayRoutes(cfg, pool, None, hub, lambda target: [("b" * 32, "127.0.0.1:9")])
        routes.on_dial_failed(node, address)
        await asyncio.sleep(0.2)
        assert pool.routed(address) and routes.relayed() == [node]
        routes.on_alive(node)
        await asyncio.sleep(0.5)
        routed, relayed = pool.routed(address), routes.relayed()
        server.close()
        await routes.close()
        await pool.close()
        return routed, relayed
    assert asyncio.run(go()) == (False, [])


def _queue_pipe(inbox: asyncio.Queue, outbox: asyncio.Queue, write_delay: float = 0.0, fail_after: int | None = None):
    """A Pipe over two queues: reads `inbox` (None: closed), writes `outbox`, each write taking
    `write_delay` (a slow next hop) and failing after `fail_after` writes (a hop that broke)."""
    written = 0

    async def write(data: bytes) -> None:
        nonlocal written
        if fail_after is not None and written >= fail_after:
            raise ConnectionResetError("the next hop broke")
        await asyncio.sleep(write_delay)
        written += 1
        await outbox.put(data)
    return Pipe(inbox.get, write)


def test_splice_delivers_every_chunk_in_order_before_the_close():
    async def go():
        a_in, a_out, b_in, b_out = (asyncio.Queue() for _ in range(4))
        chunks = [bytes([i]) * 1000 for i in range(20)]
        for c in chunks:
            await a_in.put(c)
        await a_in.put(None)                       # a closes right after its last chunk
        stats = TunnelStats()
        await asyncio.wait_for(splice(_queue_pipe(a_in, a_out), _queue_pipe(b_in, b_out, write_delay=0.01), stats), 10)
        got = [b_out.get_nowait() for _ in range(b_out.qsize())]
        return got, chunks, stats
    got, chunks, stats = asyncio.run(go())
    assert got == chunks                           # the slow hop got all of them before both ends closed
    assert stats.bytes == 20_000 and stats.connections == 1


def test_splice_ends_when_the_next_hop_breaks_with_its_reads_blocked():
    async def go():
        a_in, a_out, b_in, b_out = (asyncio.Queue() for _ in range(4))
        for i in range(50):
            await a_in.put(b"x" * 100)
        await asyncio.wait_for(splice(_queue_pipe(a_in, a_out), _queue_pipe(b_in, b_out, fail_after=3),
                                      TunnelStats()), 10)
        return b_out.qsize()
    assert asyncio.run(go()) == 3                  # and returned (no hang) once the write failed
