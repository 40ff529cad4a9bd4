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
the bytes on untrusted networks. Refusals are logged once per source per `auth_log_every`, so a flood
of bad attempts costs one HMAC each and no log storm.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
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
                 replay_capacity: int = 100_000, log_every: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.node_id = node_id
        self.max_skew = max_skew
        self._clock = clock
        self._replays = ReplayCache(replay_capacity, 2 * max_skew)
        self._log_every = log_every
        self._last_logged: dict[tuple[str, str], float] = {}
        self.refused = 0

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

    def log_refusal(self, source: str, reason: str, detail: str = "") -> None:
        """Log a refused call, at most once per (source, reason) per log_every seconds."""
        self.refused += 1
        now = self._clock()
        key = (source, reason)
        if now - self._last_logged.get(key, -1e18) >= self._log_every:
            if len(self._last_logged) > 10_000:
                self._last_logged.clear()
            self._last_logged[key] = now
            log.warning("refused call from %s: %s%s", source, reason, detail)


def _source_host(peer: str) -> str:
    # "ipv4:127.0.0.1:5555" -> "127.0.0.1"; "ipv6:[::1]:5555" -> "[::1]"
    _, _, rest = unquote(peer).partition(":")
    host, _, _ = rest.rpartition(":")
    return host or peer


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every Peer RPC that does not prove the cluster secret."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        node, reason = self.auth.verify(details.method, details.invocation_metadata)
        if node is not None:
            return handler
        auth = self.auth
        method = details.method
        claimed = dict(details.invocation_metadata or ()).get(NODE_KEY, "?")

        async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
            auth.log_refusal(_source_host(context.peer()), reason, f" (claims node {claimed[:32]}, {method})")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"peerd: refused: {reason}")

        async def refuse_stream(request, context):
            await refuse(request, context)
            yield  # pragma: no cover - abort raises before this

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(refuse)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
