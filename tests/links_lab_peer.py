"""Drive LinkTable with real gRPC Ping probes across a shaped namespace link (lab test helper).

    python tests/links_lab_peer.py serve PORT
        answers peerd.v1.Peer/Ping (payload in, `reply_bytes` back); nothing else.
    python tests/links_lab_peer.py probe HOST:PORT SECONDS CHANGE_FILE
        runs LinkTable's probes against HOST:PORT for SECONDS and prints one JSON line per estimate
        update; when CHANGE_FILE appears it also sends one 1 MiB "data-plane" transfer (a Ping
        reported with probe=False), as real traffic would reveal a link change.
The Ping here carries no authentication: it is a bare transport for timing, not the daemon.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import grpc

from peerd.config import Config
from peerd.net.links import BW, LinkTable
from peerd.v1 import peer_pb2, peer_pb2_grpc

OPTS = [("grpc.max_receive_message_length", 80 << 20), ("grpc.max_send_message_length", 80 << 20)]


class Echo(peer_pb2_grpc.PeerServicer):
    async def Ping(self, request, context):
        return peer_pb2.PingReply(nonce=request.nonce, payload=b"\0" * min(request.reply_bytes, 1 << 20))


async def serve(port: int) -> None:
    server = grpc.aio.server(options=OPTS)
    peer_pb2_grpc.add_PeerServicer_to_server(Echo(), server)
    server.add_insecure_port(f"0.0.0.0:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination(timeout=60)


async def probe(target: str, seconds: float, change_file: str) -> None:
    cfg = Config(link_min_probe_gap=0.5, link_probe_max_bytes=16 << 20, link_rtt_interval=0.5)
    table = LinkTable("prober", cfg)
    table.add_peer("echo")
    t0 = time.monotonic()
    now = lambda: time.monotonic() - t0  # noqa: E731
    async with grpc.aio.insecure_channel(target, options=OPTS) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        await stub.Ping(peer_pb2.PingRequest(nonce=0), timeout=5)          # connect outside timing
        changed = False

        async def timed(size: int, deadline: float) -> float:
            start = time.monotonic()
            await stub.Ping(peer_pb2.PingRequest(nonce=1, payload=b"\1" * size, reply_bytes=0), timeout=deadline)
            return time.monotonic() - start

        while now() < seconds:
            if not changed and os.path.exists(change_file):
                changed = True
                took = await timed(1 << 20, 10)
                table.observe_transfer("echo", 1 << 20, took, now())
                report(table, now(), "data-plane", 1 << 20)
            for p in table.due_probes(now()):
                try:
                    took = await timed(p.size_bytes, p.deadline_s)
                except grpc.aio.AioRpcError:
                    table.probe_failed(p.peer, p.kind, now())
                    continue
                if p.kind == BW:
                    table.observe_transfer(p.peer, p.size_bytes, took, now(), probe=True)
                else:
                    table.observe_rtt(p.peer, took, now())
                report(table, now(), p.kind, p.size_bytes)
            await asyncio.sleep(max(0.01, min(0.2, (table.next_due(now()) or now() + 0.2) - now())))


def report(table: LinkTable, t: float, kind: str, size: int) -> None:
    est = table.estimate("echo")
    print(json.dumps({"t": round(t, 3), "kind": kind, "size": size, "mbit_s": est.bw.mean * 8 / 1e6,
                      "mbit_s_spread": est.bw.spread * 8 / 1e6, "rtt_ms": est.rtt.mean * 1e3,
                      "bw_samples": est.bw.n}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve(int(sys.argv[2])))
    else:
        asyncio.run(probe(sys.argv[2], float(sys.argv[3]), sys.argv[4]))
