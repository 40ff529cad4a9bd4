"""Link estimates: what this node measured (LinkTable) and the swarm's link matrix (LinkMatrix).

Pure logic, no I/O and no clock: every call takes `now` (seconds, any monotonic origin of this
host). The daemon runs the probes LinkTable asks for, feeds back what it observed, and puts
LinkMatrix entries into heartbeat gossip.

Estimates
- Two bandwidth figures (bytes/s, measurer -> target):
  capacity: what the path carries, the highest trusted sample within link_capacity_window. A probe
    that shares a bottleneck with other traffic (another host of the site probing through the same
    uplink, the data plane) reads low, never high, so the best recent sample is the robust figure
    and an EWMA is not. Kept as a monotonic queue (rates fall from front to back, at most
    link_capacity_samples, dropped after the highest): O(1) amortized, the newest sample always
    counts and the highest until the window ends.
  throughput: the EWMA of all samples, probes and data-plane transfers alike: what transfers got
    lately, cross traffic included.
  A steady-state probe that reads more than link_capacity_dip below the capacity is re-checked
  (link_capacity_recheck * T * growth^(k-1) after it, k = 1, 2, ...; T/8 and T/4 by default). If link_capacity_confirm re-checks in a
  row read low too, the link really got slower: the capacity restarts from those samples. A real
  drop is thus followed within one probe period plus the re-checks (or at once, when a data-plane
  transfer shows it, see Change), and in any case once the higher samples leave the window.
- RTT (seconds) and throughput are exponentially weighted moving
  averages with an exponentially weighted variance (West/Finch incremental form):
      d = x - mean;  mean += a*d;  var = (1 - a) * (var + a*d*d)
  `spread` is sqrt(var), in the unit of the mean. Each estimate keeps its sample count and the
  time of its last sample, so its age is `now - updated_at`.
- Bandwidth samples come from probes and from real data-plane transfers alike. A transfer's
  `seconds` runs from the first byte sent to the peer's acknowledgement, so it contains one RTT;
  we subtract the base RTT R, but never more than half the transfer time:
      sample = bytes / max(seconds - R, seconds / 2)
  R is the least RTT seen within link_rtt_min_window (the path without queues; the least of all
  samples of the window, not the newest once an older least expired): pings that
  wait behind bulk traffic measure the queue (on an 8 Mbit/s htb link, ~1 s behind a 1 MiB
  transfer), which is right for the RTT estimate but would inflate probe sizes and deflate rates.
  Data-plane transfers smaller than link_min_transfer_bytes, or busy for less than
  link_min_transfer_seconds after the RTT is taken off, are not samples (they measure latency).

When to probe (due_probes)
- RTT: a small ping every link_rtt_interval unless some RTT sample arrived meanwhile.
- Bandwidth: the first probe at once (link_probe_min_bytes, since nothing is known), then
  link_warmup_samples samples link_min_probe_gap apart, each sized from the estimate so far.
  A too-short sample (RTT-dominated, or busy < link_probe_seconds / 2 while a bigger probe was
  allowed) is not trusted: an RTT-floored one is a lower bound, a burst-sized one may overshoot.
  While the estimate rests only on such samples, a larger short sample or any trustworthy one
  replaces it instead of being averaged in. Warm-up goes on (probes grow about 16x per step) until
  a sample is trusted or probes reach link_probe_max_bytes; the estimate of a link whose
  bandwidth-delay product exceeds that stays a lower bound.
  Warm-up also goes on while the estimate rises: each probe is at least twice the previous
  trusted one until link_warmup_flat of them in a row read no more than link_warmup_gain faster
  (TCP ramps up after idle, so a probe of a few RTTs reads low, and a low estimate would size
  the next probe small again: the estimate would settle low without this).
  During warm-up the estimate is the highest trusted probe sample, not their average: hosts
  started together warm up together, and probes through a shared bottleneck each measure a
  fraction of it (cross traffic only lowers a sample). The daemon also starts each bulk probe
  after a random delay, so steady-state probes of different hosts rarely meet.
  Settle: after warm-up the gap between probes grows by link_settle_growth per probe, from
  2 * link_min_probe_gap up to T. Hosts of a site that warmed up together may have met on every
  warm-up probe; as all of them thin out, overlaps get rare, and the first clean probe sets the
  capacity. While settling the capacity only rises (low probes are not re-checked). This costs
  a one-time log2(T / gap) probes, nothing at steady state.
  Afterwards a probe is due when the estimate is older than T (data-plane samples refresh it, so a
  busy link is rarely probed); after k re-checks the next period is (1 + k) * T, so the budget
  holds with re-checks too.
- After warm-up a probe is at least as big as the smallest one that read the capacity (smaller
  ones read low: TCP restarts slow start after idle), and twice the previous one while that
  raised the capacity (the plateau search goes on, since warm-up probes may all have met cross
  traffic), at most link_probe_growth_max times S below; T follows from the size, so the budget
  holds whatever the size.
- Probe size and period, with C the capacity, B the throughput EWMA (what a probe is expected to
  get, so T is right when probes meet traffic) and R the base RTT:
      S = clamp(C * max(link_probe_seconds, link_probe_rtts * R), link_probe_min_bytes, link_probe_max_bytes)
      P = ping_bytes / (B * link_rtt_interval)          (the share RTT pings take, at most budget/2)
      T = max(link_bw_interval, (S / B) / (link_probe_budget - P))
  A probe occupies the link for S/B seconds once per T seconds, so the steady-state cost of probes
  and pings together is (S/B)/T + P <= link_probe_budget (default 0.2 %), whatever B and R are
  (P is about 5e-6 at 10 Mbit/s). Where the budget cannot hold even then (below ~1 kbit/s) the
  link is useless for training anyway.
- Change: a data-plane sample that deviates from the estimate by more than link_change_fraction
  (for RTT also by more than link_rtt_change_floor) makes a probe of that kind due at once, but no
  sooner than link_min_probe_gap after the previous one. If that probe deviates the same way, the
  estimate restarts from it (a level shift) instead of crawling there at rate a. The change is
  real only if the probe also deviates that way from the last probe no change ran across;
  otherwise the alarm was false (a busy CPU makes small transfers on a fast link read slow) and
  the n-th false alarm in a row silences data-plane alarms for link_min_probe_gap *
  link_settle_growth^n, at most the kind's period (bw_period, or link_rtt_interval). So a busy
  host's probing stays near its budget (it was ~10 % of a 1 Gbit link's time), a real change
  waits at most one period, and a real change ends the silence.
- A failed probe backs off exponentially from link_min_probe_gap up to link_retry_max. A probe the
  daemon never reports on expires at its deadline and counts as failed. Liveness is not decided
  here: the failure detector owns it, and the daemon removes dead peers.

The matrix and gossip
- LinkMatrix holds (measurer, target) -> entry for the whole swarm. Entries cross hosts with their
  age relative to the sender's now (`age_s`), never as timestamps, so clock skew does not matter;
  the receiver turns an age into its own clock as `now - age_s`. The newer entry wins. This node's
  own rows come only from its LinkTable, never from gossip. Entries older than link_forget_after
  are dropped; at most link_max_entries are kept (the oldest go first).
- The dict form of one entry uses the field names of peer.proto's LinkEntry (and control.proto's
  LinkMeasurement): measurer, target, capacity_bytes_s, capacity_age_s (age of the sample that
  sets the capacity), throughput_bytes_s, throughput_spread_bytes_s, rtt_s, rtt_spread_s,
  samples, age_s. Zero means "not measured". `bandwidth()` (and so expected_times) is the
  capacity; the throughput where no sample was trusted.
"""
from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from peerd.config import Config

RTT, BW = "rtt", "bw"
MAX_ID_LEN = 128
MAX_BANDWIDTH = 1e13          # bytes/s (80 Tbit/s): anything above is garbage
MAX_RTT = 600.0               # seconds
MAX_SAMPLES = 2**32 - 1
MAX_RTT_LOWS = 256            # RTT samples kept for the windowed least RTT


# ---- estimates ----------------------------------------------------------------------------------

@dataclass
class Ewma:
    """Exponentially weighted mean and variance; the first sample sets the mean."""
    mean: float = 0.0
    var: float = 0.0
    n: int = 0

    def add(self, x: float, alpha: float) -> None:
        if self.n == 0:
            self.mean, self.var = x, 0.0
        else:
            d = x - self.mean
            self.mean += alpha * d
            self.var = (1 - alpha) * (self.var + alpha * d * d)
        self.n += 1

    def restart(self, x: float) -> None:
        """A level shift: forget the old level, keep counting samples."""
        self.mean, self.var = x, 0.0
        self.n += 1

    @property
    def spread(self) -> float:
        return math.sqrt(max(self.var, 0.0))


@dataclass(frozen=True)
class Sample:
    at: float                 # this host's clock
    rate: float               # bytes/s
    nbytes: int


@dataclass
class LinkEstimate:
    """This node's estimate of its link to one peer."""
    rtt: Ewma = field(default_factory=Ewma)          # seconds
    bw: Ewma = field(default_factory=Ewma)           # bytes/s, this node -> peer: recent throughput
    # Trusted bandwidth samples as a monotonic queue: rates strictly fall from front to back, so
    # the front is the highest sample of the window and the back the newest sample.
    peaks: collections.deque[Sample] = field(default_factory=collections.deque)
    rtt_at: float | None = None                      # time of the last RTT sample
    bw_at: float | None = None                       # time of the last bandwidth sample
    # RTT samples as a monotonic queue (rising from front to back): the front is the least RTT of
    # the window, the path without queues. Not just the newest sample once the old least expires:
    # one queued sample taken as the base RTT would make the next transfer read fast (and the
    # capacity, a maximum, would keep that).
    rtt_lows: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)

    @property
    def base_rtt(self) -> float:
        """The RTT without queueing, for sizing probes and taking the RTT off transfer times."""
        return self.rtt_lows[0][1] if self.rtt_lows else 0.0

    def add_rtt_low(self, at: float, rtt: float, window: float) -> None:
        lows = self.rtt_lows
        while lows and lows[-1][1] >= rtt:
            lows.pop()
        lows.append((at, rtt))
        while len(lows) > 1 and lows[0][0] < at - window:
            lows.popleft()
        if len(lows) > MAX_RTT_LOWS:
            del lows[1]                              # keep the least; lose some resolution after it

    @property
    def capacity(self) -> float:
        """Bytes/s the path carries: the highest trusted sample within link_capacity_window (cross
        traffic only lowers a sample). The throughput EWMA while no sample is trusted; 0: unknown."""
        if self.peaks:
            return self.peaks[0].rate
        return self.bw.mean if self.bw.n else 0.0

    @property
    def capacity_at(self) -> float | None:
        """When the sample that sets the capacity was taken (None: no trusted sample)."""
        return self.peaks[0].at if self.peaks else None

    def add_peak(self, s: Sample, window: float, most: int) -> None:
        while self.peaks and self.peaks[-1].rate <= s.rate:
            self.peaks.pop()                         # never the max again while s is in the window
        self.peaks.append(s)
        while len(self.peaks) > 1 and self.peaks[0].at < s.at - window:
            self.peaks.popleft()
        if len(self.peaks) > most:
            # Lose resolution after the highest, never the highest itself: a stream of falling
            # data-plane samples (a busy host's small transfers) would otherwise push a probe's
            # reading out long before the window ends.
            del self.peaks[1]

    @property
    def samples(self) -> int:
        return self.rtt.n + self.bw.n

    @property
    def updated_at(self) -> float | None:
        times = [t for t in (self.rtt_at, self.bw_at) if t is not None]
        return max(times) if times else None

    def age(self, now: float) -> float | None:
        t = self.updated_at
        return None if t is None else max(0.0, now - t)


@dataclass(frozen=True)
class Probe:
    """A probe the daemon should run now: a ping (`rtt`) or a timed bulk transfer (`bw`)."""
    peer: str
    kind: str                  # RTT or BW
    size_bytes: int            # payload to send
    deadline_s: float          # give up after this long (report it with probe_failed)


@dataclass
class _Schedule:
    started: float | None = None      # a probe in flight since
    deadline: float = 0.0
    last_start: float = -math.inf
    failures: int = 0
    retry_at: float = -math.inf
    change_at: float | None = None    # a data-plane sample disagreed with the estimate at
    change_sign: int = 0
    false_alarms: int = 0             # change probes in a row that found no change
    alarm_quiet_until: float = -math.inf   # data-plane deviations trigger no probe before this
    probe_level: float | None = None  # the last probe's reading that no change seen ran across
    short: bool = False               # the estimate rests only on too-short bandwidth samples
    last_bytes: int = 0               # size of the last bandwidth sample
    flat: int = 0                     # warm-up: trusted probes in a row that did not raise the estimate
    full_bytes: int = 0               # smallest probe that read the capacity (within link_warmup_gain)
    rising: bool = False              # the last trusted probe raised the capacity by more than link_warmup_gain
    settled: int = 0                  # trusted probes since warm-up (their gap grows with this)
    dips: list[Sample] = field(default_factory=list)   # probes in a row that read below the capacity
    debt: int = 0                     # re-check probes the next period must pay for (the budget holds)


def _moved(ref: float, x: float, sign: int, fraction: float, floor: float) -> bool:
    """x lies off ref by more than max(fraction * ref, floor), in direction `sign` (+1 up, -1 down)."""
    d = x - ref
    return abs(d) > max(fraction * ref, floor) and (d > 0) - (d < 0) == sign


class LinkTable:
    """This node's own link measurements, and the decision when to measure again."""

    def __init__(self, self_id: str, cfg: Config | None = None) -> None:
        self.self_id = self_id
        self.cfg = cfg or Config()
        self.links: dict[str, LinkEstimate] = {}
        self._sched: dict[tuple[str, str], _Schedule] = {}

    # -- peers --

    def add_peer(self, peer: str) -> None:
        """Measure this peer from now on (idempotent). Bounded by cfg.membership.max_peers."""
        if peer == self.self_id or peer in self.links:
            return
        if len(self.links) >= self.cfg.membership.max_peers:
            raise ValueError(f"link table full: max_peers={self.cfg.membership.max_peers}")
        self.links[peer] = LinkEstimate()
        for kind in (RTT, BW):
            self._sched[(peer, kind)] = _Schedule()

    def remove_peer(self, peer: str) -> None:
        self.links.pop(peer, None)
        for kind in (RTT, BW):
            self._sched.pop((peer, kind), None)

    @property
    def peers(self) -> list[str]:
        return list(self.links)

    def estimate(self, peer: str) -> LinkEstimate | None:
        return self.links.get(peer)

    # -- observations --

    def observe_rtt(self, peer: str, seconds: float, now: float, probe: bool = True) -> bool:
        """One round-trip time; `probe=False` for RTTs seen on other traffic. False if unusable."""
        est = self.links.get(peer)
        if est is None:
            return False
        if not 0 < seconds <= MAX_RTT:
            if probe:
                self.probe_failed(peer, RTT, now)
            return False
        sched = self._sched[(peer, RTT)]
        floor = self.cfg.links.rtt_change_floor
        self._fold(est.rtt, seconds, sched, probe, now, floor, self.cfg.links.rtt_interval)
        est.rtt_at = now
        est.add_rtt_low(now, seconds, self.cfg.links.rtt_min_window)
        return True

    def observe_transfer(self, peer: str, nbytes: int, seconds: float, now: float, probe: bool = False) -> bool:
        """A timed transfer to `peer` (first byte sent .. acknowledged). False if not used as a sample."""
        est = self.links.get(peer)
        if est is None or (not probe and nbytes < self.cfg.links.min_transfer_bytes):
            return False
        rtt = est.base_rtt
        ok = nbytes > 0 and 0 < seconds < math.inf
        busy = max(seconds - rtt, seconds / 2) if ok else 0.0
        rate = nbytes / busy if ok else 0.0
        if not 0 < rate <= MAX_BANDWIDTH:
            if probe:
                self.probe_failed(peer, BW, now)
            return False
        if not probe and busy < self.cfg.links.min_transfer_seconds:
            return False                              # latency-dominated: says little about bandwidth
        sched = self._sched[(peer, BW)]
        warming = self._warming(est, sched)
        # Too short to trust: RTT-dominated (the floor above applied), or under half a probe's time
        # when a bigger probe was allowed (the first probe, small traffic: bursts and buffers rule).
        short = seconds - rtt < seconds / 2 or (
            busy < self.cfg.links.probe_seconds / 2 and nbytes < self.cfg.links.probe_max_bytes)
        if sched.short and (not short or rate > est.bw.mean):
            # The estimate so far rests on too-short samples: a trustworthy one replaces it, and so
            # does a bigger short one (an RTT-floored rate is a lower bound that grows with size).
            est.bw.restart(rate)
            self._settle(sched, probe)
        elif probe and not short and warming:
            # Warm-up keeps the highest trusted probe: hosts started together warm up together, and
            # probes through a shared bottleneck (a site uplink) each get a fraction of it; cross
            # traffic only ever lowers a trusted sample.
            rising = rate > est.bw.mean * (1 + self.cfg.links.warmup_gain)
            sched.flat = 0 if rising else sched.flat + 1
            if rate > est.bw.mean:
                est.bw.restart(rate)
            else:
                est.bw.n += 1
            self._settle(sched, probe)
        else:
            self._fold(est.bw, rate, sched, probe, now, 0.0, self.bw_period(peer))
        after = probe and not warming
        # Only a steady-state probe may lower the capacity: while probes settle, those of hosts that
        # started together still meet often (in both directions: a full uplink also delays ACKs).
        steady = after and self._settle_gap(sched.settled) >= self.bw_period(peer)
        if after:
            sched.settled += 1
        if not short:
            self._capacity_sample(est, sched, Sample(now, rate, nbytes), probe, after, steady)
        sched.short = short and est.bw.n == 1 or (sched.short and short)
        sched.last_bytes = nbytes
        est.bw_at = now
        return True

    def _recheck_gap(self, peer: str, k: int) -> float:
        """Before the k-th re-check of a low probe: a fraction of the period, growing, so re-checks
        sample conditions apart in time (a busy CPU or a neighbour's transfer lasts seconds)."""
        cfg = self.cfg
        frac = cfg.links.capacity_recheck * cfg.links.settle_growth ** (k - 1)
        return max(cfg.links.min_probe_gap, frac * self.bw_period(peer))

    def _settle_gap(self, settled: int) -> float:
        cfg = self.cfg
        return cfg.links.min_probe_gap * cfg.links.settle_growth ** min(settled + 1, 64)

    def _capacity_sample(self, est: LinkEstimate, sched: _Schedule, s: Sample, probe: bool, after: bool,
                         steady: bool) -> None:
        """Fold a trusted sample into the capacity. A steady-state probe that reads well below it is
        re-checked; only when link_capacity_confirm re-checks in a row read low too (a real drop, not
        a probe that met cross traffic) does the capacity fall, to the best of them."""
        cfg = self.cfg
        prev, gain = (est.capacity if est.peaks else 0.0), cfg.links.warmup_gain
        higher = s.rate > prev * (1 + gain)
        # The plateau search (a new level -> the next probe twice as big) runs while warming up and
        # settling; in steady state a higher reading is noise or a faster link, and probes of the
        # size that read the capacity keep reading it: sizes then never grow (nor does T).
        if probe and higher and not steady:
            sched.full_bytes = s.nbytes
        elif probe and s.rate >= prev * (1 - gain):
            sched.full_bytes = min(sched.full_bytes or s.nbytes, s.nbytes)
        if after:
            sched.rising = higher and not steady
        if steady:
            if est.peaks and s.rate < est.capacity * (1 - cfg.links.capacity_dip):
                sched.dips.append(s)
                if len(sched.dips) > cfg.links.capacity_confirm:
                    est.peaks.clear()
                    for d in sched.dips:
                        est.add_peak(d, cfg.links.capacity_window, cfg.links.capacity_samples)
                    sched.debt, sched.dips = len(sched.dips) - 1, []
                    sched.full_bytes = est.peaks[0].nbytes
                    return
            else:
                sched.debt = len(sched.dips) if sched.dips else 0
                sched.dips.clear()
        est.add_peak(s, cfg.links.capacity_window, cfg.links.capacity_samples)

    def _warming(self, est: LinkEstimate, sched: _Schedule) -> bool:
        """Warm-up: too few samples, or the estimate still rises with bigger probes (TCP ramp-up
        after idle makes a probe of a few RTTs read low, and a low estimate sizes small probes)."""
        cfg = self.cfg
        return est.bw.n < cfg.links.warmup_samples or (
            sched.flat < cfg.links.warmup_flat and sched.last_bytes < cfg.links.probe_max_bytes)

    def _settle(self, sched: _Schedule, probe: bool) -> None:
        if probe:
            sched.started = None
            sched.failures = 0
            sched.retry_at = -math.inf
            sched.change_at = None

    def _fold(self, ewma: Ewma, x: float, sched: _Schedule, probe: bool, now: float, floor: float,
              holdoff_max: float) -> None:
        """Fold a sample into `ewma`. A data-plane sample off the estimate asks for an early probe,
        unless recent ones were false alarms (then not before alarm_quiet_until: link_min_probe_gap
        x link_settle_growth^n after the n-th in a row, at most `holdoff_max`, the kind's own period)."""
        a = self.cfg.links.ewma_alpha
        if probe:
            # Only a probe started after the change was seen answers it; one already in flight ran
            # partly before the change (or beside the transfer that showed it).
            seen = sched.change_at
            fresh = seen is not None and sched.started is not None and sched.started >= seen
            # The estimate can sit between a probe level and a data-plane level that differ for
            # good (a busy host's small transfers on a fast link read slow): following the alarm's
            # direction from there, a probe "confirms" every other alarm. So the estimate restarts
            # when the probe is off it (or off the last clean probe) in the alarm's direction, but
            # only a move off the last clean probe counts as a real change; any other alarm was
            # false, and the next ones wait longer.
            frac, sign = self.cfg.links.change_fraction, sched.change_sign
            off = ewma.n > 0 and _moved(ewma.mean, x, sign, frac, floor)
            ref = sched.probe_level
            real = off if ref is None else _moved(ref, x, sign, frac, floor)
            if fresh and (off or real):
                ewma.restart(x)
            else:
                ewma.add(x, a)
            if fresh and real:
                sched.false_alarms = 0
            elif fresh:
                sched.false_alarms += 1
                holdoff = self.cfg.links.min_probe_gap * self.cfg.links.settle_growth ** min(sched.false_alarms, 64)
                sched.alarm_quiet_until = now + min(holdoff, holdoff_max)
            self._settle(sched, probe)
            if seen is not None and not fresh:
                sched.change_at = seen               # still due: the next probe answers it
            else:
                sched.probe_level = x                # ran wholly before or after any change seen
            return
        dev = x - ewma.mean
        off = ewma.n > 0 and abs(dev) > max(self.cfg.links.change_fraction * ewma.mean, floor)
        ewma.add(x, a)
        if off and sched.change_at is None and now >= sched.alarm_quiet_until:
            sched.change_at, sched.change_sign = now, (dev > 0) - (dev < 0)

    def probe_failed(self, peer: str, kind: str, now: float) -> None:
        """The probe errored or hit its deadline (peer down, stream reset): back off."""
        sched = self._sched.get((peer, kind))
        if sched is None:
            return
        sched.started = None
        sched.failures += 1
        backoff = self.cfg.links.min_probe_gap * 2 ** min(sched.failures, 30)
        sched.retry_at = now + min(self.cfg.links.retry_max, backoff)

    # -- scheduling --

    def probe_size(self, peer: str) -> int:
        """S = clamp(B * max(probe_seconds, probe_rtts * R), min_bytes, max_bytes)."""
        cfg = self.cfg
        est = self.links[peer]
        if est.bw.n == 0 or est.bw.mean <= 0:
            return cfg.links.probe_min_bytes
        duration = max(cfg.links.probe_seconds, cfg.links.probe_rtts * est.base_rtt)
        base = est.capacity * duration
        sched = self._sched[(peer, BW)]
        if not sched.short and sched.last_bytes and self._warming(est, sched):
            size = max(base, 2 * sched.last_bytes)    # warm-up: does a twice bigger probe read faster?
        else:
            # At least as big as the probe that read the capacity (smaller ones read low: TCP
            # restarts slow start after idle), and twice the last while that raised the capacity: the
            # plateau search goes on after warm-up, whose probes may all have met cross traffic.
            size = max(base, sched.full_bytes, 2 * sched.last_bytes if sched.rising else 0)
            size = min(size, cfg.links.probe_growth_max * base)
        return int(min(cfg.links.probe_max_bytes, max(cfg.links.probe_min_bytes, size)))

    def bw_period(self, peer: str) -> float:
        """T = max(link_bw_interval, (S / B) / (budget - pings)): the steady-state probe period.

        `pings` = ping_bytes / (B * link_rtt_interval) is the share RTT pings take, so pings and
        bandwidth probes together stay within link_probe_budget (pings get at most half of it).
        """
        cfg = self.cfg
        est = self.links[peer]
        if est.bw.n == 0 or est.bw.mean <= 0:
            return cfg.links.bw_interval
        pings = min(cfg.links.probe_budget / 2, cfg.links.ping_bytes / (est.bw.mean * cfg.links.rtt_interval))
        busy = self.probe_size(peer) / est.bw.mean
        return max(cfg.links.bw_interval, busy / (cfg.links.probe_budget - pings))

    def phase(self, peer: str) -> str:
        """Where the bandwidth probing of `peer` stands: "warm-up" (back-to-back growing probes),
        "settling" (gaps growing towards the steady period; each probe still spends link time every
        few to tens of seconds) or "steady": the next probe at least bw_period / link_settle_growth
        away, so probes cost at most that factor more than at steady state (waiting out the last
        doublings, 128-256 s gaps, took the lab's 1 Gbit links past 7 minutes). Re-checks of a low
        probe belong to steady: they keep the budget, and on a busy shared link they never stop for
        long. A benchmark waits for "steady" on every link: settle probes of 25 MB on a 1 Gbit link
        doubled the bytes a scenario's first contender sent per step."""
        est, sched = self.links[peer], self._sched[(peer, BW)]
        if est.bw_at is None or self._warming(est, sched) or (
                sched.short and sched.last_bytes < self.cfg.links.probe_max_bytes):
            return "warm-up"
        settled = self._settle_gap(sched.settled) * self.cfg.links.settle_growth >= self.bw_period(peer)
        return "steady" if settled else "settling"

    def _due_at(self, peer: str, kind: str) -> float:
        cfg = self.cfg
        est = self.links[peer]
        sched = self._sched[(peer, kind)]
        soonest = max(sched.retry_at, sched.last_start + cfg.links.min_probe_gap)
        if kind == RTT:
            due = -math.inf if est.rtt_at is None else est.rtt_at + cfg.links.rtt_interval
        elif est.bw_at is None:
            due = -math.inf
        elif self._warming(est, sched) or (sched.short and sched.last_bytes < cfg.links.probe_max_bytes):
            due = est.bw_at + cfg.links.min_probe_gap         # warm-up: grow until a sample is trusted
        elif sched.dips:                                     # re-check a low probe, later each time
            due = est.bw_at + self._recheck_gap(peer, len(sched.dips))
        else:                                                # settle: gaps grow to the steady period
            due = est.bw_at + min(self._settle_gap(sched.settled), self.bw_period(peer) * (1 + sched.debt))
        if sched.change_at is not None:
            due = min(due, sched.change_at)
        return max(due, soonest)

    def next_due(self, now: float) -> float | None:
        """When due_probes may next return something (for the daemon's timer); None: no peers."""
        times = [self._due_at(p, k) for p in self.links for k in (RTT, BW)
                 if self._sched[(p, k)].started is None]
        inflight = [s.deadline for s in self._sched.values() if s.started is not None]
        return min(times + inflight, default=None)

    def due_probes(self, now: float) -> list[Probe]:
        """Probes to start now; each is marked in flight until observed, failed or past its deadline."""
        out: list[Probe] = []
        for peer in self.links:
            for kind in (RTT, BW):
                sched = self._sched[(peer, kind)]
                if sched.started is not None:
                    if now < sched.deadline:
                        continue
                    self.probe_failed(peer, kind, now)      # never reported: count it as failed
                if now < self._due_at(peer, kind):
                    continue
                size = self.cfg.links.ping_bytes if kind == RTT else self.probe_size(peer)
                deadline = self._deadline(peer, kind, size)
                sched.started, sched.last_start, sched.deadline = now, now, now + deadline
                out.append(Probe(peer, kind, size, deadline))
        return out

    def _deadline(self, peer: str, kind: str, size: int) -> float:
        est = self.links[peer]
        expected = est.rtt.mean if est.rtt.n else 0.0
        if kind == BW and est.bw.n and est.bw.mean > 0:
            expected += size / est.bw.mean
        return max(self.cfg.links.probe_timeout_min, 4 * expected)


# ---- the swarm's matrix -----------------------------------------------------------------------

@dataclass
class MatrixEntry:
    capacity_bytes_s: float       # measurer -> target: highest recent trusted sample; 0 when not measured
    throughput_bytes_s: float     # EWMA of all bandwidth samples (probes and data-plane transfers)
    throughput_spread_bytes_s: float
    rtt_s: float                  # 0 when not measured
    rtt_spread_s: float
    samples: int
    updated_at: float             # this host's clock
    capacity_at: float            # this host's clock: when the capacity's sample was taken
    changed_at: float = -math.inf  # this host's clock: when its figures last moved enough to be news
    basis: tuple[float, float, float] = (0.0, 0.0, 0.0)   # (capacity, throughput, RTT) at changed_at

    @property
    def figures(self) -> tuple[float, float, float]:
        return (self.capacity_bytes_s, self.throughput_bytes_s, self.rtt_s)

    def moved_from(self, basis: tuple[float, float, float], fraction: float, rtt_floor: float) -> bool:
        """Whether capacity, throughput or RTT differ from `basis` by more than `fraction` (the RTT
        also by more than `rtt_floor` seconds): news worth a delta heartbeat."""
        def far(a: float, b: float, floor: float = 0.0) -> bool:
            return abs(a - b) > max(fraction * max(a, b), floor)
        (c, b, r), (c0, b0, r0) = self.figures, basis
        return far(c, c0) or far(b, b0) or far(r, r0, rtt_floor)

    def to_dict(self, measurer: str, target: str, now: float) -> dict[str, Any]:
        return {"measurer": measurer, "target": target, "capacity_bytes_s": self.capacity_bytes_s,
                "capacity_age_s": max(0.0, now - self.capacity_at),
                "throughput_bytes_s": self.throughput_bytes_s,
                "throughput_spread_bytes_s": self.throughput_spread_bytes_s, "rtt_s": self.rtt_s,
                "rtt_spread_s": self.rtt_spread_s, "samples": self.samples,
                "age_s": max(0.0, now - self.updated_at)}


class BadEntry(ValueError):
    """A gossiped link entry that is not accepted; the message names the field."""


def _num(d: Mapping[str, Any], key: str, hi: float) -> float:
    v = d.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= hi:
        raise BadEntry(f"{key}={v!r} is not a number in [0, {hi:g}]")
    return float(v)


def _node(d: Mapping[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_LEN or not v.isprintable():
        raise BadEntry(f"{key}={str(v)[:40]!r} is not a node id")
    return v


class LinkMatrix:
    """The whole swarm's link estimates, merged from this node's table and peers' gossip."""

    def __init__(self, self_id: str, cfg: Config | None = None) -> None:
        self.self_id = self_id
        self.cfg = cfg or Config()
        self.entries: dict[tuple[str, str], MatrixEntry] = {}

    def absorb(self, table: LinkTable) -> None:
        """Copy this node's own estimates in (they are authoritative for its rows)."""
        for (m, t) in [k for k in self.entries if k[0] == self.self_id and k[1] not in table.links]:
            del self.entries[(m, t)]
        for peer, est in table.links.items():
            at = est.updated_at
            if at is None:
                continue
            self._put((self.self_id, peer), MatrixEntry(
                est.capacity, est.bw.mean if est.bw.n else 0.0, est.bw.spread,
                est.rtt.mean if est.rtt.n else 0.0, est.rtt.spread, min(est.samples, MAX_SAMPLES), at,
                est.capacity_at if est.capacity_at is not None else at), at)
        self._bound()

    def _put(self, key: tuple[str, str], entry: MatrixEntry, now: float) -> None:
        """Store an entry. It is news (changed_at = now) only if its figures moved from those it last
        made news with: a slow drift becomes news once it adds up, jitter never does."""
        old = self.entries.get(key)
        cfg = self.cfg
        if old is None or entry.moved_from(old.basis, cfg.links.gossip_change, cfg.links.rtt_change_floor):
            entry.changed_at, entry.basis = now, entry.figures
        else:
            entry.changed_at, entry.basis = old.changed_at, old.basis
        self.entries[key] = entry

    def merge(self, entries: Iterable[Mapping[str, Any]], now: float) -> tuple[int, list[str]]:
        """Fold gossiped entries in; newer wins. Returns (entries taken, reasons for those refused)."""
        taken, refused = 0, []
        for i, d in enumerate(entries):
            if i >= self.cfg.links.max_entries:
                refused.append(f"more than link_max_entries={self.cfg.links.max_entries} entries")
                break
            try:
                if not isinstance(d, Mapping):
                    raise BadEntry(f"entry is a {type(d).__name__}, not a mapping")
                m, t = _node(d, "measurer"), _node(d, "target")
                if m == t:
                    raise BadEntry(f"measurer and target are both {m!r}")
                age = _num(d, "age_s", math.inf)
                samples = d.get("samples", 0)
                if isinstance(samples, bool) or not isinstance(samples, int) or not 0 <= samples <= MAX_SAMPLES:
                    raise BadEntry(f"samples={samples!r} is not a count")
                entry = MatrixEntry(_num(d, "capacity_bytes_s", MAX_BANDWIDTH),
                                    _num(d, "throughput_bytes_s", MAX_BANDWIDTH),
                                    _num(d, "throughput_spread_bytes_s", MAX_BANDWIDTH),
                                    _num(d, "rtt_s", MAX_RTT), _num(d, "rtt_spread_s", MAX_RTT),
                                    samples, now - age, now - _num(d, "capacity_age_s", math.inf))
            except BadEntry as e:
                refused.append(str(e))
                continue
            if m == self.self_id or age > self.cfg.links.forget_after:
                continue                                   # ours come from our table; stale ones die
            old = self.entries.get((m, t))
            if old is None or entry.updated_at > old.updated_at:
                self._put((m, t), entry, now)
                taken += 1
        self._bound()
        return taken, refused

    def expire(self, now: float) -> None:
        """Drop entries nobody refreshed for link_forget_after seconds."""
        limit = now - self.cfg.links.forget_after
        for k in [k for k, e in self.entries.items() if e.updated_at < limit]:
            del self.entries[k]

    def remove_node(self, node: str) -> None:
        """Forget a node's rows and column (the daemon forgot the node)."""
        for k in [k for k in self.entries if node in k]:
            del self.entries[k]

    def _bound(self) -> None:
        excess = len(self.entries) - self.cfg.links.max_entries
        if excess > 0:
            oldest = sorted((e.updated_at, k) for k, e in self.entries.items() if k[0] != self.self_id)
            for _, k in oldest[:excess]:
                del self.entries[k]

    def get(self, measurer: str, target: str) -> MatrixEntry | None:
        return self.entries.get((measurer, target))

    def bandwidth(self, a: str, b: str, symmetric: bool = True) -> float | None:
        """Capacity a -> b in bytes/s (the throughput EWMA where no capacity is known); with
        `symmetric`, b's measurement towards a as a fallback."""
        for key in ((a, b), (b, a)) if symmetric else ((a, b),):
            e = self.entries.get(key)
            if e is not None and (e.capacity_bytes_s > 0 or e.throughput_bytes_s > 0):
                return e.capacity_bytes_s or e.throughput_bytes_s
        return None

    def rtt(self, a: str, b: str) -> float | None:
        """Round-trip time between a and b as measured by either (the fresher one)."""
        found = [e for e in (self.entries.get((a, b)), self.entries.get((b, a))) if e and e.rtt_s > 0]
        return max(found, key=lambda e: e.updated_at).rtt_s if found else None

    def expected_times(self, nodes: list[str], nbytes: int, unknown: float = math.inf) -> list[list[float]]:
        """times[i][j]: seconds until nodes[j]'s `nbytes` arrive at nodes[i] (half an RTT plus
        nbytes over the bandwidth j -> i; i's own measurement towards j when j's is missing). The
        shape peerd.sync's LinkEstimates takes. `unknown` where neither side measured; 0 on the
        diagonal."""
        out = []
        for i, dst in enumerate(nodes):
            row = []
            for j, src in enumerate(nodes):
                if i == j:
                    row.append(0.0)
                    continue
                bw = self.bandwidth(src, dst)
                rtt = self.rtt(src, dst) or 0.0
                row.append(unknown if bw is None else rtt / 2 + nbytes / bw)
            out.append(row)
        return out

    def pull_times(self, nodes: list[str], nbytes: int, compute: float) -> list[list[float]] | None:
        """times[i][j]: nodes[i]'s iteration time when it pulls nodes[j]'s `nbytes` while it
        computes for `compute` seconds, max(compute, RTT + nbytes over the bandwidth j -> i): the
        matrix NetMax's LinkEstimates carry (the request goes out, the parameters come back).
        Pairs nobody measured (a peer not probed yet, a vacant rank) get the slowest measured
        time, so they are never favoured; None when no pair is measured. 0 on the diagonal."""
        n = len(nodes)
        out = [[0.0] * n for _ in range(n)]
        missing = []
        for i, dst in enumerate(nodes):
            for j, src in enumerate(nodes):
                if i == j:
                    continue
                bw = self.bandwidth(src, dst) if src and dst else None
                if bw is None:
                    missing.append((i, j))
                    continue
                out[i][j] = max(compute, (self.rtt(src, dst) or 0.0) + nbytes / bw)
        gaps = set(missing)
        known = [out[i][j] for i in range(n) for j in range(n) if i != j and (i, j) not in gaps]
        if not known:
            return None
        worst = max(known)
        for i, j in missing:
            out[i][j] = worst
        return out

    def to_entries(self, now: float, limit: int | None = None,
                   newer_than: float | None = None) -> list[dict[str, Any]]:
        """Entries in gossip form (LinkEntry fields, ages relative to `now`), own rows first, then
        the freshest. `limit` caps how many (gossip budget); `newer_than` (this host's clock) keeps
        only entries that became news after it (figures moved by more than link_gossip_change),
        for delta gossip: send each peer what changed since the last heartbeat to it, and
        everything every link_gossip_full_interval. Every heartbeat refreshes RTTs, so gossiping
        each refreshed entry would send the whole matrix, N^2 entries of ~115 bytes, to every peer
        every heartbeat and back in its reply: 6 hosts -> ~50 kB/s per host, 4 % of a 10 Mbit
        link, growing as N^3 over the swarm."""
        keys = [k for k, e in self.entries.items() if newer_than is None or e.changed_at > newer_than]
        keys.sort(key=lambda k: (k[0] != self.self_id, -self.entries[k].updated_at))
        if limit is not None:
            keys = keys[:limit]
        return [self.entries[k].to_dict(*k, now) for k in keys]

    def to_dict(self, now: float) -> dict[str, Any]:
        """The whole matrix as the Links control reply carries it: {"node_id", "links": [...]}."""
        return {"node_id": self.self_id, "links": self.to_entries(now)}


# ---- `peerd links` rendering ---------------------------------------------------------------------

def _label(ids: list[str]) -> dict[str, str]:
    short = {n: n if len(n) <= 12 else n[:11] + "~" for n in ids}
    if len(set(short.values())) == len(ids):
        return short
    return {n: f"n{i}" for i, n in enumerate(ids)}


def render_links(matrix: Mapping[str, Any], fmt: str = "text") -> str:
    """Render {"node_id", "links": [LinkEntry-like dicts]} as tables or JSON.

    JSON rows: measurer, target, capacity_mbit_s (highest recent trusted sample: what the path
    carries), capacity_age_s (age of that sample), throughput_mbit_s and throughput_mbit_s_spread
    (EWMA of all samples and its spread: what transfers got lately, cross traffic included),
    rtt_ms, rtt_ms_spread, samples, age_s (since the measurer last updated the entry), probe_phase
    (the answering daemon's own links: warm-up, settling or steady; "" otherwise). Mbit/s are
    10^6 bits per second of payload. Missing fields count as 0 (protobuf's MessageToDict omits
    zeros). Rows measure towards columns.
    """
    me = str(matrix.get("node_id", ""))
    rows = []
    for d in matrix.get("links", []) or []:
        get = lambda k: float(d.get(k, 0) or 0)  # noqa: E731
        rows.append({"measurer": str(d.get("measurer", "")), "target": str(d.get("target", "")),
                     "capacity_mbit_s": get("capacity_bytes_s") * 8 / 1e6,
                     "capacity_age_s": get("capacity_age_s"),
                     "throughput_mbit_s": get("throughput_bytes_s") * 8 / 1e6,
                     "throughput_mbit_s_spread": get("throughput_spread_bytes_s") * 8 / 1e6,
                     "rtt_ms": get("rtt_s") * 1e3, "rtt_ms_spread": get("rtt_spread_s") * 1e3,
                     "age_s": get("age_s"), "samples": int(d.get("samples", 0) or 0),
                     "probe_phase": str(d.get("probe_phase", ""))})
    rows.sort(key=lambda r: (r["measurer"], r["target"]))
    if fmt == "json":
        return json.dumps({"node_id": me, "links": rows}, indent=2)
    if fmt != "text":
        raise ValueError(f"fmt {fmt!r}: expected 'text' or 'json'")
    nodes = sorted({r["measurer"] for r in rows} | {r["target"] for r in rows})
    if me in nodes:
        nodes.remove(me)
        nodes.insert(0, me)
    if not rows:
        return f"links seen by {me or '?'}: no link measured yet\n"
    cell = {(r["measurer"], r["target"]): r for r in rows}
    lab = _label(nodes)
    width = max(13, *(len(v) for v in lab.values())) + 2
    out = [f"links seen by {me}: {len(nodes)} nodes, {len(rows)} measured links "
           f"(each row measures towards each column)"]

    def table(title: str, fn) -> None:
        out.append("")
        out.append(title)
        out.append("from \\ to".ljust(width) + "".join(lab[n].rjust(width) for n in nodes))
        for m in nodes:
            line = lab[m].ljust(width)
            for t in nodes:
                r = cell.get((m, t))
                line += ("-" if m == t else "." if r is None else fn(r)).rjust(width)
            out.append(line)

    def pm(x: float, sd: float, digits: int) -> str:
        return "?" if x <= 0 else f"{x:.{digits}f}+-{sd:.{digits}f}"

    table("capacity, Mbit/s (highest recent probe or transfer)",
          lambda r: f"{r['capacity_mbit_s']:.1f}" if r["capacity_mbit_s"] > 0 else "?")
    table("throughput, Mbit/s (recent average +- spread; lower than capacity under cross traffic)",
          lambda r: pm(r["throughput_mbit_s"], r["throughput_mbit_s_spread"], 1))
    table("rtt, ms (average +- spread)", lambda r: pm(r["rtt_ms"], r["rtt_ms_spread"], 2))
    table("age, s (since the measurer last updated it)", lambda r: f"{r['age_s']:.0f}")
    late = sorted(lab[r["target"]] for r in rows if r["measurer"] == me and r["probe_phase"] not in ("", "steady"))
    if late:
        out.append("")
        out.append(f"probing not steady yet (warm-up or settling: extra probes for a few minutes): {', '.join(late)}")
    if any(lab[n] != n for n in nodes):
        out.append("")
        out.extend(f"{lab[n]} = {n}" for n in nodes)
    out.append("")
    out.append(". not measured   ? measured, no sample of that kind yet")
    return "\n".join(out) + "\n"
