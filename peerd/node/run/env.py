"""What a training run needs from its daemon: a few narrow things, passed in (never the Daemon).

`RunEnv` is built once by the daemon and handed to every run; tests build it from stand-ins.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from peerd.config import Config
from peerd.net import tensorwire as tw
from peerd.net.dataplane import Outgoing, PushResult, Received
from peerd.v1 import peer_pb2 as pb


class PeerCalls(Protocol):
    """The Peer RPCs a run makes (peerd.node.peer_client.PeerClient), each signed and bounded."""

    async def push_tensor(self, address: str, node: str, data: Outgoing, *, iteration: int,
                          kind: str) -> PushResult: ...

    async def pull_tensor(self, address: str, node: str, kind: str = "model", min_iteration: int = 0) -> Received: ...

    async def grant_tokens(self, address: str, n: int, iteration: int) -> None: ...

    async def notice_trainer(self, address: str, tag: str, state: int, iteration: int) -> int: ...

    async def describe_run(self, address: str, query: pb.RunQuery) -> pb.RunInfo: ...

    async def join_run(self, address: str, request: pb.JoinRequest) -> pb.JoinReply: ...

    async def admit_to_run(self, address: str, request: pb.AdmitRequest) -> pb.AdmitReply: ...


class Members(Protocol):
    """The membership table as a run reads it (peerd.net.membership.Membership)."""

    def get(self, node_id: str) -> Any: ...

    def alive(self) -> list[str]: ...


@dataclass
class RunEnv:
    cfg: Config
    node_id: str
    data_dir: Path
    caps: dict
    membership: Members
    peers: PeerCalls
    link_matrix: Any                       # peerd.net.links.LinkMatrix, or None (nothing measured)
    offences: Any                          # peerd.node.offences.PeerOffences: flagged_for(peer)
    set_layout: Callable[[str, tw.Layout | None], None]   # the layout the data plane expects per kind
    report_offence: Callable[[str, str], None]            # a bad update from a peer (may flag it)

    def alive(self, node: str, *, suspect: bool = True) -> bool:
        """`node` is a member the failure detector holds alive (or suspect, unless told not)."""
        m = self.membership.get(node) if node else None
        return m is not None and m.state.value in (("alive", "suspect") if suspect else ("alive",))
