"""Baselines: D-PSGD, SGP and AD-PSGD as sync policies.

- D-PSGD (Lian et al. 2017): synchronous neighbour averaging, x_{k+1} = sum_j W_kj x_j^k - lr g(x^k):
  Hop's standard mode without token queues (the graph already bounds the gap to 1 per edge), on any
  topology, time-varying ones included.
- SGP (Assran et al. 2019): push-sum on the directed one-peer exponential graph, weight 1/2 kept and
  1/2 pushed. On this regular graph with uniform weights the push-sum weight stays exactly 1 (the
  official code skips sending it, `is_regular()`), so the de-biased iterate equals the numerator and
  the policy is D-PSGD on that graph. We keep that reading and do not transmit a weight.
- AD-PSGD (Lian et al. 2018): asynchronous pairwise averaging. Workers are split bipartitely
  (even ids active, odd passive by default, like the FAIR bipartite graphs) so two actives never
  lock each other. An active worker, when it publishes iteration k, picks a live passive neighbour
  uniformly and pulls it, carrying its own x_k; the passive answers with its working parameters and
  replaces them by the pair average at once (Average); the active mixes 1/2 x_k + 1/2 x_passive.
  The two halves use the same two vectors, so the pair average is exact and the mean of all models
  is preserved by the averaging. A passive worker's own mix is its working parameters (which the
  actives average into) - its gradient step. A pull that fails or goes unanswered (PullFailed,
  bounded by the driver) goes to another live passive; the failed one rests before it is
  pulled again (PullBackoff; nor again in that iteration); with none left the active's mix is its
  local step (the pair average may still have happened passively).
"""
from __future__ import annotations

import random
from typing import Any

from peerd.sync.events import (CURRENT, Action, Average, Drop, Mix, MixRequested, PeerDown, Published,
                               Pull, PullFailed, PullRequested, Send, UpdateArrived, Wait)
from peerd.sync.hop import Hop
from peerd.sync.policy import Algorithm, Policy, PullBackoff
from peerd.sync.topology import OnePeerExp, Topology, repair


class DPSGD(Hop):
    name = "d-psgd"
    static_graph = False     # no token queues (max_ig None): any graph, time-varying ones included

    def __init__(self, me: int, topo: Topology) -> None:
        super().__init__(me, topo, max_ig=None)


class SGP(DPSGD):
    name = "sgp"

    def __init__(self, me: int, topo: Topology | None = None, *, n: int | None = None) -> None:
        if topo is None:
            if n is None:
                raise ValueError("n: SGP needs a topology or n")
            topo = OnePeerExp(n, directed=True)
        super().__init__(me, topo)
        self.eager_mix = False   # mixed when the trainer asks, not ahead (only D-PSGD and Hop's standard mode are)


class ADPSGD(Policy):
    name = "ad-psgd"
    asynchronous = True
    pulls = True
    static_graph = True

    @classmethod
    def unsupported(cls, topo: Topology) -> str | None:
        if topo.n % 2:
            return "active and passive workers alternate: needs an even number of hosts"
        return super().unsupported(topo)

    def __init__(self, me: int, topo: Topology, *, seed: int = 0, active: bool | None = None,
                 pull_backoff: float = 10.0, pull_backoff_first: float = 1.0) -> None:
        super().__init__(me, topo.n)
        self.topo = topo
        self.active = (me % 2 == 0) if active is None else active
        self.rng = random.Random(seed * 1_000_003 + me)
        self.partners = [j for j in topo.out_neighbors(me) if (j % 2 == 0) != self.active]
        if self.active and not self.partners:
            raise ValueError(f"topology: active worker {me} has no passive neighbour (needs odd ids)")
        self.pulling: int | None = None
        self.reply: tuple[int, int] | None = None
        self.want = -1
        self.failed: set[int] = set()   # passives whose pull failed in this iteration
        self.backoff = PullBackoff(pull_backoff_first, pull_backoff)   # failed passives rest before the next pull

    def _pick(self, k: int, now: float) -> list[Action]:
        # The graph repaired around the dead (topology.repair), still active -> passive only.
        live = [j for j in repair(self.topo, self.dead).out_neighbors(self.me)
                if (j % 2 == 0) != self.active and j not in self.dead and j not in self.failed
                and self.backoff.ready(j, now)]
        if not live:
            self.pulling = None
            return []
        self.pulling = self.rng.choice(live)
        return [Pull(self.pulling, carry_k=k)]

    def on_published(self, ev: Published, now: float) -> list[Action]:
        self.k = ev.k
        self.reply = None
        self.failed.clear()
        return self._pick(ev.k, now) if self.active else []

    def on_mix_requested(self, ev: MixRequested, now: float) -> list[Action]:
        self.want = ev.k
        return self._try(now)

    def on_update(self, ev: UpdateArrived, now: float) -> list[Action]:
        if not self.active or ev.src != self.pulling or self.reply is not None:
            return [Drop(ev.src, ev.k)]
        self.reply = (ev.src, ev.k)
        self.backoff.answered(ev.src)
        return self._try(now)

    def on_pull_request(self, ev: PullRequested, now: float) -> list[Action]:
        if self.active or not ev.carried:
            return [Send(ev.src, self.k, live=True)] + ([Drop(ev.src, ev.k)] if ev.carried else [])
        return [Send(ev.src, self.k, live=True),
                Average(((self.me, CURRENT, 0.5), (ev.src, ev.k, 0.5))),
                Drop(ev.src, ev.k)]

    def on_pull_failed(self, ev: PullFailed, now: float) -> list[Action]:
        # Another passive partner (the failed one rests: PullBackoff); none left: the local step.
        if not self.active or ev.k != self.k or ev.peer != self.pulling or self.reply is not None:
            return []
        self.failed.add(ev.peer)
        self.backoff.failed(ev.peer, now)
        return self._pick(self.k, now) + self._try(now)

    def on_peer_down(self, ev: PeerDown, now: float) -> list[Action]:
        if self.active and self.pulling == ev.peer and self.reply is None and self.k >= 0:
            return self._pick(self.k, now) + self._try(now)
        return self._try(now)

    def _try(self, now: float) -> list[Action]:
        k = self.want
        if k < 0 or k != self.k:
            return []
        if not self.active:
            self.want = -1
            self.mixes += 1
            return [Mix(k, ((self.me, CURRENT, 1.0),))]
        if self.pulling is not None and self.reply is None:
            self._wait("pull", [self.pulling], now)
            return [Wait(f"reply from {self.pulling}")]
        self._unwait()
        self.want = -1
        self.mixes += 1
        if self.reply is None:  # no live partner: local step only
            return [Mix(k, ((self.me, k, 1.0),))]
        j, kj = self.reply
        self.reply = None
        return [Mix(k, ((self.me, k, 0.5), (j, kj, 0.5)), waited=(j,)), Drop(j, kj)]

    def state(self) -> dict[str, Any]:
        s = super().state()
        s.update({"role": "active" if self.active else "passive", "pulling": self.pulling})
        return s


def _pull_config(cfg: Any, name: str) -> dict[str, Any]:
    return {"pull_backoff": cfg.train.pull_backoff, "pull_backoff_first": cfg.train.pull_backoff_first}


ALGORITHMS = (
    Algorithm("d-psgd", "synchronous neighbour averaging (all in-neighbours every iteration)", DPSGD,
              preference=0),
    Algorithm("ad-psgd", "asynchronous pairwise averaging, bipartite active/passive, uniform peers", ADPSGD,
              accepts=("seed", "pull_backoff", "pull_backoff_first"), from_config=_pull_config, preference=11),
    Algorithm("sgp", "stochastic gradient push, directed one-peer exponential graph", SGP,
              topology="exp-directed", preference=12),
)
