"""Data plane: push and pull one flat tensor buffer between daemons over gRPC.

`DataPlane` serves PushTensor and PullTensor as raw (serializer-less) handlers that the daemon
merges into its one `peerd.v1.Peer` generic handler, and offers `push()` / `pull()` as clients.

Design choices (measured, see shared/research/engineering.md §1-§3):

- Raw bytes path: gRPC hands us `bytes`; tensorwire decodes TensorFrame by hand, so a chunk costs
  one copy on each side beyond gRPC's own (tensor -> frame, frame -> destination). Generated
  protobuf clients interoperate (tests prove it).
- Receive buffers come from a pool of pre-touched tensors keyed by size: first-touch page faults
  cost 8x a memcpy here. A delivered `Received` owns its buffer until `release()`.
- Memory is bounded by a byte budget per peer and in total, reserved when a header is accepted and
  returned when the daemon releases the buffer; a header that can never fit is refused at once,
  one that must wait for others waits at most `dataplane_admit_timeout`.
- Every wait is bounded: a stream that sends nothing for `dataplane_stall_timeout` is aborted on
  either side; a client's whole call has a deadline derived from `dataplane_min_rate`.
- The event loop never runs a whole-buffer pass: checksums of the full buffer, casts and first
  allocations go to threads (zlib and torch release the GIL); per-chunk work is ~0.1 ms.
- Every refusal raises/returns a `TransferError` with a reason, logs one line at the receiver and
  counts in `metrics()`; nothing refused reaches the daemon's callback.

Use from the daemon:

    dp = DataPlane(cfg, node_id, run_id, on_received=queue_or_callback, source=snapshot_for)
    handlers = {**control_handlers, **dp.method_handlers()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    channel = grpc.aio.insecure_channel(addr, options=grpc_options(cfg))   # same for the server
    await dp.push(channel, peer_id, Outgoing.from_buffer(slot, layout), metadata=auth(),
                  iteration=k)                                            # -> PushResult
    rec = await dp.pull(channel, peer_id, metadata=auth(), min_iteration=k)  # -> Received
    ... rec.tensors() / rec.buffer ...; rec.release()                     # from the event loop
    dp.set_layout("model", layout)    # refuse model transfers of any other dtypes/shapes
    dp.close()                        # at shutdown
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import grpc
import torch

from peerd import workers
from peerd.config import Config
from peerd.net import copies as cp
from peerd.net import quant
from peerd.net import tensorwire as tw
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.dataplane")

SERVICE = "peerd.v1.Peer"
PUSH_METHOD = f"/{SERVICE}/PushTensor"
PULL_METHOD = f"/{SERVICE}/PullTensor"
AUTH_KEY = "x-peerd-node"      # set by the daemon's auth interceptor to the verified node id
# transfer kinds accepted by default ("carry": a pushed answer to a pull, used by the daemon);
# set_layout() and accept_kind() add more per DataPlane
KINDS = frozenset({"model", "probe", "state", "carry"})
# kinds whose receive buffers are freed, not pooled: link probes come in ever different sizes,
# and the exact-size pool would fill with them up to dataplane_pool_bytes
UNPOOLED_KINDS = frozenset({"probe"})
# kinds whose bytes are checked (framing, checksum) and dropped as they come: a link probe is
# only timed, and a 64 MiB receive buffer for it is memory a big model needs
DISCARDED_KINDS = frozenset({"probe"})
UPDATE_KINDS = frozenset({"model", "carry"})   # a run's updates (pushed, or carried to a puller)
# refusals that are the sending peer's fault, not the network's: reported to on_offence
OFFENCES = frozenset({"layout_mismatch"})
# refusals counted but not logged one by one: a flagged peer's every update; a pull for parameters
# not held (a calm start's join pull asks every neighbour for some it cannot have yet)
QUIET_REASONS = frozenset({"screened", "not_found"})
ACTIVITY_EVERY = 0.5   # seconds between two on_activity calls for one peer
CRC_PART = 8 << 20     # checksums are computed in parts of this size, in parallel, then combined
CHECKSUMS = frozenset({"crc32c", "crc32", "none"})
MAX_MASS = 1e9         # largest header.mass accepted (a weight relative to other updates)   # what a receiver checks; the sender's is in Config


def grpc_options(config: Config) -> list[tuple[str, Any]]:
    """Channel and server options for a daemon that carries the data plane.

    Message limits on both ends fit one chunk frame or header (the default 4 MiB receive limit
    would turn bigger frames into a misleading INTERNAL error). BDP probing stays on: without it
    a 50 ms RTT link ran at 90 instead of 380 Mbit/s. Keepalive detects dead peers that mDNS
    never forgets. Pending-request limits are raised so bursts queue instead of being cancelled.
    """
    frame = max(config.dataplane.chunk_bytes, config.dataplane.max_header_bytes) + 64
    limit = max(frame, config.node.max_control_message_bytes)
    ka_ms = int(config.dataplane.keepalive_interval * 1000)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.http2.bdp_probe", 1),
        ("grpc.keepalive_time_ms", ka_ms),
        ("grpc.keepalive_timeout_ms", int(config.dataplane.keepalive_timeout * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # the server must tolerate the clients' ping rate, or it answers with GOAWAY too_many_pings
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1000, ka_ms // 2)),
        ("grpc.http2.min_ping_interval_without_data_ms", ka_ms),
        ("grpc.server.max_pending_requests", 10_000),
        ("grpc.server.max_pending_requests_hard_limit", 20_000),
    ]


def cut_by_channel_close() -> bool:
    """Inside `except asyncio.CancelledError` around a gRPC call: True when it was gRPC that
    cancelled the call because its channel was closed (the daemon closes a dead peer's channel),
    not somebody cancelling this task. grpc.aio fails such calls with asyncio.CancelledError, not
    an RpcError: left as it is, a caller's `except AioRpcError` misses it, and a server handler
    that lets it out answers nothing at all, so its own caller waits out its whole deadline."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


CHANNEL_CLOSED = "the channel was closed under the call (the peer was found dead)"


def channel_closed_error() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), CHANNEL_CLOSED)


def _channel_closed(what: str) -> "TransferError":
    return TransferError("cancelled", f"{what}: {CHANNEL_CLOSED}", grpc.StatusCode.CANCELLED)


async def rpc(call: Awaitable) -> Any:
    """Await one gRPC call; a close of its channel fails it as AioRpcError CANCELLED, like any
    other failed call (see cut_by_channel_close)."""
    try:
        return await call
    except asyncio.CancelledError:
        if cut_by_channel_close():
            raise channel_closed_error() from None
        raise


# ---- errors, events, sources -----------------------------------------------------------------

class TransferError(Exception):
    """A refused or failed transfer. `reason` is a short metric label, `code` the gRPC status."""

    def __init__(self, reason: str, details: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(f"{reason}: {details}")
        self.reason = reason
        self.details = details
        self.code = code


@dataclass
class Received:
    """One complete, verified transfer, handed to the daemon. Call `release()` when done."""
    sender: str
    run_id: str
    iteration: int
    kind: str
    transfer_id: int
    layout: tw.Layout
    buffer: torch.Tensor          # flat uint8, layout.nbytes long, owned until release()
    nbytes: int
    wire_bytes: int
    seconds: float                # header to last byte
    compression: int
    compression_error_bound: float  # relative bound of the cast (tw.ROUNDING_BOUND; 0 uncompressed)
    _release: Callable[[], None] | None = field(default=None, repr=False)
    stats: tw.ParamStats | None = None   # for kinds with a layout set (a run's): computed off the loop
    sunk: bool = False                   # the bytes went to the daemon's Sink: `buffer` is empty
    mass: float = 1.0                    # the sender's weight for this update in a mix (header.mass)

    def tensors(self) -> list[torch.Tensor]:
        return self.layout.views(self.buffer)

    def release(self) -> None:
        if self._release is not None:
            rel, self._release = self._release, None
            rel()

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Outgoing:
    """Bytes to send: a layout and the memoryviews that hold it, in order (no copy made).

    The bytes must not change while an Outgoing is in use: its crc32 is computed on the first
    push and reused by later ones (a snapshot pushed to k peers is checksummed once)."""
    layout: tw.Layout
    pieces: list[memoryview]
    keep: tuple = ()              # owners of the memory behind `pieces`
    checksum: int | None = None   # crc32 of the bytes, filled in by the first push
    _pending: Any = field(default=None, repr=False)   # the first push's checksum in progress
    mass: float = 1.0             # weight in the receivers' mixes (DiLoCo: the inner steps it took)
    # bytes changed since the previous one; not None: push in copy mode (peerd.net.copies), which a
    # sender of changed ranges uses for every push of its run (the whole buffer as one range at first)
    ranges: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> "Outgoing":
        tensors = [t.detach() for t in tensors]
        cpu = [t.cpu().contiguous() for t in tensors]
        return cls(tw.Layout.of(cpu, names), [tw.byte_view(t) for t in cpu], tuple(cpu))

    @classmethod
    def from_buffer(cls, buf: torch.Tensor, layout: tw.Layout, movable: bool = False) -> "Outgoing":
        """A flat uint8 buffer (e.g. a shared-memory slot) holding `layout`. `movable`: its bytes may
        be moved to an identical copy while it streams (`move_to`)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != layout.nbytes:
            raise ValueError(f"buffer: want flat uint8 of {layout.nbytes} bytes, got {buf.dtype} {tuple(buf.shape)}")
        view = tw.byte_view(buf)
        return cls(layout, [tw.Movable(view) if movable else view], (buf,))

    def move_to(self, buf: torch.Tensor) -> None:
        """Stream the rest from `buf`, a copy of the same bytes (the checksum holds)."""
        piece = self.pieces[0]
        if not isinstance(piece, tw.Movable) or buf.numel() != len(piece):
            raise ValueError("move_to: a movable single-buffer Outgoing and a buffer of its size")
        piece.view = tw.byte_view(buf)
        self.keep = (buf,)


@dataclass
class Snapshot:
    """What a pull source serves: parameters of one iteration. `done` runs once the server is
    through with it (streamed, failed or refused): until then its bytes must not change."""
    iteration: int
    data: Outgoing
    checksum: int | None = None   # crc32 of the uncompressed bytes when the source knows it
    done: Callable[[], None] | None = None


@dataclass(frozen=True)
class PushResult:
    transfer_id: int
    nbytes: int
    wire_bytes: int
    seconds: float                # sender's time, checksum and cast included
    receiver_seconds: float
    cast_error: tw.CastError | None


# source(requester, kind, min_iteration) -> Snapshot | None, sync or async: what a pull serves
Source = Callable[[str, str, int], "Snapshot | None | Awaitable[Snapshot | None]"]


class Sink:
    """Where a transfer's bytes go instead of a receive buffer (the daemon's choice at its header,
    `DataPlane.sink_for`): each chunk is handed over as it arrives, in order, and the sink keeps
    what it needs (e.g. adds it into a running sum). The data plane still checks framing and the
    checksum; `finish` is awaited once every byte arrived and the checksum held, `abort` when the
    transfer failed after some chunks were handed over."""

    async def chunk(self, offset: int, data: memoryview) -> None:
        """Take one chunk; may wait (back-pressure: the stream is read no faster than the sink
        keeps up, so chunks never pile up in memory)."""
        raise NotImplementedError

    async def finish(self) -> "tw.ParamStats | None":
        raise NotImplementedError

    def abort(self, why: str) -> None:
        raise NotImplementedError


class Discard(Sink):
    """A transfer whose bytes only need to arrive intact (DISCARDED_KINDS): nothing is kept."""

    async def chunk(self, offset: int, data: memoryview) -> None:
        pass

    async def finish(self) -> None:
        return None

    def abort(self, why: str) -> None:
        pass


async def _sink(sink_for: Callable | None, h: pb.TensorHeader, peer: str) -> Sink | None:
    """Where an uncoded transfer's chunks go instead of a receive buffer, if anywhere."""
    if _base_kind(h.kind) in DISCARDED_KINDS:
        return Discard()
    sink = sink_for(h, peer) if sink_for is not None else None
    return await sink if inspect.isawaitable(sink) else sink


# ---- memory: pool and budget -----------------------------------------------------------------

class BufferPool:
    """Pre-touched flat uint8 tensors, reused by exact size; idle bytes are bounded."""

    def __init__(self, max_idle_bytes: int):
        self.max_idle = max_idle_bytes
        self.idle: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self.idle_bytes = 0
        self.allocated = 0       # fresh allocations, for metrics and tests

    async def get(self, nbytes: int) -> torch.Tensor:
        free = self.idle.get(nbytes)
        if free:
            buf = free.pop()
            self.idle_bytes -= nbytes
            if not free:
                del self.idle[nbytes]
            return buf
        self.allocated += 1
        if nbytes < 1 << 20:
            return torch.zeros(nbytes, dtype=torch.uint8)
        # touching fresh pages costs ~0.6 s per GB here: keep it off the event loop
        return await asyncio.to_thread(torch.zeros, nbytes, dtype=torch.uint8)

    def put(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        if n < 4096 or n > self.max_idle:  # tiny buffers are cheap to make; keep the lists short
            return
        self.trim(self.max_idle - n)
        self.idle.setdefault(n, []).append(buf)
        self.idle.move_to_end(n)
        self.idle_bytes += n

    def trim(self, keep: int | None = None) -> None:
        """Drop idle buffers, least recently used size first, until at most `keep` bytes (default
        max_idle) stay idle."""
        keep = self.max_idle if keep is None else keep
        while self.idle_bytes > keep and self.idle:
            size, bufs = next(iter(self.idle.items()))
            bufs.pop()
            self.idle_bytes -= size
            if not bufs:
                del self.idle[size]


class Budget:
    """Receive bytes held per peer and in total; reservations wait a bounded time."""

    def __init__(self, per_peer: int, total: int):
        self.per_peer = per_peer
        self.total = total
        self.used: collections.Counter[str] = collections.Counter()
        self.used_total = 0
        self.waiting = 0
        self._changed = asyncio.Condition()

    def _fits(self, peer: str, n: int) -> bool:
        return self.used[peer] + n <= self.per_peer and self.used_total + n <= self.total

    async def reserve(self, peer: str, n: int, timeout: float) -> None:
        if n > self.per_peer or n > self.total:
            raise TransferError("too_large", f"transfer needs {n} bytes, limit is "
                                f"{min(self.per_peer, self.total)} per peer/in total",
                                grpc.StatusCode.RESOURCE_EXHAUSTED)
        if not self._fits(peer, n):
            self.waiting += 1
            try:
                async with asyncio.timeout(timeout), self._changed:
                    await self._changed.wait_for(lambda: self._fits(peer, n))
            except TimeoutError:
                raise TransferError("over_budget", f"{n} bytes do not fit the receive budget "
                                    f"(peer holds {self.used[peer]}, all peers {self.used_total}) "
                                    f"within {timeout}s", grpc.StatusCode.RESOURCE_EXHAUSTED) from None
            finally:
                self.waiting -= 1
        self.used[peer] += n
        self.used_total += n

    def release(self, peer: str, n: int) -> None:
        self.used[peer] -= n
        self.used_total -= n
        if self.used[peer] <= 0:
            del self.used[peer]
        if self.waiting:  # wake transfers waiting for room
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


# ---- the data plane --------------------------------------------------------------------------

async def checksum_in(pool: concurrent.futures.Executor, algo: str, pieces: Sequence[memoryview]) -> int:
    """`algo`'s checksum of the concatenated `pieces`, computed in `pool`'s threads (crc32 in
    parallel parts combined; crc32c, five times faster, in one pass)."""
    if algo == "crc32c":
        return await asyncio.wrap_future(pool.submit(tw.crc32c, list(pieces)))
    parts = tw.split(pieces, CRC_PART)
    if sum(len(p) for p in parts) < 1 << 20:
        return tw.crc32(parts)
    crcs = await asyncio.gather(*(asyncio.wrap_future(pool.submit(tw.zlib.crc32, p)) for p in parts))
    out = 0
    for c, p in zip(crcs, parts):
        out = tw.crc32_combine(out, c, len(p))
    return out


class DataPlane:
    """Server handlers and client calls for tensor transfers of one node in one run."""

    def __init__(self, config: Config, node_id: str, run_id: str,
                 on_received: asyncio.Queue[Received] | Callable[[Received], Awaitable[None] | None],
                 source: Source | None = None):
        """`on_received` gets each verified transfer (a Queue is awaited at most
        `dataplane_deliver_timeout`); `source` answers pulls (None: every pull is NOT_FOUND)."""
        self.cfg = config
        self.node_id = node_id
        self.run_id = run_id
        self.on_received = on_received
        self.source = source
        self.layouts: dict[str, tw.Layout] = {}
        self.kinds: set[str] = set(KINDS)
        self.pool = BufferPool(config.dataplane.pool_bytes)
        self.senders = cp.Senders(self.pool)                      # our public copies (copy mode)
        self.copies = cp.ReceiverCopies(config.dataplane.copies_max)   # senders' public copies
        self._budget: Budget | None = None
        self._client_sems: dict[str, asyncio.Semaphore] = {}
        self._pushing = 0      # our pushes in flight, to every peer: they share this host's uplink
        self._server_active: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count((int.from_bytes(os.urandom(4), "big") << 20) + 1)
        self.counters: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        # screen(peer, kind) -> a reason to refuse a transfer at its header (e.g. a flagged peer),
        # or None; on_offence(peer, what) hears each transfer refused as the peer's fault
        self.screen: Callable[[str, str], str | None] | None = None
        self.on_offence: Callable[[str, str], None] | None = None
        # on_update_lost(peer, kind, iteration): a pushed update failed mid-stream; not sent again
        self.on_update_lost: Callable[[str, str, int], None] | None = None
        # sink_for(header, peer): a Sink for the chunks instead of a buffer, or None; may be async
        self.sink_for: Callable[[pb.TensorHeader, str], "Sink | None | Awaitable[Sink | None]"] | None = None
        # activity.fn(peer): bytes from `peer` are arriving (at most every ACTIVITY_EVERY s per peer):
        # life, whatever the heartbeats do; update_activity.fn: bytes of an update (a run's: slow, not silent)
        self.activity, self.update_activity = Throttle(ACTIVITY_EVERY), Throttle(ACTIVITY_EVERY)
        # checksums run beside the event loop: zlib releases the GIL, chunks combine by length
        self.crc_pool = workers.pool(2, "peerd-crc")

    def close(self) -> None:
        self.crc_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def checksum_algo(self) -> str:
        """What this node's pushes carry: Config's choice; crc32c falls back to crc32 where the
        crc32c package is missing."""
        algo = self.cfg.dataplane.checksum
        return "crc32" if algo == "crc32c" and not tw.HAVE_CRC32C else algo

    async def checksum(self, pieces: Sequence[memoryview]) -> int:
        """This node's checksum (checksum_algo) of the concatenated `pieces`, off the event loop."""
        return await checksum_in(self.crc_pool, self.checksum_algo, pieces)

    async def seal(self, data: Outgoing) -> int:
        """Checksum `data` now (e.g. at publish, before the policy picks peers), so no push pays it.

        Concurrent first pushes of one snapshot share one computation."""
        if data.checksum is None:
            if data._pending is None:
                data._pending = asyncio.ensure_future(self.checksum(data.pieces))
            data.checksum = await asyncio.shield(data._pending)
        return data.checksum

    # -- configuration ---------------------------------------------------------------------------
    def set_layout(self, kind: str, layout: tw.Layout | None) -> None:
        """Refuse transfers of `kind` whose dtypes or shapes differ from `layout` (None: any). The
        idle pool is bounded by dataplane_pool_models times the largest layout set."""
        if layout is None:
            self.layouts.pop(kind, None)
        else:
            self.accept_kind(kind)
            self.layouts[kind] = layout
        self.senders.keep_kinds(set(self.layouts))
        self.copies.keep_kinds(set(self.layouts))
        dp = self.cfg.dataplane
        largest = max((lay.nbytes for lay in self.layouts.values()), default=0)
        self.pool.max_idle = min(dp.pool_bytes, int(dp.pool_models * largest)) if largest else dp.pool_bytes
        self.pool.trim()

    def layout_for(self, kind: str) -> tw.Layout | None:
        """The layout transfers of `kind` must have (None: any)."""
        return self.layouts.get(kind, self.layouts.get(_base_kind(kind)))

    def accept_kind(self, kind: str) -> None:
        """Accept pushes and pulls of `kind` (a short label) besides the default KINDS."""
        if not kind or len(kind) > 32:
            raise ValueError(f"kind {kind!r}: want 1-32 characters")
        self.kinds.add(kind)

    @property
    def budget(self) -> Budget:
        if self._budget is None:  # created lazily: asyncio primitives bind to the running loop
            self._budget = Budget(self.cfg.dataplane.peer_bytes, self.cfg.dataplane.total_bytes)
        return self._budget

    def metrics(self) -> dict[str, float]:
        """Prometheus-style samples: name{label="..."} -> value."""
        counts = {**self.counters, **self.senders.counts()}
        out: dict[str, float] = {f"peerd_dataplane_{k}_total": v for k, v in counts.items()}
        for reason, n in self.rejected.items():
            out[f'peerd_dataplane_rejected_total{{reason="{reason}"}}'] = n
        b = self.budget
        out["peerd_dataplane_held_bytes"] = b.used_total
        out["peerd_dataplane_pool_idle_bytes"] = self.pool.idle_bytes
        return out

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Raw handlers for the daemon's `peerd.v1.Peer` generic handler."""
        return {
            "PushTensor": grpc.stream_unary_rpc_method_handler(self._serve_push),
            "PullTensor": grpc.unary_stream_rpc_method_handler(self._serve_pull),
        }

    def _refuse(self, err: TransferError, peer: str, what: str) -> None:
        self.rejected[err.reason] += 1
        if err.reason in QUIET_REASONS:
            return  # counted; the screen's owner logs a flag once, the puller its NOT_FOUND
        log.warning("%s from %s refused: %s", what, peer or "<unauthenticated>", err)
        if err.reason in OFFENCES and peer and self.on_offence is not None:
            self.on_offence(peer, f"{err.reason}: {err.details}")

    # -- server: push ---------------------------------------------------------------------------
    async def _serve_push(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> bytes:
        peer = _auth_node(context)
        try:
            if not peer:
                raise TransferError("unauthenticated", f"no {AUTH_KEY} on the call",
                                    grpc.StatusCode.UNAUTHENTICATED)
            self._take_slot(peer)
            try:
                rec = await self._receive(aiter(request_iterator), peer, expect_sender=peer, push=True)
            finally:
                self._free_slot(peer)
            await self._deliver(rec)
        except asyncio.CancelledError:
            self.rejected["cancelled"] += 1
            log.info("push from %s cancelled by the sender or the server", peer)
            raise
        except TransferError as e:
            self._refuse(e, peer, "push")
            await context.abort(e.code, f"{e.reason}: {e.details}")
        self.counters["pushes_received"] += 1
        return pb.TransferReply(transfer_id=rec.transfer_id, received_bytes=rec.wire_bytes,
                                seconds=rec.seconds).SerializeToString()

    def _take_slot(self, peer: str) -> None:
        """Count a push or pull served to `peer`; refuse beyond dataplane_max_rpcs_per_peer."""
        if self._server_active[peer] >= self.cfg.dataplane.max_rpcs_per_peer:
            raise TransferError("too_many_rpcs", f"{self.cfg.dataplane.max_rpcs_per_peer} transfers "
                                "with this peer already in flight", grpc.StatusCode.RESOURCE_EXHAUSTED)
        self._server_active[peer] += 1

    def _free_slot(self, peer: str) -> None:
        self._server_active[peer] -= 1
        if self._server_active[peer] <= 0:
            del self._server_active[peer]

    async def _deliver(self, rec: Received) -> None:
        await deliver(self.on_received, rec, self.cfg.dataplane.deliver_timeout)

    # -- receiving (push server and pull client share it) ---------------------------------------
    async def _receive(self, frames: Any, peer: str, expect_sender: str, push: bool) -> Received:
        """Read header and chunks from the async iterator `frames` into a pooled buffer."""
        cfg = self.cfg
        stall = cfg.dataplane.stall_timeout
        loop = asyncio.get_running_loop()
        asm: _Assembly | None = None
        try:
            async with asyncio.timeout(stall) as guard:
                try:
                    raw = await anext(frames)
                except StopAsyncIteration:
                    raise TransferError("no_header", "stream ended before a header") from None
                kind, value = _decode(raw, cfg.dataplane.max_header_bytes)
                if kind != tw.HEADER:
                    raise TransferError("no_header", "first frame is a chunk, not a header")
                asm = await self._admit(value, peer, expect_sender, push)
                guard.reschedule(loop.time() + stall)
                async for raw in frames:
                    kind, value = _decode(raw, cfg.dataplane.max_header_bytes)
                    if kind == tw.HEADER:
                        raise TransferError("second_header", "a header after the first frame")
                    await asm.chunk(*value)
                    guard.reschedule(loop.time() + stall)
                return await asm.finish()
        except TimeoutError:
            if asm is not None:
                asm.abort(push)
            got = asm.received if asm else 0
            raise TransferError("stalled", f"no data for {stall}s ({got} bytes received)",
                                grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except BaseException as e:
            if asm is not None:   # a refused copy base is sent again, as a keyframe: not lost
                asm.abort(push and getattr(e, "reason", "") != "copy_base")
            raise

    async def _admit(self, h: pb.TensorHeader, peer: str, expect_sender: str, push: bool) -> "_Assembly":
        dp = self.cfg.dataplane
        if h.sender != expect_sender:
            raise TransferError("sender_mismatch", f"header.sender {h.sender!r} is not the "
                                f"authenticated node {expect_sender!r}", grpc.StatusCode.PERMISSION_DENIED)
        if h.run_id != self.run_id:
            raise TransferError("run_mismatch", f"header.run_id {h.run_id!r}, this node serves run "
                                f"{self.run_id!r}", grpc.StatusCode.FAILED_PRECONDITION)
        if _base_kind(h.kind) not in self.kinds:
            raise TransferError("bad_header", f"header.kind {h.kind[:40]!r} not one of {sorted(self.kinds)}")
        if self.screen is not None and (why := self.screen(peer, h.kind)):
            raise TransferError("screened", why, grpc.StatusCode.PERMISSION_DENIED)
        layout, wire_bytes, plan = check_header(h, dp.max_tensors, dp.max_transfer_bytes)
        want = self.layout_for(h.kind)
        if want is not None and not want.same_shapes(layout):
            raise TransferError("layout_mismatch", f"layout of {h.kind!r} differs from the run's "
                                f"({_diff(want, layout)})", grpc.StatusCode.FAILED_PRECONDITION)
        if h.copy_epoch:
            if want is None:
                raise TransferError("bad_header", f"copy mode for {h.kind[:40]!r}, which is no run's parameters")
            if why := self.copies.base_error(h):     # refused before its bytes come: a keyframe follows
                raise TransferError("copy_base", why, grpc.StatusCode.FAILED_PRECONDITION)
        coded = plan is not None or wire_bytes != layout.nbytes
        sink = None if coded or not push else await _sink(self.sink_for, h, peer)   # a pull's answer: whole
        if sink is not None:
            return _Assembly(self, peer, h, layout, None, None, 0, sink)
        need = layout.nbytes + (wire_bytes if coded else 0)
        await self.budget.reserve(peer, need, dp.admit_timeout)
        try:
            dst = await self.pool.get(layout.nbytes)
            wbuf = await self.pool.get(wire_bytes) if coded else dst
        except BaseException:
            self.budget.release(peer, need)
            raise
        return _Assembly(self, peer, h, layout, dst, wbuf, need, plan=plan)

    # -- server: pull ---------------------------------------------------------------------------
    async def _serve_pull(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        peer = _auth_node(context)
        snap = None
        try:
            req = check_pull_request(request, peer, self.run_id, self.kinds)
            kind = req.kind or "model"
            if self.source is not None:
                snap = self.source(peer, kind, req.min_iteration)
                if inspect.isawaitable(snap):
                    snap = await snap
            if snap is None:
                raise TransferError("not_found", f"no {kind!r} parameters at or after iteration "
                                    f"{req.min_iteration}", grpc.StatusCode.NOT_FOUND)
            self._take_slot(peer)
        except TransferError as e:
            if snap is not None and snap.done is not None:
                snap.done()          # refused after all: the source may reuse the snapshot
            self._refuse(e, peer, "pull")
            await context.abort(e.code, f"{e.reason}: {e.details}")
        stall = self.cfg.dataplane.stall_timeout
        try:
            prep = await _Prepared.plain(self, snap.data, req.compression, snap.checksum, measure=False)
            try:
                header = prep.header(snap.iteration, kind)
                loop = asyncio.get_running_loop()
                async with asyncio.timeout(stall) as guard:
                    await context.write(header)
                    for frame in tw.encode_chunks(prep.pieces, self.cfg.dataplane.chunk_bytes):
                        guard.reschedule(loop.time() + stall)
                        await context.write(frame)
            finally:
                prep.release()
        except TimeoutError:
            self._refuse(TransferError("stalled", f"puller read nothing for {stall}s"), peer, "pull")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "stalled: reader too slow")
        finally:
            self._free_slot(peer)
            if snap.done is not None:
                snap.done()
        self.counters["pulls_served"] += 1

    # -- client side ------------------------------------------------------------------------------
    def _sem(self, peer: str) -> asyncio.Semaphore:
        sem = self._client_sems.get(peer)
        if sem is None:
            sem = self._client_sems[peer] = asyncio.Semaphore(self.cfg.dataplane.max_rpcs_per_peer)
        return sem

    def deadline(self, nbytes: int, sharing: int = 1) -> float:
        """Seconds a transfer of `nbytes` may take before it counts as failed, when `sharing`
        transfers of ours (itself included) share the link at dataplane_min_rate (pushes to several
        neighbours share our uplink: over 10 Mbit two 20 MB updates take 32 s, and one alone at the
        1 MB/s floor got 40 s: it was cut at 19 of 20 MB in the lab)."""
        return self.cfg.dataplane.stall_timeout + max(1, sharing) * nbytes / self.cfg.dataplane.min_rate

    async def push(self, channel: grpc.aio.Channel, peer: str, data: Outgoing | Sequence[torch.Tensor], *,
                   metadata: Sequence[tuple[str, str]] = (), iteration: int, kind: str = "model",
                   compression: int | str | None = None, checksum: int | None = None,
                   timeout: float | None = None, allowance: float = 0.0) -> PushResult:
        """Send one buffer to `peer` over `channel`. Raises TransferError on any failure.

        `checksum`: crc32 of the uncompressed bytes if the caller knows it. `compression`: default
        from the config. `timeout`: `deadline()` plus `allowance` (a run's, for a slow link)."""
        if not isinstance(data, Outgoing):
            data = Outgoing.of(data)
        comp = _compression(self.cfg.dataplane.compression if compression is None else compression)
        copy_mode = (comp in cp.BITS or data.ranges is not None) and self.layout_for(kind) is not None
        async with self._sem(peer):
            self._pushing += 1      # from here on, so that pushes started together count each other
            try:
                for attempt in range(2 if copy_mode else 1):
                    t0 = time.perf_counter()
                    if copy_mode:   # an increment of our public copy (a keyframe on the retry)
                        prep = await _Prepared.in_copy_mode(self, data, comp, iteration, peer, kind, attempt > 0)
                    else:
                        prep = await _Prepared.plain(self, data, comp, checksum, measure=True)
                    try:
                        raw = await self._send(channel, peer, prep, iteration, kind, metadata, timeout, allowance)
                    except TransferError as e:
                        if copy_mode:
                            self.senders.failed(kind, peer)
                            if e.reason == "copy_base" and attempt == 0:
                                self.counters["copy_refused"] += 1
                                continue
                        raise
                    finally:
                        prep.release()
                    if prep.copy is not None:
                        self.senders.delivered(kind, peer, prep.copy)
                    break
            finally:
                self._pushing -= 1
        reply = pb.TransferReply.FromString(raw)
        self.counters["pushes_sent"] += 1
        self.counters["bytes_sent"] += prep.wire_bytes
        return PushResult(prep.transfer_id, prep.layout.nbytes, prep.wire_bytes,
                          time.perf_counter() - t0, reply.seconds, prep.cast_error)

    async def _send(self, channel: grpc.aio.Channel, peer: str, prep: "_Prepared", iteration: int,
                    kind: str, metadata: Sequence[tuple[str, str]], timeout: float | None,
                    allowance: float = 0.0) -> bytes:
        header = prep.header(iteration, kind)

        async def frames() -> Any:
            yield header
            for frame in tw.encode_chunks(prep.pieces, self.cfg.dataplane.chunk_bytes):
                yield frame

        call = channel.stream_unary(PUSH_METHOD)
        try:
            return await rpc(call(frames(), metadata=tuple(metadata),
                                  timeout=timeout or self.deadline(prep.wire_bytes, self._pushing) + allowance))
        except grpc.aio.UsageError:       # the channel was closed before the call began
            self.counters["pushes_failed"] += 1
            raise _channel_closed(f"push to {peer}") from None
        except grpc.aio.AioRpcError as e:
            self.counters["pushes_failed"] += 1
            reason = _reason(e)
            details = ("the receiver ended the stream before reading all of it (it refused the push; "
                       "its log says why)" if reason == "cut_short" else e.details())
            raise TransferError(reason, f"push to {peer}: {details}", e.code()) from None

    async def pull(self, channel: grpc.aio.Channel, peer: str, *, metadata: Sequence[tuple[str, str]] = (),
                   min_iteration: int = 0, kind: str = "model", compression: int | str | None = None,
                   timeout: float | None = None) -> Received:
        """Fetch `peer`'s newest `kind` buffer at or after `min_iteration`. Caller releases it."""
        comp = _compression(self.cfg.dataplane.compression if compression is None else compression)
        req = pb.PullRequest(requester=self.node_id, run_id=self.run_id, min_iteration=min_iteration,
                             compression=comp, kind=kind).SerializeToString()
        async with self._sem(peer):
            try:
                call = channel.unary_stream(PULL_METHOD)(
                    req, metadata=tuple(metadata),
                    timeout=timeout or self.deadline(self.cfg.dataplane.max_transfer_bytes))
            except grpc.aio.UsageError:           # the channel was closed while we waited our turn
                self.counters["pulls_failed"] += 1
                raise _channel_closed(f"pull from {peer}") from None

            async def frames() -> Any:
                while True:
                    raw = await call.read()
                    if raw is grpc.aio.EOF:
                        return
                    yield raw

            try:
                rec = await self._receive(frames(), peer, expect_sender=peer, push=False)
            except TransferError as e:
                call.cancel()
                self._refuse(e, peer, "pull")
                raise
            except grpc.aio.AioRpcError as e:
                self.counters["pulls_failed"] += 1
                raise TransferError(_reason(e), f"pull from {peer}: {e.details()}", e.code()) from None
            except asyncio.CancelledError:
                if not cut_by_channel_close():
                    raise
                self.counters["pulls_failed"] += 1
                raise _channel_closed(f"pull from {peer}") from None
            finally:
                call.cancel()
        if rec.kind != kind or rec.iteration < min_iteration:
            rec.release()
            raise TransferError("bad_header", f"pulled {rec.kind!r} at iteration {rec.iteration}, asked "
                                f"for {kind!r} at or after {min_iteration}")
        self.counters["pulls_received"] += 1
        return rec


@dataclass
class _Prepared:
    dp: DataPlane
    data: Outgoing
    layout: tw.Layout
    compression: int
    pieces: list[memoryview]
    wire_bytes: int
    checksum_algo: str
    checksum: int
    transfer_id: int
    cast_error: tw.CastError | None
    scratch: torch.Tensor | None
    copy: cp.Message | None = None    # copy mode or quantized: the message (its buffer is released with us)

    def release(self) -> None:
        if self.scratch is not None:
            self.pieces = []
            self.dp.pool.put(self.scratch)
            self.scratch = None
        if self.copy is not None:
            self.pieces = []
            self.copy.release()
            self.copy.release = lambda: None

    @classmethod
    async def plain(cls, dp: DataPlane, data: Outgoing, comp: int, checksum: int | None,
                    measure: bool) -> "_Prepared":
        """`data` as it is, or cast (fp16/bf16), or quantized without a copy (int8/int4: a pull)."""
        if comp in cp.BITS:      # quantized outside copy mode (a pull): the values themselves
            src = tw._Pieces(data.pieces).tensor(0, data.layout.nbytes)
            return await cls.of_message(dp, data, await dp.senders.plain(data.layout, src, comp))
        wire = data.layout.wire(comp)
        compressed = wire.nbytes != data.layout.nbytes
        pieces, scratch, cast_error = data.pieces, None, None
        total = sum(len(p) for p in pieces)
        if total != data.layout.nbytes:
            raise ValueError(f"data: {total} bytes for a layout of {data.layout.nbytes}")
        if checksum is None and not compressed:
            checksum = data.checksum
        if compressed:
            scratch = await dp.pool.get(wire.nbytes)
            cast_error = await asyncio.to_thread(tw.compress, data.layout, pieces, scratch, comp, measure)
            pieces = [tw.flat_view(scratch)]
            checksum = None  # a known checksum is of the uncompressed bytes
        algo = dp.checksum_algo
        if algo != "none" and checksum is None:
            checksum = await (dp.checksum(pieces) if compressed else dp.seal(data))
        return cls(dp, data, data.layout, comp, pieces, wire.nbytes, algo, checksum or 0, next(dp._ids),
                   cast_error, scratch)

    @classmethod
    async def in_copy_mode(cls, dp: DataPlane, data: Outgoing, comp: int, iteration: int, peer: str, kind: str,
                           keyframe: bool) -> "_Prepared":
        """An increment of our public copy for `peer` (or a keyframe): peerd.net.copies."""
        src = tw._Pieces(data.pieces).tensor(0, data.layout.nbytes)
        m = await dp.senders.message(kind, data.layout, src, comp, data.ranges or (), iteration, peer, keyframe)
        return await cls.of_message(dp, data, m)

    @classmethod
    async def of_message(cls, dp: DataPlane, data: Outgoing, m: cp.Message) -> "_Prepared":
        try:
            pieces = [tw.flat_view(m.buf)[:m.plan.wire_bytes]]
            algo = dp.checksum_algo
            checksum = await dp.checksum(pieces) if algo != "none" else 0
        except BaseException:
            m.release()
            raise
        return cls(dp, data, data.layout, m.compression, pieces, m.plan.wire_bytes, algo, checksum,
                   next(dp._ids), None, None, m)

    def header(self, iteration: int, kind: str) -> bytes:
        m, dp = self.copy, self.dp
        return tw.encode_header(pb.TensorHeader(
            sender=dp.node_id, run_id=dp.run_id, iteration=iteration,
            tensors=self.layout.to_proto(), total_bytes=self.layout.nbytes, wire_bytes=self.wire_bytes,
            checksum_algo=self.checksum_algo, checksum=self.checksum, compression=self.compression,
            transfer_id=self.transfer_id, kind=kind, mass=self.data.mass if self.data.mass != 1.0 else 0.0,
            copy_epoch=m.epoch if m else 0, copy_base=m.base if m else 0, copy_version=m.version if m else 0,
            ranges=[x for pair in m.ranges for x in pair] if m else ()))


class _Assembly:
    """One incoming transfer: checks order and bounds of each chunk, copies it into place."""

    def __init__(self, dp: DataPlane, peer: str, h: pb.TensorHeader, layout: tw.Layout,
                 dst: torch.Tensor | None, wbuf: torch.Tensor | None, reserved: int, sink: Sink | None = None,
                 plan: cp.Plan | None = None):
        self.dp, self.peer, self.h, self.layout = dp, peer, h, layout
        self.plan = plan                          # set: quantized or copy mode (peerd.net.copies)
        self.dst, self.wbuf, self.reserved = dst, wbuf, reserved
        self.sink = sink                          # set: chunks go there, there is no buffer
        self.view = tw.flat_view(wbuf) if wbuf is not None else None
        self.wire_bytes = h.wire_bytes
        self.update = _base_kind(h.kind) in UPDATE_KINDS
        self.received = 0
        self.crcs: list[tuple[Any, int]] = []   # (crc or its future, length) per part, in order
        self.algo = h.checksum_algo
        self.check = self.algo in ("crc32", "crc32c")
        self.part: list[memoryview] = []        # chunks not yet handed to a checksum worker
        self.part_bytes = 0
        self.t0 = time.perf_counter()
        self.done = False

    async def chunk(self, offset: int, data: memoryview) -> None:
        n = len(data)
        if n == 0:
            raise TransferError("bad_frame", f"empty chunk at offset {offset}")
        if offset != self.received:
            raise TransferError("out_of_order", f"chunk at offset {offset}, expected {self.received}")
        if offset + n > self.wire_bytes:
            raise TransferError("overflow", f"chunk ends at {offset + n}, beyond the announced "
                                f"{self.wire_bytes} wire bytes")
        if self.sink is not None:
            await self.sink.chunk(offset, data)
            held = data                          # the frame's bytes, kept alive by this view
        else:
            self.view[offset:offset + n] = data
            held = self.view[offset:offset + n]
        self.dp.activity(self.peer)
        if self.update:
            self.dp.update_activity(self.peer)
        if self.check:   # in parts of CRC_PART to a worker (the loop goes on reading), combined at the end
            self.part.append(held)
            self.part_bytes += n
            if self.part_bytes >= CRC_PART:
                self._checksum_part()
        self.received += n

    def _checksum_part(self) -> None:
        if not self.part_bytes:
            return
        fn = tw.crc32c if self.algo == "crc32c" else tw.crc32
        self.crcs.append((self.dp.crc_pool.submit(fn, self.part), self.part_bytes))
        self.part, self.part_bytes = [], 0

    async def finish(self) -> Received:
        h = self.h
        if self.received != self.wire_bytes:
            raise TransferError("truncated", f"stream ended after {self.received} of {self.wire_bytes} "
                                "bytes", grpc.StatusCode.DATA_LOSS)
        if self.check:
            self._checksum_part()
            crc, poly = 0, tw.CRC32C_POLY if self.algo == "crc32c" else tw.CRC32_POLY
            for c, n in self.crcs:
                if not isinstance(c, int):
                    c = await asyncio.wrap_future(c)
                crc = tw.crc32_combine(crc, c, n, poly)
            if crc != h.checksum:
                raise TransferError("checksum", f"{self.algo} {crc:#010x} does not match header.checksum "
                                    f"{h.checksum:#010x}", grpc.StatusCode.DATA_LOSS)
        seconds = time.perf_counter() - self.t0
        dp = self.dp
        if self.sink is not None:
            stats = await self.sink.finish()
            self.done = True
            dp.counters["bytes_received"] += self.wire_bytes
            return Received(h.sender, h.run_id, h.iteration, h.kind, h.transfer_id, self.layout,
                            torch.empty(0, dtype=torch.uint8), self.layout.nbytes, self.wire_bytes, seconds,
                            h.compression, tw.ROUNDING_BOUND[h.compression], None, stats, sunk=True,
                            mass=h.mass or 1.0)
        if self.plan is not None:
            try:
                await cp.receive(dp.copies, h, self.plan, self.wbuf, self.dst)
            except cp.CopyRefused as e:
                raise TransferError("copy_base", str(e), grpc.StatusCode.FAILED_PRECONDITION) from None
            except quant.QuantError as e:
                raise TransferError("bad_values", str(e)) from None
        elif self.wbuf is not self.dst:
            await asyncio.to_thread(tw.decompress, self.layout, self.wbuf, self.dst, h.compression)
        if self.wbuf is not self.dst:
            dp.pool.put(self.wbuf)
            dp.budget.release(self.peer, self.wire_bytes)
            self.reserved -= self.wire_bytes
            self.wbuf = self.dst
        self.stats = None
        if dp.layout_for(h.kind) is not None:   # a run's parameters: the update checks' pass, off the loop
            self.stats = await asyncio.wrap_future(dp.crc_pool.submit(tw.param_stats, self.layout, self.dst))
        self.done = True
        dp.counters["bytes_received"] += self.wire_bytes
        dst, peer, reserved = self.dst, self.peer, self.reserved
        pooled = h.kind not in UNPOOLED_KINDS

        def release() -> None:
            if pooled:
                dp.pool.put(dst)
            dp.budget.release(peer, reserved)

        return Received(h.sender, h.run_id, h.iteration, h.kind, h.transfer_id, self.layout, dst,
                        self.layout.nbytes, self.wire_bytes, seconds, h.compression,
                        tw.ROUNDING_BOUND[h.compression], release, self.stats, mass=h.mass or 1.0)

    def abort(self, pushed: bool = False) -> None:
        """The transfer failed; `pushed`: a push, which its sender does not send again."""
        if self.done:
            return
        self.done = True
        if pushed and self.update and self.dp.on_update_lost is not None:
            self.dp.on_update_lost(self.peer, self.h.kind, self.h.iteration)
        if self.sink is not None:
            self.sink.abort("the transfer failed")
            return
        self.dp.pool.put(self.dst)
        if self.wbuf is not self.dst:
            self.dp.pool.put(self.wbuf)
        self.dp.budget.release(self.peer, self.reserved)


# ---- helpers ---------------------------------------------------------------------------------

async def deliver(to: "asyncio.Queue[Received] | Callable[[Received], Awaitable[None] | None]", rec: Received,
                  timeout: float) -> None:
    """Hand a verified transfer to its taker (a queue, or a callback that may be async), waiting at
    most `timeout`; a transfer not taken is released and refused."""
    try:
        if isinstance(to, asyncio.Queue):
            await asyncio.wait_for(to.put(rec), timeout)
        else:
            out = to(rec)
            if inspect.isawaitable(out):
                await asyncio.wait_for(out, timeout)
    except TimeoutError:
        rec.release()
        raise TransferError("not_taken", f"the daemon did not take the transfer within {timeout}s",
                            grpc.StatusCode.RESOURCE_EXHAUSTED) from None
    except BaseException:
        rec.release()
        raise


class Throttle:
    """At most one call of `fn(key)` per `every` seconds per key (a bounded memory of keys)."""

    def __init__(self, every: float, limit: int = 4096) -> None:
        self.every, self.limit = every, limit
        self.fn: Callable[[str], None] | None = None
        self._at: dict[str, float] = {}

    def __call__(self, key: str) -> None:
        if self.fn is None or not key:
            return
        now = time.monotonic()
        if now - self._at.get(key, -self.every) >= self.every:
            if len(self._at) >= self.limit:
                self._at.clear()
            self._at[key] = now
            self.fn(key)


def check_pull_request(raw: bytes, peer: str, run_id: str, kinds: set[str]) -> pb.PullRequest:
    """A PullRequest parsed and checked against the caller and this node; TransferError if not."""
    try:
        req = pb.PullRequest.FromString(raw)
    except Exception as e:
        raise TransferError("bad_request", f"PullRequest does not parse ({e})") from None
    if not peer:
        raise TransferError("unauthenticated", f"no {AUTH_KEY} on the call", grpc.StatusCode.UNAUTHENTICATED)
    if req.requester != peer:
        raise TransferError("sender_mismatch", f"requester {req.requester!r} is not the "
                            f"authenticated node {peer!r}", grpc.StatusCode.PERMISSION_DENIED)
    if req.run_id != run_id:
        raise TransferError("run_mismatch", f"run_id {req.run_id!r}, this node serves run "
                            f"{run_id!r}", grpc.StatusCode.FAILED_PRECONDITION)
    kind = req.kind or "model"
    if _base_kind(kind) not in kinds or req.compression not in tw.ROUNDING_BOUND:
        raise TransferError("bad_request", f"kind {kind!r} / compression {req.compression} unknown")
    return req


def check_header(h: pb.TensorHeader, max_tensors: int, max_bytes: int) -> tuple[tw.Layout, int, "cp.Plan | None"]:
    """A push's header checked against itself and the limits: (its layout, its bytes on the wire,
    the wire plan when quantized or in copy mode). Raises TransferError naming the first field that
    does not hold."""
    if h.compression not in tw.ROUNDING_BOUND:
        raise TransferError("bad_header", f"header.compression {h.compression} unknown")
    if h.checksum_algo not in CHECKSUMS:
        raise TransferError("bad_header", f"header.checksum_algo {h.checksum_algo!r} not one of "
                            f"{sorted(CHECKSUMS)}")
    if h.total_bytes > max_bytes:
        raise TransferError("too_large", f"header.total_bytes {h.total_bytes} exceeds the limit "
                            f"{max_bytes}", grpc.StatusCode.RESOURCE_EXHAUSTED)
    try:
        layout = tw.Layout.from_proto(h.tensors, max_tensors, max_bytes)
    except tw.WireError as e:
        raise TransferError("bad_layout", str(e)) from None
    if layout.nbytes != h.total_bytes:
        raise TransferError("bad_layout", f"header.total_bytes {h.total_bytes} does not match the "
                            f"layout's {layout.nbytes} bytes")
    if not (math.isfinite(h.mass) and 0 <= h.mass <= MAX_MASS):
        raise TransferError("bad_header", f"header.mass {h.mass} not within [0, {MAX_MASS:g}]")
    if not h.copy_epoch and (h.copy_base or h.copy_version or h.ranges):
        raise TransferError("bad_header", "copy_base, copy_version or ranges without copy_epoch")
    plan = None
    if h.copy_epoch or h.compression in cp.BITS:
        try:
            plan = cp.plan(layout, h.compression, cp.check_ranges(h.ranges, layout))
        except tw.WireError as e:
            raise TransferError("bad_header", str(e)) from None
        wire_bytes = plan.wire_bytes
    else:
        wire_bytes = layout.wire(h.compression).nbytes
    if wire_bytes != h.wire_bytes:
        raise TransferError("bad_layout", f"header.wire_bytes {h.wire_bytes} does not match the "
                            f"{wire_bytes} bytes the layout has on the wire")
    return layout, wire_bytes, plan


def _base_kind(kind: str) -> str:
    """"model:3f2a..." -> "model": a kind may carry a tag after a colon (the daemon tags each
    training run's transfers, so a late update of one run never reaches the next)."""
    return kind.partition(":")[0]


def _auth_node(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_KEY:
            return value if isinstance(value, str) else ""
    return ""


def _decode(raw: bytes, max_header: int) -> tuple[int, Any]:
    try:
        return tw.decode_frame(raw, max_header)
    except tw.WireError as e:
        raise TransferError("bad_frame", str(e)) from None


def _compression(value: int | str) -> int:
    if isinstance(value, str):
        if value not in tw.COMPRESSION_NAMES:
            raise ValueError(f"compression {value!r}: want one of {sorted(tw.COMPRESSION_NAMES)}")
        return tw.COMPRESSION_NAMES[value]
    if value not in tw.ROUNDING_BOUND:
        raise ValueError(f"compression {value}: unknown")
    return value


# grpc aio (grpc/grpc#36066): when a receiver refuses a push while the sender is still writing, the
# sender's failed write can replace the receiver's status with this one. The receiver counts and
# logs its real reason; the sender can only say that the stream was cut short.
CUT_SHORT_DETAILS = "Internal error from Core"


def _reason(e: grpc.aio.AioRpcError) -> str:
    """The receiver's reason label from 'reason: details', else the status code name."""
    details = e.details() or ""
    if e.code() == grpc.StatusCode.INTERNAL and details.startswith(CUT_SHORT_DETAILS):
        return "cut_short"
    head = details.split(":", 1)[0]
    return head if head.replace("_", "").isalpha() and head.islower() else e.code().name.lower()


def _diff(want: tw.Layout, got: tw.Layout) -> str:
    if len(want.specs) != len(got.specs):
        return f"{len(got.specs)} tensors, want {len(want.specs)}"
    for i, (a, b) in enumerate(zip(want.specs, got.specs)):
        if a != b:
            return f"tensor {i}: got {b.name} {b.dtype}{list(b.shape)}, want {a.name} {a.dtype}{list(a.shape)}"
    return "same specs"
