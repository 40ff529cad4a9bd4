"""Every Peer RPC this daemon makes, signed for its receiver and bounded by a deadline.

Callers name the peer's address (from the membership table) and get the reply or an
AioRpcError; tensor pushes and pulls go through the data plane (peerd.net.dataplane) on the same
channel, so control calls and tensors share one connection per peer.

Each call is signed for the node it goes to (peerd.net.auth): the node a caller names, else the
one last seen answering at that address, else "?". A server that is another node refuses the call
and says which node it is; the call is then signed again, once, for that node. Every unary reply
must be signed by the node the call was for, or it is taken as a failed call (UNAUTHENTICATED).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import grpc
from google.protobuf.message import DecodeError, Message

from peerd.config import Config
from peerd.net.auth import NONCE_KEY, RECEIVER_KEY, UNKNOWN_RECEIVER, Authenticator, Refusal
from peerd.net.dataplane import PULL_METHOD, PUSH_METHOD, DataPlane, Outgoing, PushResult, Received, rpc
from peerd.net.pki import is_node_id
from peerd.node.channels import ChannelPool
from peerd.v1 import peer_pb2 as pb

SERVICE = "peerd.v1.Peer"
MAX_ADDRESSES = 4096


def refused_reply(details: str) -> grpc.aio.AioRpcError:
    empty = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, empty, empty, details=f"peerd: {details}")


class PeerClient:
    def __init__(self, cfg: Config, node_id: str, auth: Authenticator, channels: ChannelPool,
                 dataplane: DataPlane, on_push: Callable[[str, PushResult], None]) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.auth = auth
        self.channels = channels
        self.dataplane = dataplane
        self.on_push = on_push      # a push of real data finished: a bandwidth sample (peerd.node.links_service)
        self.at: OrderedDict[str, str] = OrderedDict()   # address -> the node that last answered there

    def node_at(self, address: str) -> str:
        return self.at.get(address, "")

    def _learn(self, address: str, node: str) -> None:
        self.at[address] = node
        self.at.move_to_end(address)
        while len(self.at) > MAX_ADDRESSES:
            self.at.popitem(last=False)

    async def call(self, address: str, name: str, request: Message, reply: type[Message],
                   timeout: float | None = None, node: str = "", strict: bool = False) -> tuple[Message, str]:
        """One unary call: (the reply, the node that signed it). `node`: whom we expect at
        `address`; with `strict`, only that node may answer (a call to a member), else the node
        that is there is signed for (a first contact)."""
        method = f"/{SERVICE}/{name}"
        body = request.SerializeToString()
        to = node if is_node_id(node) else self.at.get(address) or UNKNOWN_RECEIVER
        timeout = self.cfg.node.rpc_timeout if timeout is None else timeout
        for attempt in (0, 1):
            metadata = self.auth.sign(method, to, body)
            call = self.channels.get(address).unary_unary(method)(body, metadata=metadata, timeout=timeout)
            try:
                raw = await rpc(call)
            except grpc.aio.AioRpcError as err:
                hint = dict(err.trailing_metadata() or ()).get(RECEIVER_KEY, "")
                if (attempt == 0 and err.code() == grpc.StatusCode.UNAUTHENTICATED and isinstance(hint, str)
                        and is_node_id(hint) and hint != to and not strict):
                    to = hint            # we reached another node than we thought: sign for it
                    continue
                raise
            try:
                server = self.auth.verify_reply(method, to, dict(metadata)[NONCE_KEY], raw,
                                                await call.trailing_metadata())
                parsed = reply.FromString(raw)
            except Refusal as r:
                raise refused_reply(f"{name} reply from {address}: {r.reason}") from None
            except DecodeError as e:
                raise refused_reply(f"{name} reply from {address} does not parse: {e}") from None
            self._learn(address, server)
            return parsed, server
        raise AssertionError("unreachable")

    async def _unary(self, address: str, name: str, request: Message, reply: type[Message],
                     timeout: float | None = None, node: str = "", strict: bool = False):
        return (await self.call(address, name, request, reply, timeout, node, strict))[0]

    # --- membership -----------------------------------------------------------------------------
    async def hello(self, address: str, msg: pb.Hello, node: str = "") -> tuple[pb.HelloReply, str]:
        """Hello: the reply and the node that signed it (the one we reached at `address`; `node`
        is whom gossip or mDNS said is there, a first guess)."""
        return await self.call(address, "SayHello", msg, pb.HelloReply, node=node)

    async def heartbeat(self, address: str, msg: pb.Heartbeat, node: str) -> pb.HeartbeatReply:
        return await self._unary(address, "SendHeartbeat", msg, pb.HeartbeatReply, node=node, strict=True)

    async def leave(self, address: str, msg: pb.Leave, node: str) -> None:
        await self._unary(address, "SayLeave", msg, pb.LeaveReply, timeout=self.cfg.membership.leave_timeout,
                          node=node, strict=True)

    async def ping(self, address: str, msg: pb.PingRequest, timeout: float) -> pb.PingReply:
        return await self._unary(address, "Ping", msg, pb.PingReply, timeout=timeout)

    # --- runs -----------------------------------------------------------------------------------
    async def grant_tokens(self, address: str, n: int, iteration: int) -> None:
        await self._unary(address, "GrantTokens", pb.TokenGrant(
            sender=self.node_id, run_id=self.cfg.node.run_id, tokens=n, iteration=max(iteration, 0)), pb.TokenReply)

    async def notice_trainer(self, address: str, tag: str, state: int, iteration: int) -> int:
        """Tell a peer our trainer's state in run `tag`; returns the peer's iteration (-1: none)."""
        reply = await self._unary(address, "NoticeTrainer", pb.TrainerNotice(
            sender=self.node_id, run_id=self.cfg.node.run_id, tag=tag, state=state, iteration=max(iteration, 0)),
            pb.TrainerNoticeReply)
        return reply.iteration

    async def describe_run(self, address: str, query: pb.RunQuery) -> pb.RunInfo:
        return await self._unary(address, "DescribeRun", query, pb.RunInfo)

    async def join_run(self, address: str, request: pb.JoinRequest) -> pb.JoinReply:
        # The admitter claims the rank at every other member, each within rpc_timeout, in parallel.
        return await self._unary(address, "JoinRun", request, pb.JoinReply, timeout=3 * self.cfg.node.rpc_timeout)

    async def admit_to_run(self, address: str, request: pb.AdmitRequest) -> pb.AdmitReply:
        return await self._unary(address, "AdmitToRun", request, pb.AdmitReply)

    # --- tensors --------------------------------------------------------------------------------
    async def push_tensor(self, address: str, node: str, data: Outgoing, *, iteration: int, kind: str,
                          observe: bool = True, **options) -> PushResult:
        """Push one buffer (options as DataPlane.push: compression, checksum, timeout). With
        `observe`, the push is a bandwidth sample too (a probe measures itself instead). The
        stream's frames are not signed (peerd.net.auth): TLS carries them on non-loopback links."""
        result = await self.dataplane.push(self.channels.get(address, "data"), node, data,
                                           metadata=self.auth.sign(PUSH_METHOD, node, None), iteration=iteration,
                                           kind=kind, **options)
        if observe:
            self.on_push(node, result)
        return result

    async def pull_tensor(self, address: str, node: str, kind: str = "model", min_iteration: int = 0) -> Received:
        return await self.dataplane.pull(self.channels.get(address, "data"), node,
                                         metadata=self.auth.sign(PULL_METHOD, node, None), kind=kind,
                                         min_iteration=min_iteration)
