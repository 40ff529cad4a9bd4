"""Conversions between the wire messages and the membership table."""
from __future__ import annotations

from peerd.net.membership import Member, State
from peerd.v1 import peer_pb2 as pb

STATE_TO_PB = {State.ALIVE: pb.PEER_STATE_ALIVE, State.SUSPECT: pb.PEER_STATE_SUSPECT,
               State.DEAD: pb.PEER_STATE_DEAD, State.LEFT: pb.PEER_STATE_LEFT}
PB_TO_STATE = {v: k for k, v in STATE_TO_PB.items()}

CAP_FIELDS = ("device_kind", "gpu_name", "gpu_memory_bytes", "step_time_s", "cpu_count", "peerd_version", "site")


def caps_to_pb(caps: dict) -> pb.Capabilities:
    return pb.Capabilities(**{k: caps[k] for k in CAP_FIELDS if k in caps})


def caps_from_pb(msg: pb.Capabilities) -> dict:
    return {k: getattr(msg, k) for k in CAP_FIELDS}


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
