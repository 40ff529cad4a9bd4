"""Hop's invariants, property-based over random graphs, delays and modes, driven by the simulator."""
from __future__ import annotations

from dataclasses import replace


import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from peerd.sim.engine import Simulator
from peerd.sync import topology as T
from peerd.sync.baselines import DPSGD
from peerd.sync.events import (Grant, Mix, MixRequested, PeerDown, Published, Send, Skip, TokensArrived,
                               UpdateArrived, UpdateLost, Wait)
from peerd.sync.hop import Hop
from tests.sync_helpers import random_graph, random_spec

MODES = [dict(), dict(backup=1), dict(staleness=2), dict(backup=1, staleness=1),
         dict(backup=1, skip=True), dict(staleness=2, skip=True), dict(backup=1, staleness=2, skip=True)]


def hop_policies(topo, max_ig, mode):
    return [Hop(i, topo, max_ig=max_ig, max_skip=3, **mode) for i in range(topo.n)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 8), max_ig=st.integers(1, 4),
       mode=st.sampled_from(MODES))
def test_gap_never_exceeds_max_ig_and_queues_are_bounded(seed, n, max_ig, mode):
    topo = random_graph(seed, n)
    pols = hop_policies(topo, max_ig, mode)
    worst = {"gap": 0, "queue": 0}

    def on_publish(sim, i, k):
        for j in topo.out_neighbors(i):
            worst["gap"] = max(worst["gap"], sim.k[i] - sim.k[j])
        for j, h in pols[i].held.items():
            worst["queue"] = max(worst["queue"], len(h))

    spec = random_spec(seed, n, timing_only=True, iterations=25)
    res = Simulator(spec, pols, on_publish=on_publish).run()
    assert worst["gap"] <= max_ig
    bound = 1 if mode.get("staleness") is not None else max_ig + 1
    assert worst["queue"] <= bound
    assert min(res.iterations) >= spec.iterations  # and nobody got stuck


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 8), max_ig=st.sampled_from([None, 1, 2, 4]),
       mode=st.sampled_from(MODES), lose=st.sampled_from([0.05, 0.3]))
def test_lost_updates_never_stall_a_worker_nor_break_the_gap_bound(seed, n, max_ig, mode, lose):
    """Pushes that fail on their way (UpdateLost at the receiver): every worker still finishes,
    and the token queues still bound every edge's gap."""
    if max_ig is None and mode.get("skip"):
        mode = {k: v for k, v in mode.items() if k != "skip"}
    topo = random_graph(seed, n)
    pols = [Hop(i, topo, max_ig=max_ig, max_skip=3, **mode) for i in range(n)]
    worst = 0

    def on_publish(sim, i, k):
        nonlocal worst
        worst = max([worst] + [sim.k[i] - sim.k[j] for j in topo.out_neighbors(i)])

    spec = random_spec(seed, n, timing_only=True, iterations=25, lose=lose)
    res = Simulator(spec, pols, on_publish=on_publish).run()
    assert not res.stalled and min(res.iterations) >= spec.iterations, res.iterations
    assert max_ig is None or worst <= max_ig


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 7), mode=st.sampled_from(MODES),
       crash_at=st.floats(0.0, 3.0), max_ig=st.integers(1, 4))
def test_no_deadlock_with_one_crashed_worker(seed, n, mode, crash_at, max_ig):
    topo = random_graph(seed, n)
    victim = seed % n
    spec = random_spec(seed, n, timing_only=True, iterations=20, crash={victim: crash_at}, detect=0.7)
    res = Simulator(spec, hop_policies(topo, max_ig, mode)).run()
    live = [i for i in range(n) if i != victim]
    # Every live worker finished all its iterations (a worker cut off from everyone runs alone).
    assert all(res.iterations[i] >= spec.iterations for i in live), res.iterations


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(2, 8), mh=st.booleans())
def test_standard_mode_in_order_equals_dpsgd_exactly(seed, n, mh):
    topo = random_graph(seed, n)
    topo = T.Graph(topo.adj, "mh" if mh else "uniform")
    # With grants that cost only their latency (sender="pipe") the two run in lock-step. The
    # daemon's sender queues each grant behind the updates and awaits its reply, so there Hop is
    # slower (and its gradient noise, drawn in event order, differs): same sends, later.
    for sender in ("pipe", "daemon"):
        spec = replace(random_spec(seed, n, params=32, iterations=15, p_slow=0.0), sender=sender)
        a = Simulator(spec, [DPSGD(i, topo) for i in range(n)])
        b = Simulator(spec, [Hop(i, topo, max_ig=1) for i in range(n)])
        ra, rb = a.run(), b.run()
        assert ra.iterations == rb.iterations and ra.bytes_sent == rb.bytes_sent
        if sender == "pipe":
            assert np.array_equal(a.X, b.X)            # same numbers, bit for bit
            assert ra.sim_time == rb.sim_time
        else:
            assert ra.sim_time <= rb.sim_time


def test_dpsgd_matches_the_matrix_recursion_without_noise():
    topo = T.ring(6, "mh")
    spec = random_spec(3, 6, params=8, iterations=12, p_slow=0.0, noise=0.0)
    sim = Simulator(spec, [DPSGD(i, topo) for i in range(6)])
    sim.run()
    W, obj = topo.matrix(), sim.obj
    x = np.tile(obj.x0, (6, 1))
    for _ in range(spec.iterations):
        g = np.stack([obj.grad(i, x[i], 0) for i in range(6)])
        x = W @ x - spec.lr * g
    assert np.allclose(sim.X, x, atol=1e-12)


def test_tokens_gate_the_mix_and_skip_releases_them():
    # Worker 0 on a ring of 3 with backup 1, staleness off, max_ig 2, skipping.
    topo = T.ring(3)
    p = Hop(0, topo, max_ig=2, backup=1, skip=True, max_skip=5)
    assert p.on_event(Published(0), 0.0) == [Send(1, 0), Send(2, 0)]
    # Neighbour 1 is ahead by the gap bound: iteration 2 arrives (FIFO: it sent 0 and 1 earlier).
    for k in range(3):
        p.on_event(UpdateArrived(1, k), 0.1)
    acts = p.on_event(MixRequested(0), 0.2)
    mix = [a for a in acts if isinstance(a, Mix)][0]
    assert mix.k == 0 and {e[0] for e in mix.entries} == {0, 1}
    assert abs(sum(e[2] for e in mix.entries) - 1) < 1e-12
    # Two tokens per out-edge at start: 0 -> 2 spends both and grants 2.
    assert Skip(2) in acts and Grant(1, 2) in acts and Grant(2, 2) in acts
    p.on_event(Published(2), 0.2)
    acts = p.on_event(MixRequested(2), 0.3)
    assert not any(isinstance(a, Mix) for a in acts)        # no tokens left: wait
    assert p.state()["waiting"]["reason"] == "tokens"
    # 1 runs on to 4 (its bound: 2 + max_ig): skipping to 4 would take 2 steps, the tokens allow 1.
    p.on_event(UpdateArrived(1, 4), 0.35)
    p.on_event(TokensArrived(1, 1), 0.4)
    acts = p.on_event(TokensArrived(2, 1), 0.4)
    assert any(isinstance(a, Mix) and a.k == 2 for a in acts)
    assert not any(isinstance(a, Skip) for a in acts) and Grant(1, 1) in acts


def test_constructor_refuses_unsound_settings():
    with pytest.raises(ValueError, match="skip"):
        Hop(0, T.ring(4), skip=True)
    with pytest.raises(ValueError, match="max_ig"):
        Hop(0, T.ring(4), max_ig=0)
    with pytest.raises(ValueError, match="static"):
        Hop(0, T.OnePeerExp(4))


def test_state_reports_gaps_tokens_queues():
    topo = T.ring(4)
    p = Hop(0, topo, max_ig=3, backup=1)
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(1, 0), 0.0)
    p.on_event(UpdateArrived(1, 1), 0.0)
    s = p.state()
    # 1 reached iteration 1 (its update says so): I may run to 1 + max_ig, one token more than granted
    assert s["tokens"] == {1: 4, 3: 3} and s["queue"] == {1: 2} and s["gap"] == {1: -1}
    assert s["mode"] == "backup1"


@pytest.mark.parametrize("mode", MODES)
def test_silent_crash_stops_neighbours_at_max_ig_and_the_run_reports_a_stall(mode):
    # Without a PeerDown (detection never comes) tokens hold the senders max_ig past the silent
    # peer: the gap bound is a hard guarantee; the simulator ends the run and says it stalled.
    topo = T.ring(5)
    spec = random_spec(1, 5, params=4, iterations=60, p_slow=0.0, crash={0: 1.0}, detect=1e9,
                       max_time=1e4)
    sim = Simulator(spec, hop_policies(topo, 2, mode))
    res = sim.run()
    assert res.stalled
    crashed_at = sim.k[0]
    for j in topo.out_neighbors(0):
        assert crashed_at + 1 <= sim.k[j] <= crashed_at + 2   # ran up to the bound, not past it


def test_a_lost_grant_is_made_up_by_the_next_update():
    """Grants ride an RPC that can time out on a congested link. The neighbours' next updates show
    where they are, and that bounds the gap as well as their grants would (before: the lost tokens
    held the worker until a silent-peer timeout re-admitted the neighbour)."""
    p = Hop(0, T.ring(3), max_ig=1)
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(1, 0), 0.1)
    p.on_event(UpdateArrived(2, 0), 0.1)
    assert any(isinstance(a, Mix) for a in p.on_event(MixRequested(0), 0.2))
    p.on_event(Published(1), 0.3)
    assert p.tokens(1) == 0 and p.tokens(2) == 0          # no grants came (lost)
    p.on_event(UpdateArrived(1, 1), 0.4)                  # ... but 1 and 2 reached iteration 1
    p.on_event(UpdateArrived(2, 1), 0.4)
    acts = p.on_event(MixRequested(1), 0.5)
    assert any(isinstance(a, Mix) and a.k == 1 for a in acts), acts


@pytest.mark.parametrize("mode", [dict(max_ig=None), dict(max_ig=2), dict(max_ig=2, backup=1)])
def test_a_lost_update_is_not_waited_for_in_its_iteration_only(mode):
    """A neighbour's update of k failed on its way (UpdateLost): the mix of k goes without it, at
    once or when asked; the neighbour stays one (no re-linking around it: on a ring of 5 a PeerDown
    of 1 had worker 0 wait on 2, which never sends to 0), gets our next update, and the mix of k + 1
    waits for it again. In backup mode the lost update is the one a mix may miss."""
    p = Hop(0, T.ring(5), **mode)
    p.on_event(Published(0), 0.0)
    p.on_event(UpdateArrived(4, 0), 0.1)
    first = p.on_event(MixRequested(0), 0.2)
    lost = p.on_event(UpdateLost(1, 0), 0.3)
    mixes = [a for a in first + lost if isinstance(a, Mix)]
    assert len(mixes) == 1 and {j for j, _, _ in mixes[0].entries} == {0, 4}, first + lost
    assert p.topo is p.base and not p.dead
    sends = p.on_event(Published(1), 0.4)
    assert {a.dst for a in sends if isinstance(a, Send)} == {1, 4}
    p.on_event(UpdateArrived(4, 1), 0.5)
    if mode.get("max_ig"):
        p.on_event(TokensArrived(1, 1), 0.5)
        p.on_event(TokensArrived(4, 1), 0.5)
    waiting = p.on_event(MixRequested(1), 0.6)
    if mode.get("backup"):
        assert any(isinstance(a, Mix) and a.k == 1 for a in waiting), waiting   # one missing: backup
    else:
        assert [a for a in waiting if isinstance(a, Wait)] and p.waiting.on == [1], waiting
        done = p.on_event(UpdateArrived(1, 1), 0.7)
        assert any(isinstance(a, Mix) and {j for j, _, _ in a.entries} == {0, 1, 4} for a in done), done


def test_a_lost_update_before_the_mix_is_asked_for_and_a_stale_one():
    """A loss reported ahead of our mix counts when the trainer asks for it; one of an older
    iteration changes nothing; a PeerDown clears it (back, the peer sends from where it rejoins)."""
    p = DPSGD(0, T.ring(3))
    p.on_event(Published(3), 0.0)
    p.on_event(UpdateLost(1, 2), 0.0)                  # older: 1 is still waited for
    p.on_event(UpdateLost(2, 3), 0.0)                  # ours to come
    assert isinstance(p.on_event(MixRequested(3), 0.1)[0], Wait) and p.waiting.on == [1]
    acts = p.on_event(UpdateArrived(1, 3), 0.2)
    assert any(isinstance(a, Mix) and {j for j, _, _ in a.entries} == {0, 1} for a in acts), acts
    p.on_event(Published(4), 0.3)
    p.on_event(UpdateLost(2, 4), 0.3)
    p.on_event(PeerDown(2), 0.3)
    assert 2 not in p.lost
