"""Conversions between the wire messages and the membership table (and the checks they need)."""
from __future__ import annotations

import math

from peerd.net.membership import Member, State
from peerd.net.pki import Revocation
from peerd.net.wirecheck import clip
from peerd.v1 import peer_pb2 as pb

STATE_TO_PB = {State.ALIVE: pb.PEER_STATE_ALIVE, State.SUSPECT: pb.PEER_STATE_SUSPECT,
               State.DEAD: pb.PEER_STATE_DEAD, State.LEFT: pb.PEER_STATE_LEFT}
PB_TO_STATE = {v: k for k, v in STATE_TO_PB.items()}

CAP_FIELDS = ("device_kind", "gpu_name", "gpu_memory_bytes", "step_time_s", "cpu_count", "peerd_version", "site",
              "relay")
CAP_TEXT = {"device_kind": 16, "gpu_name": 128, "peerd_version": 64, "site": 64}   # longest accepted


def caps_to_pb(caps: dict) -> pb.Capabilities:
    return pb.Capabilities(**{k: caps[k] for k in CAP_FIELDS if k in caps})


def caps_from_pb(msg: pb.Capabilities) -> tuple[dict, str]:
    """(capabilities, "") or ({}, why they are refused): strings bounded and printable, the step
    time a finite number >= 0."""
    caps = {k: getattr(msg, k) for k in CAP_FIELDS}
    for key, limit in CAP_TEXT.items():
        if len(caps[key]) > limit or not caps[key].isprintable():
            return {}, f"capabilities.{key} {clip(caps[key], 40)} is not a printable string of at most {limit} characters"
    if not (math.isfinite(caps["step_time_s"]) and caps["step_time_s"] >= 0):
        return {}, f"capabilities.step_time_s {caps['step_time_s']} is not a finite number >= 0"
    return caps, ""


def revocation_to_pb(r: Revocation) -> pb.Revocation:
    return pb.Revocation(node_id=r.node, revoked_at=r.at, reason=r.reason, signature=r.signature)


def revocation_from_pb(r) -> Revocation:
    """From pb.Revocation or control's RevokeRequest (same fields); checked by Revocations.add."""
    return Revocation(r.node_id, r.revoked_at, r.reason, bytes(r.signature))


def member_to_pb(m: Member) -> pb.PeerInfo:
    """A gossip row: only what a receiver acts on (Membership.merge_gossip). A peer's capabilities
    and run come from its own Hello, never from hearsay, so rows leave them out."""
    return pb.PeerInfo(node_id=m.node_id, address=m.address, incarnation=m.incarnation,
                       state=STATE_TO_PB[m.state])


def rows_from_pb(peers) -> list[dict]:
    return [{"node_id": p.node_id, "address": p.address, "incarnation": p.incarnation,
             "state": PB_TO_STATE.get(p.state)} for p in peers]


def split_host_port(address: str, allow_zero: bool = False) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; port 0 (any free port) only when allowed."""
    host, sep, port = address.rpartition(":")
    lowest = 0 if allow_zero else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def is_unspecified(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")
