"""Server side of the Peer service (control plane: Hello, Heartbeat, Ping, Leave).

Every handler runs after the AuthInterceptor has verified the caller; the node id a message claims
must be the one it authenticated as.
"""
from __future__ import annotations

import logging
from urllib.parse import unquote
from typing import TYPE_CHECKING

import grpc

from peerd import PROTOCOL_VERSION
from peerd.net.auth import NODE_KEY, NONCE_KEY, REPLY_MAC_KEY
from peerd.node import joining
from peerd.node.rpc import unary
from peerd.node.convert import caps_from_pb, is_unspecified, rows_from_pb, split_host_port
from peerd.v1 import peer_pb2 as pb

if TYPE_CHECKING:
    from peerd.node.daemon import Daemon

log = logging.getLogger("peerd.peer")

MAX_ID_LEN = 64
MAX_ADDRESS_LEN = 256
MAX_GOSSIP_ROWS = 4096


def _caller(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return dict(context.invocation_metadata() or ())


def _source_host(context: grpc.aio.ServicerContext) -> str:
    # gRPC names peers "ipv4:1.2.3.4:5" or, percent-encoded, "ipv6:%5B::1%5D:5"
    _, _, rest = unquote(context.peer()).partition(":")
    host, _, _ = rest.rpartition(":")
    return host.strip("[]")


class PeerService:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon

    async def _check_claim(self, context, node_id: str, what: str) -> None:
        authed = _caller(context).get(NODE_KEY, "")
        if not node_id or len(node_id) > MAX_ID_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {what}: bad node id")
        if node_id != authed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"peerd: {what} claims node {node_id[:MAX_ID_LEN]} but authenticated as {authed}")

    async def SayHello(self, request: pb.Hello, context) -> pb.HelloReply:
        d = self.d
        await self._check_claim(context, request.node_id, "Hello")
        reason = d.hello_refusal(request)
        if reason:
            code, text = reason
            log.warning("refused Hello from %s at %s: %s", request.node_id, context.peer(), text)
            await context.abort(code, f"peerd: {text}")
        address = self._reachable_address(request.address, context)
        if address is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Hello: bad address {request.address[:MAX_ADDRESS_LEN]!r}")
        d.on_admit(request.node_id, address, request.run_id, request.incarnation,
                   caps_from_pb(request.capabilities), how="incoming Hello")
        nonce = _caller(context).get(NONCE_KEY, "")
        await context.send_initial_metadata(((REPLY_MAC_KEY, d.auth.reply_mac(nonce)),))
        return pb.HelloReply(node=d.hello_message(), peers=d.peer_table())

    def _reachable_address(self, claimed: str, context) -> str | None:
        """The address to dial the caller back: its claim, with an unspecified host replaced by the
        address its packets came from."""
        if len(claimed) > MAX_ADDRESS_LEN:
            return None
        try:
            host, port = split_host_port(claimed)
        except ValueError:
            return None
        if is_unspecified(host):
            host = _source_host(context)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def SendHeartbeat(self, request: pb.Heartbeat, context) -> pb.HeartbeatReply:
        d = self.d
        await self._check_claim(context, request.node_id, "Heartbeat")
        if len(request.peers) > MAX_GOSSIP_ROWS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Heartbeat carries {len(request.peers)} rows (max {MAX_GOSSIP_ROWS})")
        address = self._reachable_address(request.address, context)
        d.on_heartbeat(request.node_id, request.incarnation, address, rows_from_pb(request.peers))
        d.links.merge(request.node_id, request.links)
        links, mark = d.links.gossip(request.node_id, "reply")
        d.links.gossiped(request.node_id, "reply", mark)   # no acknowledgement: the full refresh repairs losses
        peers, peers_mark = d.peer_news(request.node_id, "reply")
        d.membership.gossiped(request.node_id, "reply", peers_mark)
        return pb.HeartbeatReply(node_id=d.node_id, incarnation=d.incarnation, peers=peers, links=links)

    async def Ping(self, request: pb.PingRequest, context) -> pb.PingReply:
        limit = self.d.cfg.max_control_message_bytes - 64
        if request.reply_bytes > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Ping asks for {request.reply_bytes} bytes (max {limit})")
        return pb.PingReply(nonce=request.nonce, payload=bytes(request.reply_bytes))

    async def SayLeave(self, request: pb.Leave, context) -> pb.LeaveReply:
        await self._check_claim(context, request.node_id, "Leave")
        self.d.on_leave(request.node_id, request.incarnation, request.reason)
        return pb.LeaveReply()

    async def GrantTokens(self, request: pb.TokenGrant, context) -> pb.TokenReply:
        await self._check_claim(context, request.sender, "GrantTokens")
        if request.run_id != self.d.cfg.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: tokens for run {request.run_id!r}, this daemon runs {self.d.cfg.run_id!r}")
        if not 0 < request.tokens <= 1_000_000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {request.tokens} tokens")
        self.d.on_tokens(request.sender, request.tokens)
        return pb.TokenReply()

    async def NoticeTrainer(self, request: pb.TrainerNotice, context) -> pb.TrainerNoticeReply:
        await self._check_claim(context, request.sender, "NoticeTrainer")
        if request.run_id != self.d.cfg.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: notice for run {request.run_id!r}, this daemon runs {self.d.cfg.run_id!r}")
        return pb.TrainerNoticeReply(iteration=self.d.on_trainer_notice(request))

    async def _check_run(self, context, run_id: str, what: str) -> None:
        if run_id != self.d.cfg.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: {what} for run {run_id!r}, this daemon runs {self.d.cfg.run_id!r}")

    async def DescribeRun(self, request: pb.RunQuery, context) -> pb.RunInfo:
        await self._check_claim(context, request.sender, "DescribeRun")
        await self._check_run(context, request.run_id, "DescribeRun")
        return joining.run_info(self.d, request)

    async def JoinRun(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        await self._check_claim(context, request.sender, "JoinRun")
        await self._check_run(context, request.run_id, "JoinRun")
        try:
            return await joining.admit(self.d, request)
        except joining.JoinRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
        except (RuntimeError, ValueError) as e:   # contested or unanswered: the joiner asks again
            await context.abort(grpc.StatusCode.ABORTED, f"peerd: {e}")

    async def AdmitToRun(self, request: pb.AdmitRequest, context) -> pb.AdmitReply:
        await self._check_claim(context, request.sender, "AdmitToRun")
        await self._check_run(context, request.run_id, "AdmitToRun")
        return joining.on_admit(self.d, request)

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "SayHello": unary(self.SayHello, pb.Hello, pb.HelloReply),
            "SendHeartbeat": unary(self.SendHeartbeat, pb.Heartbeat, pb.HeartbeatReply),
            "Ping": unary(self.Ping, pb.PingRequest, pb.PingReply),
            "SayLeave": unary(self.SayLeave, pb.Leave, pb.LeaveReply),
            "GrantTokens": unary(self.GrantTokens, pb.TokenGrant, pb.TokenReply),
            "NoticeTrainer": unary(self.NoticeTrainer, pb.TrainerNotice, pb.TrainerNoticeReply),
            "DescribeRun": unary(self.DescribeRun, pb.RunQuery, pb.RunInfo),
            "JoinRun": unary(self.JoinRun, pb.JoinRequest, pb.JoinReply),
            "AdmitToRun": unary(self.AdmitToRun, pb.AdmitRequest, pb.AdmitReply),
        }


def hello_refusal(self_id: str, run_id: str, request: pb.Hello) -> tuple[grpc.StatusCode, str] | None:
    """Why a Hello cannot be accepted, independent of the table (None when it can)."""
    if request.protocol_version != PROTOCOL_VERSION:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not supported "
                f"(this daemon speaks {PROTOCOL_VERSION}); upgrade the older daemon")
    if request.node_id == self_id:
        return (grpc.StatusCode.ALREADY_EXISTS,
                f"duplicate node id {self_id}: another daemon uses this node id (copied data dir?)")
    if request.run_id != run_id:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"run id {request.run_id!r} differs from this daemon's run id {run_id!r}")
    return None
