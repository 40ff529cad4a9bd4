"""Model inputs from what peerd knows: a lab profile, or the live link matrix (`peerd links --json`).

Pure: callers load the profile or fetch the matrix; these functions only translate.

- Profile: pair rate (bit/s -> bytes/s of TCP payload: a link's rate counts whole Ethernet frames,
  of which TCP carries 1448 of every 1514 bytes, peerd.lab.shaping.GOODPUT_RATIO, 95.6 %, what
  `peerd lab calibrate` measures; unshaped pairs get Config.plan_unshaped_rate), a host's
  access link as two shared capacities (its egress and its ingress), a [[site_links]] rate as one
  shared capacity over every host pair across the two sites (it is an aggregate), one-way delay of
  the site link plus Config.plan_base_latency, sites as given, straggler factors (`slowdown`) on
  the compute mean and spread.
- Link matrix: bandwidth of i -> j as measured by i (else j's measurement of j -> i), latency half
  the RTT; a pair nobody measured gets Config.plan_unshaped_rate and is reported. No shared
  capacities are known there (each pair was probed alone). Sites: hosts joined by links at least
  Config.plan_site_ratio of the fastest one (connected components; ours).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from peerd.config import Config
from peerd.lab.profile import Profile
from peerd.lab.shaping import GOODPUT_RATIO
from peerd.plan.model import Compute, Network, Shared


def network_from_profile(prof: Profile, cfg: Config | None = None) -> Network:
    cfg = cfg or Config()
    names = [h.name for h in prof.hosts]
    n = len(names)
    idx = {h: i for i, h in enumerate(names)}
    bw = np.full((n, n), float(cfg.plan.unshaped_rate))
    lat = np.full((n, n), float(cfg.plan.base_latency))
    payload = GOODPUT_RATIO / 8           # bit/s of frames -> bytes/s of TCP payload
    for (a, b), bps in prof.pair_rates.items():
        bw[idx[a], idx[b]] = bps * payload
    shared = []
    for h in prof.hosts:
        if h.link_bps:
            i = idx[h.name]
            shared.append(Shared(f"{h.name}-out", h.link_bps * payload, frozenset((i, j) for j in range(n) if j != i)))
            shared.append(Shared(f"{h.name}-in", h.link_bps * payload, frozenset((j, i) for j in range(n) if j != i)))
    for (sa, sb), link in prof.site_links.items():
        pairs = frozenset((idx[a.name], idx[b.name]) for a in prof.site_hosts(sa) for b in prof.site_hosts(sb))
        if link.rate_bps:
            shared.append(Shared(f"{sa}->{sb}", link.rate_bps * payload, pairs))
        for p in pairs:
            lat[p] += link.delay_s
    site_idx = {s: k for k, s in enumerate(prof.sites)}
    sites = tuple(site_idx[h.site] for h in prof.hosts)
    return Network(bw, lat, tuple(shared), sites if len(prof.sites) > 1 else None, tuple(names))


def permute(net: Network, order: list[int]) -> Network:
    """The same network with its hosts renumbered: new host r is old host order[r] (e.g. the
    profile's hosts in the ranks a run gave them)."""
    if sorted(order) != list(range(net.n)):
        raise ValueError(f"order: expected a permutation of 0..{net.n - 1}, got {order}")
    if order == list(range(net.n)):
        return net
    new = {old: r for r, old in enumerate(order)}
    ix = np.ix_(order, order)
    shared = tuple(Shared(g.name, g.capacity, frozenset((new[a], new[b]) for a, b in g.pairs)) for g in net.shared)
    return Network(net.bandwidth[ix], net.latency[ix], shared,
                   None if net.sites is None else tuple(net.sites[o] for o in order),
                   tuple(net.names[o] for o in order) if net.names else ())


def compute_from_profile(prof: Profile, mean: float, std: float = 0.0) -> Compute:
    f = np.array([h.slowdown for h in prof.hosts])
    return Compute(mean * f, std * f)


def network_from_links(matrix: Mapping[str, Any], nodes: list[str] | None = None,
                       cfg: Config | None = None) -> tuple[Network, list[str]]:
    """(network, warnings) from {"node_id", "links": [LinkMeasurement dicts]}: the link's capacity
    (bytes/s), or its throughput where no capacity was trusted yet."""
    cfg = cfg or Config()
    ent: dict[tuple[str, str], Mapping[str, Any]] = {}
    seen: set[str] = {str(matrix.get("node_id", ""))} - {""}
    for d in matrix.get("links", []) or []:
        m, t = str(d.get("measurer", "")), str(d.get("target", ""))
        if m and t and m != t:
            ent[(m, t)] = d
            seen |= {m, t}
    nodes = sorted(seen) if nodes is None else list(nodes)
    n = len(nodes)
    bw = np.full((n, n), float(cfg.plan.unshaped_rate))
    lat = np.full((n, n), 0.0)
    missing = []

    def val(key: tuple[str, str], field: str) -> float:
        d = ent.get(key)
        return float(d.get(field, 0) or 0) if d is not None else 0.0

    def rate_of(key: tuple[str, str]) -> float:
        d = ent.get(key)
        return link_rate(d) if d is not None else 0.0

    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            if i == j:
                continue
            rate = rate_of((a, b)) or rate_of((b, a))
            if rate > 0:
                bw[i, j] = rate
            else:
                missing.append(f"{a}->{b}")
            rtts = [x for x in (val((a, b), "rtt_s"), val((b, a), "rtt_s")) if x > 0]
            lat[i, j] = min(rtts) / 2 if rtts else cfg.plan.base_latency
    warnings = [f"no bandwidth measured for {len(missing)} pairs ({', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}); assumed {cfg.plan.unshaped_rate * 8 / 1e6:.0f} Mbit/s"] \
        if missing else []
    return Network(bw, lat, (), infer_sites(bw, cfg.plan.site_ratio), tuple(nodes)), warnings


def link_rate(entry: Mapping[str, Any]) -> float:
    """A link entry's rate (bytes/s): its trusted capacity, else its throughput; 0 when neither."""
    return float(entry.get("capacity_bytes_s", 0) or 0) or float(entry.get("throughput_bytes_s", 0) or 0)


def access_rates(matrix: Mapping[str, Any], nodes: list[str]) -> dict[str, float]:
    """Each node's fastest measured link in either direction (bytes/s: capacity, else throughput),
    the matrix's best guess at its access link; nodes without a measured link are left out."""
    want = set(nodes)
    out: dict[str, float] = {}
    for d in matrix.get("links", []) or []:
        rate = link_rate(d)
        for node in {str(d.get("measurer", "")), str(d.get("target", ""))} & want:
            if rate > out.get(node, 0.0):
                out[node] = rate
    return out


def infer_sites(bw: np.ndarray, ratio: float) -> tuple[int, ...] | None:
    """Connected components of the links at least `ratio` x the fastest; None if only one."""
    n = bw.shape[0]
    if n < 2:
        return None
    off = ~np.eye(n, dtype=bool)
    fast = np.minimum(bw, bw.T) >= ratio * np.minimum(bw, bw.T)[off].max()
    site = [-1] * n
    s = 0
    for i in range(n):
        if site[i] >= 0:
            continue
        stack = [i]
        site[i] = s
        while stack:
            a = stack.pop()
            for b in range(n):
                if a != b and fast[a, b] and site[b] < 0:
                    site[b] = s
                    stack.append(b)
        s += 1
    return tuple(site) if s > 1 else None
