"""A rogue peer without the cluster secret: announces `_peerd._tcp` with the right run id and answers
Hello like a daemon would, in plaintext, but holds no certificate of the cluster and signs nothing.
Daemons on non-loopback addresses dial it with mutual TLS, so none of them reaches it. Lab test helper.

    python tests/rogue_peer.py IP PORT RUN_ID NODE_ID SECONDS

Prints {"ready": ...} once announced, then one JSON line per Hello it receives ({"hello_from": id}),
and {"exit": n} after SECONDS.
"""
from __future__ import annotations

import asyncio
import json
import sys

import grpc

from peerd import PROTOCOL_VERSION
from peerd.net.discovery import MdnsDiscovery
from peerd.v1 import peer_pb2 as pb


async def main(ip: str, port: int, run_id: str, node_id: str, seconds: float) -> None:
    hellos = 0

    async def say_hello(request: pb.Hello, context) -> pb.HelloReply:
        nonlocal hellos
        hellos += 1
        print(json.dumps({"hello_from": request.node_id}), flush=True)
        return pb.HelloReply(node=pb.Hello(node_id=node_id, protocol_version=PROTOCOL_VERSION, run_id=run_id,
                                           address=f"{ip}:{port}", incarnation=1))

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(say_hello, request_deserializer=pb.Hello.FromString,
                                                  response_serializer=pb.HelloReply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("peerd.v1.Peer", {"SayHello": handler}),))
    server.add_insecure_port(f"{ip}:{port}")
    await server.start()
    disc = MdnsDiscovery(node_id=node_id, run_id=run_id, protocol_version=PROTOCOL_VERSION, port=port,
                         addresses=[f"{ip}:{port}"], capabilities={"device_kind": "cuda"},
                         interfaces=[("eth0", ip)], on_candidate=lambda c: None)
    await disc.start()
    print(json.dumps({"ready": node_id}), flush=True)
    await asyncio.sleep(seconds)
    await disc.stop()
    await server.stop(0.5)
    print(json.dumps({"exit": hellos}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])))
