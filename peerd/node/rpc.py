"""Building gRPC method handlers whose malformed input gets a clear INVALID_ARGUMENT, and whose
inner calls cut by a closed channel get a clear UNAVAILABLE instead of no answer."""
from __future__ import annotations

import asyncio
import inspect
from typing import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError, Message

from peerd.net.dataplane import cut_by_channel_close


def unary(fn: Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]],
          request_type: type[Message], response_type: type[Message]) -> grpc.RpcMethodHandler:
    """A unary handler that parses the request itself: a corrupt message is refused as
    INVALID_ARGUMENT naming the message type (gRPC's own deserializer failure says UNKNOWN).

    A handler that calls a peer whose channel the daemon closes meanwhile (the peer was found
    dead) gets asyncio.CancelledError from gRPC; let out of a handler, gRPC answers nothing and the
    caller waits out its deadline (a trainer's Attach did, for 2 minutes). It is answered
    UNAVAILABLE, which the caller can retry."""
    name = request_type.DESCRIPTOR.full_name

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: malformed {name}: {e}")
        try:
            return await fn(request, context)
        except asyncio.CancelledError:
            if not cut_by_channel_close():
                raise                      # the call itself was cancelled (its caller went away)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"peerd: {name} not answered: a call it made to a peer was cut (that peer's "
                            f"channel was closed: it was found dead); try again")

    return grpc.unary_unary_rpc_method_handler(handler, response_serializer=response_type.SerializeToString)


def unary_stream(fn, request_type: type[Message], response_type: type[Message]) -> grpc.RpcMethodHandler:
    """A response-streaming handler (an async generator, or a coroutine writing with
    context.write) that parses its request itself: a corrupt one is INVALID_ARGUMENT, not
    UNKNOWN with a traceback per message."""
    name = request_type.DESCRIPTOR.full_name

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return request_type.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: malformed {name}: {e}")

    if inspect.isasyncgenfunction(fn):
        async def gen(raw: bytes, context: grpc.aio.ServicerContext):
            async for item in fn(await parse(raw, context), context):
                yield item
        behaviour = gen
    else:
        async def coro(raw: bytes, context: grpc.aio.ServicerContext):
            return await fn(await parse(raw, context), context)
        behaviour = coro
    return grpc.unary_stream_rpc_method_handler(behaviour, response_serializer=response_type.SerializeToString)


def stream_unary(fn, request_type: type[Message], response_type: type[Message]) -> grpc.RpcMethodHandler:
    """A request-streaming handler whose messages are parsed one by one here: the first corrupt
    one ends the call with INVALID_ARGUMENT."""
    name = request_type.DESCRIPTOR.full_name

    async def handler(request_iterator, context: grpc.aio.ServicerContext):
        async def parsed():
            async for raw in request_iterator:
                try:
                    yield request_type.FromString(raw)
                except DecodeError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: malformed {name}: {e}")
        return await fn(parsed(), context)

    return grpc.stream_unary_rpc_method_handler(handler, response_serializer=response_type.SerializeToString)
