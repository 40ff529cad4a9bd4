"""The incremental mix (peerd.node.run.mixacc) against the direct weighted sum, driven by a real Hop
policy through random arrivals, drops, repairs and skips, the way the daemon drives it."""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings, strategies as st

from peerd.node.run.mixacc import MixAccumulator, summable
from peerd.sync import events as ev
from peerd.sync import topology
from peerd.sync.hop import Hop
from peerd.train.flat import Layout

LAYOUT = Layout.build([("w", "float32", (37, 5)), ("b", "float64", (11,))])
MODES = [dict(backup=1), dict(backup=2), dict(staleness=2), dict(staleness=1, backup=1),
         dict(backup=1, skip=True), dict(staleness=2, skip=True)]


def params(rng: random.Random) -> torch.Tensor:
    buf = torch.empty(LAYOUT.total_bytes, dtype=torch.uint8)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for t in LAYOUT.typed(buf):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 3 + 1)
    return buf


def direct(entries, buffers) -> tuple[torch.Tensor, int]:
    """The daemon's direct path (TrainingRun._weighted_sum), in float64 as the reference."""
    parts = [(buffers[(s, i)], w) for s, i, w in entries if w > 0 and (s, i) in buffers]
    total = sum(w for _, w in parts)
    out = [torch.zeros(t.shape, dtype=torch.float64) for t in LAYOUT.typed(parts[0][0])]
    for buf, w in parts:
        for o, t in zip(out, LAYOUT.typed(buf)):
            o.add_(t.double(), alpha=w / total)
    return out, len(parts)


def scenario(seed: int, mode: dict, n: int) -> int:
    """One worker through 12 iterations of random events; every summed mix is checked against
    the direct sum. Returns how many mixes came from the sum."""
    rng = random.Random(seed)
    topo = topology.complete(n) if rng.random() < 0.5 else topology.ring(n)
    pol = Hop(0, topo, max_ig=None if not mode.get("skip") else 6, max_skip=3, **mode)
    acc = MixAccumulator(LAYOUT)
    out = torch.empty(LAYOUT.total_bytes, dtype=torch.uint8)
    held: dict[tuple[int, int], torch.Tensor] = {}
    sent = {j: -1 for j in range(1, n)}     # newest iteration each neighbour sent (FIFO links)
    k = 0

    def run(event) -> list:
        actions = pol.on_event(event, 0.0)
        mixes = []
        for a in actions:
            if isinstance(a, ev.Drop) and (a.src, a.k) in held:
                acc.withdraw((a.src, a.k), held[(a.src, a.k)])
                del held[(a.src, a.k)]
            elif isinstance(a, ev.Mix):
                want, used_direct = direct(a.entries, held)
                used = acc.finish(a.k, a.entries, lambda s, i: held.get((s, i)))
                if used is None:    # the daemon then sums in full: nothing to compare
                    continue
                assert used == used_direct
                for o, t in zip(LAYOUT.typed(out), want):
                    assert torch.allclose(o.double(), t, rtol=1e-5, atol=1e-5)
                mixes.append(a)
            elif isinstance(a, ev.Skip):
                mixes.append(a)
        if acc.k >= 0:
            acc.sync(pol.preview(acc.k) if acc.k == pol.k else None, lambda s, i: held.get((s, i)))
        return [a for a in actions if isinstance(a, (ev.Mix, ev.Skip))]

    for _ in range(12):
        held[(0, k)] = params(rng)
        run(ev.Published(k))
        acc.start(k, out)
        acc.sync(pol.preview(k), lambda s, i: held.get((s, i)))
        requested, mixed, nxt = False, False, k + 1
        for _step in range(40):
            r = rng.random()
            j = rng.randrange(1, n)
            if r < 0.5:
                if 0 not in topo.out_neighbors(j) or j in pol.dead:
                    continue
                sent[j] = max(sent[j] + 1, k - 2 + rng.randrange(4))
                held[(j, sent[j])] = params(rng)
                acts = run(ev.UpdateArrived(j, sent[j]))
            elif r < 0.6 and pol.max_ig is not None:
                acts = run(ev.TokensArrived(j, 1))
            elif r < 0.63 and n > 3:
                acts = run(ev.PeerUp(j, k) if j in pol.dead else ev.PeerDown(j))
            elif not requested:
                requested = True
                acts = run(ev.MixRequested(k))
            else:
                acts = run(ev.Tick())
            for a in acts:
                if isinstance(a, ev.Mix):
                    mixed = True
                elif isinstance(a, ev.Skip):
                    nxt = a.to
            if mixed:
                break
        if not mixed:
            break                       # starved (e.g. not enough live neighbours): nothing more to check
        for key in [key for key in held if key[0] == 0 and key[1] < k]:
            del held[key]
        k = nxt
    return acc.hits


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1_000_000), mode=st.sampled_from(MODES), n=st.integers(3, 6))
def test_incremental_mix_equals_the_direct_sum(seed, mode, n):
    scenario(seed, mode, n)


def test_the_random_scenarios_use_the_sum():
    """The scenarios are not all fallbacks to the direct sum (the check above would be vacuous)."""
    assert all(sum(scenario(seed, mode, 4) for seed in range(5)) >= 5 for mode in MODES)


def test_a_full_row_costs_no_pass_at_mix_and_a_late_update_one():
    """Backup 1 of 2 on a ring of 3: both neighbours' updates in before Mix(k) -> the mix was
    summed already; only one in -> one rescaling pass at Mix(k)."""
    rng = random.Random(1)
    pol = Hop(0, topology.ring(3), max_ig=None, backup=1)
    acc, out = MixAccumulator(LAYOUT), torch.empty(LAYOUT.total_bytes, dtype=torch.uint8)
    held = {(0, 0): params(rng), (1, 0): params(rng), (2, 0): params(rng)}
    pol.on_event(ev.Published(0), 0.0)
    acc.start(0, out)
    for j in (1, 2):
        pol.on_event(ev.UpdateArrived(j, 0), 0.0)
        acc.sync(pol.preview(0), lambda s, i: held.get((s, i)))
    assert acc.passes == 3
    (mix,) = [a for a in pol.on_event(ev.MixRequested(0), 0.0) if isinstance(a, ev.Mix)]
    assert acc.finish(0, mix.entries, lambda s, i: held.get((s, i))) == 3
    assert acc.passes == 3 and acc.hits == 1
    want, _ = direct(mix.entries, held)
    assert all(torch.allclose(o.double(), t, rtol=1e-5, atol=1e-5) for o, t in zip(LAYOUT.typed(out), want))

    held.update({(0, 1): params(rng), (1, 1): params(rng)})
    pol.on_event(ev.Published(1), 0.0)
    acc.start(1, out)
    pol.on_event(ev.UpdateArrived(1, 1), 0.0)
    acc.sync(pol.preview(1), lambda s, i: held.get((s, i)))
    (mix,) = [a for a in pol.on_event(ev.MixRequested(1), 0.0) if isinstance(a, ev.Mix)]
    before = acc.passes
    assert acc.finish(1, mix.entries, lambda s, i: held.get((s, i))) == 2
    assert acc.passes == before + 1          # the rescale: 2 of 3 entries, weights 1/2 not 1/3
    want, _ = direct(mix.entries, held)
    assert all(torch.allclose(o.double(), t, rtol=1e-5, atol=1e-5) for o, t in zip(LAYOUT.typed(out), want))


def test_preview_is_pure_and_ends_with_the_mix():
    pol = Hop(0, topology.ring(4), max_ig=4, staleness=1, backup=1)
    assert pol.preview(0) is None                       # nothing published yet
    pol.on_event(ev.Published(0), 0.0)
    pol.on_event(ev.UpdateArrived(1, 0), 0.0)
    before = pol.state()
    first = pol.preview(0)
    assert first == pol.preview(0) and pol.state() == before
    assert {(s, i) for s, i, _ in first} == {(0, 0), (1, 0)}
    assert sum(w for *_, w in first) < 1                # raw topology weights, not renormalised
    (mix,) = [a for a in pol.on_event(ev.MixRequested(0), 0.0) if isinstance(a, ev.Mix)]
    total = sum(w for *_, w in first)
    assert mix.entries == tuple((s, i, w / total) for s, i, w in first)
    assert pol.preview(0) is None


def test_only_float32_and_float64_layouts_are_summed():
    assert summable(LAYOUT)
    assert not summable(Layout.build([("w", "bfloat16", (4,))]))


def test_a_summed_update_the_mix_does_not_use_is_taken_out():
    """A weight that changes under the sum (the graph was repaired) restarts it; an update summed
    but not in the decided mix is subtracted at finish."""
    rng = random.Random(2)
    acc, out = MixAccumulator(LAYOUT), torch.empty(LAYOUT.total_bytes, dtype=torch.uint8)
    held = {(0, 0): params(rng), (1, 0): params(rng), (2, 0): params(rng)}
    acc.start(0, out)
    acc.sync([(0, 0, 0.5), (1, 0, 0.25), (2, 0, 0.25)], lambda s, i: held.get((s, i)))
    entries = [(0, 0, 2 / 3), (1, 0, 1 / 3)]          # 2 was left out of the decided mix
    assert acc.finish(0, entries, lambda s, i: held.get((s, i))) == 2
    want, _ = direct(entries, held)
    assert all(torch.allclose(o.double(), t, rtol=1e-5, atol=1e-6) for o, t in zip(LAYOUT.typed(out), want))
    acc.start(1, out)
    held.update({(0, 1): params(rng), (1, 1): params(rng)})
    acc.sync([(0, 1, 0.5), (1, 1, 0.5)], lambda s, i: held.get((s, i)))
    acc.sync([(0, 1, 1 / 3), (1, 1, 1 / 3)], lambda s, i: held.get((s, i)))   # reweighted: restart
    assert acc.parts == {(0, 1): 1 / 3, (1, 1): 1 / 3}
    entries = [(0, 1, 0.5), (1, 1, 0.5)]
    assert acc.finish(1, entries, lambda s, i: held.get((s, i))) == 2
    want, _ = direct(entries, held)
    assert all(torch.allclose(o.double(), t, rtol=1e-5, atol=1e-6) for o, t in zip(LAYOUT.typed(out), want))
