"""Churn in the pure policies: the graph repairs around dead workers, nobody waits on the dead, and a
returning worker is re-admitted (issue 8, item 1)."""
from __future__ import annotations

import numpy as np
import pytest

from peerd.sim.engine import Simulator
from peerd.sync import registry
from peerd.sync import topology as T
from peerd.sync.events import (Drop, Mix, MixRequested, PeerDown, PeerUp, Published, Send, Skip, TokensArrived,
                               UpdateArrived)
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


def test_hop_takes_the_update_a_new_neighbour_sent_before_my_own_repair():
    """Ring 0-1-2-3, standard mode: 2 dies, 3 finds it dead first and, ahead of me, sends me its
    newest update (iteration 2) when the edge appears on its side; it reaches me before my own
    repair. It stands in for the iterations 3 never sent me, as when it comes after the repair.
    Dropped, 3 sent nothing more before my next update, which waited on its one: a deadlock
    until the silent-peer timeout (the stall of tests/test_churn_daemons.py)."""
    p = Hop(1, T.ring(4), max_ig=4)
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(0, 0), 0.1)
    # Not my in-neighbour yet: kept, not dropped; it counts me as its neighbour: it gets my newest.
    assert p.on_event(UpdateArrived(3, 2), 0.2) == [Send(3, 0)]
    assert not any(isinstance(a, Mix) for a in p.on_event(MixRequested(0), 0.3))   # waits for 2
    mix = next(a for a in p.on_event(PeerDown(2), 2.0) if isinstance(a, Mix))
    assert {(s, k) for s, k, _ in mix.entries} == {(1, 0), (0, 0), (3, 2)}


def test_hop_keeps_one_update_of_a_worker_not_yet_its_neighbour():
    """Such updates are bounded: the newest one per sender, the older dropped, and all of them
    once a repair (or a mix past them) says they can never be used."""
    p = Hop(1, T.ring(5), max_ig=4)
    p.on_event(Published(0), 0.0)
    assert p.on_event(UpdateArrived(3, 1), 0.1) == [Send(3, 0)]
    assert p.on_event(UpdateArrived(3, 2), 0.2) == [Drop(3, 1)]
    assert p.on_event(UpdateArrived(3, 1), 0.3) == [Drop(3, 1)]     # older than the one kept
    assert p.held[3] == {2}
    out = p.on_event(PeerDown(4), 0.4)                  # repaired: 3 is still not my in-neighbour
    assert Drop(3, 2) in out and not p.held[3]


@pytest.mark.parametrize("algo", ["hop", "aau"])
def test_a_worker_that_counts_me_as_its_neighbour_gets_my_updates(algo):
    """Ring 0-1-2-3-4: 0 finds 1 dead and re-links to 2, which still counts 1 alive (dead sets
    differ for a while during churn). 0 waits for 2's updates, which 2 sends only to its own
    neighbours: 2 answers 0's update with its newest, sends 0 its next ones while 0 keeps sending
    to it, and stops a few iterations after 0 no longer does (0's view healed)."""
    from peerd.sync.aau import AAU
    p = Hop(2, T.ring(5), max_ig=None) if algo == "hop" else AAU(2, T.ring(5))
    assert p.on_event(Published(0), 0.0) == [Send(1, 0), Send(3, 0)]
    assert p.on_event(UpdateArrived(0, 0), 0.1) == [Send(0, 0)]
    p.on_event(UpdateArrived(1, 0), 0.2)
    p.on_event(UpdateArrived(3, 0), 0.2)
    mix = next(a for a in p.on_event(MixRequested(0), 0.3) if isinstance(a, Mix))
    assert {s for s, _, _ in mix.entries} == {1, 2, 3}          # 0 is not my neighbour: not mixed
    sent = [sorted(a.dst for a in p.on_event(Published(k), 1.0 + k) if isinstance(a, Send)) for k in (1, 2, 3)]
    assert sent == [[0, 1, 3], [0, 1, 3], [1, 3]]


def test_aau_takes_the_update_a_new_neighbour_sent_before_my_own_repair():
    """As Hop's: ring 0-1-2-3-4, 2 dies, 3 repairs first and, ahead, sends me its iteration 2 before
    my repair. After mine (ring 0-1-3-4), 3 is a tree neighbour whose later update stands in for
    iteration 0; dropped, I waited on 3 until the silent-peer timeout."""
    from peerd.sync.aau import AAU
    p = AAU(1, T.ring(5))
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(0, 0), 0.1)
    # Not my neighbour yet: kept, not dropped; it counts me as its neighbour: it gets my newest.
    assert p.on_event(UpdateArrived(3, 2), 0.2) == [Send(3, 0)]
    assert p.on_event(UpdateArrived(3, 1), 0.25) == [Drop(3, 1)]   # older than the one kept
    assert not any(isinstance(a, Mix) for a in p.on_event(MixRequested(0), 0.3))   # waits for 2
    mix = next(a for a in p.on_event(PeerDown(2), 2.0) if isinstance(a, Mix))
    assert {(s, k) for s, k, _ in mix.entries} == {(1, 0), (0, 0), (3, 2)}


class Swarm:
    """Hop workers driven by hand, in rounds: each idle worker publishes its next iteration and asks
    for its mix; messages (updates, tokens) are delivered at once unless a cut separates the two
    workers. Each worker computes at most one iteration per round (rate[i] rounds per iteration)."""

    def __init__(self, n: int, **mode):
        self.pol = [Hop(i, T.ring(n), **mode) for i in range(n)]
        self.next = [0] * n            # the iteration each worker publishes next
        self.busy = [False] * n        # published, mix not given yet
        self.cut: set[frozenset] = set()
        self.jumps: list[tuple[int, int, int]] = []   # (worker, from, to)

    def apart(self, i: int, j: int) -> bool:
        return frozenset((i, j)) in self.cut

    def act(self, i: int, actions, now: float) -> None:
        for a in actions:
            if isinstance(a, Send) and not self.apart(i, a.dst):
                self.deliver(a.dst, UpdateArrived(i, a.k), now)
            elif type(a).__name__ == "Grant" and not self.apart(i, a.dst):
                self.deliver(a.dst, TokensArrived(i, a.n), now)
            elif isinstance(a, Mix):
                self.busy[i] = False
                self.next[i] = a.k + 1
            elif isinstance(a, Skip):
                self.jumps.append((i, self.next[i] - 1, a.to))
                self.next[i] = a.to

    def deliver(self, i: int, event, now: float) -> None:
        self.act(i, self.pol[i].on_event(event, now), now)

    def round(self, now: float, who) -> None:
        for i in who:
            if not self.busy[i]:
                self.busy[i] = True
                k = self.next[i]
                self.act(i, self.pol[i].on_event(Published(k), now), now)
                self.act(i, self.pol[i].on_event(MixRequested(k), now), now)


def test_hop_lagging_side_catches_up_after_a_long_partition():
    """Ring 0-1-2-3, standard mode, max_ig 2. The cut separates {0, 1} from {2, 3}; side {0, 1}
    runs 40 iterations, side {2, 3} 10. After the heal (each side re-admits the other at the
    iteration of its first update), the lagging side jumps to the leaders' iteration instead of
    computing its way up while the leaders wait on their tokens: within a few rounds every worker
    is within max_ig of its neighbours and all of them advance every round."""
    sw = Swarm(4, max_ig=2)
    t = 0.0
    for _ in range(3):
        sw.round(t := t + 1, range(4))
    sides = ((0, 1), (2, 3))
    across = [(i, j) for a, b in (sides, sides[::-1]) for i in a for j in b]
    sw.cut = {frozenset(p) for p in across}
    for i, j in across:                          # each side's failure detector: the other is dead
        sw.deliver(i, PeerDown(j), t)
    for r in range(40):
        sw.round(t := t + 1, (0, 1) if r >= 10 else range(4))
    lead, lag = sw.next[0], sw.next[2]
    assert lead - lag >= 20, sw.next           # far beyond max_ig apart
    sw.cut = set()
    for i, j in across:             # what the daemon does on a heal: PeerUp at the peer's newest
        kj = sw.pol[j].k            # tag, then its newest update (the greeting)
        sw.deliver(i, PeerUp(j, kj), t)
        sw.deliver(i, UpdateArrived(j, kj), t)
    for _ in range(4):
        sw.round(t := t + 1, range(4))
    assert {i for i, _, _ in sw.jumps} >= {2, 3}, sw.jumps
    assert all(to >= lead - 1 for i, _, to in sw.jumps if i in (2, 3)), sw.jumps
    before = list(sw.next)
    for _ in range(10):
        sw.round(t := t + 1, range(4))
    assert all(b - a == 10 for a, b in zip(before, sw.next)), (before, sw.next)
    assert max(sw.next) - min(sw.next) <= 2, sw.next


def test_hop_jumps_only_past_the_gap_bound():
    """A neighbour within max_ig ahead is ordinary: standard mode without skipping never jumps."""
    p = Hop(1, T.ring(4), max_ig=4)
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(0, 0), 0.1)
    p.on_event(UpdateArrived(2, 4), 0.1)        # 4 ahead: the bound, not beyond it
    acts = p.on_event(MixRequested(0), 0.2)
    assert any(isinstance(a, Mix) for a in acts) and not any(isinstance(a, Skip) for a in acts)


@pytest.mark.parametrize("algo", ["d-psgd", "hop", "aau"])
def test_a_readmission_right_after_a_publish_does_not_send_the_update_twice(algo):
    """A restarted trainer resyncs its neighbours (PeerUp at their iteration) at its first
    publish, which has just sent them that update: a second Send is a whole model again. A
    neighbour that was down since gets it again (what was on its way may be lost)."""
    p = registry.build_one(algo, 3, T.make("ring", 3), 0)
    assert sorted(a.dst for a in p.on_event(Published(5), 0.0) if isinstance(a, Send)) == [1, 2]
    assert not [a for a in p.on_event(PeerUp(1, 5), 0.0) if isinstance(a, Send)]
    p.on_event(PeerDown(1), 0.0)
    assert [(a.dst, a.k) for a in p.on_event(PeerUp(1, 5), 0.0) if isinstance(a, Send)] == [(1, 5)]
