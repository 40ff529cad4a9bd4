"""Credentials for tests that talk to live daemons as a peer would: a fresh member of the test
cluster, a daemon's own identity (its data dir's key), a stranger certified by another secret."""
from __future__ import annotations

from pathlib import Path

import grpc

from peerd.net import pki
from peerd.net.auth import Authenticator
from peerd.node.identity import NODE_KEY_FILE
from tests.daemons import SECRET


def member(secret: str = SECRET, key=None, **kw) -> Authenticator:
    """A node of the cluster of `secret` (a fresh key unless one is given)."""
    trust = pki.ClusterTrust.from_secrets([secret.encode()])
    return Authenticator(pki.Credentials.issued(trust, key), trust, **kw)


def as_daemon(data_dir: Path, secret: str = SECRET, **kw) -> Authenticator:
    """The identity of the daemon whose data dir this is (its own node key)."""
    return member(secret, key=pki.load_key(Path(data_dir) / NODE_KEY_FILE), **kw)


def call(channel: grpc.Channel, method: str, request, auth: Authenticator | None, to: str, *,
         metadata=None, raw: bool = False, timeout: float = 3.0) -> bytes:
    """One unary call signed by `auth` for node `to` (or with `metadata` as given); the raw reply."""
    body = request if raw else request.SerializeToString()
    md = metadata if metadata is not None else (auth.sign(method, to, body) if auth is not None else None)
    return channel.unary_unary(method)(body, metadata=md, timeout=timeout)
