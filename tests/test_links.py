"""Link estimates, probe scheduling and the gossiped link matrix (pure logic, time as an argument)."""
from __future__ import annotations

import json
import math
import random

import pytest
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings, strategies as st

from peerd.config import Config, ConfigError, validate
from peerd.net.links import BW, RTT, Ewma, LinkMatrix, LinkTable, render_links
from peerd.v1 import control_pb2, peer_pb2

CFG = Config()


def steady(table: LinkTable, peer: str, bw: float, rtt: float, now: float = 0.0, rounds: int = 8) -> float:
    """Answer every probe with the true link for a while; returns the time reached."""
    for _ in range(rounds):
        for p in table.due_probes(now):
            run(table, p, bw, rtt, now)
        now = max(now + 0.1, table.next_due(now) or now + 1)
    return now


def run(table, p, bw, rtt, now):
    if p.kind == RTT:
        table.observe_rtt(p.peer, rtt, now)
    else:
        table.observe_transfer(p.peer, p.size_bytes, rtt + p.size_bytes / bw, now, probe=True)


# ---- EWMA ------------------------------------------------------------------------------------

def test_ewma_constant_input_has_no_spread():
    e = Ewma()
    for _ in range(20):
        e.add(3.0, 0.25)
    assert e.mean == 3.0 and e.spread == 0.0 and e.n == 20


@settings(max_examples=30, deadline=None)
@given(st.floats(1e-4, 1e10), st.floats(0.01, 0.3), st.integers(0, 2**32))
def test_ewma_converges_to_mean_and_spread(mu, rel_sd, seed):
    rng = random.Random(seed)
    e = Ewma()
    means, spreads = [], []
    for i in range(4000):
        e.add(rng.gauss(mu, rel_sd * mu), 0.1)
        if i >= 1000:
            means.append(e.mean)
            spreads.append(e.spread)
    avg_mean = sum(means) / len(means)
    avg_spread = sum(spreads) / len(spreads)
    assert abs(avg_mean - mu) < 0.05 * mu
    # EW variance is a biased-low estimate (factor ~ 1 - a/2); a loose band is what matters here.
    assert 0.7 * rel_sd * mu < avg_spread < 1.2 * rel_sd * mu


def test_ewma_follows_a_step():
    e = Ewma()
    for _ in range(10):
        e.add(100.0, 0.25)
    for _ in range(30):
        e.add(50.0, 0.25)
    assert abs(e.mean - 50.0) < 0.1


# ---- the table -------------------------------------------------------------------------------

def test_first_probes_are_immediate_and_age_counts_from_the_last_sample():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    probes = {p.kind: p for p in t.due_probes(100.0)}
    assert probes[RTT].size_bytes == CFG.links.ping_bytes
    assert probes[BW].size_bytes == CFG.links.probe_min_bytes
    assert t.due_probes(100.0) == []                      # in flight: not handed out twice
    t.observe_rtt("b", 0.02, 100.5)
    assert t.estimate("b").age(103.0) == pytest.approx(2.5)
    t.observe_transfer("b", 1_000_000, 0.02 + 0.1, 101.0, probe=True)
    est = t.estimate("b")
    assert est.bw.mean == pytest.approx(1e7)               # the RTT is subtracted
    assert est.age(103.0) == pytest.approx(2.0) and est.samples == 2


def test_unknown_peer_self_and_bad_samples_are_refused():
    t = LinkTable("a", CFG)
    t.add_peer("a")
    assert t.peers == []
    t.add_peer("b")
    assert not t.observe_rtt("zz", 0.1, 0.0)
    assert not t.observe_rtt("b", -1.0, 0.0) and not t.observe_rtt("b", math.nan, 0.0)
    assert not t.observe_transfer("b", 10, 1.0, 0.0)       # too small for a data-plane sample
    assert not t.observe_transfer("b", 10**6, 0.0, 0.0) and not t.observe_transfer("b", 10**6, math.inf, 0.0)
    assert t.estimate("b").samples == 0


def test_probe_size_and_period_formula():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    bw, rtt = 1.25e6, 0.05                               # 10 Mbit/s, 50 ms
    steady(t, "b", bw, rtt)
    s = t.probe_size("b")
    assert s == pytest.approx(bw * max(CFG.links.probe_seconds, CFG.links.probe_rtts * rtt), rel=0.01)
    assert t.bw_period("b") == pytest.approx(max(CFG.links.bw_interval, s / bw / CFG.links.probe_budget), rel=0.01)
    t2 = LinkTable("a", CFG)
    t2.add_peer("b")
    steady(t2, "b", 1.25e9, 0.0002)                      # 10 Gbit/s: capped at link_probe_max_bytes
    assert t2.probe_size("b") == CFG.links.probe_max_bytes


@pytest.mark.parametrize("bw,rtt", [(1.25e5, 0.3), (1.25e6, 0.05), (1.25e8, 0.25), (1.25e9, 0.0002)])
def test_warm_up_reaches_the_true_bandwidth_from_a_short_first_probe(bw, rtt):
    t = LinkTable("a", CFG)
    t.add_peer("b")
    now = 0.0
    while now < 30.0:                                          # warm-up probes are 2 s apart
        for p in t.due_probes(now):
            run(t, p, bw, rtt, now)
        now = t.next_due(now)
    n = t.estimate("b").bw.n
    assert CFG.links.warmup_samples <= n <= 6                  # short probes grow ~16x per step
    assert t.estimate("b").bw.mean == pytest.approx(bw, rel=0.02)


def test_queueing_delay_does_not_inflate_probes_but_a_new_path_does_count():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    now = steady(t, "b", 1e6, 0.002)
    size = t.probe_size("b")
    for _ in range(5):                                      # pings stuck behind bulk data: 0.9 s
        now += 1.0
        t.observe_rtt("b", 0.9, now, probe=False)
    est = t.estimate("b")
    assert est.rtt.mean > 0.5 and est.base_rtt == 0.002     # experienced RTT vs path RTT
    assert t.probe_size("b") == size
    t.observe_transfer("b", 1_000_000, 0.002 + 1.0, now)   # the RTT taken off is the path's
    assert est.bw.mean == pytest.approx(1e6, rel=0.01)
    now += CFG.links.rtt_min_window + 1                      # a longer path for good
    t.observe_rtt("b", 0.05, now)
    assert est.base_rtt == 0.05


def test_the_base_rtt_is_the_least_of_its_window_not_the_newest_sample():
    """Once the least RTT expires, a queued sample (a ping behind a CPU-starved event loop) must not
    become the base RTT: a transfer would then read fast, and the capacity keeps its highest."""
    t = LinkTable("a", CFG)
    t.add_peer("b")
    w = CFG.links.rtt_min_window
    for at, rtt in ((0.0, 0.002), (w / 3, 0.02), (w / 2, 0.01), (w + 1, 0.3)):
        t.observe_rtt("b", rtt, at, probe=False)
    est = t.estimate("b")
    assert est.base_rtt == 0.01
    t.observe_transfer("b", 4_000_000, 0.01 + 4.0, w + 2)
    assert est.capacity == pytest.approx(1e6, rel=0.01)     # with the queued RTT taken off: 1.08e6
    t.observe_rtt("b", 0.4, 2 * w + 1, probe=False)
    assert est.base_rtt == 0.3                               # the least of the last window


def test_a_bursty_first_sample_does_not_linger():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    t.observe_rtt("b", 0.002, 0.0)
    t.observe_transfer("b", 65536, 0.002 + 65536 / 2e7, 0.0, probe=True)   # 2x too fast: a burst
    t.observe_transfer("b", 2_000_000, 0.002 + 2_000_000 / 1e7, 2.0, probe=True)
    assert t.estimate("b").bw.mean == pytest.approx(1e7, rel=0.01)


def test_warm_up_keeps_the_highest_trusted_probe_grows_until_flat_then_averages():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    bw, rtt, now = 6.25e6, 0.04, 0.0
    t.observe_rtt("b", rtt, now)
    est = t.estimate("b")
    size = 2_000_000
    # Trusted samples: the link alone, sharing a bottleneck with another host's probe (half), ...
    for share in (0.5, 1.0, 0.5, 0.5):
        now += CFG.links.min_probe_gap
        assert BW in {p.kind for p in t.due_probes(now)}              # still warming up
        t.observe_transfer("b", size, rtt + size / (bw * share), now, probe=True)
        assert est.bw.mean == pytest.approx(bw if share == 1.0 or est.bw.n > 2 else bw * share, rel=0.01)
        if est.bw.n < 4:
            assert t.probe_size("b") >= 2 * size                      # is the rate still rising?
    # ... two trusted probes in a row that did not read faster: warm-up is over, sizes follow B.
    assert est.bw.n == 4 and est.bw.mean == pytest.approx(bw, rel=0.01)
    assert t.probe_size("b") == pytest.approx(bw * max(CFG.links.probe_seconds, CFG.links.probe_rtts * rtt), rel=0.01)
    now += CFG.links.min_probe_gap
    t.observe_transfer("b", size, rtt + size / (bw / 2), now, probe=True)   # after warm-up: averaged
    assert est.bw.mean == pytest.approx(bw * (1 - CFG.links.ewma_alpha / 2), rel=0.01)


@pytest.mark.parametrize("flat,climbs", [(CFG.links.warmup_flat, True), (0, False)])
def test_warm_up_climbs_out_of_a_tcp_ramp(flat, climbs):
    """A path whose rate grows with transfer size (slow start after idle) is not left at the rate
    of the first few-RTT probe (and without the plateau search it would be)."""
    t = LinkTable("a", CFG.replace(link_warmup_flat=flat))
    t.add_peer("b")
    bw, rtt, now = 6.25e6, 0.045, 0.0
    ramp = 14_480 * 2 ** 5                  # bytes sent during ~5 RTTs of slow start from 10 segments

    def took(n: int) -> float:
        return rtt + (5 * rtt + (n - ramp) / bw if n > ramp else rtt * math.log2(1 + n / 14_480))
    while now < 60.0:
        for p in t.due_probes(now):
            if p.kind == RTT:
                t.observe_rtt(p.peer, rtt, now)
            else:
                t.observe_transfer(p.peer, p.size_bytes, took(p.size_bytes), now, probe=True)
        now = t.next_due(now)
    assert (t.estimate("b").bw.mean > 0.85 * bw) is climbs


@settings(max_examples=25, deadline=None)
@given(st.floats(1e5, 5e9), st.floats(1e-4, 0.3), st.floats(0.0, 0.2), st.integers(0, 2**32))
def test_probing_costs_well_under_one_percent_at_steady_state(bw, rtt, noise, seed):
    rng = random.Random(seed)
    t = LinkTable("a", CFG)
    t.add_peer("b")
    now, warmup, horizon = 0.0, 1800.0, 4 * 3600.0
    bw_starts, bw_busy, ping_busy = [], [], 0.0
    while now < horizon:
        for p in t.due_probes(now):
            took = p.size_bytes / (bw * (1 + rng.uniform(-noise, noise)))
            if p.kind == BW:
                t.observe_transfer(p.peer, p.size_bytes, rtt + took, now, probe=True)
                if now >= warmup:
                    bw_starts.append(now)
                    bw_busy.append(took)
            else:
                t.observe_rtt(p.peer, rtt, now)
                ping_busy += took if now >= warmup else 0.0
        now = max(now + 0.01, t.next_due(now))
    assert len(bw_starts) >= 3                             # the estimate is kept fresh ...
    # Whole probe periods only, so the window's edges do not count a fraction of a period twice.
    bw_share = sum(bw_busy[:-1]) / (bw_starts[-1] - bw_starts[0])
    fraction = bw_share + ping_busy / (horizon - warmup)
    assert fraction <= CFG.links.probe_budget * (1 + 2 * noise) + 1e-6
    assert fraction < 0.01
    gaps = [b - a for a, b in zip(bw_starts, bw_starts[1:])]
    # ... on schedule: a period, or as many as the re-checks of a low probe took, to pay for them.
    assert max(gaps) <= t.bw_period("b") * (1 + CFG.links.capacity_confirm) * (1 + 2 * noise) + 1.0


def answer(t, now, bw, rtt):
    """Run every due probe against the true link; returns the kinds run."""
    kinds = []
    for p in t.due_probes(now):
        run(t, p, bw, rtt, now)
        kinds.append(p.kind)
    return kinds


def test_data_plane_traffic_replaces_probes():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    bw, rtt = 1.25e8, 0.001
    now = steady(t, "b", bw, rtt)
    kinds = []
    for _ in range(360):                                    # an hour of transfers every 10 s
        now += 10.0
        assert t.observe_transfer("b", 16 << 20, rtt + (16 << 20) / bw, now)
        kinds += answer(t, now, bw, rtt)
    assert BW not in kinds and kinds.count(RTT) >= 300      # pings go on, bulk probes are not needed
    assert t.estimate("b").bw.mean == pytest.approx(bw, rel=0.01)


def test_change_detection_triggers_a_reprobe_and_a_confirmed_change_resets():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    bw, rtt = 1.25e8, 0.001
    now = steady(t, "b", bw, rtt) + 1.0
    while answer(t, now, bw, rtt):                          # drain anything pending
        now += 0.5
    now += CFG.links.min_probe_gap
    assert BW not in answer(t, now, bw, rtt)
    # The link dropped to a third: a real transfer shows it.
    t.observe_transfer("b", 8 << 20, rtt + (8 << 20) / (bw / 3), now)
    assert answer(t, now, bw / 3, rtt).count(BW) == 1
    assert t.estimate("b").bw.mean == pytest.approx(bw / 3, rel=0.01)   # confirmed: restarted there
    # Noise: one slow transfer that the probe does not confirm folds in, no reset.
    now += 10 * CFG.links.min_probe_gap
    t.observe_transfer("b", 8 << 20, rtt + (8 << 20) / (bw / 30), now)
    assert answer(t, now, bw / 3, rtt).count(BW) == 1
    assert t.estimate("b").bw.mean < bw / 3 * 0.9           # folded, not restarted at the probe
    # An in-band deviation triggers nothing.
    now += 10 * CFG.links.min_probe_gap
    t.observe_transfer("b", 8 << 20, rtt + (8 << 20) / (bw / 3.3), now)
    assert BW not in answer(t, now, bw / 3, rtt)
    # RTT jumps past the floor: an early ping; a tiny jump below the floor does not count.
    now += CFG.links.min_probe_gap
    t.observe_rtt("b", rtt * 1.9, now, probe=False)
    assert RTT not in answer(t, now, bw / 3, rtt)
    t.observe_rtt("b", 0.080, now, probe=False)
    assert answer(t, now, bw / 3, rtt).count(RTT) == 1


def test_a_busy_hosts_slow_small_transfers_do_not_keep_reprobing_a_fast_link():
    """On a CPU-bound host, 1.1 MB transfers over 1 Gbit read ~5x slow while probes read the link.
    Each alarm a probe does not confirm makes the next wait longer, so probing stays within its
    budget (before: a 25 MB probe every link_min_probe_gap, ~10 % of the link's time, and the
    capacity fell to the transfers' level). A real drop is still confirmed within a period."""
    bw, rtt, size = 1.25e8, 0.0002, 1_100_000
    t, now = settled(bw, rtt)
    rng, start, probe_time = random.Random(3), now, 0.0
    while now < start + 600:
        t.observe_transfer("b", size, 0.06 * rng.uniform(0.5, 1.5), now)
        for p in t.due_probes(now):
            probe_time += p.size_bytes / bw if p.kind == BW else 0.0
            run(t, p, bw, rtt, now)
        now += 0.2
    assert probe_time / 600 < 2 * CFG.links.probe_budget
    assert t.estimate("b").capacity == pytest.approx(bw, rel=0.01)
    slow, dropped = bw / 10, now
    while now < dropped + t.bw_period("b") + CFG.links.min_probe_gap:
        t.observe_transfer("b", size, rtt + size / slow, now)
        for p in t.due_probes(now):
            run(t, p, slow, rtt, now)
        now += 0.2
    assert t.estimate("b").bw.mean == pytest.approx(slow, rel=0.05)


# ---- capacity: robust to probes that share a bottleneck ----------------------------------------

def probe_all(t, now, bw, rtt, share=1.0):
    """Run every due probe; bandwidth probes get `share` of the link (a neighbour's traffic has the
    rest). Returns the kinds run."""
    kinds = []
    for p in t.due_probes(now):
        if p.kind == RTT:
            t.observe_rtt(p.peer, rtt, now)
        else:
            t.observe_transfer(p.peer, p.size_bytes, rtt + p.size_bytes / (bw * share), now, probe=True)
        kinds.append(p.kind)
    return kinds


def settled(bw, rtt, cfg=CFG):
    t = LinkTable("a", cfg)
    t.add_peer("b")
    now = 0.0
    while now < 4 * t.cfg.links.bw_interval + 3600:
        probe_all(t, now, bw, rtt)
        now = t.next_due(now)
    return t, now


def test_probe_phase_goes_warm_up_settling_steady_and_steady_probes_keep_the_period():
    """What a benchmark waits for before its first run: once "steady", the next bandwidth probe
    of the link is at least half a bw_period away (no settle probe 4-64 s later)."""
    bw, rtt = 125e6, 0.0002                      # 1 Gbit, as in the lab's LAN scenarios
    t = LinkTable("a", CFG)
    t.add_peer("b")
    now, seen, bw_starts = 0.0, [], []
    while now < 600:
        phase = t.phase("b")
        if not seen or seen[-1] != phase:
            seen.append(phase)
        if phase == "steady" and len(bw_starts) < 1:
            bw_starts.append(now)
        kinds = probe_all(t, now, bw, rtt)
        if phase == "steady" and BW in kinds:
            bw_starts.append(now)
        now = t.next_due(now)
    assert seen == ["warm-up", "settling", "steady"]
    assert len(bw_starts) >= 3 and bw_starts[1] - bw_starts[0] >= t.bw_period("b") / CFG.links.settle_growth
    assert bw_starts[2] - bw_starts[1] >= 0.99 * t.bw_period("b")
    # a probe that met cross traffic is re-checked sooner: still the steady state (it keeps the budget)
    while BW not in probe_all(t, now, bw, rtt, share=0.3):
        now = t.next_due(now)
    assert t._sched[("b", BW)].dips and t.phase("b") == "steady"


def test_probes_that_met_cross_traffic_do_not_drag_the_capacity_down():
    bw, rtt = 6.25e6, 0.04
    t, now = settled(bw, rtt)
    est = t.estimate("b")
    assert est.capacity == pytest.approx(bw, rel=0.01)
    # A day in which two probes of every three share the bottleneck with a neighbour's (read half):
    # never link_capacity_confirm + 1 low ones in a row.
    shares, bw_probes, start = [0.5, 0.5, 1.0] * 1000, 0, now
    while now < start + 86400:
        share = shares[bw_probes]
        bw_probes += probe_all(t, now, bw, rtt, share).count(BW)
        assert est.capacity == pytest.approx(bw, rel=0.01)
        now = t.next_due(now)
    assert bw_probes > 20
    # The throughput EWMA shows the contention, with its spread; both figures reach the matrix.
    assert est.bw.mean < 0.9 * bw and est.bw.spread > 0.1 * bw
    m = LinkMatrix("a", CFG)
    m.absorb(t)
    (e,) = m.to_entries(now + 5.0)
    assert e["capacity_bytes_s"] == pytest.approx(bw, rel=0.01) and e["throughput_bytes_s"] == est.bw.mean
    assert e["throughput_spread_bytes_s"] == est.bw.spread and e["rtt_spread_s"] == est.rtt.spread
    assert e["capacity_age_s"] == pytest.approx(now + 5.0 - est.capacity_at) and e["capacity_age_s"] >= e["age_s"]
    shown = control_pb2.LinkMeasurement(**e)                 # `peerd links` carries every figure
    assert shown.throughput_spread_bytes_s == pytest.approx(est.bw.spread)
    assert m.bandwidth("a", "b") == e["capacity_bytes_s"]    # sync policies plan with the capacity


def test_a_low_probe_is_rechecked_sooner_and_a_clean_recheck_keeps_the_capacity():
    bw, rtt = 6.25e6, 0.04
    t, now = settled(bw, rtt)
    est = t.estimate("b")
    period = t.bw_period("b")
    now = t.next_due(now)
    while BW not in probe_all(t, now, bw, rtt, share=0.5):
        now = t.next_due(now)
    low_at, recheck = now, CFG.links.capacity_recheck * t.bw_period("b")
    now = t.next_due(now)
    while BW not in probe_all(t, now, bw, rtt):
        now = t.next_due(now)
    assert now - low_at == pytest.approx(recheck, abs=0.05) and recheck < period / 4    # not a whole period
    assert est.capacity == pytest.approx(bw, rel=0.01)
    # Back to the steady period, which pays for the re-check: probes stay within the budget.
    assert t._due_at("b", BW) == pytest.approx(now + 2 * t.bw_period("b"))


def test_a_real_drop_is_followed_within_a_period_and_the_rechecks():
    bw, rtt = 6.25e6, 0.04
    t, now = settled(bw, rtt)
    est, g = t.estimate("b"), CFG.links.settle_growth
    bound = t.bw_period("b") * (1 + sum(CFG.links.capacity_recheck * g ** k
                                        for k in range(CFG.links.capacity_confirm))) + 1.0
    dropped_at = now
    while est.capacity > 1.05 * bw / 3:
        probe_all(t, now, bw / 3, rtt)
        now = t.next_due(now)
        assert now - dropped_at <= bound, f"capacity {est.capacity:.3g} still above {bw / 3:.3g}"
    assert est.capacity == pytest.approx(bw / 3, rel=0.01)


def test_warm_up_under_cross_traffic_is_corrected_by_the_settle_probes():
    """Hosts of one site start together: every warm-up probe shares the uplink (reads half). Probes
    then thin out (gaps 2, 4, 8 ... x link_min_probe_gap), and the first clean one sets the capacity."""
    bw, rtt, gap, g = 6.25e6, 0.04, CFG.links.min_probe_gap, CFG.links.settle_growth
    t = LinkTable("a", CFG)
    t.add_peer("b")
    est, sched, now, starts = t.estimate("b"), t._sched[("b", BW)], 0.0, []
    while sched.settled == 0:
        probe_all(t, now, bw, rtt, share=0.5)
        now = t.next_due(now)
    assert est.capacity == pytest.approx(bw / 2, rel=0.02)     # the first settle probe met traffic too
    shared_at = est.bw_at
    while not starts:
        if BW in probe_all(t, now, bw, rtt):
            starts.append(now)
            assert est.capacity == pytest.approx(bw, rel=0.01)
        now = t.next_due(now)
    assert starts[0] - shared_at == pytest.approx(gap * g ** 2, abs=0.05)
    while now < shared_at + 200:
        if BW in probe_all(t, now, bw, rtt):
            starts.append(now)
        now = t.next_due(now)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:3] == pytest.approx([gap * g ** 3, gap * g ** 4, gap * g ** 5], abs=0.05)
    # While probes settle, low ones (hosts that started together still meet) never lower it.
    while t._settle_gap(sched.settled) < t.bw_period("b"):
        probe_all(t, now, bw, rtt, share=0.5)
        now = t.next_due(now)
        assert est.capacity == pytest.approx(bw, rel=0.01)


def test_the_plateau_search_goes_on_after_a_warm_up_under_cross_traffic():
    """A path whose rate grows with transfer size (slow start after idle), every warm-up probe
    sharing it (half): the first clean settle probe raises the capacity, so the next one is twice
    as big, until the rate stops rising. Without that the capacity stays at what a probe sized from
    the contended estimate reads."""
    t = LinkTable("a", CFG)
    t.add_peer("b")
    bw, rtt, now = 6.25e6, 0.045, 0.0
    est, sched = t.estimate("b"), t._sched[("b", BW)]
    ramp = 14_480 * 2 ** 5                  # bytes sent during ~5 RTTs of slow start from 10 segments

    def busy(n: int) -> float:
        return 5 * rtt + (n - ramp) / bw if n > ramp else rtt * math.log2(1 + n / 14_480)
    while now < 60.0:
        for p in t.due_probes(now):
            if p.kind == RTT:
                t.observe_rtt(p.peer, rtt, now)
            else:
                share = 0.5 if sched.settled == 0 else 1.0
                t.observe_transfer(p.peer, p.size_bytes, rtt + busy(p.size_bytes) / share, now, probe=True)
        now = t.next_due(now)
    assert est.capacity > 0.85 * bw
    assert t.probe_size("b") <= CFG.links.probe_growth_max * est.capacity * CFG.links.probe_rtts * rtt + 1


def test_capacity_samples_expire_after_the_window():
    """Data-plane transfers (no probes while they flow) that read less than an old probe: after
    link_capacity_window the old sample no longer counts."""
    bw, rtt = 6.25e6, 0.04
    t, now = settled(bw, rtt)
    est, high_at, size = t.estimate("b"), t.estimate("b").capacity_at, 4_000_000
    while now < high_at + CFG.links.capacity_window + 30:
        assert t.observe_transfer("b", size, rtt + size / (bw / 2), now)
        assert est.capacity == pytest.approx(bw if now - high_at <= CFG.links.capacity_window else bw / 2, rel=0.01)
        assert BW not in {p.kind for p in t.due_probes(now)}
        now += 10.0
    assert est.capacity == pytest.approx(bw / 2, rel=0.01) and len(est.peaks) <= CFG.links.capacity_samples


def test_a_probe_already_in_flight_when_a_change_is_seen_does_not_confirm_it():
    bw, rtt = 1.25e8, 0.001
    t, now = settled(bw, rtt)
    est, gap = t.estimate("b"), CFG.links.min_probe_gap
    now = t._due_at("b", BW)
    (p,) = [p for p in t.due_probes(now) if p.kind == BW]
    t.observe_transfer("b", 8 << 20, rtt + (8 << 20) / (bw / 3), now + 0.1)     # seen while it runs
    t.observe_transfer("b", p.size_bytes, rtt + p.size_bytes / (bw / 3), now + 0.5, probe=True)
    assert est.bw.mean > 0.5 * bw                           # folded in, not taken as the new level
    assert t._due_at("b", BW) == pytest.approx(now + gap)   # the change still wants its own probe
    assert answer(t, now + gap, bw / 3, rtt).count(BW) == 1
    assert est.bw.mean == pytest.approx(bw / 3, rel=0.01)


def test_failures_back_off_and_unreported_probes_expire():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    (p,) = [p for p in t.due_probes(0.0) if p.kind == RTT]
    t.probe_failed("b", RTT, 1.0)
    assert [x for x in t.due_probes(1.0 + CFG.links.min_probe_gap * 2 - 0.01) if x.kind == RTT] == []
    assert [x for x in t.due_probes(1.0 + CFG.links.min_probe_gap * 2) if x.kind == RTT]
    now = 10.0
    gaps = []
    for _ in range(12):                                      # never reported: deadline = failure
        due = t.next_due(now)
        now = max(now, due)
        ps = [x for x in t.due_probes(now) if x.kind == RTT]
        if ps:
            gaps.append(now)
        now += 0.01
    spacing = [b - a for a, b in zip(gaps, gaps[1:])]
    assert spacing == sorted(spacing) and spacing[-1] <= CFG.links.retry_max + CFG.links.probe_timeout_min + 0.1
    t.remove_peer("b")
    assert t.due_probes(now) == [] and t.next_due(now) is None


# ---- the matrix --------------------------------------------------------------------------------

def entry(m, t, age, bw=1e6, rtt=0.01, n=3, cap=None):
    return {"measurer": m, "target": t, "capacity_bytes_s": bw if cap is None else cap, "capacity_age_s": age,
            "throughput_bytes_s": bw, "throughput_spread_bytes_s": 0.0,
            "rtt_s": rtt, "rtt_spread_s": 0.0, "samples": n, "age_s": age}


def test_gossip_form_matches_the_proto_and_survives_clock_skew():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    steady(t, "b", 1.25e6, 0.02)
    sender = LinkMatrix("a", CFG)
    sender.absorb(t)
    skew = 1e6                                               # the receiver's clock is far away
    wire = [peer_pb2.LinkEntry(**d) for d in sender.to_entries(now=50.0)]   # exact field names
    receiver = LinkMatrix("c", CFG)
    got = [MessageToDict(e, preserving_proto_field_name=True) for e in wire]
    assert receiver.merge(got, now=50.0 + skew) == (1, [])
    (back,) = receiver.to_entries(now=50.0 + skew + 2.0)
    (orig,) = sender.to_entries(now=52.0)
    assert back["age_s"] == pytest.approx(orig["age_s"])
    assert back["throughput_bytes_s"] == pytest.approx(1.25e6, rel=1e-6)
    assert back["capacity_bytes_s"] == pytest.approx(1.25e6, rel=1e-6)
    assert back["capacity_age_s"] == pytest.approx(orig["capacity_age_s"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("bcd"), st.sampled_from("bcde"), st.floats(0, 500),
                          st.floats(1, 1e9), st.floats(0, 1000)), max_size=40))
def test_merge_newest_wins_whatever_the_order(gossip):
    # (measurer, target, age at send, bandwidth, receive time)
    m = LinkMatrix("a", CFG)
    best: dict = {}
    for meas, targ, age, bw, at in sorted(gossip, key=lambda g: g[4]):
        if meas == targ:
            continue
        m.merge([entry(meas, targ, age, bw)], now=at)
        born = at - age
        if (meas, targ) not in best or born > best[(meas, targ)][0]:
            best[(meas, targ)] = (born, bw)
    assert {k: e.capacity_bytes_s for k, e in m.entries.items()} == {k: v[1] for k, v in best.items()}


def test_own_rows_are_never_overwritten_by_gossip():
    t = LinkTable("a", CFG)
    t.add_peer("b")
    t.observe_rtt("b", 0.01, 10.0)
    m = LinkMatrix("a", CFG)
    m.absorb(t)
    m.merge([entry("a", "b", 0.0, bw=5.0, rtt=9.0)], now=100.0)
    assert m.get("a", "b").rtt_s == 0.01
    t.remove_peer("b")
    m.absorb(t)
    assert m.get("a", "b") is None


def test_bad_entries_are_refused_with_reasons_and_size_is_bounded():
    cfg = Config(link_max_entries=50)
    m = LinkMatrix("a", cfg)
    bad = [entry("b", "b", 1), entry("b", "c", -1), entry("b", "c", math.nan),
           entry("b", "c", 1, bw=1e20), entry("b", "c", 1, rtt=math.inf), {**entry("b", "c", 1), "samples": True},
           {**entry("b", "c", 1), "measurer": 7}, {**entry("b", "c", 1), "target": "x" * 500}, "garbage"]
    taken, refused = m.merge(bad, now=10.0)
    assert taken == 0 and len(refused) == len(bad)
    assert any("age_s" in r for r in refused) and any("measurer" in r for r in refused)
    many = [entry(f"n{i}", f"n{i + 1}", age=float(i)) for i in range(200)]
    taken, refused = m.merge(many, now=1000.0)
    assert len(m.entries) == 50 and refused == ["more than link_max_entries=50 entries"]
    assert max(e.updated_at for e in m.entries.values()) == 1000.0   # the freshest are kept
    m.merge([entry("x", "y", age=cfg.links.forget_after + 1)], now=2000.0)
    assert m.get("x", "y") is None                                     # too old to take
    m.expire(now=1000.0 + cfg.links.forget_after + 100)
    assert m.entries == {}


def test_lookups_and_gossip_limit():
    m = LinkMatrix("a", CFG)
    m.merge([entry("b", "c", 5, bw=2e6, rtt=0.02), entry("c", "b", 1, bw=3e6, rtt=0.03)], now=10.0)
    assert m.bandwidth("b", "c") == 2e6 and m.bandwidth("c", "d") is None
    assert m.bandwidth("d", "b") is None and m.rtt("b", "c") == 0.03    # the fresher measurement
    assert [e["measurer"] for e in m.to_entries(10.0, limit=1)] == ["c"]
    # Delta gossip goes by when an entry became news here, not when it was measured: both arrived
    # at 10, so a peer last told at 7 hears of both (b's, measured at 5, is news to it too).
    assert sorted(e["measurer"] for e in m.to_entries(10.0, newer_than=7.0)) == ["b", "c"]
    assert m.to_entries(10.0, newer_than=10.0) == []
    times = m.expected_times(["b", "c", "d"], nbytes=4_000_000)
    assert times[1][0] == pytest.approx(0.03 / 2 + 4_000_000 / 2e6)    # b -> c, measured by b
    assert times[0][1] == pytest.approx(0.03 / 2 + 4_000_000 / 3e6)    # c -> b, measured by c
    assert times[0][0] == 0.0 and times[2][0] == math.inf
    m.remove_node("b")
    assert m.entries == {}


def test_delta_gossip_carries_news_not_every_refresh():
    # Heartbeats refresh every RTT each second; only a move past link_gossip_change is news.
    cfg = Config(link_gossip_change=0.1, link_rtt_change_floor=0.002)
    m = LinkMatrix("a", cfg)
    m.merge([entry("b", "c", 0, bw=1e6, rtt=0.010)], now=1.0)
    assert [e["target"] for e in m.to_entries(2.0, newer_than=0.5)] == ["c"]          # new: news
    m.merge([entry("b", "c", 0, bw=1.05e6, rtt=0.0105)], now=2.0)                     # jitter
    assert m.get("b", "c").throughput_bytes_s == 1.05e6                              # taken ...
    assert m.to_entries(2.0, newer_than=1.5) == []                                     # ... not news
    assert len(m.to_entries(2.0)) == 1                                                 # full gossip has it
    for i, bw in enumerate((1.08e6, 1.12e6), start=3):                                 # a slow drift
        m.merge([entry("b", "c", 0, bw=bw, rtt=0.010)], now=float(i))
    assert [e["throughput_bytes_s"] for e in m.to_entries(4.0, newer_than=3.5)] == [1.12e6]  # adds up
    m.merge([entry("b", "c", 0, bw=1.12e6, rtt=0.0119)], now=5.0)                     # 19 % but < 2 ms
    assert m.to_entries(5.0, newer_than=4.5) == []
    m.merge([entry("b", "c", 0, bw=1.12e6, rtt=0.030)], now=6.0)                      # queueing: news
    assert [e["rtt_s"] for e in m.to_entries(6.0, newer_than=5.5)] == [0.030]
    # Our own rows follow the same rule.
    t = LinkTable("a", cfg)
    t.add_peer("b")
    t.observe_rtt("b", 0.010, 10.0)
    m.absorb(t)
    assert ("a", "b") in [(e["measurer"], e["target"]) for e in m.to_entries(10.0, newer_than=9.5)]
    t.observe_rtt("b", 0.0101, 11.0)
    m.absorb(t)
    assert m.to_entries(11.0, newer_than=10.5) == []
    with pytest.raises(ConfigError, match="link_gossip_change"):
        validate(Config(link_gossip_change=1.0))


def test_pull_times_are_the_round_trip_against_compute_and_unknown_pairs_the_slowest():
    m = LinkMatrix("a", CFG)
    assert m.pull_times(["b", "c"], 1_000_000, 0.1) is None              # nothing measured
    m.merge([entry("b", "c", 5, bw=2e6, rtt=0.04), entry("c", "b", 5, bw=100e6, rtt=0.001)], now=10.0)
    times = m.pull_times(["b", "c", "d", ""], nbytes=1_000_000, compute=0.1)
    assert times[1][0] == pytest.approx(0.04 + 1_000_000 / 2e6)     # c pulls b: b -> c at 2 MB/s
    assert times[0][1] == pytest.approx(0.1)                        # fast link: the compute bounds it
    assert times[2][0] == times[3][1] == times[0][3] == pytest.approx(0.54)   # unmeasured: the slowest
    assert all(times[i][i] == 0.0 for i in range(4))


# ---- rendering ---------------------------------------------------------------------------------

def test_render_text_and_json():
    m = LinkMatrix("alpha", CFG)
    m.merge([entry("beta", "alpha", 3, bw=117.5e6, rtt=0.00021), entry("beta", "gamma", 40, bw=1.25e6, rtt=0.05),
             entry("gamma", "alpha", 2, bw=0.0, rtt=0.0123)], now=100.0)
    text = render_links(m.to_dict(now=100.0))
    assert "940.0" in text and "10.0" in text and "0.21" in text and "50.00" in text and "12.30" in text
    assert "?" in text                                        # gamma->alpha has no bandwidth sample
    lines = text.splitlines()
    assert lines[0].startswith("links seen by alpha: 3 nodes, 3 measured links")
    assert "alpha" in lines[3] and lines[4].startswith("alpha")   # self first
    js = json.loads(render_links(m.to_dict(now=100.0), fmt="json"))
    row = next(r for r in js["links"] if r["target"] == "gamma")
    assert row["capacity_mbit_s"] == pytest.approx(10.0) and row["throughput_mbit_s"] == pytest.approx(10.0)
    assert row["rtt_ms"] == pytest.approx(50.0) and row["age_s"] == 40 and row["capacity_age_s"] == 40
    assert row["probe_phase"] == "" and "not steady" not in text
    reply = m.to_dict(now=100.0)
    reply["links"] = [dict(e, probe_phase="settling") if e["measurer"] == "alpha" else e for e in reply["links"]]
    reply["links"].append({"measurer": "alpha", "target": "beta", "probe_phase": "settling"})
    assert "probing not steady yet" in render_links(reply) and "beta" in render_links(reply).splitlines()[-3]


def test_render_accepts_the_links_reply_and_long_ids():
    long_a, long_b = "node-" + "a" * 30, "node-" + "a" * 29 + "b"
    reply = control_pb2.LinksReply(node_id=long_a, links=[
        control_pb2.LinkMeasurement(measurer=long_a, target=long_b, capacity_bytes_s=1.25e8,
                                    throughput_bytes_s=1e8, throughput_spread_bytes_s=2.5e6, rtt_s=0.001,
                                    rtt_spread_s=0.0002, age_s=0.0, samples=4)])
    text = render_links(MessageToDict(reply, preserving_proto_field_name=True))   # age_s=0 is omitted
    assert "1000.0" in text and "800.0+-20.0" in text and "1.00+-0.20" in text and "n0 = " + long_a in text
    assert "no link measured yet" in render_links({"node_id": "x", "links": []})
    with pytest.raises(ValueError, match="fmt"):
        render_links({}, fmt="xml")


def test_config_refuses_a_budget_of_one_percent_or_more():
    from peerd.config import ConfigError, load
    with pytest.raises(ConfigError, match="link_probe_budget"):
        load(env={"PEERD_LINK_PROBE_BUDGET": "0.01"})
    with pytest.raises(ConfigError, match="link_ewma_alpha"):
        load(env={"PEERD_LINK_EWMA_ALPHA": "1.5"})
    with pytest.raises(ConfigError, match="link_capacity_dip"):
        load(env={"PEERD_LINK_CAPACITY_DIP": "1.0"})
    with pytest.raises(ConfigError, match="link_settle_growth"):
        load(env={"PEERD_LINK_SETTLE_GROWTH": "1.0"})
    assert load(env={"PEERD_MDNS": "off"}).mdns.enabled is False
