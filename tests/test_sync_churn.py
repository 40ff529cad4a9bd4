"""Churn in the pure policies: the graph repairs around dead workers, nobody waits on the dead, and a
returning worker is re-admitted (issue 8, item 1)."""
from __future__ import annotations

import numpy as np
import pytest

from peerd.sim.engine import Simulator
from peerd.sync import registry
from peerd.sync import topology as T
from peerd.sync.events import Mix, MixRequested, PeerDown, PeerUp, Published, Send, UpdateArrived
from peerd.sync.hop import Hop
from tests.sync_helpers import random_spec


def test_ring_relinks_around_the_hole():
    ring = T.ring(6)
    r = T.repair(ring, {2})
    assert r.out_neighbors(1) == (0, 3) and r.in_neighbors(3) == (1, 4)
    r2 = T.repair(ring, {1, 2})            # a hole two wide
    assert r2.out_neighbors(0) == (3, 5) and r2.out_neighbors(1) == ()
    for i in (0, 3, 4, 5):
        assert abs(sum(r2.weights(i).values()) - 1) < 1e-12
    assert T.repair(ring, set()) is ring and T.repair(ring, {2}) is r      # cached per dead set
    full = T.complete(5)
    assert np.array_equal(T.repair(full, {0}).adjacency()[1:, 1:], full.adjacency()[1:, 1:])


def test_torus_repair_keeps_metropolis_hastings_doubly_stochastic():
    r = T.repair(T.torus(3, 3, "mh"), {4})
    w = r.matrix()
    live = [i for i in range(9) if i != 4]
    assert np.allclose(w[np.ix_(live, live)].sum(0), 1) and np.allclose(w[np.ix_(live, live)].sum(1), 1)


class Recorder:
    """Wraps a policy: records every Mix with the simulated time it was emitted."""

    def __init__(self, policy):
        self.p, self.mixes = policy, []
        self.me, self.n, self.name = policy.me, policy.n, policy.name

    def on_event(self, ev, now):
        actions = self.p.on_event(ev, now)
        self.mixes += [(now, a) for a in actions if isinstance(a, Mix)]
        return actions

    def __getattr__(self, name):
        return getattr(self.p, name)


ALGOS = ["hop", "hop-backup-skip", "hop-staleness", "d-psgd", "aau", "netmax", "ad-psgd", "sgp"]


@pytest.mark.parametrize("algo", ALGOS)
def test_two_crashes_split_nothing_and_nobody_waits_on_the_dead(algo):
    """Ring of 8, workers 1 and 4 crash (without repair the live ring falls into {5,6,7,0} and
    {2,3}): every live worker finishes; after detection no mix waits on or uses a dead worker; for
    the ring algorithms worker 0 mixes with 2, its neighbour across the hole."""
    n, crash, detect = 8, {1: 1.0, 4: 1.5}, 0.5
    topo = T.make("exp-directed" if algo == "sgp" else "ring", n)
    pols = [Recorder(p) for p in registry.build(algo, n, topo, seed=3)]
    spec = random_spec(7, n, timing_only=True, iterations=40, crash=crash, detect=detect, p_slow=0.0)
    res = Simulator(spec, pols).run()
    live = [i for i in range(n) if i not in crash]
    assert not res.stalled and all(res.iterations[i] >= spec.iterations for i in live), res.iterations
    cutoff = max(crash.values()) + detect + 1e-9
    for i in live:
        for t, m in pols[i].mixes:
            if t >= cutoff:
                assert not set(m.waited) & set(crash), (algo, i, t, m)
                assert not {s for s, _, w in m.entries if w > 0} & set(crash), (algo, i, t, m)
    if algo in ("hop", "hop-staleness", "d-psgd", "aau"):
        assert any(2 in {s for s, _, _ in m.entries} for t, m in pols[0].mixes if t >= cutoff), algo


@pytest.mark.parametrize("mode", [dict(), dict(backup=1), dict(staleness=2)])
def test_hop_readmits_a_returning_worker(mode):
    """A ring of 4 in Hop: 2 dies (1 and 3 re-link to each other, 1 sends 3 its newest update),
    2 comes back at 1's iteration: the ring is the configured one again, 2 gets 1's newest update
    and full tokens, and 1 mixes with 2's fresh update without waiting on 3's."""
    p = Hop(1, T.ring(4), max_ig=2, **mode)
    p.on_event(Published(0), 0.0)
    acts = p.on_event(PeerDown(2), 0.1)
    assert Send(3, 0) in acts and p.live_in(0) == [0, 3]
    p.on_event(UpdateArrived(0, 0), 0.2)
    p.on_event(UpdateArrived(3, 0), 0.2)
    assert any(isinstance(a, Mix) for a in p.on_event(MixRequested(0), 0.3))
    p.on_event(Published(1), 0.4)
    acts = p.on_event(PeerUp(2, 1), 0.5)
    assert Send(2, 1) in acts and p.live_in(1) == [0, 2] and p.tokens(2) == 2
    p.on_event(UpdateArrived(0, 1), 0.6)
    if mode.get("backup"):
        return                        # one backup: 0's update alone is enough, by design
    assert not any(isinstance(a, Mix) for a in p.on_event(MixRequested(1), 0.7))  # needs 2's update
    mix = next(a for a in p.on_event(UpdateArrived(2, 1), 0.8) if isinstance(a, Mix))
    assert {s for s, _, _ in mix.entries} == {0, 1, 2}


def test_hop_standard_mode_takes_a_new_neighbours_later_update():
    """Standard mode, 2 dies while 3 is already past my iteration: 3's newest update (sent when the
    edge appeared) stands in for the iteration it never sent me; no wait on a dead or ahead peer."""
    p = Hop(1, T.ring(4), max_ig=4)
    p.on_event(Published(0), 0.0)
    p.on_event(PeerDown(2), 0.1)
    p.on_event(UpdateArrived(0, 0), 0.2)
    p.on_event(UpdateArrived(3, 2), 0.2)       # 3 was at iteration 2 when the edge appeared
    mix = next(a for a in p.on_event(MixRequested(0), 0.3) if isinstance(a, Mix))
    assert {(s, k) for s, k, _ in mix.entries} == {(1, 0), (0, 0), (3, 2)}
