"""The pure parts of joining a run (peerd/node/run/joining.py): the shared spec and its tag, the first
difference named, and the member-table rule that keeps two joiners off one rank."""
from __future__ import annotations

import dataclasses
import json

from peerd.node.run.joining import give_back, take
from peerd.node.run.spec import RunSpec, first_difference, run_tag, shared_spec

SPEC = RunSpec("digits", "hop", "ring", 4, 300, 0, False, 1.0, {"lr": "0.1"}, [], 50, 60.0, 8)
FOUNDERS = ["a", "b", "c", "d"]


def test_tag_ignores_per_host_fields_and_names_the_founders():
    tag = run_tag(SPEC, FOUNDERS)
    assert run_tag(dataclasses.replace(SPEC, slowdown=3.0, join_timeout=5.0), FOUNDERS) == tag
    assert run_tag(dataclasses.replace(SPEC, max_world=6), FOUNDERS) != tag
    assert run_tag(SPEC, ["a", "b", "c", "e"]) != tag
    assert "slowdown" not in shared_spec(SPEC) and shared_spec(SPEC)["max_world"] == 8


def test_first_difference_is_named_in_a_fixed_order():
    ours = shared_spec(SPEC)
    assert first_difference(ours, dict(ours)) is None
    theirs = shared_spec(dataclasses.replace(SPEC, iterations=200, seed=3))
    assert first_difference(ours, theirs) == "iterations: 300 here, 200 in the run"
    theirs = shared_spec(dataclasses.replace(SPEC, options={"lr": "0.2"}))
    assert first_difference(ours, theirs) == "options: {'lr': '0.1'} here, {'lr': '0.2'} in the run"
    auto = shared_spec(dataclasses.replace(SPEC, algorithm="auto", topology="ring"))
    assert first_difference(auto, shared_spec(dataclasses.replace(SPEC, topology="torus"))) is None


def test_one_holder_per_rank_one_rank_per_node():
    nodes = FOUNDERS + ["", "", "", ""]
    assert take(nodes, 4, "x", 4) == ""
    assert take(nodes, 4, "x", 4) == ""                  # the same claim again: idempotent
    assert take(nodes, 4, "y", 4) == "x"                 # a second joiner for that rank: refused
    assert take(nodes, 4, "x", 5).startswith("x already holds rank 4")
    assert take(nodes, 4, "y", 2).startswith("rank 2 outside")   # a founder's rank is never given
    assert take(nodes, 4, "y", 8).startswith("rank 8 outside")
    assert not give_back(nodes, 4, "y", 4) and nodes[4] == "x"  # only the holder's claim is withdrawn
    assert give_back(nodes, 4, "x", 4) and nodes[4] == ""
    assert take(nodes, 4, "y", 4) == "" and nodes == FOUNDERS + ["y", "", "", ""]


def test_two_admitters_with_overlapping_members_never_both_win():
    """Admitters P and Q claim rank 4 for x and y at once; each claims locally first, then at every
    other member it sees alive, in any order. An admission commits only if all accepted."""
    import itertools
    members = ["a", "b", "c"]
    for order in itertools.permutations([("a", "x"), ("b", "y"), ("c", "x"), ("c", "y"), ("b", "x"), ("a", "y")]):
        tables = {m: FOUNDERS + ["", "", "", ""] for m in members}
        take(tables["a"], 4, "x", 4)                   # P is a, Q is b: their own claims come first
        take(tables["b"], 4, "y", 4)
        accepted = {"x": {"a"}, "y": {"b"}}
        for member, node in order:
            if member == ("a" if node == "x" else "b"):
                continue
            if take(tables[member], 4, node, 4) == "":
                accepted[node].add(member)
        winners = [n for n, acc in accepted.items() if acc == set(members)]
        assert len(winners) <= 1, order


def test_world_is_ranked_by_site_then_node_id():
    """Sites a and b, node ids interleaved: the ranks keep each site together (a ring over them
    crosses between the sites twice), the same on every host; no labels: node id order as before."""
    import types

    from peerd.node.run.joining import form_world

    def daemon(me: str, sites: dict[str, str]):
        members = {n: types.SimpleNamespace(capabilities={"site": s}) for n, s in sites.items() if n != me}
        return types.SimpleNamespace(node_id=me, caps={"site": sites[me]},
                                     membership=types.SimpleNamespace(alive=lambda: sorted(members),
                                                                      get=members.get))

    sites = {"n1": "b", "n2": "a", "n3": "b", "n4": "a", "n5": "b", "n6": "a"}
    worlds = {me: form_world(daemon(me, sites), 6) for me in sites}
    assert all(w == ["n2", "n4", "n6", "n1", "n3", "n5"] for w in worlds.values()), worlds
    assert form_world(daemon("n1", {n: "" for n in sites}), 6) == sorted(sites)
    assert form_world(daemon("n1", sites), 7) is None                 # too few peers alive
    assert form_world(daemon("n1", sites), 3) == ["n2", "n1", "n3"]  # the first peers by id, by site


def test_every_founder_forms_the_run_in_the_first_founders_ranks(monkeypatch):
    """No run found: every founder forms the run, in the ranks the first founder by node id (a)
    answers with DescribeRun: the two 10 Mbit hosts b and c, side by side by node id, apart (Hop
    waits for every neighbour), in node id order for NetMax. Its answer does not move while
    founders ask, even when its links do; an older first founder (no ranking in its answer) leaves
    site and node id order, which it uses too."""
    import asyncio
    import types

    from peerd.config import Config
    from peerd.node.run import joining
    from peerd.v1 import peer_pb2 as pb

    access = {"a": 1e9, "b": 1e7, "c": 1e7, "d": 1e9}
    links = [{"measurer": u, "target": v, "capacity_bytes_s": min(access[u], access[v]) / 8}
             for u in access for v in access if u != v]

    def daemon(me: str, cfg: Config):
        others = {n: types.SimpleNamespace(capabilities={}) for n in access if n != me}
        return types.SimpleNamespace(node_id=me, caps={}, cfg=cfg, rankings=joining.Rankings(),
                                     membership=types.SimpleNamespace(alive=lambda: sorted(others), get=others.get),
                                     link_matrix=types.SimpleNamespace(to_dict=lambda now: {"links": list(links)}))
    hosts = {n: daemon(n, Config()) for n in access}

    asking = {}                                           # node -> the spec its `peerd train` asks for

    async def describe(asker, node, founders=None, algorithm=""):      # DescribeRun, answered in-process
        host = hosts[node]
        return joining.run_info(host, host.rankings, None, pb.RunQuery(sender=asker.node_id, founders=founders or [],
                                                                       algorithm=algorithm), asking.get(node))

    def place(me, spec):
        asking.update(dict.fromkeys(hosts, spec))
        return asyncio.run(joining.place(hosts[me], hosts[me].rankings, spec))
    monkeypatch.setattr(joining, "describe", describe)
    spec = dataclasses.replace(SPEC, max_world=6)
    spread = ["b", "d", "c", "a", "", ""]                 # slowest first, then fast, slow, fast
    for me in "abcd":
        assert place(me, spec) == (spread, "")
    netmax = dataclasses.replace(spec, algorithm="netmax")  # asynchronous: slow hosts are not spread
    for me in "abcd":
        assert place(me, netmax) == (["a", "b", "c", "d", "", ""], "")
    links[:] = [dict(e, capacity_bytes_s=1e8) for e in links]   # a's links now read uniform
    assert place("c", spec) == (spread, "")

    hosts["a"] = daemon("a", Config().replace(train_spread_slow_hosts=False))
    for me in "abcd":
        assert place(me, spec) == (["a", "b", "c", "d", "", ""], "")

    async def older(asker, node, founders=None, algorithm=""):
        return pb.RunInfo(active=False, iteration=-1, waiting_spec_json=json.dumps(shared_spec(spec), sort_keys=True))
    monkeypatch.setattr(joining, "describe", older)
    assert asyncio.run(joining.place(hosts["d"], hosts["d"].rankings, spec)) == (["a", "b", "c", "d", "", ""], "")


def test_a_run_forms_among_the_hosts_that_ask_for_it(monkeypatch):
    """Daemons a..d are up; `peerd train --world 2` runs on b and d only. The run forms among b
    and d once both ask (not among a and b, the first two daemons by id, which left b training
    alone beside an a that never came); one that asks for other options is named; a third host
    asking for the same run waits for the first two to form it."""
    import asyncio
    import types

    from peerd.config import Config
    from peerd.node.run import joining
    from peerd.v1 import peer_pb2 as pb

    names = "abcd"

    def daemon(me: str):
        others = {n: types.SimpleNamespace(capabilities={}) for n in names if n != me}
        return types.SimpleNamespace(node_id=me, caps={}, cfg=Config(), rankings=joining.Rankings(),
                                     membership=types.SimpleNamespace(alive=lambda: sorted(others), get=others.get),
                                     link_matrix=types.SimpleNamespace(to_dict=lambda now: {"links": []}))
    hosts = {n: daemon(n) for n in names}
    asking: dict[str, object] = {}

    async def describe(asker, node, founders=None, algorithm=""):
        host = hosts[node]
        return joining.run_info(host, host.rankings, None, pb.RunQuery(sender=asker.node_id, founders=founders or [],
                                                                       algorithm=algorithm), asking.get(node))
    monkeypatch.setattr(joining, "describe", describe)
    spec = dataclasses.replace(SPEC, world=2, max_world=2)

    def place(me):
        return asyncio.run(joining.place(hosts[me], hosts[me].rankings, spec))
    asking["b"] = spec
    nodes, why = place("b")
    assert nodes is None and "1 of 2 hosts ask for this run" in why and "not asking yet: a, c, d" in why, why
    asking["d"] = dataclasses.replace(spec, iterations=spec.iterations + 1)
    nodes, why = place("b")
    assert nodes is None and "d asks for or runs a different run (iterations:" in why, why
    asking["d"] = spec
    assert place("b") == (["b", "d"], "") and place("d") == (["b", "d"], "")
    asking["c"] = spec                                    # a third asker: b and c come first by id
    nodes, why = place("d")
    assert nodes is None and "the run forms among b, c" in why, why
