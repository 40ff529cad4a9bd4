"""Server side of the Control service on the daemon's unix socket (local clients only)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from peerd.node.rpc import unary

from peerd.v1 import control_pb2 as cpb

if TYPE_CHECKING:
    from peerd.node.daemon import Daemon


class ControlService:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon

    async def Status(self, request: cpb.StatusRequest, context) -> cpb.StatusReply:
        return self.d.status_message()

    async def Links(self, request: cpb.LinksRequest, context) -> cpb.LinksReply:
        return self.d.links_message()

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Status": unary(self.Status, cpb.StatusRequest, cpb.StatusReply),
            "Links": unary(self.Links, cpb.LinksRequest, cpb.LinksReply),
        }
