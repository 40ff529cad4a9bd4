"""Communication graphs and mixing weights.

A Topology answers, for worker i at iteration k: whom i sends to, whom i receives from, and the
mixing weights of row i (self included). Static graphs ignore k; one-peer exponential and the
alternating exponential ring (AER) are time-varying.

Weights:
- uniform: w_ij = 1/(|N_in(i)| + 1) for j in N_in(i) and for i itself.
- Metropolis-Hastings (undirected graphs): w_ij = 1/(1 + max(d_i, d_j)), w_ii = 1 - sum_j w_ij;
  symmetric and doubly stochastic, so plain averaging preserves the mean.
- Group topologies (one-peer exp, AER): exact average inside this iteration's group, 1/|group|.
`renormalise(row, used)` restricts a row to the entries actually mixed and rescales it to sum 1 (what
backup workers, staleness and crashes need).

Repair (`repair(topo, dead)`): a static graph with dead workers is contracted around them: live u
sends to live v when the original graph has a path u -> ... -> v whose inner workers are all dead.
A ring thus re-links around the hole (the live ring), a torus around a dead cell; nothing changes
for a complete graph. Weights are recomputed (same weighting) on the repaired graph. Every worker
with the same dead set derives the same graph. Time-varying group topologies are returned as they
are: a round whose partner is dead is a self step, and the next round pairs differently.

Choice: the undirected one-peer exponential graph pairs j with j XOR 2^q in round q (a perfect
matching, n a power of two) so each pairwise average is exact and the mean is preserved; the
directed one-peer exponential graph (SGP) sends i -> i + 2^q mod n.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class Topology:
    n: int
    directed: bool = False
    period: int = 1  # iterations after which the graph repeats

    def out_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        raise NotImplementedError

    def in_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        raise NotImplementedError

    def weights(self, i: int, k: int = 0) -> dict[int, float]:
        """Row i of W at iteration k over i and its in-neighbours; sums to 1."""
        raise NotImplementedError

    def adjacency(self, k: int = 0) -> np.ndarray:
        a = np.zeros((self.n, self.n), dtype=bool)
        for i in range(self.n):
            for j in self.out_neighbors(i, k):
                a[i, j] = True
        return a

    def matrix(self, k: int = 0) -> np.ndarray:
        w = np.zeros((self.n, self.n))
        for i in range(self.n):
            for j, x in self.weights(i, k).items():
                w[i, j] = x
        return w


@dataclass
class Graph(Topology):
    """A static graph given by its directed adjacency (adj[i, j]: i sends to j)."""
    adj: np.ndarray
    weighting: str = "uniform"  # uniform | mh

    def __post_init__(self) -> None:
        a = np.asarray(self.adj, dtype=bool).copy()
        if a.ndim != 2 or a.shape[0] != a.shape[1]:
            raise ValueError(f"adj: expected a square matrix, got shape {a.shape}")
        if self.weighting not in ("uniform", "mh"):
            raise ValueError(f"weighting: expected uniform or mh, got {self.weighting!r}")
        np.fill_diagonal(a, False)
        a.flags.writeable = False  # shared by every policy built on this graph
        self.adj = a
        self.n = a.shape[0]
        self.directed = not np.array_equal(a, a.T)
        if self.weighting == "mh" and self.directed:
            raise ValueError("weighting: Metropolis-Hastings needs an undirected graph")
        self._out = [tuple(int(j) for j in np.flatnonzero(a[i])) for i in range(self.n)]
        self._in = [tuple(int(j) for j in np.flatnonzero(a[:, i])) for i in range(self.n)]
        self._w = [self._row(i) for i in range(self.n)]

    def _row(self, i: int) -> dict[int, float]:
        nb = self._in[i]
        if self.weighting == "uniform":
            w = 1.0 / (len(nb) + 1)
            row = {j: w for j in nb}
            row[i] = 1.0 - w * len(nb)
            return row
        d = [len(self._in[j]) for j in range(self.n)]
        row = {j: 1.0 / (1 + max(d[i], d[j])) for j in nb}
        row[i] = 1.0 - sum(row.values())
        return row

    def adjacency(self, k: int = 0) -> np.ndarray:
        return self.adj

    def out_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        return self._out[i]

    def in_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        return self._in[i]

    def weights(self, i: int, k: int = 0) -> dict[int, float]:
        return self._w[i]


def ring(n: int, weighting: str = "uniform") -> Graph:
    if n < 2:
        raise ValueError(f"n: a ring needs at least 2 workers, got {n}")
    a = np.zeros((n, n), dtype=bool)
    for i in range(n):
        a[i, (i + 1) % n] = a[(i + 1) % n, i] = True
    return Graph(a, weighting)


def spread_slow_hosts(order: list[str], access: dict[str, float], site: dict[str, str] | None = None) -> list[str]:
    """`order` (ranks, each site's hosts together) with the hosts of slow access spread out, so that
    a ring over the ranks never joins two slow hosts where it can help it (ours).

    Why: on a star, two 10 Mbit hosts that are ring neighbours send each other their updates
    across two saturated access links at once; plain TCP took 2.62-2.81 s per ring exchange with
    them adjacent against 1.82-1.86 s with them apart, the same bytes on the same links
    (docs/bench/experiments/ring_order_tcp.py). A rate model sees no difference between the two.

    `access[h]`: h's fastest measured link, either direction (bytes/s; absent or 0: unknown, taken
    as fast). Within each run of consecutive hosts of one site (`site`, default one site), a host's
    class is floor(log2(fastest / access)): hosts within 2x of the site's fastest are class 0.
    All class 0: the order is kept as it is (noise never reshuffles a uniform LAN). Otherwise,
    slowest class first (ties in the given order), the first half is interleaved with the rest
    reversed: slowest, fastest, second slowest, second fastest, ... Pure and deterministic, but the
    inputs are one host's measurements: one host orders a run (peerd.node.run.joining.place)."""
    site = site or {}
    out: list[str] = []
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and site.get(order[end], "") == site.get(order[start], ""):
            end += 1
        block = order[start:end]
        start = end
        rates = {h: float(access.get(h, 0.0) or 0.0) for h in block}
        top = max(rates.values(), default=0.0)
        cls = {h: int(math.floor(math.log2(top / r))) if 0 < r < top else 0 for h, r in rates.items()}
        if len(block) < 3 or not any(cls.values()):
            out += block
            continue
        ranked = sorted(block, key=lambda h: -cls[h])          # stable: ties keep the given order
        half = (len(ranked) + 1) // 2
        slow, fast = ranked[:half], ranked[half:][::-1]
        for k, h in enumerate(slow):
            out.append(h)
            if k < len(fast):
                out.append(fast[k])
    return out


def torus(rows: int, cols: int, weighting: str = "uniform") -> Graph:
    if rows < 1 or cols < 1 or rows * cols < 2:
        raise ValueError(f"rows, cols: a torus needs at least 2 workers, got {rows}x{cols}")
    n = rows * cols
    a = np.zeros((n, n), dtype=bool)
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for j in (((r + 1) % rows) * cols + c, r * cols + (c + 1) % cols):
                if j != i:
                    a[i, j] = a[j, i] = True
    return Graph(a, weighting)


def complete(n: int, weighting: str = "uniform") -> Graph:
    a = ~np.eye(n, dtype=bool)
    return Graph(a, weighting)


def from_links(links: np.ndarray | list, weighting: str = "uniform") -> Graph:
    """A graph from a link matrix: links[i][j] truthy (or > 0: a bandwidth) means i can send to j."""
    a = np.asarray(links)
    return Graph(a > 0 if a.dtype != bool else a, weighting)


def _log2_exact(n: int, what: str) -> int:
    r = int(round(math.log2(n))) if n > 0 else -1
    if n < 2 or 2 ** r != n:
        raise ValueError(f"n: {what} needs a power of two >= 2 workers, got {n}")
    return r


@dataclass
class OnePeerExp(Topology):
    """One-peer exponential graph. Undirected (default): round q = k mod log2(n) pairs i with
    i XOR 2^q, weight 1/2. Directed (SGP): i sends to i + 2^q and receives from i - 2^q."""
    n: int
    directed: bool = False

    def __post_init__(self) -> None:
        if self.directed:
            if self.n < 2:
                raise ValueError(f"n: needs at least 2 workers, got {self.n}")
            self.period = max(1, int(math.floor(math.log2(self.n - 1))) + 1) if self.n > 2 else 1
        else:
            self.period = _log2_exact(self.n, "the undirected one-peer exponential graph")

    def _hop(self, k: int) -> int:
        return 2 ** (k % self.period)

    def out_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        if self.directed:
            return ((i + self._hop(k)) % self.n,)
        return (i ^ self._hop(k),)

    def in_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        if self.directed:
            return ((i - self._hop(k)) % self.n,)
        return (i ^ self._hop(k),)

    def weights(self, i: int, k: int = 0) -> dict[int, float]:
        (j,) = self.in_neighbors(i, k)
        return {i: 0.5, j: 0.5}


@dataclass
class AlternatingExpRing(Topology):
    """AER (paper 4): n = nodes * per_node workers, nodes a power of two. Round q = (k // 2) mod
    log2(nodes) pairs node j with node j XOR 2^q; a pair averages either inside each node (two
    groups of per_node) or across both nodes (one group of 2 * per_node), alternating between
    consecutive iterations and staggered across pairs. Exact group averages."""
    n: int
    per_node: int = 1

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.n % self.per_node:
            raise ValueError(f"per_node: {self.per_node} does not divide n={self.n}")
        self.nodes = self.n // self.per_node
        self.r = _log2_exact(self.nodes, "AER (number of nodes)")
        self.period = 2 * self.r

    def group(self, i: int, k: int) -> tuple[int, ...]:
        node = i // self.per_node
        q = (k // 2) % self.r
        other = node ^ (1 << q)
        lo = min(node, other)
        cross = (k + lo) % 2 == 0
        members = (node, other) if cross else (node,)
        return tuple(sorted(m * self.per_node + x for m in members for x in range(self.per_node)))

    def out_neighbors(self, i: int, k: int = 0) -> tuple[int, ...]:
        return tuple(j for j in self.group(i, k) if j != i)

    in_neighbors = out_neighbors

    def weights(self, i: int, k: int = 0) -> dict[int, float]:
        g = self.group(i, k)
        return {j: 1.0 / len(g) for j in g}


def renormalise(row: dict[int, float], used: list[int] | tuple[int, ...] | set[int]) -> dict[int, float]:
    """Row restricted to `used` (self must be in it) and rescaled to sum 1."""
    sub = {j: row[j] for j in used}
    total = sum(sub.values())
    if total <= 0:
        raise ValueError(f"used: entries {sorted(used)} carry no weight in row {row}")
    return {j: w / total for j, w in sub.items()}


def repair(topo: Topology, dead: set[int] | frozenset[int]) -> Topology:
    """The graph the live workers use while `dead` are down (see the module docstring); cached per
    dead set on the base topology, so N policies in one process share one repaired graph."""
    if not dead or not isinstance(topo, Graph):
        return topo
    key = frozenset(dead)
    cache = topo.__dict__.setdefault("_repaired", {})
    got = cache.get(key)
    if got is None:
        a = topo.adj
        out = np.zeros_like(a)
        for u in range(topo.n):
            if u in key:
                continue
            seen, stack = {u}, [u]
            while stack:  # walk through dead workers only; stop at the first live one
                x = stack.pop()
                for v in np.flatnonzero(a[x]):
                    v = int(v)
                    if v in seen:
                        continue
                    seen.add(v)
                    if v in key:
                        stack.append(v)
                    else:
                        out[u, v] = True
        if len(cache) > 64:
            cache.clear()
        got = cache[key] = Graph(out, topo.weighting)
    return got


def make(name: str, n: int, weighting: str = "uniform", per_node: int = 1,
         links: np.ndarray | None = None) -> Topology:
    """A topology by name: ring, torus (as square as n allows), exp (one-peer exponential),
    exp-directed, aer, complete, links (needs `links`)."""
    if name == "ring":
        return ring(n, weighting)
    if name == "torus":
        rows = max(r for r in range(1, int(math.isqrt(n)) + 1) if n % r == 0)
        return torus(rows, n // rows, weighting)
    if name == "complete":
        return complete(n, weighting)
    if name == "exp":
        return OnePeerExp(n)
    if name == "exp-directed":
        return OnePeerExp(n, directed=True)
    if name == "aer":
        return AlternatingExpRing(n, per_node)
    if name == "links":
        if links is None:
            raise ValueError("links: topology 'links' needs a link matrix")
        return from_links(links, weighting)
    raise ValueError(f"topology: unknown {name!r} (ring, torus, complete, exp, exp-directed, aer, links)")
