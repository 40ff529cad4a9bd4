"""The second baseline of `peerd bench size`: the same bytes over plain gRPC streams, no daemon.

peerd's tensors travel on gRPC streams (by design: one port, HTTP/2 through proxies, the same
authentication as every other call), so plain TCP is not the floor it can reach: gRPC's own copies
and HTTP/2 framing are. This worker measures that floor the way peerd.bench.rawtcp measures TCP's:
each process serves one stream-unary method on loopback (grpc.aio on uvloop, as the daemon), and
per iteration pushes its buffer to every out-neighbour as a stream of chunk-sized messages (one
copy into each message, as the daemon's frames) while it receives every in-neighbour's stream into
a preallocated buffer, then computes sum(w * x) into its own buffer. No checksums, no update
checks, no authentication: what is left between this and peerd is the daemon's own overhead. Its
event loop's lag is measured as the daemon's (LoopWatch): what gRPC alone costs the loop.

    python -m peerd.bench.rawgrpc WORKER N TOPOLOGY NBYTES ITERATIONS PORT_BASE CHUNK_BYTES
prints one JSON line: seconds per iteration (wire only, and with the sum), peak RSS and loop lag.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import torch

from peerd.node.loopwatch import LoopWatch
from peerd.sync import topology

METHOD = "/peerd.bench.RawGrpc/Push"
LIMIT = 64 << 20


async def worker(me: int, n: int, topo_name: str, nbytes: int, iterations: int, port_base: int,
                 chunk: int) -> dict:
    torch.set_num_threads(1)
    watch = LoopWatch()
    watching = asyncio.create_task(watch.run())
    topo = topology.make(topo_name, n)
    ins, outs = list(topo.in_neighbors(me)), list(topo.out_neighbors(me))
    weights = topo.weights(me)
    x = torch.randn(nbytes // 4)
    bufs = {j: torch.empty(nbytes // 4) for j in ins}
    views = {j: memoryview(bufs[j].numpy()).cast("B") for j in ins}
    may_write = {j: asyncio.Event() for j in ins}        # our sum of the last iteration has read bufs[j]
    arrived = {j: asyncio.Event() for j in ins}
    for e in may_write.values():
        e.set()

    async def push(requests, context) -> bytes:
        j = int(dict(context.invocation_metadata())["sender"])
        await may_write[j].wait()
        may_write[j].clear()
        got, view = 0, views[j]
        async for m in requests:
            view[got:got + len(m)] = m
            got += len(m)
        if got != nbytes:
            raise ValueError(f"got {got} of {nbytes} bytes from {j}")
        arrived[j].set()
        return b""

    opts = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    server = grpc.aio.server(options=opts)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "peerd.bench.RawGrpc", {"Push": grpc.stream_unary_rpc_method_handler(push)}),))
    server.add_insecure_port(f"127.0.0.1:{port_base + me}")
    await server.start()
    channels = {j: grpc.aio.insecure_channel(f"127.0.0.1:{port_base + j}", options=opts) for j in outs}
    for ch in channels.values():
        await asyncio.wait_for(ch.channel_ready(), 60)

    async def send(j: int) -> None:
        mine = memoryview(x.numpy()).cast("B")

        async def frames():
            for i in range(0, nbytes, chunk):
                yield bytes(mine[i:i + chunk])
        await channels[j].stream_unary(METHOD)(frames(), metadata=(("sender", str(me)),), timeout=300)

    w_self = weights.get(me, 0.0)
    wire_s, total_s = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        await asyncio.gather(*(send(j) for j in outs), *(arrived[j].wait() for j in ins))
        t1 = time.perf_counter()

        def weighted_sum() -> None:
            out = x.mul(w_self)
            for j in ins:
                out.add_(bufs[j], alpha=weights[j])
            x.copy_(out)
        await asyncio.to_thread(weighted_sum)     # off the loop, as the daemon's: the lag is gRPC's
        for j in ins:
            arrived[j].clear()
            may_write[j].set()
        t2 = time.perf_counter()
        wire_s.append(t1 - t0)
        total_s.append(t2 - t0)
    await asyncio.sleep(0.5)           # the neighbours' last pushes to us are answered before we stop
    for ch in channels.values():
        await ch.close()
    await server.stop(5)
    watching.cancel()
    from peerd.train.benchsize import peak_rss_bytes
    return {"worker": me, "wire_s": wire_s, "total_s": total_s, "peak_rss_bytes": peak_rss_bytes(),
            "loop_lag_p99_ms": 1000 * watch.quantile(0.99),
            "loop_lag_own_p99_ms": 1000 * watch.quantile(0.99, own=True)}


if __name__ == "__main__":
    import uvloop
    args = [int(a) if i != 2 else a for i, a in enumerate(sys.argv[1:8])]
    uvloop.install()
    print(json.dumps(asyncio.run(worker(*args))), flush=True)
