"""DSGD-AAU: the waited-for edges of every iteration form a strongly connected spanning subgraph."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from peerd.sim.engine import Simulator
from peerd.sync import topology as T
from peerd.sync.aau import AAU, spanning_tree
from peerd.sync.events import Mix, MixRequested, Published, UpdateArrived, UpdateLost, Wait
from tests.sync_helpers import random_graph, random_spec, strongly_connected


def run_aau(seed, n, crash=None, estimates="arrival", iterations=20, lose=0.0):
    topo = random_graph(seed, n)
    pols = [AAU(i, topo) for i in range(n)]
    waited: dict[int, dict[int, tuple[int, ...]]] = defaultdict(dict)

    def on_mix(sim, i, mix: Mix):
        assert abs(sum(w for _, _, w in mix.entries) - 1.0) < 1e-9
        waited[mix.k][i] = mix.waited

    spec = random_spec(seed, n, params=8, iterations=iterations, estimates=estimates,
                       crash=crash or {}, detect=0.5, lose=lose)
    sim = Simulator(spec, pols, on_mix=on_mix)
    return sim, sim.run(), waited, topo


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(2, 9), measured=st.booleans())
def test_waited_edges_strongly_connected_every_iteration(seed, n, measured):
    sim, res, waited, topo = run_aau(seed, n, estimates="arrival" if measured else "none")
    assert min(res.iterations) >= sim.spec.iterations
    for k, per in waited.items():
        assert sorted(per) == list(range(n))          # everyone mixed iteration k
        edges = {(j, i) for i, w in per.items() for j in w}
        assert all(topo.adj[j, i] for j, i in edges)  # only real links
        assert strongly_connected(list(range(n)), edges), (k, per)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(2, 9), lose=st.sampled_from([0.05, 0.3]))
def test_lost_updates_never_stall_a_worker(seed, n, lose):
    """Pushes that fail on their way (UpdateLost at the receiver): every worker still finishes."""
    sim, res, _, _ = run_aau(seed, n, lose=lose)
    assert not res.stalled and min(res.iterations) >= sim.spec.iterations, res.iterations


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 8), at=st.floats(0.0, 2.0))
def test_crash_keeps_live_workers_going_and_connected(seed, n, at):
    victim = seed % n
    sim, res, waited, topo = run_aau(seed, n, crash={victim: at})
    live = [i for i in range(n) if i != victim]
    assert all(res.iterations[i] >= sim.spec.iterations for i in live)
    # Rounds mixed after every live worker learned of the crash use the live tree.
    last = max(waited)
    per = {i: w for i, w in waited[last].items() if i in live}
    edges = {(j, i) for i, w in per.items() for j in w}
    assert victim not in {j for j, _ in edges}
    sub = T.Graph(topo.adj[np.ix_(live, live)])
    connected = strongly_connected(list(range(len(live))),
                                   {(a, b) for a in range(len(live)) for b in sub.out_neighbors(a)})
    if connected:
        assert strongly_connected(live, edges)


def test_tree_prefers_fast_links():
    adj = ~np.eye(4, dtype=bool)
    cost = np.full((4, 4), 10.0)
    for a, b in [(0, 1), (1, 2), (2, 3)]:
        cost[a, b] = cost[b, a] = 1.0
    nb = spanning_tree(adj, cost, [0, 1, 2, 3])
    assert nb == [{1}, {0, 2}, {1, 3}, {2}]
    nb = spanning_tree(adj, cost, [0, 2, 3])           # 1 is dead: 0 must use a slow link
    assert nb[1] == set() and sum(len(x) for x in nb) == 4


def test_refuses_directed_graphs():
    with pytest.raises(ValueError, match="undirected"):
        AAU(0, T.OnePeerExp(4, directed=True))


def test_link_change_mid_run_switches_every_worker_at_the_same_iteration():
    # Ring-with-chords graph; at t=2 the fast links become slow and vice versa.
    n = 8
    topo = random_graph(11, n, extra=0.4)
    rng = np.random.default_rng(2)
    bw1 = rng.uniform(1e3, 1e6, (n, n))
    bw2 = 1e9 / bw1
    pols = [AAU(i, topo) for i in range(n)]
    waited: dict[int, dict[int, tuple[int, ...]]] = defaultdict(dict)
    spec = random_spec(11, n, params=200, iterations=40, estimates="arrival", bandwidth=bw1,
                       latency=1e-3, p_slow=0.0, bandwidth_changes={2.0: bw2})
    sim = Simulator(spec, pols, on_mix=lambda s, i, m: waited[m.k].__setitem__(i, m.waited))
    res = sim.run()
    assert min(res.iterations) >= spec.iterations
    assert all(p.late == 0 and len(p.versions) == 3 for p in pols)
    trees = set()
    for k, per in waited.items():
        edges = frozenset((j, i) for i, w in per.items() for j in w)
        assert strongly_connected(list(range(n)), set(edges)), k
        trees.add(edges)
    assert len(trees) == 2           # the tree changed once, for everyone at once


def test_a_lost_update_is_not_waited_for_in_its_iteration_only():
    """On a ring of 4 the tree (by ids, no estimates) is 0-1, 1-2, 2-3: worker 1 waits on 0 and 2.
    2's update of 0 is lost on its way: the mix of 0 goes without it, the mix of 1 waits for 2."""
    p = AAU(1, T.ring(4))
    assert p.waited(0) == [0, 2]
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(0, 0), 0.1)
    assert isinstance(p.on_event(MixRequested(0), 0.2)[0], Wait)
    acts = p.on_event(UpdateLost(2, 0), 0.3)
    assert any(isinstance(a, Mix) and {j for j, _, _ in a.entries} == {0, 1} for a in acts), acts
    p.on_event(Published(1), 0.4)
    p.on_event(UpdateArrived(0, 1), 0.5)
    assert not any(isinstance(a, Mix) for a in p.on_event(MixRequested(1), 0.6))
    assert any(isinstance(a, Mix) for a in p.on_event(UpdateArrived(2, 1), 0.7))
