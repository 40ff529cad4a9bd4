"""probe_loop over real gRPC on loopback: one bulk probe at a time, failures back off, stop is bounded."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from peerd.config import Config
from peerd.net.linkprobe import probe_loop
from peerd.net.links import BW, LinkMatrix, LinkTable, render_links
from peerd.v1 import peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class Echo(peer_pb2_grpc.PeerServicer):
    async def Ping(self, request, context):
        return peer_pb2.PingReply(nonce=request.nonce)


async def echo_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 << 20)])
    peer_pb2_grpc.add_PeerServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_probe_loop_measures_serializes_bulk_and_survives_a_dead_peer():
    async def main():
        server, port = await echo_server()
        cfg = Config(link_min_probe_gap=0.2, link_rtt_interval=0.3, link_probe_seconds=0.05,
                     link_probe_max_bytes=4 << 20, link_probe_timeout_min=1.0)
        table = LinkTable("me", cfg)
        matrix = LinkMatrix("me", cfg)
        peers = ["p1", "p2", "p3"]
        for p in peers:
            table.add_peer(p)
        table.add_peer("ghost")                            # nobody listens there
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                            options=[("grpc.max_send_message_length", 8 << 20)])
        dead = grpc.aio.insecure_channel("127.0.0.1:9")   # discard port: refused at once
        bulk_now, bulk_max, calls = 0, 0, {"ghost": 0}

        async def run_probe(p) -> float:
            nonlocal bulk_now, bulk_max
            stub = peer_pb2_grpc.PeerStub(dead if p.peer == "ghost" else channel)
            if p.peer == "ghost":
                calls["ghost"] += 1
            bulk_now += p.kind == BW
            bulk_max = max(bulk_max, bulk_now)
            try:
                start = time.monotonic()
                await stub.Ping(peer_pb2.PingRequest(payload=bytes(p.size_bytes)))
                return time.monotonic() - start
            finally:
                bulk_now -= p.kind == BW

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(3.0, stop.set)
        t0 = time.monotonic()
        await probe_loop(table, run_probe, stop, tick_max=0.1,
                         on_update=lambda peer, kind: matrix.absorb(table))
        stopped_in = time.monotonic() - t0
        await channel.close()
        await dead.close()
        await server.stop(None)
        return table, matrix, bulk_max, calls, stopped_in

    table, matrix, bulk_max, calls, stopped_in = asyncio.run(main())
    assert bulk_max == 1                                    # bulk probes never overlap
    for p in ("p1", "p2", "p3"):
        est = table.estimate(p)
        assert est.bw.n >= 2 and est.bw.mean > 1e6 and est.rtt.n >= 2
    assert table.estimate("ghost").samples == 0
    # 3 s with min gap 0.2 s would allow ~15 attempts per kind; back-off keeps it to a handful.
    assert 2 <= calls["ghost"] <= 8
    assert stopped_in < 3.0 + 1.0
    text = render_links(matrix.to_dict(time.monotonic()))
    assert "p1" in text and "Mbit/s" in text
    assert {(m, t) for m, t in matrix.entries} == {("me", "p1"), ("me", "p2"), ("me", "p3")}
