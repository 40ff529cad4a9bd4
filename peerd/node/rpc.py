"""Building gRPC method handlers whose malformed input gets a clear INVALID_ARGUMENT."""
from __future__ import annotations

from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError, Message


def unary(fn: Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]],
          request_type: type[Message], response_type: type[Message]) -> grpc.RpcMethodHandler:
    """A unary handler that parses the request itself: a corrupt message is refused as
    INVALID_ARGUMENT naming the message type (gRPC's own deserializer failure says UNKNOWN)."""
    name = request_type.DESCRIPTOR.full_name

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: malformed {name}: {e}")
        return await fn(request, context)

    return grpc.unary_unary_rpc_method_handler(handler, response_serializer=response_type.SerializeToString)
