"""Server side of the Peer service's control calls (Hello, Heartbeat, Ping, Leave, and the calls
of training runs); tensors are the data plane's (peerd.net.dataplane).

Every handler runs after the AuthInterceptor has verified the caller (its node key, the receiver,
the body); the node id a message claims must be the one it authenticated as. Every field from the
wire is checked before use, and what an error or a log line echoes of it is cut short
(peerd.net.wirecheck.clip).
"""
from __future__ import annotations

import logging

import grpc

from peerd.config import Config
from peerd.net.auth import NODE_KEY, source_host
from peerd.net.pki import is_node_id
from peerd.net.wirecheck import MAX_ADDRESS_LEN, clip, is_unspecified_host, split_address
from peerd.node.convert import caps_from_pb
from peerd.node.membership_service import MembershipService
from peerd.node.rpc import unary
from peerd.node.run import joining
from peerd.node.run_host import RunHost
from peerd.node.tunnels import TunnelHub, dial_back
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.peer")

MAX_GOSSIP_ROWS = 4096
MAX_LINK_ROWS = 1 << 16
MAX_TEXT = 256                     # a run id, a tag, a Leave reason
NOTICE_STATES = frozenset(pb.TrainerNotice.State.values()) - {pb.TrainerNotice.STATE_UNSPECIFIED}


def _caller(context: grpc.aio.ServicerContext) -> str:
    """The node the call authenticated as (the interceptor admitted exactly one x-peerd-node)."""
    for key, value in context.invocation_metadata() or ():
        if key == NODE_KEY:
            return value if isinstance(value, str) else ""
    return ""


def reachable_address(claimed: str, peer: str) -> str | None:
    """The address to dial a caller back: its claim (host:port, an IP or a DNS name, nothing
    else), with an unspecified host replaced by the address its packets came from (`peer`, as
    gRPC names it). None when the claim is not an address."""
    hp = split_address(claimed)
    if hp is None:
        return None
    host, port = hp
    if is_unspecified_host(host):
        host = source_host(peer).strip("[]")
        if split_address(f"[{host}]:{port}" if ":" in host else f"{host}:{port}") is None:
            return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PeerService:
    def __init__(self, cfg: Config, members: MembershipService, runs: RunHost, tunnels: TunnelHub) -> None:
        self.cfg = cfg
        self.members = members
        self.runs = runs
        self.tunnels = tunnels

    async def _check_claim(self, context, node_id: str, what: str) -> None:
        authed = _caller(context)
        if not is_node_id(node_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {what}: {clip(node_id, 40)} is no node id")
        if node_id != authed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"peerd: {what} claims node {node_id} but authenticated as {authed}")

    async def _check_run(self, context, run_id: str, what: str) -> None:
        if run_id != self.cfg.node.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: {what} for run {clip(run_id, 64)}, this daemon runs {self.cfg.node.run_id!r}")

    async def _check_text(self, context, what: str, value: str, limit: int = MAX_TEXT) -> None:
        if len(value) > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: {what} is {len(value)} characters (at most {limit})")

    # --- membership -------------------------------------------------------------------------------
    async def SayHello(self, request: pb.Hello, context) -> pb.HelloReply:
        await self._check_claim(context, request.node_id, "Hello")
        reason = self.members.hello_refusal(request)
        if reason:
            code, text = reason
            log.warning("refused Hello from %s at %s: %s", request.node_id, context.peer(), text)
            await context.abort(code, f"peerd: {text}")
        caps, why = caps_from_pb(request.capabilities)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: Hello: {why}")
        address = reachable_address(request.address, context.peer())
        if address is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Hello: bad address {clip(request.address, 80)} (want HOST:PORT)")
        self.members.on_admit(request.node_id, address, request.run_id, request.incarnation, caps,
                              how="incoming Hello")
        reached = await dial_back(address, min(self.cfg.node.dial_back_timeout, self.cfg.node.rpc_timeout / 2))
        return pb.HelloReply(node=self.members.hello_message(), peers=self.members.peer_table(),
                             revocations=self.members.revocations(), dial_back=reached)

    async def SendHeartbeat(self, request: pb.Heartbeat, context) -> pb.HeartbeatReply:
        await self._check_claim(context, request.node_id, "Heartbeat")
        if len(request.peers) > MAX_GOSSIP_ROWS or len(request.links) > MAX_LINK_ROWS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Heartbeat carries {len(request.peers)} peer rows and {len(request.links)} "
                                f"link rows (max {MAX_GOSSIP_ROWS} and {MAX_LINK_ROWS})")
        bound = self.members.max_incarnation()
        if request.incarnation > bound:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Heartbeat: incarnation {request.incarnation} is beyond this host's clock "
                                f"plus the skew bound ({bound})")
        if len(request.address) > MAX_ADDRESS_LEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peerd: Heartbeat: address too long")
        return self.members.on_heartbeat(request, reachable_address(request.address, context.peer()))

    async def Ping(self, request: pb.PingRequest, context) -> pb.PingReply:
        limit = self.cfg.node.max_control_message_bytes - 64
        if request.reply_bytes > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: Ping asks for {request.reply_bytes} bytes (max {limit})")
        return pb.PingReply(nonce=request.nonce, payload=bytes(request.reply_bytes))

    async def SayLeave(self, request: pb.Leave, context) -> pb.LeaveReply:
        await self._check_claim(context, request.node_id, "Leave")
        self.members.on_leave(request.node_id, request.incarnation, clip(request.reason, 80))
        return pb.LeaveReply()

    # --- training runs ----------------------------------------------------------------------------
    async def GrantTokens(self, request: pb.TokenGrant, context) -> pb.TokenReply:
        await self._check_claim(context, request.sender, "GrantTokens")
        await self._check_run(context, request.run_id, "tokens")
        if not 0 < request.tokens <= 1_000_000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {request.tokens} tokens")
        self.runs.on_tokens(request.sender, request.tokens)
        return pb.TokenReply()

    async def NoticeTrainer(self, request: pb.TrainerNotice, context) -> pb.TrainerNoticeReply:
        await self._check_claim(context, request.sender, "NoticeTrainer")
        await self._check_run(context, request.run_id, "notice")
        await self._check_text(context, "notice tag", request.tag)
        if request.state not in NOTICE_STATES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: notice: unknown state {request.state}")
        return pb.TrainerNoticeReply(iteration=self.runs.on_trainer_notice(
            request.sender, request.tag, request.state, request.iteration))

    async def DescribeRun(self, request: pb.RunQuery, context) -> pb.RunInfo:
        await self._check_claim(context, request.sender, "DescribeRun")
        await self._check_run(context, request.run_id, "DescribeRun")
        await self._check_text(context, "algorithm", request.algorithm)
        if len(request.founders) > joining.MAX_FOUNDERS or not all(map(is_node_id, request.founders)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: DescribeRun: founders must be at most {joining.MAX_FOUNDERS} node ids")
        return joining.run_info(self.runs.env, self.runs.rankings, self.runs.training, request, self.runs.waiting)

    async def JoinRun(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        await self._check_claim(context, request.sender, "JoinRun")
        await self._check_run(context, request.run_id, "JoinRun")
        await self._check_text(context, "JoinRun tag", request.tag)
        await self._check_text(context, "JoinRun spec", request.spec_json, joining.MAX_SPEC_JSON)
        try:
            return await joining.admit(self.runs.env, self.runs.training, request)
        except joining.JoinRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
        except (RuntimeError, ValueError) as e:   # contested or unanswered: the joiner asks again
            await context.abort(grpc.StatusCode.ABORTED, f"peerd: {str(e)[:400]}")

    async def AdmitToRun(self, request: pb.AdmitRequest, context) -> pb.AdmitReply:
        await self._check_claim(context, request.sender, "AdmitToRun")
        await self._check_run(context, request.run_id, "AdmitToRun")
        await self._check_text(context, "AdmitToRun tag", request.tag)
        if not is_node_id(request.node):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: AdmitToRun: {clip(request.node, 40)} is no node id")
        return joining.on_admit(self.runs.training, request)

    # --- reverse connections -------------------------------------------------------------------------
    async def Tunnel(self, request_iterator, context) -> None:
        await self.tunnels.serve(_caller(context), request_iterator, context)

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
            "Tunnel": grpc.stream_stream_rpc_method_handler(
                self.Tunnel, request_deserializer=pb.TunnelFrame.FromString,
                response_serializer=pb.TunnelFrame.SerializeToString),
        }
