"""Cluster-secret authentication of every Peer RPC.

Every RPC from a peer carries, in gRPC metadata:

    x-peerd-node   the caller's node id
    x-peerd-ts     the caller's clock, unix seconds
    x-peerd-nonce  16 random bytes, hex
    x-peerd-mac    HMAC-SHA256(secret, "peerd-v1|method|node|ts|nonce"), hex

The server interceptor refuses (UNAUTHENTICATED) a call whose MAC does not verify, whose clock
differs from ours by more than `auth_max_skew`, or whose nonce it has already seen (replay). Nonces
are remembered for twice the skew window, in a bounded cache. Hello replies carry the server's own
MAC over the caller's nonce (`x-peerd-reply-mac`), so the caller knows the server holds the secret
too: authentication is mutual.

The MAC covers the call, not the message bodies: it proves membership, and TLS (optional) protects
the bytes on untrusted networks.

Floods. Every call passes a `RefusalGate` before anything else: one token bucket of refusals per
(source address, claimed node id). A key that has spent `auth_refusal_burst` refusals (earning back
`auth_refusal_rate` per second) is refused at once, before the HMAC, unlogged: a flood costs a dict
lookup per call. The claimed id is part of the key so a flooder behind the address of a real peer
(NAT, one host) does not lock that peer out; a flooder that invents a new id per call gets one HMAC
per call, still bounded, and the tables are bounded by `auth_max_sources` (least recently seen
forgotten, so ids used once never push out a key that keeps knocking).
Refusals are logged once per source address per `auth_log_every`; what was suppressed meanwhile is
logged as one count summary (`flush()`), so a flood costs no log storm.
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import os
import secrets
import stat
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Sequence
from urllib.parse import unquote

import grpc

log = logging.getLogger("peerd.auth")

NODE_KEY = "x-peerd-node"
TS_KEY = "x-peerd-ts"
NONCE_KEY = "x-peerd-nonce"
MAC_KEY = "x-peerd-mac"
REPLY_MAC_KEY = "x-peerd-reply-mac"
MIN_SECRET_LEN = 16

Metadata = Sequence[tuple[str, str]]


class SecretError(ValueError):
    """The cluster secret is missing or unusable."""


def load_secret(secret_file: str, env: dict[str, str] | None = None) -> bytes:
    """The secret from --secret-file, else PEERD_SECRET; stripped of surrounding whitespace."""
    env = os.environ if env is None else env
    if secret_file:
        path = Path(secret_file).expanduser()
        try:
            raw = path.read_bytes().strip()
        except OSError as e:
            raise SecretError(f"cannot read secret file {path}: {e.strerror}") from None
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("secret file %s is readable by others (mode %o); chmod 600 it", path, mode & 0o777)
        source = f"secret file {path}"
    elif env.get("PEERD_SECRET"):
        raw = env["PEERD_SECRET"].strip().encode()
        source = "PEERD_SECRET"
    else:
        raise SecretError("no cluster secret: pass --secret-file FILE or set PEERD_SECRET "
                          "(create one with `peerd keys new FILE`)")
    if len(raw) < MIN_SECRET_LEN:
        raise SecretError(f"{source}: the secret is {len(raw)} bytes; use at least {MIN_SECRET_LEN}")
    return raw


def new_secret() -> str:
    return secrets.token_hex(32)


class ReplayCache:
    """Nonces seen recently; bounded, oldest forgotten first."""

    def __init__(self, capacity: int, window: float) -> None:
        self.capacity = capacity
        self.window = window
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check_and_add(self, nonce: str, now: float) -> bool:
        """True when the nonce is fresh (and remembers it); False for a replay."""
        while self._seen:
            oldest, seen_at = next(iter(self._seen.items()))
            if now - seen_at <= self.window and len(self._seen) < self.capacity:
                break
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


class Authenticator:
    """Signs outgoing calls and verifies incoming ones with the cluster secret."""

    def __init__(self, secret: bytes, node_id: str, max_skew: float = 30.0,
                 replay_capacity: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.node_id = node_id
        self.max_skew = max_skew
        self._clock = clock
        self._replays = ReplayCache(replay_capacity, 2 * max_skew)

    def _mac(self, method: str, node: str, ts: str, nonce: str) -> str:
        msg = f"peerd-v1|{method}|{node}|{ts}|{nonce}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def sign(self, method: str) -> list[tuple[str, str]]:
        """Metadata for one outgoing call to `method` (the full path, /peerd.v1.Peer/Name)."""
        ts = f"{self._clock():.6f}"
        nonce = secrets.token_hex(16)
        return [(NODE_KEY, self.node_id), (TS_KEY, ts), (NONCE_KEY, nonce),
                (MAC_KEY, self._mac(method, self.node_id, ts, nonce))]

    def verify(self, method: str, metadata: Metadata | None) -> tuple[str | None, str]:
        """(node id, "") when the call is authentic, else (None, reason)."""
        md = dict(metadata or ())
        node, ts, nonce, mac = (md.get(k) for k in (NODE_KEY, TS_KEY, NONCE_KEY, MAC_KEY))
        if not (node and ts and nonce and mac):
            return None, "no credentials (is the caller a peerd daemon with a cluster secret?)"
        if len(node) > 128 or len(nonce) > 64 or len(mac) != 64 or len(ts) > 32:
            return None, "malformed credentials"
        if not hmac.compare_digest(self._mac(method, node, ts, nonce), mac):
            return None, "cluster secret mismatch"
        try:
            skew = abs(self._clock() - float(ts))
        except ValueError:
            return None, "malformed timestamp"
        if not skew <= self.max_skew:  # also refuses NaN
            return None, f"clock skew {skew:.1f}s exceeds {self.max_skew:.0f}s"
        if not self._replays.check_and_add(nonce, self._clock()):
            return None, "replayed call"
        return node, ""

    def reply_mac(self, caller_nonce: str) -> str:
        return self._mac("reply", self.node_id, "", caller_nonce)

    def verify_reply(self, server_node: str, caller_nonce: str, mac: str | None) -> bool:
        if not mac:
            return False
        return hmac.compare_digest(self._mac("reply", server_node, "", caller_nonce), mac)


@dataclass
class _Source:
    """Log state of one refusing source address."""
    last_logged: float
    suppressed: int = 0
    reasons: Counter = field(default_factory=Counter)


class RefusalGate:
    """Rate limit and log of refused calls, per source; every table bounded by `max_sources`."""

    def __init__(self, burst: int = 50, rate: float = 5.0, max_sources: int = 4096, log_every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.rate, self.max_sources, self.log_every = burst, rate, max_sources, log_every
        self._clock = clock
        self._buckets: OrderedDict[tuple[str, str], list[float]] = OrderedDict()  # key -> [tokens, at]
        self._sources: OrderedDict[str, _Source] = OrderedDict()
        self.refused = 0          # refused after verification (no or bad credentials, replay, skew)
        self.rate_limited = 0     # refused unverified, the key having spent its burst
        self.log_lines = 0        # lines this gate logged (a flood must not grow this)

    def limited(self, key: tuple[str, str]) -> bool:
        """True when `key` has no refusal left: refuse it without verifying anything."""
        b = self._buckets.get(key)
        if b is None:
            return False
        self._buckets.move_to_end(key)  # a key that keeps knocking is never the one forgotten
        now = self._clock()
        b[0] = min(float(self.burst), b[0] + (now - b[1]) * self.rate)
        b[1] = now
        return b[0] < 1.0

    def charge(self, key: tuple[str, str]) -> None:
        """A verified refusal spends one token of `key`."""
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.max_sources:
                self._buckets.popitem(last=False)
            b = self._buckets[key] = [float(self.burst), self._clock()]
        else:
            self._buckets.move_to_end(key)
        b[0] -= 1.0

    def note(self, source: str, reason: str, detail: str = "") -> None:
        """Count a refusal; log it when `source` had no line within log_every, else keep it for
        the next summary."""
        now = self._clock()
        src = self._sources.get(source)
        if src is None or now - src.last_logged >= self.log_every:
            if src is not None and src.suppressed:
                self._summary(source, src, now)
            if src is None and len(self._sources) >= self.max_sources:
                self._sources.popitem(last=False)
            self._sources[source] = _Source(now)
            self._sources.move_to_end(source)
            self.log_lines += 1
            log.warning("refused call from %s: %s%s (further refusals from it are counted and summarised "
                        "every %.0fs)", source, reason, detail, self.log_every)
            return
        src.suppressed += 1
        src.reasons[reason.split(":")[0]] += 1

    def flush(self) -> None:
        """Log one count line for each source with refusals not logged for log_every (call it
        periodically: a flood that stopped still gets its summary)."""
        now = self._clock()
        for source, src in list(self._sources.items()):
            if src.suppressed and now - src.last_logged >= self.log_every:
                self._summary(source, src, now)

    def _summary(self, source: str, src: _Source, now: float) -> None:
        reasons = ", ".join(f"{r} x{n}" for r, n in src.reasons.most_common(4))
        self.log_lines += 1
        log.warning("refused %d more calls from %s in the last %.0fs (%s)", src.suppressed, source,
                    now - src.last_logged, reasons)
        src.last_logged, src.suppressed = now, 0
        src.reasons.clear()

    def state(self) -> dict[str, int]:
        return {"refused": self.refused, "rate_limited": self.rate_limited, "log_lines": self.log_lines,
                "rate_limit_entries": len(self._buckets), "log_entries": len(self._sources)}


def _source_host(peer: str) -> str:
    # "ipv4:127.0.0.1:5555" -> "127.0.0.1"; "ipv6:[::1]:5555" -> "[::1]"
    _, _, rest = unquote(peer).partition(":")
    host, _, _ = rest.rpartition(":")
    return host or peer


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every Peer RPC that does not prove the cluster secret; rate-limits refused sources.

    The check runs inside the returned handler, where the caller's address is known (gRPC does not
    give it to the interceptor itself). The handlers it wraps take raw bytes, so nothing of a
    refused call's body is ever parsed."""

    def __init__(self, auth: Authenticator, gate: RefusalGate | None = None) -> None:
        self.auth = auth
        self.gate = gate or RefusalGate()

    async def _check(self, method: str, metadata: Metadata | None, context: grpc.aio.ServicerContext) -> None:
        gate = self.gate
        md = dict(metadata or ())
        claimed = str(md.get(NODE_KEY, ""))[:64]
        source = _source_host(context.peer())
        key = (source, claimed)
        if gate.limited(key):
            gate.rate_limited += 1
            gate.note(source, "rate-limited")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peerd: refused: rate-limited after {gate.burst} refused calls from "
                                f"{source} (node {claimed[:32] or '?'}); {gate.rate:g} per second allowed")
        node, reason = self.auth.verify(method, metadata)
        if node is None:
            gate.refused += 1
            gate.charge(key)
            gate.note(source, reason, f" (claims node {claimed[:32] or '?'}, {method})")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"peerd: refused: {reason}")

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method, metadata, check = details.method, details.invocation_metadata, self._check
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                await check(method, metadata, context)
                return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
        if handler.stream_unary:
            inner = handler.stream_unary

            async def stream_unary(request_iterator, context):
                await check(method, metadata, context)
                return await inner(request_iterator, context)
            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, method, metadata, check), **kw)
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, method, metadata, check), **kw)


def _streaming(inner, method: str, metadata, check):
    """A response-streaming behaviour behind the check: an async generator stays one, a coroutine
    that writes with context.write stays a coroutine."""
    if inspect.isasyncgenfunction(inner):
        async def gen(request, context):
            await check(method, metadata, context)
            async for item in inner(request, context):
                yield item
        return gen

    async def coro(request, context):
        await check(method, metadata, context)
        return await inner(request, context)
    return coro
