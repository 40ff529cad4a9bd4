"""A benchmark peer: one process serving the data plane, driven by JSON lines on stdin.

`peerd bench transport` starts two of these (in two network namespaces when shaping links) and
asks one to push to the other, or to run the raw-TCP ceiling. It stands in for the daemon, which
serves the same `DataPlane` handlers; `spawn()` is the one function to change when benchmarking
real daemons instead. Commands (one JSON object per line; one JSON reply per line):

  {"op": "push", "to": "HOST:PORT", "peer": ID, "nbytes": N, "reps": R, "compression": "none"}
      -> {"seconds": [...]}                 sender's time per push, checksum included
  {"op": "raw_listen", "nbytes": N}          -> {"port": P}; serves R transfers of N bytes
  {"op": "raw_send", "to": "HOST:PORT", "nbytes": N} -> {"seconds": [s]}   one transfer
  {"op": "raw_close", "to": "HOST:PORT"}
  {"op": "mem_reset"} -> {"rss": B}           resets the peak-RSS mark (/proc/self/clear_refs)
  {"op": "mem"}       -> {"rss": B, "peak": B}
  {"op": "quit"}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import numpy as np
import torch

from peerd.config import Config
from peerd.net.dataplane import AUTH_KEY, SERVICE, DataPlane, Outgoing, Received, grpc_options

RAW_CHUNK = 1 << 20   # 1-4 MiB writes reach the ceiling (engineering.md §1)


def spawn(node_id: str, host: str, netns: str | None = None, chunk_bytes: int | None = None) -> subprocess.Popen:
    """Start a benchmark peer (inside `netns` when given). Swap this for a real daemon later."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "peerd.net.benchnode", "--node-id", node_id, "--host", host]
    if chunk_bytes:
        cmd += ["--chunk-bytes", str(chunk_bytes)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)


def _mem() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out["rss" if line.startswith("VmRSS") else "peak"] = int(line.split()[1]) * 1024
    return out


class _RawReceiver(threading.Thread):
    """Blocking-socket receiver into a pre-touched buffer, one-byte ack per transfer."""

    def __init__(self, host: str, nbytes: int, reps: int):
        super().__init__(daemon=True)
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.nbytes, self.reps = nbytes, reps
        self.buf = np.ones(nbytes, dtype=np.uint8)  # touched
        self.sock.settimeout(60)

    def run(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(600)
        mv = memoryview(self.buf)
        with conn:
            for _ in range(self.reps):
                got = 0
                while got < self.nbytes:
                    n = conn.recv_into(mv[got:], min(self.nbytes - got, 4 << 20))
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")
        self.sock.close()


def _raw_send(s: socket.socket, data: memoryview) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(data), RAW_CHUNK):
        s.sendall(data[i:i + RAW_CHUNK])
    if s.recv(1) != b"k":
        raise RuntimeError("raw receiver closed early")
    return time.perf_counter() - t0


class BenchNode:
    def __init__(self, node_id: str, host: str, chunk_bytes: int | None):
        self.cfg = Config() if not chunk_bytes else Config(dataplane_chunk_bytes=chunk_bytes)
        self.id, self.host = node_id, host
        self.dp = DataPlane(self.cfg, node_id, "bench", self._received)
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.received = 0
        self.data: dict[int, torch.Tensor] = {}
        self.raw: dict[str, socket.socket] = {}

    def _data(self, n: int) -> torch.Tensor:
        if n not in self.data:
            self.data.clear()
            self.data[n] = torch.randn(n // 4) if n % 4 == 0 else torch.randint(0, 256, (n,), dtype=torch.uint8)
        return self.data[n]

    def _received(self, rec: Received) -> None:
        self.received += 1
        rec.release()  # the checksum was verified; a daemon would hand it to the policy here

    async def serve(self) -> None:
        server = grpc.aio.server(options=grpc_options(self.cfg))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, self.dp.method_handlers()),))
        port = server.add_insecure_port(f"{self.host}:0")
        await server.start()
        self._reply({"address": f"{self.host}:{port}", "pid": os.getpid()})
        loop = asyncio.get_running_loop()
        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line or not line.strip():
                    break
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    break
                try:
                    self._reply(await self.handle(cmd))
                except Exception as e:  # report, keep serving: the driver decides
                    self._reply({"error": f"{type(e).__name__}: {e}"})
        finally:
            for ch in self.channels.values():
                await ch.close()
            await server.stop(1)
            self.dp.close()

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "push":
            to = cmd["to"]
            ch = self.channels.get(to)
            if ch is None:
                ch = self.channels[to] = grpc.aio.insecure_channel(to, options=grpc_options(self.cfg))
            x = self._data(cmd["nbytes"])
            out = []
            for i in range(cmd.get("reps", 1)):
                data = Outgoing.of([x])  # fresh each time: no checksum is reused
                r = await self.dp.push(ch, cmd["peer"], data, metadata=((AUTH_KEY, self.id),),
                                       iteration=i, compression=cmd.get("compression", "none"))
                out.append(r.seconds)
            return {"seconds": out}
        if op == "raw_listen":
            rx = _RawReceiver(self.host, cmd["nbytes"], cmd.get("reps", 1))
            rx.start()
            return {"port": rx.port}
        if op == "raw_send":  # one connection per receiver, kept across commands
            to = cmd["to"]
            if to not in self.raw:
                host, port = to.rsplit(":", 1)
                self.raw[to] = socket.create_connection((host, int(port)), timeout=600)
            mv = memoryview(self._data(cmd["nbytes"]).view(torch.uint8).numpy())
            return {"seconds": [await asyncio.to_thread(_raw_send, self.raw[to], mv)]}
        if op == "raw_close":
            sock = self.raw.pop(cmd["to"], None)
            if sock is not None:
                sock.close()
            return {}
        if op == "mem_reset":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _mem()
        if op == "mem":
            return _mem()
        raise ValueError(f"unknown op {op!r}")

    @staticmethod
    def _reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--chunk-bytes", type=int, default=0)
    args = ap.parse_args()
    node = BenchNode(args.node_id, args.host, args.chunk_bytes)
    try:
        import uvloop
        uvloop.run(node.serve())
    except ImportError:
        asyncio.run(node.serve())


if __name__ == "__main__":
    main()
