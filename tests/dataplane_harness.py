"""Test harness: real grpc.aio servers on loopback serving only the data plane's two methods.

The daemon's auth interceptor is not here; it would verify an HMAC and leave the node id in
`x-peerd-node`. A test client sends that key itself, which is exactly what the handler sees
behind the interceptor.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import grpc

from peerd.config import Config
from peerd.net.dataplane import AUTH_KEY, SERVICE, DataPlane, Received, Snapshot, grpc_options


class Node:
    def __init__(self, node_id: str, config: Config | None = None, run_id: str = "run1"):
        self.id = node_id
        self.cfg = config or Config()
        self.inbox: asyncio.Queue[Received] = asyncio.Queue()
        self.snapshots: dict[str, Snapshot] = {}
        self.dp = DataPlane(self.cfg, node_id, run_id, self.inbox, self._source)
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.channels: dict[str, grpc.aio.Channel] = {}

    def _source(self, requester: str, kind: str, min_iteration: int) -> Snapshot | None:
        snap = self.snapshots.get(kind)
        return snap if snap is not None and snap.iteration >= min_iteration else None

    async def start(self) -> "Node":
        self.server = grpc.aio.server(options=grpc_options(self.cfg))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, self.dp.method_handlers()),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        return self

    def channel(self, other: "Node") -> grpc.aio.Channel:
        ch = self.channels.get(other.address)
        if ch is None:
            ch = self.channels[other.address] = grpc.aio.insecure_channel(
                other.address, options=grpc_options(self.cfg))
        return ch

    def meta(self, node_id: str | None = None) -> tuple[tuple[str, str], ...]:
        return ((AUTH_KEY, node_id or self.id),)

    async def push(self, other: "Node", data, **kw):
        kw.setdefault("iteration", 1)
        return await self.dp.push(self.channel(other), other.id, data, metadata=self.meta(), **kw)

    async def pull(self, other: "Node", **kw) -> Received:
        return await self.dp.pull(self.channel(other), other.id, metadata=self.meta(), **kw)

    async def stop(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        if self.server is not None:
            await self.server.stop(0.5)
        self.dp.close()


@contextlib.asynccontextmanager
async def nodes(*ids: str, config: Config | None = None, run_id: str = "run1") -> AsyncIterator[list[Node]]:
    started: list[Node] = []
    try:
        for i in ids:
            started.append(await Node(i, config, run_id).start())
        yield started
    finally:
        for n in started:
            await n.stop()


def run(coro, timeout: float = 60.0):
    """Run one test coroutine on a fresh loop, bounded."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())
