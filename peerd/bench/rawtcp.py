"""The baseline of `peerd bench size`: the same bytes over plain TCP between processes on this
machine, the same graph, and the same weighted sum, with no daemon in between.

Each worker (one process) listens on loopback, connects to its out-neighbours, and per iteration
sends its buffer to every out-neighbour while it receives every in-neighbour's buffer into a
preallocated one (a thread per connection; the kernel and memcpy do the work), then computes
sum(w * x) into its own buffer, as a D-PSGD iteration does. Synchronous: iteration k+1 starts when
the worker has everything of k.

    python -m peerd.bench.rawtcp WORKER N TOPOLOGY NBYTES ITERATIONS PORT_BASE
prints one JSON line: seconds per iteration (wire only, and with the sum) and peak RSS.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time

import torch

from peerd.sync import topology


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _connect(port: int, deadline: float) -> socket.socket:
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def worker(me: int, n: int, topo_name: str, nbytes: int, iterations: int, port_base: int) -> dict:
    torch.set_num_threads(1)
    topo = topology.make(topo_name, n)
    ins, outs = list(topo.in_neighbors(me)), list(topo.out_neighbors(me))
    weights = topo.weights(me)            # j -> W_ij, self included: the same rule as the daemon's mix
    server = socket.create_server(("127.0.0.1", port_base + me), backlog=n)
    deadline = time.monotonic() + 60
    out_socks = {j: _connect(port_base + j, deadline) for j in outs}
    for j, s in out_socks.items():
        s.sendall(me.to_bytes(4, "big"))
    in_socks: dict[int, socket.socket] = {}
    while len(in_socks) < len(ins):
        s, _ = server.accept()
        s.settimeout(60)
        hdr = bytearray(4)
        _recv_into(s, memoryview(hdr))
        in_socks[int.from_bytes(hdr, "big")] = s
    x = torch.randn(nbytes // 4)
    bufs = {j: torch.empty(nbytes // 4) for j in ins}
    w_self = weights.get(me, 0.0)
    wire_s, total_s = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        mine = memoryview(x.numpy()).cast("B")
        threads = [threading.Thread(target=s.sendall, args=(mine,)) for s in out_socks.values()]
        threads += [threading.Thread(target=_recv_into, args=(in_socks[j], memoryview(bufs[j].numpy()).cast("B")))
                    for j in ins]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t1 = time.perf_counter()
        out = x.mul(w_self)
        for j in ins:
            out.add_(bufs[j], alpha=weights[j])
        x.copy_(out)
        t2 = time.perf_counter()
        wire_s.append(t1 - t0)
        total_s.append(t2 - t0)
    for s in [*out_socks.values(), *in_socks.values(), server]:
        s.close()
    from peerd.train.benchsize import peak_rss_bytes
    return {"worker": me, "wire_s": wire_s, "total_s": total_s, "peak_rss_bytes": peak_rss_bytes()}


if __name__ == "__main__":
    me, n, topo_name, nbytes, iterations, port_base = sys.argv[1:7]
    print(json.dumps(worker(int(me), int(n), topo_name, int(nbytes), int(iterations), int(port_base))), flush=True)
