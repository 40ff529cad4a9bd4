"""Authentication of every Peer RPC: each call is signed by its sender's node key, for one receiver,
over its body, once.

A call carries, in gRPC metadata (each key exactly once; a repeated key is refused):

    x-peerd-node   the sender's node id (the hash of its public key, peerd.net.pki)
    x-peerd-cert   the sender's node certificate (DER, base64), issued by the cluster CA
    x-peerd-to     the receiver's node id ("?" when the caller does not know it yet)
    x-peerd-ts     the sender's clock, unix seconds
    x-peerd-nonce  16 random bytes, hex
    x-peerd-body   SHA-256 of the request message (hex); "-" for a streamed request
    x-peerd-sig    the sender's signature over "peerd-call-v2", method, node, to, ts, nonce, body

The server refuses (UNAUTHENTICATED) a call whose certificate no trusted CA issued, whose node id is
not its certificate key's, whose node is revoked, whose signature does not verify, whose clock
differs from ours by more than `auth_max_skew`, whose (node, nonce) it has seen (replay), whose
receiver is another node, or whose body does not hash to x-peerd-body. A call for another receiver
is answered with this node's id (x-peerd-receiver), which is public, so a caller that dialled an
address learns whom it reached and signs again for it. Over TLS, the call's signer must also be
the node of the TLS client certificate.

Replies of unary calls carry the server's certificate and its signature over "peerd-reply-v2",
method, server, caller, the caller's nonce and the reply's SHA-256 (trailing metadata), so the
caller knows which node answered, and that nothing changed the answer.

Streamed bodies (PushTensor frames) are not covered by the signature; on any address that is not
loopback they travel inside mutual TLS (peerd.node.channels), which binds them to the connection
of the authenticated node.

Order of the checks: the refusal gate first (a dict lookup), then the shape of the metadata, then
the certificate (verified once and cached), then one signature verification; a refused call's
body is never read (peerd.net.auth.AuthInterceptor reads a unary request only after admitting it).

Floods. Every call passes a `RefusalGate`: one token bucket of refusals per *transport identity*:
the node of the TLS client certificate, or (plaintext) the TCP connection. A key that has spent
`auth_refusal_burst` refusals (earning back `auth_refusal_rate` per second) is refused at once,
before any verification, unlogged. Nobody can spend another node's bucket: over TLS that needs
its key, in plaintext its connection. Tables are bounded by `auth_max_sources`. Refusals are
logged once per source address per `auth_log_every`, then summarised (`flush()`).
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import heapq
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
from google.protobuf.message import DecodeError

from peerd.net import pki

log = logging.getLogger("peerd.auth")

NODE_KEY = "x-peerd-node"
CERT_KEY = "x-peerd-cert"
TO_KEY = "x-peerd-to"
TS_KEY = "x-peerd-ts"
NONCE_KEY = "x-peerd-nonce"
BODY_KEY = "x-peerd-body"
SIG_KEY = "x-peerd-sig"
RECEIVER_KEY = "x-peerd-receiver"      # a refusal's hint: the node that received the call
CALL_KEYS = (NODE_KEY, CERT_KEY, TO_KEY, TS_KEY, NONCE_KEY, BODY_KEY, SIG_KEY)
V1_KEYS = ("x-peerd-mac",)             # protocol 1's HMAC credentials
UNKNOWN_RECEIVER = "?"
STREAMED = "-"
MIN_SECRET_LEN = 16
MAX_CERT_CHARS = 4096
MAX_SIG_CHARS = 1024
BIG_BODY = 256 * 1024          # bodies hashed in a worker thread (hashlib releases the GIL), not on the loop

Metadata = Sequence[tuple[str, str | bytes]]


class SecretError(ValueError):
    """The cluster secret is missing or unusable."""


def load_secret(secret_file: str, env: dict[str, str] | None = None) -> bytes:
    """The secret from --secret-file, else PEERD_SECRET; stripped of surrounding whitespace. A file
    may hold two secrets on two lines while the secret is rotated (`secrets_of`)."""
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
    for line in secrets_of(raw) or [b""]:
        if len(line) < MIN_SECRET_LEN:
            raise SecretError(f"{source}: a secret is {len(line)} bytes; use at least {MIN_SECRET_LEN}")
    if len(secrets_of(raw)) > 2:
        raise SecretError(f"{source}: at most two secrets (the one in use, then the one being retired)")
    return raw


def secrets_of(raw: bytes) -> list[bytes]:
    """The secrets of a keyring: one per non-empty line, the first one issues."""
    return [line.strip() for line in raw.splitlines() if line.strip()]


def new_secret() -> str:
    return pki.new_secret()


def body_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


class Refusal(Exception):
    """A call (or a reply) that does not authenticate; `reason` is safe to log and return."""

    def __init__(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
                 receiver: str = "") -> None:
        super().__init__(reason)
        self.reason, self.code, self.receiver = reason, code, receiver


@dataclass(frozen=True)
class Caller:
    """An admitted call: who sent it, its nonce and the body hash it announced."""
    node: str
    nonce: str
    body: str


class ReplayCache:
    """(node, nonce) of calls admitted within the skew window; bounded. When full of calls still
    in the window, the oldest is forgotten and every call no newer than it is refused from then on
    (the floor), so a forgotten call can never be replayed."""

    def __init__(self, capacity: int, window: float) -> None:
        self.capacity = max(1, capacity)
        self.window = window
        self._heap: list[tuple[float, tuple[str, str]]] = []
        self._seen: set[tuple[str, str]] = set()
        self.floor = float("-inf")

    def check_and_add(self, key: tuple[str, str], ts: float, now: float) -> str:
        """"" when the call is fresh (and remembers it), else why not."""
        heap, seen = self._heap, self._seen
        while heap and heap[0][0] < now - self.window:
            seen.discard(heapq.heappop(heap)[1])
        if key in seen:
            return "replayed call"
        if ts <= self.floor:
            return "call older than the ones this daemon still remembers (its replay cache is full)"
        if len(seen) >= self.capacity:
            old_ts, old = heapq.heappop(heap)
            seen.discard(old)
            self.floor = max(self.floor, old_ts)
            if ts <= self.floor:
                return "call older than the ones this daemon still remembers (its replay cache is full)"
        heapq.heappush(heap, (ts, key))
        seen.add(key)
        return ""

    def __len__(self) -> int:
        return len(self._seen)


def _one_each(metadata: Metadata | None) -> dict[str, str]:
    """Our credential headers, each exactly once (a repeated one is refused: a server that checked
    the last and a handler that read the first would disagree on who called)."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if not key.startswith("x-peerd-"):
            continue
        if key in found:
            raise Refusal(f"header {key} given more than once")
        found[key] = value if isinstance(value, str) else ""
    return found


class Authenticator:
    """Signs our calls and replies; verifies the calls and replies of others."""

    def __init__(self, creds: pki.Credentials, trust: pki.ClusterTrust, revoked: pki.Revocations | None = None,
                 max_skew: float = 30.0, replay_capacity: int = 100_000, cache_size: int = 4096,
                 clock: Callable[[], float] = time.time) -> None:
        self.creds = creds
        self.trust = trust
        self.revoked = revoked if revoked is not None else pki.Revocations(trust)
        self.max_skew = max_skew
        self._clock = clock
        self._replays = ReplayCache(replay_capacity, max_skew)
        self._certs: OrderedDict[str, tuple[str, pki.PublicKey] | str] = OrderedDict()   # b64 -> (node, key) | why not
        self._tls: OrderedDict[bytes, str] = OrderedDict()                             # TLS peer PEM -> node
        self._cache_size = cache_size

    @property
    def node_id(self) -> str:
        return self.creds.node_id

    # --- our side -------------------------------------------------------------------------------
    def sign(self, method: str, to: str, body: bytes | None) -> list[tuple[str, str]]:
        """Metadata for one call to `method` (/peerd.v1.Peer/Name) for node `to` ("?": unknown);
        `body` is the serialized request, None for a streamed one."""
        ts = f"{self._clock():.6f}"
        nonce = secrets.token_hex(16)
        digest = STREAMED if body is None else body_hash(body)
        sig = self.creds.sign(_call_bytes(method, self.node_id, to, ts, nonce, digest))
        return [(NODE_KEY, self.node_id), (CERT_KEY, self.creds.cert_b64), (TO_KEY, to), (TS_KEY, ts),
                (NONCE_KEY, nonce), (BODY_KEY, digest), (SIG_KEY, base64.b64encode(sig).decode())]

    def sign_reply(self, method: str, caller: Caller, raw: bytes) -> tuple[tuple[str, str], ...]:
        sig = self.creds.sign(_reply_bytes(method, self.node_id, caller.node, caller.nonce, body_hash(raw)))
        return ((CERT_KEY, self.creds.cert_b64), (SIG_KEY, base64.b64encode(sig).decode()))

    # --- their side -----------------------------------------------------------------------------
    def peer_cert(self, cert_b64: str) -> tuple[str, pki.PublicKey]:
        """(node id, public key) of a node certificate a trusted CA issued; cached either way."""
        got = self._certs.get(cert_b64)
        if got is None:
            try:
                cert = pki.cert_from_b64(cert_b64)
                got = (self.trust.check(cert), cert.public_key())
            except pki.PkiError as e:
                got = f"certificate: {e}"
            self._certs[cert_b64] = got
            while len(self._certs) > self._cache_size:
                self._certs.popitem(last=False)
        else:
            self._certs.move_to_end(cert_b64)
        if isinstance(got, str):
            raise Refusal(got)
        return got

    def transport_node(self, pem: bytes) -> str:
        """The node id of a TLS peer's certificate (the TLS handshake verified it)."""
        node = self._tls.get(pem)
        if node is None:
            try:
                node = pki.node_id_of(pki.cert_from_pem(pem).public_key())
            except (pki.PkiError, ValueError):
                node = ""
            self._tls[pem] = node
            while len(self._tls) > self._cache_size:
                self._tls.popitem(last=False)
        return node

    def verify(self, method: str, metadata: Metadata | None, transport_node: str | None = None) -> Caller:
        """The caller of an authentic call; raises Refusal naming the first check that failed.
        The body hash is checked by the caller of this (it has the body)."""
        md = _one_each(metadata)
        if not any(k in md for k in CALL_KEYS):
            if any(k in md for k in V1_KEYS):
                raise Refusal("credentials of protocol 1 (an older peerd): upgrade every daemon of the cluster")
            raise Refusal("no credentials (is the caller a peerd daemon of this cluster?)")
        missing = [k for k in CALL_KEYS if not md.get(k)]
        if missing:
            raise Refusal(f"incomplete credentials (no {', '.join(missing)})")
        node, cert, to, ts, nonce, digest, sig = (md[k] for k in CALL_KEYS)
        if (len(node) != pki.NODE_ID_LEN or len(cert) > MAX_CERT_CHARS or len(to) > pki.NODE_ID_LEN
                or len(ts) > 32 or len(nonce) != 32 or len(digest) not in (1, 64) or len(sig) > MAX_SIG_CHARS):
            raise Refusal("malformed credentials")
        try:
            sent = float(ts)
        except ValueError:
            raise Refusal("malformed timestamp") from None
        now = self._clock()
        skew = abs(now - sent)
        if not skew <= self.max_skew:  # also refuses NaN
            raise Refusal(f"clock skew {skew:.1f}s exceeds {self.max_skew:.0f}s" if skew == skew
                          else "malformed timestamp")
        signer, key = self.peer_cert(cert)
        if signer != node:
            raise Refusal(f"{NODE_KEY} {node} is not the node of the certificate ({signer})")
        if node in self.revoked:
            raise Refusal(f"node {node} is revoked ({self.revoked.by_node[node].reason or 'no reason given'})",
                          grpc.StatusCode.PERMISSION_DENIED)
        if transport_node is not None and transport_node != node:
            raise Refusal(f"signed by node {node} over the TLS connection of node {transport_node or '?'}",
                          grpc.StatusCode.PERMISSION_DENIED)
        try:
            raw_sig = base64.b64decode(sig, validate=True)
        except ValueError:
            raise Refusal("malformed signature") from None
        if not pki.verify(key, raw_sig, _call_bytes(method, node, to, ts, nonce, digest)):
            raise Refusal("bad signature (the call was altered, or is for another method)")
        if to != self.node_id:
            what = "names no receiver" if to == UNKNOWN_RECEIVER else f"is for node {to}"
            raise Refusal(f"the call {what}; this is node {self.node_id}", receiver=self.node_id)
        why = self._replays.check_and_add((node, nonce), sent, now)
        if why:
            raise Refusal(why)
        return Caller(node, nonce, digest)

    def verify_reply(self, method: str, to: str, nonce: str, raw: bytes, trailing: Metadata | None) -> str:
        """The node that answered our call (signed for `to`, with `nonce`): its certificate, its
        signature over the reply. Raises Refusal."""
        md = _one_each(trailing)
        cert, sig = md.get(CERT_KEY), md.get(SIG_KEY)
        if not cert or not sig or len(cert) > MAX_CERT_CHARS or len(sig) > MAX_SIG_CHARS:
            raise Refusal("the reply is not signed (is the peer a peerd daemon of this cluster?)")
        server, key = self.peer_cert(cert)
        if to != UNKNOWN_RECEIVER and server != to:
            raise Refusal(f"the reply is signed by node {server}, the call was for {to}")
        if server in self.revoked:
            raise Refusal(f"the reply is from node {server}, which is revoked")
        try:
            raw_sig = base64.b64decode(sig, validate=True)
        except ValueError:
            raise Refusal("malformed reply signature") from None
        if not pki.verify(key, raw_sig, _reply_bytes(method, server, self.node_id, nonce, body_hash(raw))):
            raise Refusal("bad reply signature (the reply was altered)")
        return server

    def replay_entries(self) -> int:
        return len(self._replays)


def _call_bytes(method: str, node: str, to: str, ts: str, nonce: str, digest: str) -> bytes:
    return f"peerd-call-v2\n{method}\n{node}\n{to}\n{ts}\n{nonce}\n{digest}".encode()


def _reply_bytes(method: str, server: str, caller: str, nonce: str, digest: str) -> bytes:
    return f"peerd-reply-v2\n{method}\n{server}\n{caller}\n{nonce}\n{digest}".encode()


@dataclass
class _Source:
    """Log state of one refusing source address."""
    last_logged: float
    suppressed: int = 0
    reasons: Counter = field(default_factory=Counter)


class RefusalGate:
    """Rate limit and log of refused calls, per key; every table bounded by `max_sources`."""

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
        src.reasons[reason.split(":")[0][:60]] += 1

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


def source_host(peer: str) -> str:
    # "ipv4:127.0.0.1:5555" -> "127.0.0.1"; "ipv6:[::1]:5555" -> "[::1]"
    _, _, rest = unquote(peer).partition(":")
    host, _, _ = rest.rpartition(":")
    return host or peer


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits only authenticated calls, before their bodies are read; signs unary replies.

    Every handler is served as a request-streaming one, so gRPC reads no request message before
    the check: a refused call costs its metadata, never its (up to 4 MiB) body. An admitted unary
    request is then read (at most `max_request` bytes), its hash checked against the signed one,
    parsed, and handed to the real handler. `streamed`: methods whose requests are streams (their
    frames are not hashed). `unbound`: unary methods whose clients cannot hash the request yet
    (they send "-"); the hash is checked whenever one is given."""

    def __init__(self, auth: Authenticator, gate: RefusalGate | None = None, *, max_request: int = 4 << 20,
                 streamed: frozenset[str] = frozenset(), unbound: frozenset[str] = frozenset()) -> None:
        self.auth = auth
        self.gate = gate or RefusalGate()
        self.max_request = max_request
        self.streamed = streamed
        self.unbound = unbound

    def _transport(self, context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], str, str | None]:
        """(rate-limit key, source host for logs, TLS node or None) of the connection."""
        peer = context.peer() or "?"
        pems = (context.auth_context() or {}).get("x509_pem_cert")
        if pems:
            node = self.auth.transport_node(pems[0])
            return ("tls", node), source_host(peer), node
        return ("conn", peer), source_host(peer), None

    async def _admit(self, method: str, metadata, context) -> Caller:
        gate = self.gate
        key, source, tls_node = self._transport(context)
        if gate.limited(key):
            gate.rate_limited += 1
            gate.note(source, "rate-limited")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peerd: refused: rate-limited after {gate.burst} refused calls on this "
                                f"connection; {gate.rate:g} per second allowed")
        try:
            return self.auth.verify(method, metadata, tls_node)
        except Refusal as r:
            if r.receiver:
                # An authentic call for another node (a first contact): the caller learns whom it
                # reached and signs again; no refusal to count or log.
                await context.abort(r.code, f"peerd: refused: {r.reason}", trailing_metadata=((RECEIVER_KEY, r.receiver),))
            gate.refused += 1
            gate.charge(key)
            gate.note(source, r.reason, f" ({method.rsplit('/', 1)[-1][:40]})")
            await context.abort(r.code, f"peerd: refused: {r.reason}")

    async def _request(self, method: str, caller: Caller, request_iterator, context) -> bytes:
        raw = None
        async for msg in request_iterator:
            if raw is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peerd: more than one request message")
            raw = msg
        if raw is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peerd: no request message")
        if len(raw) > self.max_request:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peerd: request of {len(raw)} bytes (max {self.max_request})")
        if caller.body == STREAMED:
            if method not in self.unbound:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "peerd: refused: the signature covers no request body")
        elif (await asyncio.to_thread(body_hash, raw) if len(raw) > BIG_BODY else body_hash(raw)) != caller.body:
            self.gate.refused += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "peerd: refused: the request body is not the one signed (altered in transit?)")
        return raw

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method, metadata = details.method, details.invocation_metadata
        deser, ser = handler.request_deserializer, handler.response_serializer
        admit, read, auth = self._admit, self._request, self.auth

        async def parsed(request_iterator, context, caller):
            raw = await read(method, caller, request_iterator, context)
            if deser is None:
                return raw
            try:
                return deser(raw)
            except (DecodeError, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: malformed request: {str(e)[:200]}")

        def signed(result, context, caller):
            raw = ser(result) if ser is not None else result
            context.set_trailing_metadata(auth.sign_reply(method, caller, raw))
            return raw

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request_iterator, context):
                caller = await admit(method, metadata, context)
                request = await parsed(request_iterator, context, caller)
                return signed(await inner(request, context), context, caller)
            return grpc.stream_unary_rpc_method_handler(unary_unary)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator, context):
                caller = await admit(method, metadata, context)
                return signed(await inner_su(request_iterator, context), context, caller)
            return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=deser)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def first(request_iterator, context):
                caller = await admit(method, metadata, context)
                return await parsed(request_iterator, context, caller)
            return grpc.stream_stream_rpc_method_handler(_streaming(inner_us, first), response_serializer=ser)

        async def admitted(request_iterator, context):
            await admit(method, metadata, context)
            return request_iterator
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, admitted),
                                                     request_deserializer=deser, response_serializer=ser)


def _streaming(inner, before):
    """A response-streaming behaviour behind `before` (which admits the call and returns what the
    inner behaviour takes): an async generator stays one, a coroutine that writes with
    context.write stays a coroutine."""
    if inspect.isasyncgenfunction(inner):
        async def gen(request_iterator, context):
            request = await before(request_iterator, context)
            async for item in inner(request, context):
                yield item
        return gen

    async def coro(request_iterator, context):
        request = await before(request_iterator, context)
        return await inner(request, context)
    return coro
