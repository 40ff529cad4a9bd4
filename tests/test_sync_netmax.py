"""NetMax probabilities: rows sum to 1, zero off the links, favour fast links, beat uniform's gap."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from peerd.sync import netmax as nm
from peerd.sync import topology as T
from peerd.sync.events import LinkEstimates, Mix, MixRequested, PeerDown, Published, Pull, UpdateArrived
from tests.sync_helpers import random_graph


def rand_times(seed, n, adj):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.05, 2.0, (n, n))
    t = (t + t.T) / 2
    return np.where(adj, t, 0.0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 7), kind=st.sampled_from(nm.PROBS))
def test_rows_are_distributions_on_the_links(seed, n, kind):
    adj = random_graph(seed, n).adj
    t = rand_times(seed, n, adj)
    P = nm.probabilities(t, adj, kind)
    assert np.allclose(P.sum(1), 1.0)
    assert (P >= -1e-12).all()
    assert np.all(P[~adj] == 0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 7))
def test_solved_gap_at_least_uniform_at_equal_budget(seed, n):
    adj = random_graph(seed, n).adj
    t = rand_times(seed, n, adj)
    U = nm.uniform_probs(adj)
    budget = float(nm.row_time(U, t).max())
    P, gap = nm.solve_budget(t, adj, budget)
    assert nm.row_time(P, t).max() <= budget + 1e-9
    assert gap >= nm.spectral_gap(U) - 1e-12


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 7), power=st.sampled_from([1.0, 0.5]))
def test_ablations_give_faster_links_higher_probability(seed, n, power):
    adj = random_graph(seed, n).adj
    t = rand_times(seed, n, adj)
    P = nm.inverse_time_probs(t, adj, power)
    for i in range(n):
        nb = np.flatnonzero(adj[i])
        order = nb[np.argsort(t[i, nb])]
        assert np.all(np.diff(P[i, order]) <= 1e-12)


@pytest.mark.parametrize("n", [4, 8])
def test_two_sites_optimum_favours_intra_site_links(n):
    site = np.arange(n) // (n // 2)
    same = site[:, None] == site[None, :]
    adj = ~np.eye(n, dtype=bool)
    t = np.where(same, 0.1, 1.0)
    P, tbar, gap = nm.solve(t, adj)
    for i in range(n):
        intra = P[i, same[i] & adj[i]]
        inter = P[i, ~same[i]]
        assert intra.min() > inter.max() > 0      # faster links more likely, sites still connected
    U = nm.uniform_probs(adj)
    tu = float(nm.row_time(U, t).max())
    beta = 0.3 * nm.spectral_gap(U)
    assert tbar * (1 + beta / gap) <= tu * (1 + beta / nm.spectral_gap(U))


def test_policy_pulls_by_probability_and_resolves_on_changes():
    n = 4
    topo = T.complete(n)
    p = nm.NetMax(0, topo, seed=1)
    t = np.where(np.arange(n)[:, None] // 2 == np.arange(n)[None, :] // 2, 0.1, 1.0)
    p.on_event(LinkEstimates(tuple(map(tuple, t))), 0.0)
    assert p.solves == 1
    p.on_event(LinkEstimates(tuple(map(tuple, t * 1.1))), 1.0)    # within 20%: keep P
    assert p.solves == 1
    p.on_event(LinkEstimates(tuple(map(tuple, t * 2))), 2.0)      # beyond: re-solve
    assert p.solves == 2
    picks = []
    for k in range(200):
        acts = p.on_event(Published(k), k)
        (pull,) = [a for a in acts if isinstance(a, Pull)]
        picks.append(pull.dst)
        p.on_event(UpdateArrived(pull.dst, k + 3), k)
        (mix,) = [a for a in p.on_event(MixRequested(k), k) if isinstance(a, Mix)]
        assert mix.entries == ((0, k, 0.5), (pull.dst, k + 3, 0.5))
    assert picks.count(1) > picks.count(2) and picks.count(1) > picks.count(3)
    p.on_event(PeerDown(1), 300)
    assert p.row()[1] == 0 and abs(p.row().sum() - 1) < 1e-12


def _mix_with(p: nm.NetMax, k: int, k_pulled: int) -> Mix:
    (pull,) = [a for a in p.on_event(Published(k), k) if isinstance(a, Pull)]
    p.on_event(UpdateArrived(pull.dst, k_pulled), k)
    (mix,) = [a for a in p.on_event(MixRequested(k), k) if isinstance(a, Mix)]
    return mix


def test_an_older_pulled_model_weighs_by_its_share_of_our_iterations():
    """A host at iteration 49 that pulls a model of iteration 4 mixes it with gamma x 5/50, not
    gamma: it is not dragged back to its young peers (the mixed-links star's fast host was)."""
    p = nm.NetMax(0, T.complete(3), seed=1)
    mix = _mix_with(p, 49, 4)
    assert [w for _, _, w in mix.entries] == pytest.approx([1 - 0.05, 0.05])
    assert [w for _, _, w in _mix_with(p, 50, 80).entries] == [0.5, 0.5]   # a newer model: plain gamma
    plain = nm.NetMax(0, T.complete(3), seed=1, gap_weight=False)
    assert [w for _, _, w in _mix_with(plain, 49, 4).entries] == [0.5, 0.5]


def test_simulated_link_change_triggers_a_resolve_towards_the_new_fast_links():
    from dataclasses import replace

    from peerd.sim.engine import Simulator
    from peerd.sim.scenarios import scenario

    spec, _ = scenario("two-sites", 8)
    n = spec.n
    same = (np.arange(n)[:, None] // 4) == (np.arange(n)[None, :] // 4)
    fast = spec.bandwidth.max()
    flipped = np.where(same, fast / 10, fast)          # now the other site is close
    spec = replace(spec, estimates="pull", iterations=60, stop_at_target=False,
                   bandwidth_changes={1.0: flipped})
    pols = [nm.NetMax(i, T.complete(n), seed=0) for i in range(n)]
    res = Simulator(spec, pols).run()
    assert min(res.iterations) >= 60
    assert all(p.solves == 2 for p in pols)
    row = pols[0].row()
    assert row[~same[0]].min() > row[same[0] & (np.arange(n) != 0)].max()


def _bisection_project(y, t, adj, tbar):
    """The reference: the budget multiplier by 200 plain bisection steps."""
    tt = np.where(adj, t, 0.0)
    yy = np.where(adj, y, nm._OFF)
    p = nm._simplex_rows(yy)
    for i in range(len(y)):
        if (p[i] * tt[i]).sum() <= tbar:
            continue
        lo, hi = 0.0, 1.0
        while (nm._simplex_rows((yy[i] - hi * tt[i])[None])[0] * tt[i]).sum() > tbar:
            hi *= 2
        for _ in range(200):
            mid = (lo + hi) / 2
            if (nm._simplex_rows((yy[i] - mid * tt[i])[None])[0] * tt[i]).sum() > tbar:
                lo = mid
            else:
                hi = mid
        p[i] = nm._simplex_rows((yy[i] - hi * tt[i])[None])[0]
    return p


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(3, 8), q=st.floats(0.0, 1.0))
def test_projection_matches_bisection_and_keeps_the_budget(seed, n, q):
    adj = random_graph(seed, n).adjacency()
    t = rand_times(seed, n, adj)
    rng = np.random.default_rng(seed + 1)
    y = rng.normal(0.3, 0.5, (n, n))
    lo = np.where(adj, t, np.inf).min(1).max()
    hi = np.where(adj, t, -np.inf).max(1).max()
    tbar = lo + q * (hi - lo)
    p = nm.project(y, t, adj, tbar)
    ref = _bisection_project(y, t, adj, tbar)
    np.testing.assert_allclose(p, ref, atol=1e-6)
    assert ((p * np.where(adj, t, 0.0)).sum(1) <= tbar + 1e-9).all()
    np.testing.assert_allclose(p.sum(1), 1.0)
    assert (p[~adj] == 0).all()


def test_estimates_work_is_the_solve_on_estimates_would_run_and_none_within_resolve_frac():
    n = 6
    topo = T.ring(n)
    p = nm.NetMax(0, topo, seed=1)
    site = np.arange(n) // 3
    t = np.where(site[:, None] == site[None, :], 0.1, 0.4 + 0.01 * np.arange(n)[None, :])
    work = p.estimates_work(t)
    assert work is not None
    P = work()
    p.on_event(LinkEstimates(t), 0.0)
    assert p.P is P                              # the policy found the driver's solve cached
    assert p.row()[1] > 0.65 and 0 < p.row()[5] < 0.35   # h1 pulls its site neighbour most
    assert p.estimates_work(t * 1.1) is None     # within resolve_frac: no re-solve
    assert p.estimates_work(t * 2) is not None
    assert nm.NetMax(0, topo, probs="uniform").estimates_work(t) is None



def _star_times(slow: set[int], n: int = 6) -> np.ndarray:
    """The lab's mixed-links star as NetMax sees it on a ring: a pull over a slow host's link takes
    0.92 s, any other the 0.1-s step."""
    return np.array([[0.92 if (i in slow or m in slow) else 0.1 for m in range(n)] for i in range(n)])


def test_estimate_noise_moves_the_held_probabilities_only_a_share_and_a_real_change_at_once():
    n = 6
    topo = T.ring(n)
    adj = topo.adjacency()
    base = _star_times({0, 5})
    rng = np.random.default_rng(7)
    noisy = [base * np.exp(rng.normal(0.0, 0.2, (n, n))) for _ in range(12)]
    steady = nm.probabilities(np.where(adj, base, 0.0), adj)
    swing = {}
    for smoothing in (1.0, 0.25):
        p = nm.NetMax(1, topo, smoothing=smoothing)
        p.on_event(LinkEstimates(base), 0.0)
        rows = []
        for k, t in enumerate(noisy):
            p.on_event(LinkEstimates(t), 10.0 * (k + 1))
            rows.append(p.row()[0])
        assert p.solves == 1 + len(noisy)                  # every feed moved a link past resolve_frac
        swing[smoothing] = max(abs(r - steady[1, 0]) for r in rows)
        np.testing.assert_allclose(p.row().sum(), 1.0)
        assert (p.row()[~adj[1]] == 0).all()
    assert swing[1.0] > 0.15                               # the raw solves swing on noise alone
    assert swing[0.25] < swing[1.0] / 2
    # The sites regroup (two sites on a complete graph): the held P now costs far more than the
    # fresh solve, which replaces it at once.
    full = T.complete(n)
    sites = lambda site: np.where(site[:, None] == site[None, :], 0.1, 1.0)  # noqa: E731
    before, after = sites(np.arange(n) // 3), sites(np.array([0, 1, 1, 0, 0, 1]))
    p = nm.NetMax(0, full, smoothing=0.25)
    p.on_event(LinkEstimates(before), 0.0)
    held = p.P
    p.on_event(LinkEstimates(after), 10.0)
    fresh = nm.probabilities(after, full.adjacency())
    assert nm.total_time(held, after, full.adjacency()) > 2 * nm.total_time(fresh, after, full.adjacency())
    np.testing.assert_array_equal(p.P, fresh)
    with pytest.raises(ValueError, match="smoothing"):
        nm.NetMax(0, topo, smoothing=0.0)
