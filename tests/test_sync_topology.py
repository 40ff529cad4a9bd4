from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from peerd.sync import topology as T
from tests.sync_helpers import random_graph


@pytest.mark.parametrize("topo", [T.ring(8), T.ring(7, "mh"), T.torus(3, 4), T.torus(4, 4, "mh"),
                                  T.complete(5), T.complete(6, "mh"), T.OnePeerExp(16),
                                  T.OnePeerExp(6, directed=True), T.AlternatingExpRing(16, 4),
                                  T.AlternatingExpRing(8, 1)])
def test_rows_sum_to_one_every_iteration(topo):
    for k in range(2 * max(topo.period, 1) + 1):
        W = topo.matrix(k)
        assert np.allclose(W.sum(1), 1.0)
        assert (W >= 0).all()
        # weights only on self and in-neighbours
        for i in range(topo.n):
            support = set(np.flatnonzero(W[i])) - {i}
            assert support <= set(topo.in_neighbors(i, k))


@pytest.mark.parametrize("topo", [T.ring(8, "mh"), T.torus(3, 3, "mh"), T.OnePeerExp(8),
                                  T.OnePeerExp(8, directed=True), T.AlternatingExpRing(8, 2)])
def test_doubly_stochastic_topologies_preserve_the_mean(topo):
    x = np.random.default_rng(0).normal(size=(topo.n, 3))
    for k in range(topo.period * 2):
        x = topo.matrix(k) @ x
    assert np.allclose(x.mean(0), np.random.default_rng(0).normal(size=(topo.n, 3)).mean(0))


def test_time_varying_shapes():
    e = T.OnePeerExp(8)
    assert [e.out_neighbors(0, k) for k in range(4)] == [(1,), (2,), (4,), (1,)]
    d = T.OnePeerExp(8, directed=True)
    assert d.out_neighbors(7, 1) == (1,) and d.in_neighbors(1, 1) == (7,)
    aer = T.AlternatingExpRing(8, 2)
    sizes = {len(aer.group(0, k)) for k in range(aer.period)}
    assert sizes == {2, 4}  # alternates intra-node (2) and cross-node (4)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 12), mh=st.booleans(),
       used_seed=st.integers(0, 10_000))
def test_random_graph_weights_and_renormalisation(seed, n, mh, used_seed):
    g = random_graph(seed, n)
    g = T.Graph(g.adj, "mh" if mh else "uniform")
    W = g.matrix()
    assert np.allclose(W.sum(1), 1.0)
    if mh:
        assert np.allclose(W, W.T)
    rng = np.random.default_rng(used_seed)
    for i in range(n):
        nb = list(g.in_neighbors(i))
        used = [i] + [j for j in nb if rng.random() < 0.5]
        row = T.renormalise(g.weights(i), used)
        assert set(row) == set(used)
        assert abs(sum(row.values()) - 1.0) < 1e-12


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="n:"):
        T.OnePeerExp(6)
    with pytest.raises(ValueError, match="weighting"):
        T.from_links(np.array([[0, 1], [0, 0]]), "mh")
    with pytest.raises(ValueError, match="topology"):
        T.make("star", 4)


def test_slow_access_hosts_are_spread_apart_on_the_ring():
    """mixed-links' star: access 10/10/100/100/1000/1000 Mbit in node-id order puts the two 10 Mbit
    hosts side by side; spread, every ring edge has at most one 10 Mbit end."""
    from peerd.sync.topology import spread_slow_hosts

    order = ["a", "b", "c", "d", "e", "f"]
    access = dict(zip(order, [10e6, 10e6, 100e6, 100e6, 1000e6, 1000e6]))
    ranked = spread_slow_hosts(order, access)
    assert ranked == ["a", "f", "b", "e", "c", "d"]
    ring_edges = [(ranked[i], ranked[(i + 1) % 6]) for i in range(6)]
    assert not any(access[u] == access[v] == 10e6 for u, v in ring_edges)
    # Within 2x of the fastest is "fast": measurement noise on a uniform LAN keeps the order.
    assert spread_slow_hosts(order, {h: 1000e6 - 90e6 * i for i, h in enumerate(order)}) == order
    assert spread_slow_hosts(order, {}) == order                          # nothing measured
    assert spread_slow_hosts(order, {"c": 1e6}) == order                  # one measured: no fastest to compare
    # Two slow among three fast: slow, fast, slow, fast, fast.
    assert spread_slow_hosts(["a", "b", "c", "d", "e"], {"a": 1e9, "b": 1e9, "c": 1e9, "d": 1e7, "e": 1e7}) \
        == ["d", "c", "e", "b", "a"]
    # Sites stay together; each site's hosts are spread within it.
    site = dict(zip(order, "xxxyyy"))
    access = dict(zip(order, [1e9, 1e7, 1e7, 1e9, 1e9, 1e9]))
    assert spread_slow_hosts(order, access, site) == ["b", "a", "c", "d", "e", "f"]


def test_access_rate_is_a_nodes_fastest_measured_link():
    from peerd.plan.sources import access_rates

    links = [{"measurer": "a", "target": "b", "capacity_bytes_s": 1.2e6},
             {"measurer": "c", "target": "a", "capacity_bytes_s": 0, "throughput_bytes_s": 9e6},
             {"measurer": "b", "target": "c", "capacity_bytes_s": 1.1e6},
             {"measurer": "x", "target": "y", "capacity_bytes_s": 5e9}]
    assert access_rates({"links": links}, ["a", "b", "c", "d"]) == {"a": 9e6, "b": 1.2e6, "c": 9e6}
