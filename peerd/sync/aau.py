"""DSGD-AAU (Xiong et al., MobiHoc'24): adaptive asynchronous updates with a waited-for subgraph that
keeps the graph strongly connected every round.

Reading choice: the paper's Pathsearch rules are not retrievable, so we implement the
"measured subgraph" reading (research/papers.md 2.2, Reading B), with a round = one iteration:
- From measured expected arrival delays t[i][j] (j's model at i: j's compute + transfer), every
  worker computes the same minimum spanning tree of the live undirected graph (Kruskal, edge cost
  max(t_ij, t_ji), ties broken by ids). A minimum spanning tree is also a minimum-bottleneck
  spanning tree: the slowest link the round waits on is as fast as any spanning choice allows.
- In iteration k worker i waits for the fresh (iteration-k) models of its tree neighbours only.
  Each tree edge is waited on from both ends, so the waited-for edges of one iteration form a
  symmetric spanning tree of the live workers: strongly connected by construction, every round.
- The mix also takes, without waiting, every other neighbour's newest model already in hand at
  iteration k - staleness or later (fresh ones included): the number of neighbours used adapts to
  who is fast in this iteration. Weights are the topology's row renormalised over what is used.
- Agreement: a new tree must take effect at the same iteration everywhere, so LinkEstimates carries
  `effective_k`; a worker uses, at iteration k, the newest estimates with effective_k <= k. The
  simulator tags them with its global view; the daemon tags them from the gossiped link matrix.
  Before any estimate, all costs are 1 (tree by ids). `late` counts estimates that arrived after
  their effective iteration (those rounds may mix two trees).
- A lost update (UpdateLost(j, k): it failed on its way) is not waited for in iteration k; j stays
  a tree neighbour.
- Crash: PeerDown removes the peer; the graph is repaired around it (`topology.repair`: a ring
  re-links around the hole) and the tree is recomputed over the live workers (the others get the
  same PeerDown). A new neighbour gets my newest update at once; a tree neighbour that is past k
  without having sent k to me (it was not my neighbour then) is represented by its next update,
  also one that reached me before my own repair (its newest is kept). No deadlock: sends never
  wait, and each worker waits only on tree neighbours that are alive, which all publish every
  iteration.
- Held updates: per neighbour, the iterations beyond the last mix plus the newest one at or below it;
  bounded by the tree's diameter + 2 (tree neighbours are within one iteration of each other).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from peerd.sync.events import (Action, Drop, LinkEstimates, Mix, MixRequested, PeerDown, PeerUp, Published,
                               Tick, UpdateArrived, UpdateLost, Wait)
from peerd.sync.policy import Algorithm, Policy
from peerd.sync import topology
from peerd.sync.topology import Topology, renormalise


def spanning_tree(adj: np.ndarray, cost: np.ndarray | None, live: list[int]) -> list[set[int]]:
    """Minimum spanning forest (Kruskal) of the undirected graph adj restricted to live nodes;
    returns the tree neighbours of every node."""
    n = adj.shape[0]
    alive = np.zeros(n, dtype=bool)
    alive[live] = True
    und = (adj | adj.T) & alive[:, None] & alive[None, :]
    iu, ju = np.nonzero(np.triu(und, 1))
    c = np.ones(len(iu)) if cost is None else np.maximum(cost[iu, ju], cost[ju, iu])
    order = np.lexsort((ju, iu, c))
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    nb: list[set[int]] = [set() for _ in range(n)]
    for e in order:
        a, b = int(iu[e]), int(ju[e])
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
            nb[a].add(b)
            nb[b].add(a)
    return nb


class AAU(Policy):
    name = "aau"
    estimates = "arrival"
    static_graph = True

    def __init__(self, me: int, topo: Topology, *, staleness: int = 2) -> None:
        super().__init__(me, topo.n)
        if topo.period != 1 or topo.directed:
            raise ValueError("topology: AAU needs a static undirected graph")
        if staleness < 0:
            raise ValueError(f"staleness: must be >= 0, got {staleness}")
        self.base = topo                 # the configured graph; self.topo is it repaired
        self.topo, self.staleness = topo, staleness
        self.adj = topo.adjacency()
        self.nb = list(topo.in_neighbors(me))
        self.versions: list[tuple[int, np.ndarray | None]] = [(0, None)]
        self.trees: dict[tuple[int, frozenset[int]], list[set[int]]] = {}
        self.held: dict[int, set[int]] = {}
        self.want = -1
        self.mixed = -1
        self.late = 0

    def _version(self, k: int) -> int:
        v = 0
        for idx, (eff, _) in enumerate(self.versions):
            if eff <= k:
                v = idx
        return v

    def tree(self, k: int) -> list[set[int]]:
        v = self._version(k)
        key = (v, frozenset(self.dead))
        tr = self.trees.get(key)
        if tr is None:
            live = [i for i in range(self.n) if i not in self.dead]
            tr = spanning_tree(self.adj, self.versions[v][1], live)
            if len(self.trees) > 16:
                self.trees.clear()
            self.trees[key] = tr
        return tr

    def waited(self, k: int) -> list[int]:
        return sorted(j for j in self.tree(k)[self.me] if j not in self.dead)

    def on_published(self, ev: Published, now: float) -> list[Action]:
        self.k = ev.k
        outs = [j for j in self.nb if j not in self.dead]
        return self.sends(outs + self.counting_me(outs, 2), ev.k)   # tree neighbours are an iteration apart

    def on_mix_requested(self, ev: MixRequested, now: float) -> list[Action]:
        self.want = ev.k
        return self._try(now)

    def on_update(self, ev: UpdateArrived, now: float) -> list[Action]:
        if ev.src in self.dead or ev.k <= self.mixed and self._newest(ev.src, self.mixed) > ev.k:
            return [Drop(ev.src, ev.k)]
        if ev.src not in self.nb:
            return self._hold_early_edge(ev.src, ev.k)
        self.counted_by.pop(ev.src, None)   # our views of the graph agree again
        self.held.setdefault(ev.src, set()).add(ev.k)
        return self._try(now)

    def _hold_early_edge(self, j: int, k: int) -> list[Action]:
        """An update from a live worker that is not my neighbour yet: it repaired the graph around a
        dead worker before I did and sent me its newest update when the edge appeared on its side
        (as in Hop). Dropped, it was never sent again, and when j was ahead and waited on me as a
        tree neighbour, each waited for the other's next update until the silent-peer timeout. Its
        newest one is kept (no mix uses it while j is not my neighbour; my repair keeps it). The
        other way round, j counts me as its neighbour: it gets my updates (Policy.answer_out_of_edge)."""
        out: list[Action] = list(self.answer_out_of_edge(j, k, [x for x in self.nb if x not in self.dead]))
        h = self.held.setdefault(j, set())
        if k <= self.mixed or k <= max(h, default=-1):
            return out + [Drop(j, k)]
        out += [Drop(j, x) for x in sorted(h)]
        h.clear()
        h.add(k)
        return out

    def on_estimates(self, ev: LinkEstimates, now: float) -> list[Action]:
        t = np.asarray(ev.times, dtype=float)
        if t.shape != (self.n, self.n):
            raise ValueError(f"LinkEstimates.times: expected {self.n}x{self.n}, got {t.shape}")
        if ev.effective_k <= self.mixed:
            self.late += 1
        self.versions.append((ev.effective_k, t))
        return self._try(now)

    def on_update_lost(self, ev: UpdateLost, now: float) -> list[Action]:
        return self._try(now)

    def on_peer_down(self, ev: PeerDown, now: float) -> list[Action]:
        out: list[Action] = [Drop(ev.peer, x) for x in sorted(self.held.pop(ev.peer, ()))]
        return out + self._retopo() + self._try(now)

    def on_peer_up(self, ev: PeerUp, now: float) -> list[Action]:
        out = self._retopo()
        if self.k >= 0 and ev.peer in self.nb:
            out += self.sends([ev.peer], self.k)
        return out + self._try(now)

    def _retopo(self) -> list[Action]:
        """Repair the graph for the current dead set; new neighbours get my newest update."""
        old = set(self.nb)
        self.topo = topology.repair(self.base, self.dead)
        self.adj = self.topo.adjacency()
        self.nb = list(self.topo.in_neighbors(self.me))
        out: list[Action] = self.sends([j for j in self.nb if j not in old], self.k) if self.k >= 0 else []
        for j in [j for j in self.held if j not in self.nb]:
            out.extend(Drop(j, x) for x in sorted(self.held.pop(j)))
        return out

    def on_tick(self, ev: Tick, now: float) -> list[Action]:
        return self._try(now)

    def holds(self, src: int) -> bool:
        oldest = self.mixed + 1 - self.staleness
        return any(x >= oldest for x in self.held.get(src, ()))

    def _newest(self, j: int, upto: int) -> int:
        return max((x for x in self.held.get(j, ()) if x <= upto), default=-1)

    def _try(self, now: float) -> list[Action]:
        k = self.want
        if k < 0 or k != self.k or self.mixed >= k:
            return []
        wait = self.waited(k)
        used, missing = [], []
        for j in wait:
            h = self.held.get(j, ())
            later = [x for x in h if x > k]
            if k in h:
                used.append((j, k))
            elif later:                  # past k without sending it to me: its next update stands in
                used.append((j, min(later)))
            elif not self.excused(j, k):
                missing.append(j)
        if missing:
            self._wait("tree neighbours", missing, now)
            return [Wait(f"tree neighbours {missing} at iteration {k}")]
        self._unwait()
        for j in self.nb:
            if j in self.dead or j in wait:
                continue
            x = self._newest(j, k)
            if x >= 0 and x >= k - self.staleness:
                used.append((j, x))
        row = renormalise(self.topo.weights(self.me), [self.me] + [j for j, _ in used])
        out: list[Action] = [Mix(k, tuple([(self.me, k, row[self.me])] + [(j, x, row[j]) for j, x in used]),
                                 waited=tuple(wait))]
        self.mixes += 1
        self.mixed = k
        self.want = -1
        for j, h in self.held.items():
            keep = self._newest(j, k)
            for x in sorted(h):
                if x < keep or (x == keep and x < k + 1 - self.staleness):
                    h.discard(x)
                    out.append(Drop(j, x))
        return out

    def state(self) -> dict[str, Any]:
        s = super().state()
        k = max(self.k, 0)
        s.update({"waits_for": self.waited(k), "queue": {j: len(h) for j, h in self.held.items() if h},
                  "estimate_versions": len(self.versions) - 1, "late": self.late})
        return s


ALGORITHMS = (
    Algorithm("aau", "DSGD-AAU: wait for a spanning tree of fastest links, use the rest when fresh", AAU,
              accepts=("staleness",), from_config=lambda cfg, name: {"staleness": cfg.sync.aau_staleness},
              preference=6),
)
