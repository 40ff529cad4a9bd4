"""Shared builders for the sync/sim tests: random connected graphs and random delays."""
from __future__ import annotations

import numpy as np

from peerd.sim.engine import SimSpec
from peerd.sync import topology


def random_graph(seed: int, n: int, extra: float = 0.3) -> topology.Graph:
    """A connected undirected graph: a random spanning tree plus random extra edges."""
    rng = np.random.default_rng(seed)
    a = np.zeros((n, n), dtype=bool)
    order = rng.permutation(n)
    for idx in range(1, n):
        u, v = order[idx], order[rng.integers(idx)]
        a[u, v] = a[v, u] = True
    extra_edges = rng.random((n, n)) < extra
    extra_edges = np.triu(extra_edges, 1)
    a |= extra_edges | extra_edges.T
    np.fill_diagonal(a, False)
    return topology.Graph(a)


def random_spec(seed: int, n: int, **kw) -> SimSpec:
    """Random per-worker slowdowns, random per-link bandwidth and latency."""
    rng = np.random.default_rng(seed + 1)
    factors = {i: float(rng.choice([1.0, 1.0, 1.5, 3.0, 6.0])) for i in range(n)}
    bw = rng.uniform(2e4, 2e6, (n, n))
    lat = rng.uniform(1e-4, 0.2, (n, n))
    base = dict(n=n, params=16, iterations=30, compute=0.1, factors=factors, p_slow=0.2,
                slow_factor=float(rng.uniform(1, 8)), bandwidth=bw, latency=lat, seed=seed,
                stop_at_target=False, max_time=1e5)
    base.update(kw)
    return SimSpec(**base)


def strongly_connected(nodes: list[int], edges: set[tuple[int, int]]) -> bool:
    if len(nodes) <= 1:
        return True
    fwd: dict[int, list[int]] = {i: [] for i in nodes}
    bwd: dict[int, list[int]] = {i: [] for i in nodes}
    for a, b in edges:
        if a in fwd and b in fwd:
            fwd[a].append(b)
            bwd[b].append(a)

    def reach(adj: dict[int, list[int]]) -> set[int]:
        seen, todo = {nodes[0]}, [nodes[0]]
        while todo:
            for y in adj[todo.pop()]:
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return seen

    return len(reach(fwd)) == len(nodes) and len(reach(bwd)) == len(nodes)
