"""Forming a run, and joining one under way (issue 8, item 2).

A run has ranks 0..max_world-1. The `world` founders take ranks 0..world-1 (by site label, then node id,
as `form_world` ranks them, then re-ranked by the first founder to keep hosts of slow access apart:
`ranking`); ranks world..max_world-1 are vacant until late joiners take them. Every
policy is built for max_world workers and hears PeerDown for each vacant rank before anything else,
so a vacancy is exactly a dead worker to it (never waited on; a ring re-links around it, NetMax and
AAU solve on the live set). The run's tag is derived from the shared spec and the founders only, so
it never changes when hosts join.

`peerd train` on any host first asks the live peers what they run (DescribeRun):
- a peer runs an active run with the same shared spec (everything but the per-host slowdown and
  join timeout) and this host is in its member table: take that rank (a restarted founder or
  joiner, or a founder whose `peerd train` started late);
- the same, this host not in the table: join it (below), or fail at once when every rank is taken;
- a peer that would be a founder runs an active run with a different spec: wait (the message names
  the first difference) until it finishes or `--join-timeout` passes, then fail naming it; so
  does one that does not answer (a loaded host: it may run this very run);
- otherwise form a new run as before, in the ranks the first founder (rank 0 of `form_world`)
  gives in its DescribeRun answer (`ranking`: slow access links apart on the ring, by its link
  matrix, unless the algorithm is asynchronous; the same answer to every asker); with `--algo auto`, only the first founder forms it and
  chooses, the others wait for its run and take its algorithm and topology (one plan per run).
  One host decides both because they read measurements, which differ a little between hosts.

Joining: the joiner asks the run's lowest-ranked member it sees alive (the admitter) to JoinRun.
The admitter, one admission at a time, takes the lowest vacant rank and claims it for the joiner at
every other member it sees alive (AdmitToRun); a member accepts the first claim for a rank (and
none for a node that already holds another rank). Only when every one of them accepted does the
admitter commit and answer with the rank and the member table; otherwise it releases the claims
and the joiner asks again after `train_join_retry`.

Guarantee: two hosts never hold the same rank at any member that took part in both admissions:
a member accepts one claim per rank, and each admission needs every member its admitter sees alive.
Two concurrent joiners (same admitter, or two admitters with overlapping live views) get different
ranks or one retries. What it does not guarantee: under a partition, two admitters that each see
only their own side can give one rank to two hosts; the members of each side then agree with their
admitter, and a member that returns keeps the table it has (the same limit as forming a world
from two different membership views).

A member that was down during an admission learns the table when it rejoins (it asks a live member
first). A joiner is PeerUp to a member once its run reaches it (its parameter pull or first
update), like a returning peer; it then pulls the current parameters (`TrainingRun.join_swarm`),
starts at the neighbour's iteration and trains on data shard `rank mod world` (the data is dealt
over the founding world).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from peerd.net.dataplane import rpc
from peerd.v1 import peer_pb2 as pb

if TYPE_CHECKING:
    from peerd.node.daemon import Daemon
    from peerd.node.training import RunSpec, TrainingRun

log = logging.getLogger("peerd.join")

PER_HOST = ("slowdown", "join_timeout")   # spec fields each host may set for itself


class JoinRefused(RuntimeError):
    """This host cannot take part in the run it found; the message says why."""


def shared_spec(spec: "RunSpec") -> dict[str, Any]:
    """The part of a spec every host of a run must share."""
    d = dataclasses.asdict(spec)
    for key in PER_HOST:
        d.pop(key, None)
    return d


def run_tag(spec: "RunSpec", founders: list[str]) -> str:
    """Every host of a run derives the same tag: the shared spec and the founding members."""
    return hashlib.sha1(json.dumps([shared_spec(spec), founders], sort_keys=True).encode()).hexdigest()[:12]


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field (in a fixed order) where two shared specs differ, as 'field: X here, Y in
    the run'; None when they agree. `--algo auto` here agrees with whatever the run resolved."""
    skip = {"algorithm", "topology"} if ours.get("algorithm") == "auto" else set()
    for key in sorted(set(ours) | set(theirs)):
        if key in skip:
            continue
        a, b = ours.get(key), theirs.get(key)
        if a != b:
            return f"{key.replace('_', '-')}: {a!r} here, {b!r} in the run"
    return None


@dataclass
class Found:
    peer: str
    tag: str
    spec: dict[str, Any]
    nodes: list[str]


MAX_FOUNDERS = 1024   # a DescribeRun asking to rank more is not ranked (a bound on a peer's ask)
UNKNOWN = pb.RunInfo(active=False, iteration=-2)   # a peer that did not answer: it may run something


async def describe(daemon: "Daemon", node: str, founders: list[str] | None = None, algorithm: str = "") -> pb.RunInfo:
    """What `node` runs (and, when it is the first of `founders`, how it ranks them for
    `algorithm`); UNKNOWN when it did not answer (a daemon without DescribeRun runs nothing that
    could be joined)."""
    m = daemon.membership.get(node)
    if m is None:
        return UNKNOWN
    method = "/peerd.v1.Peer/DescribeRun"
    stub = daemon._channel(m.address).unary_unary(method, request_serializer=pb.RunQuery.SerializeToString,
                                                  response_deserializer=pb.RunInfo.FromString)
    try:
        return await rpc(stub(pb.RunQuery(sender=daemon.node_id, run_id=daemon.cfg.run_id, founders=founders or [],
                                          algorithm=algorithm),
                              metadata=daemon.auth.sign(method), timeout=daemon.cfg.rpc_timeout))
    except grpc.aio.AioRpcError as e:
        log.info("describe run: %s did not answer: %s", node, e.code().name)
        return pb.RunInfo(active=False, iteration=-1) if e.code() == grpc.StatusCode.UNIMPLEMENTED else UNKNOWN


async def place(daemon: "Daemon", spec: "RunSpec") -> tuple[list[str] | None, str]:
    """This host's member table for `spec` (max_world entries, "" for vacant ranks), or None and
    why it must wait. Raises JoinRefused when it can never take part."""
    from peerd.node.training import form_world

    alive = daemon.membership.alive()
    founders = form_world(daemon, spec.world)
    infos = await asyncio.gather(*(describe(daemon, n, founders, spec.algorithm) for n in alive))
    mine = shared_spec(spec)
    match: Found | None = None
    differ: dict[str, str] = {}
    silent = {node for node, info in zip(alive, infos) if info is UNKNOWN}
    for node, info in zip(alive, infos):
        if not info.active:
            continue
        theirs = json.loads(info.spec_json)
        diff = first_difference(mine, theirs)
        if diff is not None:
            differ[node] = diff
        elif match is None or sum(map(bool, info.nodes)) > sum(map(bool, match.nodes)):
            match = Found(node, info.tag, theirs, list(info.nodes))   # the fullest table is the newest
    if match is not None:
        if spec.algorithm == "auto":
            spec.algorithm, spec.topology = match.spec["algorithm"], match.spec["topology"]
        tag = run_tag(spec, match.nodes[:spec.world])
        if tag != match.tag:
            raise JoinRefused(f"run {match.tag} on {match.peer}: its tag differs from the one this host derives "
                              f"({tag}) for the same spec and founders; are the daemons of different versions?")
        if daemon.node_id in match.nodes:
            return match.nodes, ""
        if "" not in match.nodes:
            raise JoinRefused(f"run {match.tag} is full: world {spec.world}, max-world {len(match.nodes)}, every "
                              f"rank taken; start the run with a larger --max-world to admit late joiners")
        return await ask_to_join(daemon, spec, match)
    if founders is None:
        why = f"{len(alive) + 1} of {spec.world} hosts present"
        return None, why + "".join(f"; {n} runs a different run ({d})" for n, d in differ.items())
    clash = {n: d for n, d in differ.items() if n in founders}
    if clash:
        return None, "; ".join(f"{n} runs a different run ({d})" for n, d in clash.items())
    if silent & set(founders):
        # It may run the run this host belongs to (or a different one): never form without knowing.
        return None, f"asking {', '.join(sorted(silent & set(founders)))} what it runs: no answer yet"
    if spec.algorithm == "auto" and founders[0] != daemon.node_id:
        # One plan per run: the first founder chooses, the others take its choice from its run
        # (the match above). Planning on each host's own view of the links split the run near a
        # tie (a uniform LAN is all ties): hosts that chose differently derive different tags.
        return None, f"--algo auto: waiting for {founders[0]}, the run's first host, to choose"
    if founders[0] == daemon.node_id:
        founders = ranking(daemon, founders, spec.algorithm)
    else:
        # The first founder's ranks (its link matrix, not ours: every founder must form the same
        # table); one that gives none (an older daemon) ranks by site and node id, as we then do.
        theirs = list(infos[alive.index(founders[0])].ranking)
        if sorted(theirs) == sorted(founders):
            founders = theirs
    return founders + [""] * (spec.max_world - spec.world), ""


def ranking(daemon: "Daemon", founders: list[str], algorithm: str = "") -> list[str]:
    """The ranks this host, as the first founder, gives `founders` for `algorithm`: slow-access
    hosts spread apart on the ring (peerd.sync.topology.spread_slow_hosts) by its link matrix;
    as given for an asynchronous algorithm, when Config.train_spread_slow_hosts is off, or when
    nothing was measured. (An asker that names no algorithm is an older daemon, which spreads;
    `--algo auto` is ranked before the plan chooses, so it spreads too.)

    Why not the asynchronous ones: on the lab's star (10/10/100/100/1000/1000 Mbit) spreading made
    D-PSGD, Hop and AAU, which wait for both neighbours, 1.3-1.4x faster per iteration, but NetMax,
    which waits for no one, reached 80 % in 30.6 s (median of 3) apart against 17.8 s with the
    slow hosts side by side (README, ring order).

    The same answer to every founder that asks (DescribeRun) while they form the run: the first
    answer for a founder set is kept until nobody asked for Config.train_join_timeout, so a link
    estimate that moves between two askers cannot split the run."""
    import time

    from peerd.node.training import site_of
    from peerd.plan.sources import access_rates
    from peerd.sync.registry import ASYNCHRONOUS
    from peerd.sync.topology import spread_slow_hosts

    now = time.monotonic()
    spread = algorithm not in ASYNCHRONOUS
    key = (tuple(founders), spread)
    kept = daemon.rankings.get(key)
    if kept is not None and now - kept[1] <= daemon.cfg.train_join_timeout:
        daemon.rankings[key] = (kept[0], now)
        return list(kept[0])
    ranked = list(founders)
    if spread and daemon.cfg.train_spread_slow_hosts and daemon.link_matrix is not None:
        access = access_rates(daemon.link_matrix.to_dict(now), founders)
        ranked = spread_slow_hosts(founders, access, {n: site_of(daemon, n) for n in founders})
        if ranked != founders:
            log.info("ranked the run's hosts to keep slow access links apart on the ring: %s (%s)", ranked,
                     ", ".join(f"{n} {access.get(n, 0) * 8 / 1e6:.0f} Mbit/s" for n in ranked))
    for old in [k for k, (_, at) in daemon.rankings.items() if now - at > daemon.cfg.train_join_timeout]:
        del daemon.rankings[old]
    while len(daemon.rankings) >= 64:          # askers with many different worlds: forget the oldest
        del daemon.rankings[min(daemon.rankings, key=lambda k: daemon.rankings[k][1])]
    daemon.rankings[key] = (ranked, now)
    return list(ranked)


async def ask_to_join(daemon: "Daemon", spec: "RunSpec", found: Found) -> tuple[list[str] | None, str]:
    live = [n for n in found.nodes if n and (m := daemon.membership.get(n)) is not None
            and m.state.value == "alive"]
    admitter = live[0] if live else found.peer
    m = daemon.membership.get(admitter)
    if m is None:
        return None, f"admitter {admitter} of run {found.tag} is not a member here yet"
    method = "/peerd.v1.Peer/JoinRun"
    stub = daemon._channel(m.address).unary_unary(method, request_serializer=pb.JoinRequest.SerializeToString,
                                                  response_deserializer=pb.JoinReply.FromString)
    try:
        # The admitter claims the rank at every other member, each within rpc_timeout, in parallel.
        reply = await rpc(stub(pb.JoinRequest(sender=daemon.node_id, run_id=daemon.cfg.run_id, tag=found.tag,
                                              spec_json=json.dumps(shared_spec(spec), sort_keys=True)),
                               metadata=daemon.auth.sign(method), timeout=3 * daemon.cfg.rpc_timeout))
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            raise JoinRefused(f"{admitter} refused: {e.details()}") from None
        return None, f"joining run {found.tag} via {admitter}: {e.code().name} {e.details() or ''}".strip()
    nodes = list(reply.nodes)
    if nodes[reply.rank] != daemon.node_id:
        return None, f"{admitter} answered an inconsistent table; asking again"
    log.info("joined run %s as rank %d (admitted by %s): %s", found.tag, reply.rank, admitter, nodes)
    return nodes, ""


# --- the member side ------------------------------------------------------------------------------
def run_info(daemon: "Daemon", query: pb.RunQuery | None = None) -> pb.RunInfo:
    run = daemon.training
    founders = list(query.founders) if query is not None else []
    if founders and founders[0] == daemon.node_id and len(set(founders)) == len(founders) <= MAX_FOUNDERS:
        rank = ranking(daemon, founders, query.algorithm)
    else:
        rank = []
    if run is None:
        return pb.RunInfo(active=False, iteration=-1, ranking=rank)
    active = not run.draining and run.progress.state not in ("done", "failed", "stopping")
    return pb.RunInfo(active=active, tag=run.tag, spec_json=json.dumps(shared_spec(run.spec), sort_keys=True),
                      nodes=run.nodes, iteration=run.policy.k, ranking=rank)


def take(nodes: list[str], world: int, node: str, rank: int) -> str:
    """The member-table rule: take `rank` for `node` in `nodes` (in place); "" when accepted, else
    why not (the holder). One holder per rank, one rank per node, founders' ranks never."""
    if not world <= rank < len(nodes):
        return f"rank {rank} outside {world}..{len(nodes) - 1}"
    if node in nodes and nodes.index(node) != rank:
        return f"{node} already holds rank {nodes.index(node)}"
    if nodes[rank] not in ("", node):
        return nodes[rank]
    nodes[rank] = node
    return ""


def give_back(nodes: list[str], world: int, node: str, rank: int) -> bool:
    """Withdraw `node`'s claim of `rank` (a joiner's only); True when it held it."""
    if world <= rank < len(nodes) and nodes[rank] == node:
        nodes[rank] = ""
        return True
    return False


def claim(run: "TrainingRun", node: str, rank: int) -> str:
    new = node not in run.nodes
    why = take(run.nodes, run.spec.world, node, rank)
    if not why and new:
        run.returning.add(node)    # PeerUp once its run reaches us (its pull or first update)
        log.info("run %s: rank %d taken by %s", run.tag, rank, node)
    return why


def release(run: "TrainingRun", node: str, rank: int) -> None:
    if give_back(run.nodes, run.spec.world, node, rank):
        run.returning.discard(node)
        log.info("run %s: claim of rank %d for %s released", run.tag, rank, node)


async def admit(daemon: "Daemon", req: pb.JoinRequest) -> pb.JoinReply:
    """JoinRun at the admitter. Raises JoinRefused (never admissible) or RuntimeError (try again)."""
    run = daemon.training
    if run is None or not run_info(daemon).active or req.tag != run.tag:
        raise JoinRefused(f"run {req.tag} is not active here")
    diff = first_difference(json.loads(req.spec_json), shared_spec(run.spec))
    if diff is not None:
        raise JoinRefused(f"spec differs from run {run.tag}: {diff}")
    async with run.admitting:
        if req.sender in run.nodes:
            return pb.JoinReply(rank=run.nodes.index(req.sender), nodes=run.nodes)
        vacant = [r for r in range(run.spec.world, run.n) if run.nodes[r] == ""]
        if not vacant:
            raise JoinRefused(f"run {run.tag} is full: every one of its {run.n} ranks is taken")
        rank = vacant[0]
        claim(run, req.sender, rank)
        others = [n for n in run.nodes if n and n not in (daemon.node_id, req.sender)
                  and (m := daemon.membership.get(n)) is not None and m.state.value in ("alive", "suspect")]
        answers = await asyncio.gather(*(_claim_at(daemon, run, n, req.sender, rank, False) for n in others))
        refused = {n: why for n, why in zip(others, answers) if why}
        if refused:
            release(run, req.sender, rank)
            await asyncio.gather(*(_claim_at(daemon, run, n, req.sender, rank, True)
                                   for n, why in zip(others, answers) if not why))
            raise RuntimeError(f"rank {rank} not agreed: " + "; ".join(f"{n}: {w}" for n, w in refused.items()))
        log.info("run %s: admitted %s as rank %d (agreed by %s)", run.tag, req.sender, rank, others or "nobody else")
        return pb.JoinReply(rank=rank, nodes=run.nodes)


async def _claim_at(daemon: "Daemon", run: "TrainingRun", member: str, node: str, rank: int, rel: bool) -> str:
    m = daemon.membership.get(member)
    if m is None:
        return "not a member"
    method = "/peerd.v1.Peer/AdmitToRun"
    stub = daemon._channel(m.address).unary_unary(method, request_serializer=pb.AdmitRequest.SerializeToString,
                                                  response_deserializer=pb.AdmitReply.FromString)
    try:
        reply = await rpc(stub(pb.AdmitRequest(sender=daemon.node_id, run_id=daemon.cfg.run_id, tag=run.tag,
                                               node=node, rank=rank, release=rel),
                               metadata=daemon.auth.sign(method), timeout=daemon.cfg.rpc_timeout))
    except grpc.aio.AioRpcError as e:
        return f"no answer ({e.code().name})"
    return "" if reply.accepted else f"held by {reply.holder or '?'}"


def on_admit(daemon: "Daemon", req: pb.AdmitRequest) -> pb.AdmitReply:
    """AdmitToRun at a member: accept or refuse the admitter's claim (or take it back)."""
    run = daemon.training
    if run is None or req.tag != run.tag:
        return pb.AdmitReply(accepted=False, holder=f"run {req.tag} not here")
    if req.release:
        release(run, req.node, req.rank)
        return pb.AdmitReply(accepted=True)
    holder = claim(run, req.node, req.rank)
    return pb.AdmitReply(accepted=not holder, holder=holder)
