"""The Swarm control call (`peerd top`, the live view of `peerd train`): the whole swarm from one host.

This daemon's status and link matrix, and for each live peer what that peer's daemon says of its
run (DescribeRun, the same signed call a joining host makes, without founders: it changes nothing
there), all peers asked at once and each bounded by `swarm_timeout`. The CLI talks to its own
daemon only; a peer that does not answer in time is listed with the reason.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable

import grpc

from peerd.net.membership import Membership, State
from peerd.node.peer_client import PeerClient
from peerd.node.run_host import RunHost
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb


async def _ask(client: PeerClient, query: pb.RunQuery, node_id: str, address: str, state: str,
               timeout: float) -> cpb.SwarmPeer:
    out = cpb.SwarmPeer(node_id=node_id, address=address, state=state, iteration=-1)
    try:
        info = await asyncio.wait_for(client.describe_run(address, query), timeout)
    except asyncio.TimeoutError:
        out.error = f"no answer within swarm_timeout {timeout:g}s"
        return out
    except grpc.aio.AioRpcError as e:
        out.error = f"{e.code().name}: {e.details()}"[:200]
        return out
    except Exception as e:  # noqa: BLE001 - one peer's failure is that peer's line, not the call's
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out
    out.answered, out.run_active, out.run_tag, out.iteration = True, info.active, info.tag, info.iteration
    if info.spec_json:
        try:
            out.algorithm = str(json.loads(info.spec_json).get("algorithm", ""))
        except (ValueError, AttributeError):
            pass
    return out


async def swarm_reply(status: Callable[[], cpb.StatusReply], links: Callable[[], cpb.LinksReply],
                      runs: RunHost, table: Membership, client: PeerClient, node_id: str, run_id: str,
                      timeout: float) -> cpb.SwarmReply:
    query = pb.RunQuery(sender=node_id, run_id=run_id)
    members = sorted(table.members.values(), key=lambda m: m.node_id)
    asked = [m for m in members if m.state in (State.ALIVE, State.SUSPECT)]
    answers = await asyncio.gather(*(_ask(client, query, m.node_id, m.address, m.state.value, timeout)
                                     for m in asked))
    by_id = {a.node_id: a for a in answers}
    peers = [by_id.get(m.node_id) or cpb.SwarmPeer(node_id=m.node_id, address=m.address, state=m.state.value,
                                                   iteration=-1, error=f"not asked: {m.state.value}")
             for m in members]
    reply = cpb.SwarmReply(status=status(), links=links(), peers=peers)
    if runs.training is not None:
        reply.progress.CopyFrom(runs.training.progress_message())
    return reply
