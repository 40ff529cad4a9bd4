"""Drive LinkTable + probe_loop with real gRPC Ping probes across a namespace link (lab test helper).

    python tests/links_lab_peer.py serve PORT
        answers peerd.v1.Peer/Ping (payload in, `reply_bytes` back); nothing else.
    python tests/links_lab_peer.py probe HOST:PORT SECONDS CHANGE_FILE PROBE_SECONDS
        runs probe_loop against HOST:PORT for SECONDS, printing JSON lines: each probe's start, end
        or error, and the estimate after each update. When CHANGE_FILE appears it also times one
        1 MiB "data-plane" transfer (a Ping reported with probe=False), as real traffic would
        reveal a link change.
The Ping here carries no authentication: it is a bare timed transport, not the daemon.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import grpc

from peerd.config import Config
from peerd.net.linkprobe import probe_loop
from peerd.net.links import LinkTable, Probe
from peerd.v1 import peer_pb2, peer_pb2_grpc

OPTS = [("grpc.max_receive_message_length", 80 << 20), ("grpc.max_send_message_length", 80 << 20)]
T0 = time.monotonic()


def emit(**kw) -> None:
    print(json.dumps({"t": round(time.monotonic() - T0, 3), **kw}), flush=True)


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


async def probe(target: str, seconds: float, change_file: str, probe_seconds: float) -> None:
    cfg = Config(link_min_probe_gap=0.5, link_probe_max_bytes=16 << 20, link_rtt_interval=0.5,
                 link_probe_seconds=probe_seconds, link_probe_timeout_min=3.0)
    table = LinkTable("prober", cfg)
    table.add_peer("echo")
    now = lambda: time.monotonic() - T0  # noqa: E731
    async with grpc.aio.insecure_channel(target, options=OPTS) as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        await stub.Ping(peer_pb2.PingRequest(nonce=0), timeout=5)          # connect outside timing

        async def timed(size: int) -> float:
            start = time.monotonic()
            await stub.Ping(peer_pb2.PingRequest(nonce=1, payload=b"\1" * size, reply_bytes=0))
            return time.monotonic() - start

        async def run_probe(p: Probe) -> float:
            emit(kind=p.kind, event="start", size=p.size_bytes, deadline=p.deadline_s)
            try:
                took = await timed(p.size_bytes)
            except BaseException as e:
                emit(kind=p.kind, event="error", error=type(e).__name__)
                raise
            emit(kind=p.kind, event="end", size=p.size_bytes, took=took)
            return took

        def report(peer: str, kind: str, event: str = "estimate") -> None:
            est = table.estimate(peer)
            emit(kind=kind, event=event, mbit_s=est.bw.mean * 8 / 1e6, mbit_s_spread=est.bw.spread * 8 / 1e6,
                 cap_mbit_s=est.capacity * 8 / 1e6, rtt_ms=est.rtt.mean * 1e3, bw_samples=est.bw.n)

        async def traffic() -> None:
            while not os.path.exists(change_file):
                await asyncio.sleep(0.05)
            took = await timed(1 << 20)
            table.observe_transfer("echo", 1 << 20, took, now())
            report("echo", "data-plane", "observed")

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        side = asyncio.create_task(traffic())
        await probe_loop(table, run_probe, stop, clock=now, tick_max=0.2, on_update=report)
        side.cancel()
    emit(event="exit")


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    if sys.argv[1] == "serve":
        asyncio.run(serve(int(sys.argv[2])))
    else:
        asyncio.run(probe(sys.argv[2], float(sys.argv[3]), sys.argv[4], float(sys.argv[5])))
