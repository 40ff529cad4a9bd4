"""Late joiners in the pure policies (issue 8, item 2): a run sized for up to 8 workers starts with
4; the 4 missing ranks are PeerDown to every policy from the start (nobody waits on them, a ring
re-links around them), then rank 4 joins mid-run at the others' iteration and is mixed like any
other worker."""
from __future__ import annotations

import pytest

from peerd.sim.engine import SimSpec, Simulator
from peerd.sync import registry
from peerd.sync import topology as T
from peerd.sync.events import Average
from tests.test_sync_churn import ALGOS, Recorder


class Mixed(Recorder):
    """Also records AD-PSGD's passive averages (the joiner's carried parameters land there)."""

    def __init__(self, policy):
        super().__init__(policy)
        self.averages = []

    def on_event(self, ev, now):
        actions = super().on_event(ev, now)
        self.averages += [a for a in actions if isinstance(a, Average)]
        return actions

N, PRESENT, JOINER, JOIN_AT = 8, 4, 4, 1.5


def run(algo: str, timing_only: bool = True, iterations: int = 40, seed: int = 3, joins: bool = True):
    topo = T.make("exp-directed" if algo == "sgp" else "ring", N)
    pols = [Mixed(p) for p in registry.build(algo, N, topo, seed=seed)]
    join = {JOINER: JOIN_AT if joins else 1e9, **{r: 1e9 for r in range(PRESENT + 1, N)}}   # 5..7 never come
    spec = SimSpec(n=N, params=16, iterations=iterations, compute=0.1, latency=0.005, bandwidth=1e6,
                   timing_only=timing_only, join=join, seed=seed, stop_at_target=False, max_time=1e4,
                   estimates=registry.ESTIMATES.get(algo, "none"))
    sim = Simulator(spec, pols)
    return spec, pols, sim.run(), sim


@pytest.mark.parametrize("algo", ALGOS)
def test_absent_ranks_are_never_waited_on_and_a_joiner_is_mixed(algo):
    spec, pols, res, _ = run(algo)
    live = list(range(PRESENT + 1))
    never = set(range(PRESENT + 1, N))
    assert not res.stalled and all(res.iterations[i] >= spec.iterations for i in live), res.iterations
    for i in live:
        for _, m in pols[i].mixes:
            assert not set(m.waited) & never, (algo, i, m)
            assert not {s for s, _, w in m.entries if w > 0} & never, (algo, i, m)
    # The joiner started at the others' iteration, not at 0...
    first = min(m.k for _, m in pols[JOINER].mixes)
    assert first > 0, (algo, first)
    # ...mixed the others' updates...
    assert any({s for s, _, w in m.entries if w > 0} - {JOINER} for _, m in pols[JOINER].mixes), algo
    # ...and its updates were mixed by the others. Not with a backup in-neighbour: all equally
    # fast, the joiner stays a fraction of a step behind (it starts mid-step, at the iteration the
    # others published), so it is the backup its neighbours never need, by design.
    used = [(i, m.k) for i in range(PRESENT) for _, m in pols[i].mixes
            if any(s == JOINER and w > 0 for s, _, w in m.entries)]
    used += [a for i in range(PRESENT) for a in pols[i].averages if any(s == JOINER and w > 0 for s, _, w in a.entries)]
    assert used or "backup" in algo, f"{algo}: nobody mixed the joiner's updates"
    if algo in ("hop", "hop-staleness", "d-psgd"):
        # Ring of 8 with 5..7 absent: before the join 3 and 0 are neighbours across the hole;
        # after it 4 sits between them.
        before = [m for t, m in pols[0].mixes if t < JOIN_AT]
        after = [m for t, m in pols[0].mixes if t > JOIN_AT + 1]
        assert any(3 in {s for s, _, _ in m.entries} for m in before), algo
        assert after and all(4 in {s for s, _, _ in m.entries} for m in after), algo


@pytest.mark.parametrize("algo", ["hop", "d-psgd", "netmax"])
def test_a_joiner_reaches_the_others_model(algo):
    """With parameters (a quadratic whose terms differ per worker): the joiner copies a live
    worker's parameters and trains on. At the end it is as close to the others' mean as they are
    (within 2x the farthest of them), and the
    average model is better than without it (its data term counts: it contributed)."""
    import numpy as np

    _, _, res, sim = run(algo, timing_only=False, iterations=300)
    _, _, alone, _ = run(algo, timing_only=False, iterations=300, joins=False)
    assert not res.stalled and not alone.stalled
    mean = sim.X[:PRESENT].mean(0)
    spread = max(np.linalg.norm(x - mean) for x in sim.X[:PRESENT])
    joined = np.linalg.norm(sim.X[JOINER] - mean)
    assert joined < 2 * spread, algo
    assert res.loss < alone.loss, (algo, res.loss, alone.loss)
