"""Forming a run, and joining one under way (issue 8, item 2).

A run has ranks 0..max_world-1. The `world` founders take ranks 0..world-1 (by site label, then node id,
as `form_world` ranks them, then re-ranked by the first founder to keep hosts of slow access apart:
`ranking`); ranks world..max_world-1 are vacant until late joiners take them. Every
policy is built for max_world workers (at most `train_max_world_limit`) and has every vacant rank
in its dead set before anything else (peerd.node.run.run.vacate: one repair for all of them),
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
- otherwise form a new run among the hosts whose `peerd train` asks for this same run (DescribeRun
  says what a waiting `peerd train` asks for): the first `world` of them by site and node id, once
  that many ask (a host whose `peerd train` starts later is waited for, not trained beside; one
  that asks for other options is named), in the ranks the first founder (rank 0 of `form_world`)
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
first). A joiner pulls the current parameters (peerd.node.run.resume), starts at the lowest
iteration of its live neighbours and trains on data shard `rank mod world` (the data is dealt over
the founding world). It is PeerUp to a member once its run reaches it, like a returning peer: its
RESUMING notice after the pull, or its first update (under a pull policy, its first pull).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from peerd.net.pki import is_node_id
from peerd.net.wirecheck import clip
from peerd.node.run.env import RunEnv
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import RunSpec, first_difference, run_tag, shared_spec
from peerd.plan.sources import access_rates
from peerd.sync.registry import ASYNCHRONOUS
from peerd.sync.topology import spread_slow_hosts
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.join")


class JoinRefused(RuntimeError):
    """This host cannot take part in the run it found; the message says why."""


@dataclass
class Found:
    peer: str
    tag: str
    spec: dict[str, Any]
    nodes: list[str]


MAX_FOUNDERS = 1024   # a DescribeRun asking to rank more is not ranked (a bound on a peer's ask)
MAX_SPEC_JSON = 64 * 1024   # a shared spec as JSON (options and script included), from a peer


def parse_spec(text: str) -> dict[str, Any] | None:
    """A peer's shared spec (JSON object), or None when it is not one (too long, malformed)."""
    if len(text) > MAX_SPEC_JSON:
        return None
    try:
        spec = json.loads(text)
    except ValueError:
        return None
    return spec if isinstance(spec, dict) else None


def table_ok(nodes, max_world: int) -> bool:
    """A member table from a peer: max_world entries, each a node id or "" (vacant), no id twice."""
    taken = [n for n in nodes if n]
    return (len(nodes) == max_world and all(is_node_id(n) for n in taken) and len(set(taken)) == len(taken))
UNKNOWN = pb.RunInfo(active=False, iteration=-2)   # a peer that did not answer: it may run something


def site_of(env: RunEnv, node: str) -> str:
    """A node's `--site` label as it advertised it ("" when none or unknown)."""
    if node == env.node_id:
        return str(env.caps.get("site", ""))
    member = env.membership.get(node)
    return str(member.capabilities.get("site", "")) if member is not None else ""


def form_world(env: RunEnv, world: int, among: list[str] | None = None) -> list[str] | None:
    """The first `world` of this node and the peers `among` (default: the alive ones) by node id,
    in rank order: by site label, then node id (every host that sees the same hosts forms the same
    world; a ring over these ranks keeps each site's hosts together, crossing between two sites
    twice, not at random). None while too few are there. The first of them re-ranks them to keep
    slow access links apart on the ring, for every founder (`ranking`)."""
    peers = env.membership.alive() if among is None else among
    if len(peers) < world - 1:
        return None
    chosen = sorted({env.node_id, *peers})[:world]
    return sorted(chosen, key=lambda n: (site_of(env, n), n))


async def describe(env: RunEnv, node: str, founders: list[str] | None = None, algorithm: str = "") -> pb.RunInfo:
    """What `node` runs (and, when it is the first of `founders`, how it ranks them for
    `algorithm`); UNKNOWN when it did not answer (a daemon without DescribeRun runs nothing that
    could be joined)."""
    m = env.membership.get(node)
    if m is None:
        return UNKNOWN
    try:
        return await env.peers.describe_run(m.address, pb.RunQuery(
            sender=env.node_id, run_id=env.cfg.node.run_id, founders=founders or [], algorithm=algorithm))
    except grpc.aio.AioRpcError as e:
        log.info("describe run: %s did not answer: %s", node, e.code().name)
        return pb.RunInfo(active=False, iteration=-1) if e.code() == grpc.StatusCode.UNIMPLEMENTED else UNKNOWN


class Rankings:
    """The ranks this host gave each founder set it was asked about, kept while founders ask
    (see `ranking`)."""

    MAX = 64

    def __init__(self) -> None:
        self.kept: dict[tuple[tuple[str, ...], bool], tuple[list[str], float]] = {}


async def place(env: RunEnv, rankings: Rankings, spec: RunSpec) -> tuple[list[str] | None, str]:
    """This host's member table for `spec` (max_world entries, "" for vacant ranks), or None and
    why it must wait. Raises JoinRefused when it can never take part."""
    alive = env.membership.alive()
    guess = form_world(env, spec.world)       # the founders when every alive host asks for this run
    infos = await asyncio.gather(*(describe(env, n, guess, spec.algorithm) for n in alive))
    mine = shared_spec(spec)
    match: Found | None = None
    differ: dict[str, str] = {}
    silent = {node for node, info in zip(alive, infos) if info is UNKNOWN}
    ready: list[str] = []                     # their `peerd train` waits for this same run
    for node, info in zip(alive, infos):
        if not info.active and info.waiting_spec_json:
            theirs = parse_spec(info.waiting_spec_json)
            diff = first_difference(mine, theirs) if theirs is not None else "its spec is malformed"
            if diff is None:
                ready.append(node)
            else:
                differ[node] = diff
        if not info.active:
            continue
        theirs = parse_spec(info.spec_json)
        if theirs is None or not table_ok(info.nodes, theirs.get("max_world") if isinstance(
                theirs.get("max_world"), int) else -1):
            log.warning("ignoring %s's answer to DescribeRun: its spec or member table is malformed", node)
            continue
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
        if env.node_id in match.nodes:
            return match.nodes, ""
        if "" not in match.nodes:
            raise JoinRefused(f"run {match.tag} is full: world {spec.world}, max-world {len(match.nodes)}, every "
                              f"rank taken; start the run with a larger --max-world to admit late joiners")
        return await ask_to_join(env, spec, match)
    others = "".join(f"; {n} asks for or runs a different run ({d})" for n, d in differ.items())
    if guess is None:
        return None, (f"{len(alive) + 1} of {spec.world} hosts present (`peerd status` lists the daemons this one "
                      f"sees; one missing needs a --peer seed, the same cluster secret and its port open)" + others)
    # A run forms among hosts whose `peerd train` asks for it, not among every daemon that is up:
    # a host whose trainer starts later would be waited on as silent, then left out of its
    # neighbours' mixes until it came (a short run ended degraded on both hosts).
    maybe = form_world(env, spec.world, ready + sorted(silent))
    if maybe is not None and silent & set(maybe):
        # It may run the run this host belongs to (or a different one): never form without knowing.
        return None, f"asking {', '.join(sorted(silent & set(maybe)))} what it runs: no answer yet"
    founders = form_world(env, spec.world, ready)
    if founders is None:
        idle = sorted(set(alive) - set(ready) - set(differ) - silent)
        return None, (f"{len(ready) + 1} of {spec.world} hosts ask for this run; waiting for `peerd train` with "
                      f"the same options on {spec.world - 1 - len(ready)} more"
                      + (f" (up, not asking yet: {', '.join(idle)})" if idle else "") + others)
    if env.node_id not in founders:
        return None, (f"the run forms among {', '.join(founders)} ({spec.world} hosts asked first); this host "
                      f"joins it once it has, if its --max-world leaves a rank")
    if spec.algorithm == "auto" and founders[0] != env.node_id:
        # One plan per run: the first founder chooses, the others take its choice from its run
        # (the match above). Planning on each host's own view of the links split the run near a
        # tie (a uniform LAN is all ties): hosts that chose differently derive different tags.
        return None, f"--algo auto: waiting for {founders[0]}, the run's first host, to choose"
    if founders[0] == env.node_id:
        founders = ranking(env, rankings, founders, spec.algorithm)
    else:
        # The first founder's ranks (its link matrix, not ours: every founder must form the same
        # table); one that gives none (an older daemon) ranks by site and node id, as we then do.
        first = infos[alive.index(founders[0])]
        if founders != guess:                 # it ranked the world we guessed: ask for this one
            first = await describe(env, founders[0], founders, spec.algorithm)
        theirs = list(first.ranking)
        if sorted(theirs) == sorted(founders):
            founders = theirs
    return founders + [""] * (spec.max_world - spec.world), ""


def ranking(env: RunEnv, rankings: Rankings, founders: list[str], algorithm: str = "") -> list[str]:
    """The ranks this host, as the first founder, gives `founders` for `algorithm`: slow-access
    hosts spread apart on the ring (peerd.sync.topology.spread_slow_hosts) by its link matrix;
    as given for an asynchronous algorithm, when Config.train_spread_slow_hosts is off, or when
    nothing was measured. (An asker that names no algorithm is an older daemon, which spreads;
    `--algo auto` is ranked before the plan chooses, so it spreads too.)

    Why not the asynchronous ones: on the lab's star (10/10/100/100/1000/1000 Mbit) spreading made
    D-PSGD, Hop and AAU, which wait for both neighbours, 1.3-1.4x faster per iteration, but NetMax,
    which waits for no one, reached 80 % in 30.6 s (median of 3) apart against 17.8 s with the
    slow hosts side by side (docs/benchmarks.md, ring order).

    The same answer to every founder that asks (DescribeRun) while they form the run: the first
    answer for a founder set is kept until nobody asked for Config.train_join_timeout, so a link
    estimate that moves between two askers cannot split the run."""
    now = time.monotonic()
    keep_for = env.cfg.train.join_timeout
    spread = algorithm not in ASYNCHRONOUS
    key = (tuple(founders), spread)
    kept = rankings.kept.get(key)
    if kept is not None and now - kept[1] <= keep_for:
        rankings.kept[key] = (kept[0], now)
        return list(kept[0])
    ranked = list(founders)
    if spread and env.cfg.train.spread_slow_hosts and env.link_matrix is not None:
        access = access_rates(env.link_matrix.to_dict(now), founders)
        ranked = spread_slow_hosts(founders, access, {n: site_of(env, n) for n in founders})
        if ranked != founders:
            log.info("ranked the run's hosts to keep slow access links apart on the ring: %s (%s)", ranked,
                     ", ".join(f"{n} {access.get(n, 0) * 8 / 1e6:.0f} Mbit/s" for n in ranked))
    for old in [k for k, (_, at) in rankings.kept.items() if now - at > keep_for]:
        del rankings.kept[old]
    while len(rankings.kept) >= Rankings.MAX:     # askers with many different worlds: forget the oldest
        del rankings.kept[min(rankings.kept, key=lambda k: rankings.kept[k][1])]
    rankings.kept[key] = (ranked, now)
    return list(ranked)


async def ask_to_join(env: RunEnv, spec: RunSpec, found: Found) -> tuple[list[str] | None, str]:
    live = [n for n in found.nodes if n and env.alive(n, suspect=False)]
    admitter = live[0] if live else found.peer
    m = env.membership.get(admitter)
    if m is None:
        return None, f"admitter {admitter} of run {found.tag} is not a member here yet"
    try:
        # The admitter claims the rank at every other member, each within rpc_timeout, in parallel.
        reply = await env.peers.join_run(m.address, pb.JoinRequest(
            sender=env.node_id, run_id=env.cfg.node.run_id, tag=found.tag,
            spec_json=json.dumps(shared_spec(spec), sort_keys=True)))
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            raise JoinRefused(f"{admitter} refused: {e.details()}") from None
        return None, f"joining run {found.tag} via {admitter}: {e.code().name} {clip(e.details() or '', 200)}"
    nodes = list(reply.nodes)
    if not table_ok(nodes, spec.max_world) or not 0 <= reply.rank < len(nodes) or nodes[reply.rank] != env.node_id:
        return None, f"{admitter} answered an inconsistent table; asking again"
    log.info("joined run %s as rank %d (admitted by %s): %s", found.tag, reply.rank, admitter, nodes)
    return nodes, ""


# --- the member side ------------------------------------------------------------------------------
def run_info(env: RunEnv, rankings: Rankings, run: TrainingRun | None, query: pb.RunQuery | None = None,
             waiting: RunSpec | None = None) -> pb.RunInfo:
    """DescribeRun's answer: the run here (if any), the spec a `peerd train` here `waiting` for its
    run asks for, and this host's ranks for the query's founders when it is the first of them."""
    founders = list(query.founders) if query is not None else []
    if founders and founders[0] == env.node_id and len(set(founders)) == len(founders) <= MAX_FOUNDERS:
        rank = ranking(env, rankings, founders, query.algorithm)
    else:
        rank = []
    asks = json.dumps(shared_spec(waiting), sort_keys=True) if waiting is not None else ""
    if run is None:
        return pb.RunInfo(active=False, iteration=-1, ranking=rank, waiting_spec_json=asks)
    return pb.RunInfo(active=is_active(run), tag=run.tag, spec_json=json.dumps(shared_spec(run.spec), sort_keys=True),
                      nodes=run.nodes, iteration=run.policy.k, ranking=rank, waiting_spec_json=asks)


def is_active(run: TrainingRun) -> bool:
    return not run.draining and run.progress.state not in ("done", "degraded", "failed", "stopping")


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


def claim(run: TrainingRun, node: str, rank: int) -> str:
    new = node not in run.nodes
    why = take(run.nodes, run.spec.world, node, rank)
    if not why and new:
        run.liveness.returning.add(node)    # PeerUp once its run reaches us (PeerLiveness)
        log.info("run %s: rank %d taken by %s", run.tag, rank, node)
    return why


def release(run: TrainingRun, node: str, rank: int) -> None:
    if give_back(run.nodes, run.spec.world, node, rank):
        run.liveness.returning.discard(node)
        log.info("run %s: claim of rank %d for %s released", run.tag, rank, node)


async def admit(env: RunEnv, run: TrainingRun | None, req: pb.JoinRequest) -> pb.JoinReply:
    """JoinRun at the admitter. Raises JoinRefused (never admissible) or RuntimeError (try again)."""
    if run is None or not is_active(run) or req.tag != run.tag:
        raise JoinRefused(f"run {clip(req.tag, 40)} is not active here")
    theirs = parse_spec(req.spec_json)
    if theirs is None:
        raise JoinRefused("the joiner's spec is not a JSON object")
    diff = first_difference(theirs, shared_spec(run.spec))
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
        others = [n for n in run.nodes if n and n not in (env.node_id, req.sender) and env.alive(n)]
        answers = await asyncio.gather(*(_claim_at(env, run, n, req.sender, rank, False) for n in others))
        refused = {n: why for n, why in zip(others, answers) if why}
        if refused:
            release(run, req.sender, rank)
            await asyncio.gather(*(_claim_at(env, run, n, req.sender, rank, True)
                                   for n, why in zip(others, answers) if not why))
            raise RuntimeError(f"rank {rank} not agreed: " + "; ".join(f"{n}: {w}" for n, w in refused.items()))
        log.info("run %s: admitted %s as rank %d (agreed by %s)", run.tag, req.sender, rank, others or "nobody else")
        return pb.JoinReply(rank=rank, nodes=run.nodes)


async def _claim_at(env: RunEnv, run: TrainingRun, member: str, node: str, rank: int, rel: bool) -> str:
    m = env.membership.get(member)
    if m is None:
        return "not a member"
    try:
        reply = await env.peers.admit_to_run(m.address, pb.AdmitRequest(
            sender=env.node_id, run_id=env.cfg.node.run_id, tag=run.tag, node=node, rank=rank, release=rel))
    except grpc.aio.AioRpcError as e:
        return f"no answer ({e.code().name})"
    return "" if reply.accepted else f"held by {reply.holder or '?'}"


def on_admit(run: TrainingRun | None, req: pb.AdmitRequest) -> pb.AdmitReply:
    """AdmitToRun at a member: accept or refuse the admitter's claim (or take it back)."""
    if run is None or req.tag != run.tag:
        return pb.AdmitReply(accepted=False, holder=f"run {clip(req.tag, 40)} not here")
    if req.release:
        release(run, req.node, req.rank)
        return pb.AdmitReply(accepted=True)
    holder = claim(run, req.node, req.rank)
    return pb.AdmitReply(accepted=not holder, holder=holder)
