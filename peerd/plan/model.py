"""Runtime model: predicted seconds per iteration of every algorithm and topology peerd offers.

Pure: no I/O, no clock. Inputs are a `Network` (per ordered pair bandwidth in bytes/s and one-way
latency in s, plus capacities several pairs share: a host's access link, a site-to-site link), a
`Compute` (per host mean and spread of the gradient time, straggler factors already applied), the
model size M in bytes and a per-iteration overhead O_i per host (everything that is neither
gradient nor waiting for others: publish, the mix itself, evaluation, bookkeeping; one value for
every host, or one per host). Output: one `Prediction` per (algorithm, topology, overlap).

Definitions
- Iteration time (one definition, the same as `peerd bench scenarios` measures, see
  peerd.bench.scenarios.host_times): each host's wall seconds per iteration in steady state (its
  own iterations, skipped ones included as the trainer's counter counts them), averaged over the
  hosts. Synchronous contenders run every host at one pace, so the mean is that pace; asynchronous
  ones (NetMax, AD-PSGD) run each host at its own, and the mean is what a user sees as the swarm's
  iterations per second per host. Steady state: the benchmark leaves out each host's first 10 %
  of steps and everything after the first host finished (the rest then run a different swarm);
  the max-plus path leaves out its first quarter, the simulator starts in steady state.
- C_i: host i's gradient time, Normal(mean_i, std_i) truncated at 0, drawn per iteration.
- X_{j->i}: time a model takes on link j->i = lat_ji + M / r_ji, r_ji the pair's rate under sharing:
      r_ji = min(bw_ji, min over shared capacities g carrying (j,i) of cap_g / (1 + flows_g - w_ji))
  where flows_g counts the transfers the algorithm has in flight on g at once and w_ji (at most 1)
  is this transfer's own count: while it is in flight it shares g with the others' expected count
  (for synchronous algorithms every transfer of a step is in flight, w = 1: cap_g / flows_g; for
  the asynchronous ones w is the share of time a pull is in flight, see below). An asynchronous
  worker has one pull in flight at a time, so its own other pulls are not among the others: for
  them w_ji is replaced by the worker's whole count on g (a 10 Mbit host pulling two neighbours
  over its own downlink gets all of it). Equal share, not max-min fairness: ours, simple and
  conservative.
  Rates are TCP payload bytes/s: a profile's link rates count whole frames, and
  peerd.plan.sources takes 1448/1514 of them (measured links already are payload).

All-Reduce (the paper's baseline, "From promise to practice" [P4] §4.2 / App. A.5, reconstructed
in research/papers.md 4.2; the ring cost is the textbook one, papers.md 5.4):
- ring over the hosts in rank order (what DDP/gloo does), 2(n-1) steps of M/n bytes each:
      T_ring = 2(n-1) * max_e (lat_e + (M/n) / r_e)          -> 2(n-1)/n * M/B on a uniform network
- hierarchical (sites of k hosts, S sites): reduce-scatter inside each site, k concurrent all-reduce
  rings across the sites on M/k bytes each, all-gather inside each site [P4 §4.2 hierarchical ring]:
      T_hier = 2(k-1) * max_intra (lat + (M/k)/r) + 2(S-1) * max_inter (lat + (M/(kS))/r)
- DDP all-reduces its gradients in buckets, one collective each, one after another: the first
  bucket holds first_bucket_bytes (torch's 1 MiB, so the last layers' gradients go out early), the
  rest bucket_bytes each (25 MiB). Every bucket pays the ring's 2(n-1) latencies, so a model just
  over 1 MiB pays them twice (digits-wide, 1.10 MB: DDP's buckets were measured at 1,093,672 and
  4,992 bytes; ours):
      T_comm = sum over buckets b of T_ring(b)
- iteration, a global barrier every step: T = E[max_i (C_i + O_i)] + exposed, where
      no overlap: exposed = T_comm
      overlap   : exposed = max(T_comm - f_bw * E[max_i C_i], T_ring(last bucket))   [P4 factor 1:
                  DDP overlaps only with the backward pass (share f_bw of compute); the last
                  bucket is always exposed]
  E[max_i C_i] = integral of (1 - prod_i Phi((t - mean_i)/std_i)) dt over t >= 0 (numeric; ours; for
  iid Gaussians it is ~ mean + std*sqrt(2 ln n), the form [P4] quotes).

Synchronous decentralized (D-PSGD on ring / torus / one-peer exp / AER / complete, SGP on the
directed one-peer exponential graph, Hop standard, backup b, staleness s): a max-plus recursion on
publish times P_i(k), evaluated along one seeded sample path of K iterations (ours; [P4] §4.2 writes
the one-step form T = max(E[max_{j in group} C_j], T_comm) + O, which this reproduces when the
recursion has no memory). The sends are the daemon's (peerd.node.run.outbound): one ordered queue per
neighbour j -> i carries j's updates and, for Hop, its token grants to i, in the order the policy
emits them (update k, grant after the mix of k, update k+1, ...); each is an RPC whose reply j
awaits before the queue's next item, so an update holds the queue for its bytes plus a round trip
and a grant for a round trip. With F_{j->i} the time the queue may start its next item:
      A_{j->i}(k) = S + M / r_ji + lat_ji     S = max(P_j(k) [+ C_j(k) if no overlap], F_{j->i});
                                               then F_{j->i} = A_{j->i}(k) + lat_ij
      G_{j->i}(k) = S' + lat_ji               S' = max(P_j(k+1) - O_j (j's mix of k), F_{j->i});
                                               then F_{j->i} = S' + lat_ji + lat_ij
      gather_i(k) = max_{j in N_in(i,k)} A_{j->i}(k)                 standard / D-PSGD / SGP
                  = (|N_in| - b)-th smallest A_{j->i}(k)             Hop backup b (order statistic)
                  = max_j A_{j->i}(k - s)                            Hop staleness s
      tokens_i(k) = max_{j in N_out(i)} G_{j->i}(k - max_ig)         Hop token queues (gap bound:
                    i leaves k once every out-neighbour j granted its step k - max_ig; the grant
                    waits behind j's updates queued to i before it, so on a slow cut the updates'
                    arrival bounds the ring even where backup mixes without them; the policy's
                    other token source, j's newest update k + 1 - max_ig, comes after that grant
                    on the same queue, so it never binds first)
      P_i(k+1)    = max(P_i(k) + C_i(k), gather_i(k), tokens_i(k)) + O_i
  T = (max_i P_i(K) - max_i P_i(K0)) / (K - K0), K0 = K/4 burn-in. With no spread this is the
  max cycle mean of the graph (exact). With spread, note the difference from [P4]'s
  E[max_{j in group} C_j]: a worker waits for its neighbours' *published* x_k, which each
  published one step earlier (after its own previous gradient), so a slow gradient only delays the
  neighbour's next publish and most of the spread is absorbed (T is close to E[C], not E[max C];
  the simulator driving the real policies agrees, tests/test_plan_model.py). All-Reduce waits for
  the gradients themselves, hence E[max_i C_i] there.

Asynchronous closed forms (ours; NetMax and AD-PSGD define no barrier, so a worker's iteration
time is its own):
- NetMax [NetMax §"probabilities minimise total time", papers.md 3.2]: t_im = E[max(C_i, R_im)]
  with R_im = lat_im + lat_mi + M / r_mi the pull's round trip (C_i + R_im without overlap);
  P = the policy's own probabilities (peerd.sync.netmax.probabilities, same solver and consensus
  weight as the daemon) on what the daemon feeds it, the link matrix's times max(mean C_i,
  lat_im + lat_mi + M / bw_mi) of each pull alone on the network (peerd.net.links.pull_times);
  T_i = sum_m P_im t_im + O_i; T = mean_i T_i.
  E[max(X, c)] for X ~ N(mu, s): c + (mu - c) Phi(z) + s phi(z), z = (mu - c)/s.
- AD-PSGD [papers.md 5.2, peerd.sync.baselines]: an active worker pulls a uniform passive
  neighbour carrying its model, then takes the reply: R_ij = (lat_ij + M/r_ij) + (M/r_ji + lat_ji);
  T_i = mean_j E[max(C_i, R_ij)] + O_i; a passive worker never waits: T_j = E[C_j] + O_j;
  T = mean_i T_i. The flows that share a link are weighted by time, not by iteration (ours): the
  carry i -> j is in flight a share w = (lat_ij + M/r_ij) / (|partners_i| T_i) of i's time, the
  reply likewise with its own leg, so a fast active that picks a slow passive half the time
  still holds that passive's link most of the time, and every other pull through it gets a
  share. w starts at 1/(2|partners_i|) and is iterated (damped) to its fixed point with the rates.
  NetMax's flows are weighted the same way, w_im = P_im R_im / T_i (P held at the policy's
  probabilities): on the lab's star its 10 Mbit hosts pull from 10 Mbit hosts whose uplinks a
  faster host's pulls hold most of the time. Measured there with a swarm-wide budget (long
  windows: 18-19 iterations of AD-PSGD's 10 Mbit active, 51-59 of NetMax's 10 Mbit hosts;
  docs/bench/full-matrix): AD-PSGD -1/+3/-1 % (its 10 Mbit active 2.69 s predicted, 2.24-2.46 s
  measured; +28/+33/+29 % when a worker's own pulls shared its link and both legs counted for
  the whole pull). NetMax +10/+33/+14 % while the daemon took every re-solve as it came: the
  solve chased estimate noise (a fast host's row swung 0.27-0.73 between 10-s feeds), and
  stretches of equal wall time at two paces average fewer seconds per iteration than the steady
  P. With the daemon's P smoothed across re-solves (peerd.sync.netmax, `smoothing`), +22/+19/-2 %.

Simulated (the simulator drives the very policies; per-iteration time is better computed there
than in closed form): Hop with iteration skipping (backup + skip, staleness + skip) and DSGD-AAU;
and, when the daemons coalesce queued updates (Options.coalesce, Config.train_coalesce_updates),
Hop's backup and staleness modes too, because max-plus delivers every update (ours; two sites,
Hop with staleness: 0.24 s simulated, 0.25-0.27 s measured, where max-plus says 0.45 s).
peerd.sim runs them timing-only with Gaussian compute (mean_i + O_i, std_i), the shared rates
r_ji of the topology's flows as per-pair bandwidths and the daemon's ordered sender (SimSpec
sender="daemon": the queue above, grants included); T = mean over hosts of each host's finish
time / its iterations. Overlap only:
peerd's runtime always overlaps (the trainer publishes x_k before computing its gradient).

Decentralized rows with overlap=True are what `peerd train` runs; overlap=False rows show what the
overlap buys. Splitting (ours): the edges whose updates the mixes actually used in steady state (in
hand at the mix; the last quarter of the sample path, the last half of a simulation) must connect
every host. Hop's backup mode on a slow cut never mixes an update across it (the grants bound each
side to max_ig iterations past what it received, so every cross update arrives about max_ig
iterations after its receiver mixed that iteration and is dropped), yet runs at the cut's pace
(the grants ride behind those updates): such rows are marked `splits` and never recommended. The recommendation is the fastest runnable row that does not split. Per-iteration time only: the model
says nothing about how many iterations each algorithm needs to reach a loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

import numpy as np

from peerd.config import Config
from peerd.sync import netmax as nm
from peerd.sync import registry, topology
from peerd.sync.topology import Topology

# Algorithms whose steady state the max-plus recursion models, and those left to the simulator.
SYNC = ("d-psgd", "hop", "hop-backup", "hop-staleness", "sgp")
SIMULATED = ("hop-backup-skip", "hop-staleness-skip", "aau")
COALESCING_MAXPLUS = ("hop-backup", "hop-staleness")   # simulated instead when Options.coalesce
ASYNC = ("netmax", "netmax-uniform", "netmax-inv", "netmax-invsqrt", "ad-psgd")
TOPOLOGIES = ("ring", "exp", "aer", "complete")
DDP = "ddp"


@dataclass(frozen=True)
class Shared:
    """A capacity several ordered host pairs share (bytes/s), e.g. a site uplink."""
    name: str
    capacity: float
    pairs: frozenset[tuple[int, int]]


@dataclass(frozen=True)
class Network:
    bandwidth: np.ndarray                 # (n, n) bytes/s, [i, j]: i -> j; diagonal ignored
    latency: np.ndarray                   # (n, n) one-way seconds
    shared: tuple[Shared, ...] = ()
    sites: tuple[int, ...] | None = None  # site index per host (hierarchical All-Reduce)
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bw = np.asarray(self.bandwidth, dtype=float)
        lat = np.asarray(self.latency, dtype=float)
        n = bw.shape[0] if bw.ndim == 2 else -1
        if bw.ndim != 2 or bw.shape != (n, n) or lat.shape != (n, n):
            raise ValueError(f"bandwidth/latency: expected two n x n matrices, got {bw.shape} and {lat.shape}")
        off = ~np.eye(n, dtype=bool)
        if n and (not np.all(bw[off] > 0) or not np.all(np.isfinite(bw[off]))):
            raise ValueError("bandwidth: every pair needs a finite rate > 0 (bytes/s)")
        if n and (not np.all(lat[off] >= 0) or not np.all(np.isfinite(lat[off]))):
            raise ValueError("latency: every pair needs a finite one-way latency >= 0 (s)")
        if self.sites is not None and len(self.sites) != n:
            raise ValueError(f"sites: expected {n} entries, got {len(self.sites)}")
        object.__setattr__(self, "bandwidth", bw)
        object.__setattr__(self, "latency", lat)

    @property
    def n(self) -> int:
        return self.bandwidth.shape[0]

    @classmethod
    def uniform(cls, n: int, bandwidth: float, latency: float = 0.0) -> "Network":
        return cls(np.full((n, n), float(bandwidth)), np.full((n, n), float(latency)))

    def rates(self, flows: dict[tuple[int, int], float],
              owners: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], float]:
        """Rate of each flow (src, dst) -> weight (expected number in flight), equal share of each
        shared capacity it crosses. A flow is seen while it is in flight, so it shares g with
        itself and the others' expected count: cap_g / (1 + load_g - min(1, w_f)). Whole counts
        (w >= 1: flows that are always in flight) give cap_g / load_g. `owners` names the worker
        that starts each flow, for asynchronous workers that have one transfer in flight at a
        time: while f is in flight its owner's other flows are not, so f shares g with the other
        owners' count only, cap_g / (1 + load_g - min(1, own_g))."""
        load = {g.name: sum(w for f, w in flows.items() if f in g.pairs) for g in self.shared}
        own: dict[tuple[str, int], float] = {}
        if owners is not None:
            for f, w in flows.items():
                for g in self.shared:
                    if f in g.pairs:
                        own[g.name, owners[f]] = own.get((g.name, owners[f]), 0.0) + w
        out = {}
        for f, w in flows.items():
            r = float(self.bandwidth[f])
            for g in self.shared:
                if f in g.pairs:
                    mine = w if owners is None else own[g.name, owners[f]]
                    r = min(r, g.capacity / (1.0 + load[g.name] - min(1.0, mine)))
            out[f] = r
        return out


@dataclass(frozen=True)
class Compute:
    mean: np.ndarray                      # (n,) seconds per gradient, straggler factor applied
    std: np.ndarray                       # (n,) seconds

    def __post_init__(self) -> None:
        m = np.atleast_1d(np.asarray(self.mean, dtype=float))
        s = np.atleast_1d(np.asarray(self.std, dtype=float))
        if m.shape != s.shape or m.ndim != 1:
            raise ValueError(f"mean/std: expected two vectors of one length, got {m.shape} and {s.shape}")
        if np.any(m < 0) or np.any(s < 0) or not np.all(np.isfinite(m)) or not np.all(np.isfinite(s)):
            raise ValueError("mean/std: compute times must be finite and >= 0")
        object.__setattr__(self, "mean", m)
        object.__setattr__(self, "std", s)

    @classmethod
    def of(cls, n: int, mean: float, std: float = 0.0, factors: dict[int, float] | None = None) -> "Compute":
        f = np.array([(factors or {}).get(i, 1.0) for i in range(n)])
        return cls(mean * f, std * f)

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        if not np.any(self.std):
            return self.mean
        return np.maximum(0.0, rng.normal(self.mean, self.std))


@dataclass(frozen=True)
class Prediction:
    algorithm: str
    topology: str
    overlap: bool
    iter_time_s: float
    method: str                # all-reduce | max-plus | closed-form | simulator
    runnable: bool             # peerd (or DDP) runs exactly this
    speedup: float = 0.0       # over ring All-Reduce with overlap
    connected: bool = True     # the updates it mixes in steady state reach every host (else it splits)

    def record(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "topology": self.topology, "overlap": self.overlap,
                "iter_time_s": self.iter_time_s, "speedup": self.speedup, "method": self.method,
                "runnable": self.runnable, "connected": self.connected}


@dataclass(frozen=True)
class Options:
    overhead: float | tuple[float, ...] = 0.0   # O, seconds per iteration (one value, or one per host)
    iterations: int = 400          # K of the max-plus sample path
    sim_iterations: int = 150      # iterations per worker of a simulated contender
    seed: int = 0
    backward_fraction: float = 0.67
    bucket_bytes: int = 25 << 20
    first_bucket_bytes: int = 1 << 20
    max_ig: int = 4
    backup: int = 1
    staleness: int = 2
    max_skip: int = 4
    aau_staleness: int = 2
    netmax_consensus: float = 0.3
    coalesce: bool = False         # the daemon's train_coalesce_updates (simulated contenders)

    def overheads(self, n: int) -> np.ndarray:
        """O per host."""
        o = np.atleast_1d(np.asarray(self.overhead, dtype=float))
        if o.size == 1:
            return np.full(n, float(o[0]))
        if o.shape != (n,) or np.any(o < 0):
            raise ValueError(f"overhead: expected one value >= 0 or {n} (one per host), got {o.tolist()}")
        return o

    @classmethod
    def from_config(cls, cfg: Config, overhead: float | None = None) -> "Options":
        return cls(overhead=cfg.plan.overhead if overhead is None else overhead,
                   iterations=cfg.plan.iterations, sim_iterations=cfg.plan.sim_iterations,
                   backward_fraction=cfg.plan.backward_fraction, bucket_bytes=cfg.plan.bucket_bytes,
                   first_bucket_bytes=cfg.plan.first_bucket_bytes,
                   max_ig=cfg.sync.hop_max_ig, backup=cfg.sync.hop_backup,
                   staleness=cfg.sync.hop_staleness if cfg.sync.hop_staleness >= 0 else 2, max_skip=cfg.sync.hop_max_skip,
                   aau_staleness=cfg.sync.aau_staleness, netmax_consensus=cfg.sync.netmax_consensus,
                   coalesce=cfg.train.coalesce_updates)


# ---- order statistics ------------------------------------------------------------------------

def _phi(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


_erf = np.frompyfunc(math.erf, 1, 1)


def _Phi(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.asarray(_erf(np.asarray(z, dtype=float) / math.sqrt(2)), dtype=float))


def expected_max(mean: Iterable[float], std: Iterable[float], points: int = 4001) -> float:
    """E[max_i X_i], X_i ~ Normal(mean_i, std_i) independent, truncated at 0 (numeric integral of
    the survival function of the max)."""
    m, s = np.asarray(list(mean), float), np.asarray(list(std), float)
    if not np.any(s):
        return float(m.max())
    # Below the largest deterministic time the max is certainly above t: integrate from there.
    lo = float(m[s == 0].max()) if np.any(s == 0) else 0.0
    hi = max(lo, float(np.max(m + 8 * s)))
    t = np.linspace(lo, hi, points)
    cdf = np.ones_like(t)
    for mu, sd in zip(m[s > 0], s[s > 0]):
        cdf *= _Phi((t - mu) / sd)
    return lo + float(np.trapezoid(1.0 - cdf, t))


def expected_max_const(mu: float, sd: float, c: float) -> float:
    """E[max(X, c)] for X ~ Normal(mu, sd)."""
    if sd == 0:
        return max(mu, c)
    z = (mu - c) / sd
    return float(c + (mu - c) * _Phi(np.array(z)) + sd * _phi(np.array(z)))


# ---- All-Reduce ------------------------------------------------------------------------------

def ring_allreduce_time(net: Network, nbytes: float, order: list[int] | None = None) -> float:
    """2(n-1) steps of nbytes/n over the ring in `order`, all ring edges busy at once."""
    order = list(range(net.n)) if order is None else order
    n = len(order)
    if n < 2:
        return 0.0
    edges = [(order[i], order[(i + 1) % n]) for i in range(n)]
    r = net.rates({e: 1.0 for e in edges})
    step = max(net.latency[e] + nbytes / n / r[e] for e in edges)
    return 2 * (n - 1) * step


def hierarchical_allreduce_time(net: Network, nbytes: float) -> float | None:
    """Intra-site reduce-scatter, k concurrent inter-site rings on nbytes/k, intra-site all-gather.
    None without at least two sites."""
    if net.sites is None:
        return None
    groups: dict[int, list[int]] = {}
    for h, s in enumerate(net.sites):
        groups.setdefault(s, []).append(h)
    sites = list(groups.values())
    S, k = len(sites), max(len(g) for g in sites)
    if S < 2 or k < 2:
        return None
    intra = [(g[i], g[(i + 1) % len(g)]) for g in sites if len(g) > 1 for i in range(len(g))]
    inter = []
    for r in range(k):
        ring = [g[r % len(g)] for g in sites]
        inter += [(ring[i], ring[(i + 1) % S]) for i in range(S)]
    flows = {e: 0.0 for e in intra + inter}
    for e in intra + inter:
        flows[e] += 1.0
    ri = net.rates({e: flows[e] for e in intra})
    rx = net.rates({e: flows[e] for e in inter})
    t_intra = max(net.latency[e] + nbytes / k / ri[e] for e in intra)
    t_inter = max(net.latency[e] + nbytes / (k * S) / rx[e] for e in inter)
    return 2 * (k - 1) * t_intra + 2 * (S - 1) * t_inter


def ddp_buckets(nbytes: float, opts: Options) -> list[float]:
    """Bytes of each DDP gradient bucket, in all-reduce order (see the module docstring)."""
    first = min(nbytes, float(opts.first_bucket_bytes))
    rest = nbytes - first
    full, tail = divmod(rest, float(opts.bucket_bytes))
    return [first] + [float(opts.bucket_bytes)] * int(full) + ([tail] if tail > 0 else [])


def ddp_iteration(bucket_times: list[float], comp: Compute, opts: Options, overlap: bool) -> float:
    cmax = expected_max(comp.mean + opts.overheads(len(comp.mean)), comp.std)
    comm = sum(bucket_times)
    if overlap:
        exposed = max(comm - opts.backward_fraction * expected_max(comp.mean, comp.std), bucket_times[-1])
    else:
        exposed = comm
    return cmax + exposed


# ---- synchronous decentralized: max-plus recursion --------------------------------------------

def _edges(topo: Topology, k: int) -> list[tuple[int, int]]:
    return [(j, i) for i in range(topo.n) for j in topo.in_neighbors(i, k)]


def maxplus_iteration(net: Network, comp: Compute, nbytes: float, topo: Topology, opts: Options, *,
                      overlap: bool = True, backup: int = 0, staleness: int | None = None,
                      max_ig: int | None = None, used: set[tuple[int, int]] | None = None) -> float:
    """Steady-state seconds per iteration of the recursion in the module docstring. `used` collects
    the edges (j, i) whose update was in hand at i's mix during the last quarter."""
    n, K = topo.n, max(8, opts.iterations)
    O = opts.overheads(n)
    rng = np.random.default_rng(opts.seed + 104729)
    lag = staleness or 0
    lat = net.latency
    hist = [np.zeros(n)]                         # P(k), k = 0..
    link: dict[tuple[int, int], float] = {}      # (j, i): j's ordered queue to i may start its next item
    grant_at: dict[tuple[int, int], dict[int, float]] = {}   # (j, i) -> {k: arrival at i of j's grant of k}
    C_hist: list[np.ndarray] = []
    per = {}                                     # k mod period -> (edges, seconds on the wire)
    # Grants travel j -> i for every edge i -> j (i spends tokens on i -> j, j grants them back).
    gpairs = sorted({(j, i) for (i, j) in _edges(topo, 0)}) if max_ig is not None else []

    def grant(j: int, i: int, m: int) -> None:
        """j's grant after its mix of m, queued to i behind j's update m (the ordered sender)."""
        start = max(hist[m + 1][j] - O[j], link.get((j, i), 0.0))
        grant_at.setdefault((j, i), {})[m] = start + lat[j, i]
        link[(j, i)] = start + lat[j, i] + lat[i, j]
    for k in range(K):
        C = comp.sample(rng)
        C_hist.append(C)
        P = hist[-1]
        key = k % topo.period
        if key not in per:
            es = _edges(topo, k)
            r = net.rates({e: 1.0 for e in es})
            per[key] = (es, {e: nbytes / r[e] for e in es})
        es, X = per[key]
        # Arrival at i of j's iteration-(k - lag) model, after j's grant of k - lag - 1 on the queue.
        src_k = k - lag
        if max_ig is not None and src_k >= 1:
            for (j, i) in gpairs:
                grant(j, i, src_k - 1)
        arr = np.full((n, n), -np.inf)
        if src_k >= 0:
            Ps, Cs = hist[src_k], C_hist[src_k]
            es_src, X_src = per.get(src_k % topo.period, (es, X))
            for (j, i) in es_src:
                start = max(Ps[j] + (0.0 if overlap else Cs[j]), link.get((j, i), 0.0))
                arr[i, j] = start + X_src[(j, i)] + lat[j, i]
                link[(j, i)] = arr[i, j] + lat[i, j]      # the push's reply frees the queue
        need = np.full(n, -np.inf)
        for i in range(n):
            row = arr[i][np.isfinite(arr[i])]
            if row.size == 0:
                continue
            if backup:
                want = row.size - backup
                if want >= 1:
                    need[i] = np.sort(row)[want - 1]
            else:
                need[i] = row.max()
        if max_ig is not None and k - max_ig >= 0:
            for (j, i) in gpairs:                # i may leave k once j granted k - max_ig
                need[i] = max(need[i], grant_at[(j, i)].pop(k - max_ig))
        mix = np.maximum(P + C, need)
        if used is not None and k >= 3 * K // 4:
            for (j, i) in es:
                if arr[i, j] <= mix[i]:
                    used.add((j, i))
        hist.append(mix + O)
    k0 = K // 4
    return float((hist[K].max() - hist[k0].max()) / (K - k0))


# ---- asynchronous closed forms ---------------------------------------------------------------

def _pull_times(net: Network, nbytes: float, flows: dict[tuple[int, int], float]) -> np.ndarray:
    """R[i, m]: i asks m (latency), m's model comes back at the shared rate, over every (m, i) flow."""
    r = net.rates(flows, owners={f: f[1] for f in flows})   # a worker pulls one peer at a time
    n = net.n
    R = np.full((n, n), np.inf)
    for (m, i), rate in r.items():
        R[i, m] = net.latency[i, m] + net.latency[m, i] + nbytes / rate
    return R


def _time_shares(busy: dict, shares: Any, rounds: int) -> None:
    """Iterate the flows' time shares to their fixed point with the rates they imply: `shares(busy)`
    returns the new shares (and updates the caller's times). Damped: a shared link may oscillate."""
    for _ in range(rounds):
        new = shares(busy)
        moved = max(abs(new[k] - busy[k]) for k in busy)
        for k in busy:
            busy[k] = 0.5 * busy[k] + 0.5 * new[k]
        if moved < 1e-4:
            break


def netmax_iteration(net: Network, comp: Compute, nbytes: float, topo: Topology, opts: Options,
                     overlap: bool = True, kind: str = "opt", rounds: int = 50) -> float:
    return float(np.mean(netmax_host_times(net, comp, nbytes, topo, opts, overlap, kind, rounds)[0]))


def netmax_host_times(net: Network, comp: Compute, nbytes: float, topo: Topology, opts: Options,
                      overlap: bool = True, kind: str = "opt", rounds: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """(T_i per host, P): NetMax's per-host iteration times and the probabilities they use."""
    adj = topo.adjacency()
    n = topo.n
    pairs = [(m, i) for i in range(n) for m in range(n) if adj[i, m]]
    # P from what the daemon feeds the policy (peerd.net.links.LinkTable.pull_times): each pull's
    # time alone on the network, max(compute, RTT + M / bandwidth), not the shared times below.
    R = _pull_times(net, nbytes, {(m, i): 0.0 for (m, i) in pairs})
    t = np.full((n, n), np.inf)
    for (m, i) in pairs:
        t[i, m] = (comp.mean[i] + R[i, m]) if not overlap else max(comp.mean[i], R[i, m])
    P = nm.probabilities(np.where(adj, t, 0.0), adj, kind, opts.netmax_consensus)
    over = opts.overheads(n)
    # Then the flows by time, as for AD-PSGD: i's pull from m is in flight a share
    # w_im = P_im R_im / T_i of i's time, so a fast host that pulls a slow one half the time holds
    # that host's uplink most of the time, and every other pull through it gets a share.
    T = np.zeros(n)

    def shares(busy: dict) -> dict:
        R = _pull_times(net, nbytes, busy)
        for (m, i) in pairs:
            t[i, m] = (comp.mean[i] + R[i, m]) if not overlap else expected_max_const(comp.mean[i], comp.std[i], R[i, m])
        T[:] = [sum(P[i, m] * t[i, m] for m in range(n) if adj[i, m]) + over[i] for i in range(n)]
        return {(m, i): min(1.0, P[i, m] * R[i, m] / T[i]) for (m, i) in pairs}

    _time_shares({(m, i): 1.0 / max(1, adj[i].sum()) for (m, i) in pairs}, shares, rounds)
    return T, P


def adpsgd_iteration(net: Network, comp: Compute, nbytes: float, topo: Topology, opts: Options,
                     overlap: bool = True, rounds: int = 50) -> float:
    return float(np.mean(adpsgd_host_times(net, comp, nbytes, topo, opts, overlap, rounds)))


def adpsgd_host_times(net: Network, comp: Compute, nbytes: float, topo: Topology, opts: Options,
                      overlap: bool = True, rounds: int = 50) -> np.ndarray:
    """AD-PSGD's per-host iteration times (actives: even ranks)."""
    n = topo.n
    act = [i for i in range(n) if i % 2 == 0]
    partners = {i: [j for j in topo.out_neighbors(i) if j % 2 == 1] for i in act}
    if any(not p for p in partners.values()):
        raise ValueError("topology: AD-PSGD needs a passive (odd) neighbour for every active worker")
    over = opts.overheads(n)
    T = comp.mean.copy()                       # passive workers never wait
    # busy[f]: share of active i's time the flow f of its pull from j is in flight: the carry
    # i -> j, then the reply j -> i (one after the other); both are i's, which pulls one passive at
    # a time. Start from the per-iteration share, then iterate to the time share (module docstring).
    owners = {f: i for i in act for j in partners[i] for f in ((i, j), (j, i))}

    def shares(busy: dict) -> dict:
        r = net.rates(busy, owners)
        leg = {f: net.latency[f] + nbytes / r[f] for f in busy}
        R = {(i, j): leg[(i, j)] + leg[(j, i)] for i in act for j in partners[i]}
        for i in act:
            T[i] = float(np.mean([comp.mean[i] + R[(i, j)] if not overlap else
                                  expected_max_const(comp.mean[i], comp.std[i], R[(i, j)]) for j in partners[i]]))
        return {f: min(1.0, leg[f] / len(partners[owners[f]]) / (T[owners[f]] + over[owners[f]])) for f in busy}

    _time_shares({f: 0.5 / len(partners[i]) for f, i in owners.items()}, shares, rounds)
    return T + over


# ---- simulated -------------------------------------------------------------------------------

def simulated_iteration(net: Network, comp: Compute, nbytes: float, topo: Topology, topo_name: str,
                        algorithm: str, opts: Options, used: set[tuple[int, int]] | None = None) -> float:
    from peerd.sim.engine import SimSpec, Simulator

    O = opts.overheads(net.n)

    class _GaussSim(Simulator):
        def compute_time(self, i: int) -> float:
            sd = comp.std[i]
            t = comp.mean[i] + O[i]
            return max(0.0, float(self.rng.normal(t, sd))) if sd else float(t)

    n = topo.n
    es = _edges(topo, 0)
    r = net.rates({e: 1.0 for e in es})
    bw = net.bandwidth.copy()
    for e, rate in r.items():
        bw[e] = rate
    bw[np.eye(n, dtype=bool)] = 1.0
    K = max(10, opts.sim_iterations)
    spec = SimSpec(n=n, params=max(1, int(nbytes // 4)), iterations=K, compute=1.0, bandwidth=bw,
                   latency=net.latency, timing_only=True, stop_at_target=False, seed=opts.seed,
                   estimates=registry.ESTIMATES.get(algorithm, "none"), coalesce=opts.coalesce)
    o: dict[str, Any] = {}
    if algorithm.startswith("hop"):
        o.update(max_ig=opts.max_ig, max_skip=opts.max_skip)
        if "backup" in algorithm:
            o["backup"] = opts.backup
        if "staleness" in algorithm:
            o["staleness"] = opts.staleness
    elif algorithm == "aau":
        o["staleness"] = opts.aau_staleness
    pols = registry.build(algorithm, n, topo, seed=opts.seed, **o)
    def on_mix(_sim: Any, i: int, mix: Any) -> None:
        if used is not None and mix.k >= K // 2:
            used.update((src, i) for src, _, _ in mix.entries if src != i)

    sim = _GaussSim(spec, pols, name=algorithm, on_mix=on_mix)
    sim.estimates = _estimates_with(sim, comp, opts, nbytes, r, net)  # type: ignore[method-assign]
    res = sim.run()
    if res.stalled:
        return math.inf
    return float(np.mean(sim.finish) / K)     # each host's seconds per iteration, mean over hosts


def _estimates_with(sim: Any, comp: Compute, opts: Options, nbytes: float, r: dict, net: Network):
    """The LinkEstimates a perfect monitor would measure, with our compute means (the simulator's
    own version reads its scalar compute)."""
    def estimates(kind: str) -> np.ndarray:
        n = net.n
        c = comp.mean + opts.overheads(n)
        xfer = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                if i != j:
                    rate = r.get((j, i), net.bandwidth[j, i])
                    xfer[i, j] = nbytes / rate + net.latency[j, i]
        if kind == "arrival":
            return c[None, :] + xfer
        return np.maximum(c[:, None], xfer + net.latency)
    return estimates


# ---- the plan --------------------------------------------------------------------------------

def make_topology(name: str, n: int) -> Topology | None:
    """The topology `peerd train --topology NAME` builds, or None where n does not allow it."""
    try:
        return topology.make(name, n)
    except ValueError:
        return None


def _rows(n: int) -> list[tuple[str, str]]:
    """Every (algorithm, topology) `peerd plan` considers for n hosts: the registry's planned
    algorithms on each topology they support, those with a graph of their own last."""
    rows, fixed = [], []
    distinct = _distinct_topologies(n)
    for algo in registry.ALGORITHMS.values():
        if not algo.planned:
            continue
        if algo.topology:
            topo = make_topology(algo.topology, n)
            if topo is not None and n > 1 and algo.policy.unsupported(topo) is None:
                fixed.append((algo.name, algo.topology))
            continue
        for t, topo in distinct.items():
            if algo.policy.unsupported(topo) is None:
                rows.append((algo.name, t))
    rows.sort(key=lambda r: TOPOLOGIES.index(r[1]))     # by topology, each in the registry's order
    return rows + fixed


def _distinct_topologies(n: int) -> dict[str, Topology]:
    """TOPOLOGIES that n allows, each graph once under its first name: on 2 hosts the ring, the
    one-peer exponential graph, the alternating exponential ring and the complete graph are one
    graph (on 3, the ring and the complete graph), and rows that differ only in the name would be
    decided by noise in the measured links."""
    out: dict[str, Topology] = {}
    for t in TOPOLOGIES:
        topo = make_topology(t, n)
        if topo is not None and not any(_same_graph(topo, u) for u in out.values()):
            out[t] = topo
    return out


def _same_graph(a: Topology, b: Topology) -> bool:
    """The same mixing matrix at every iteration."""
    if a.n != b.n or a.directed != b.directed:
        return False
    return all(np.allclose(a.matrix(k), b.matrix(k)) for k in range(math.lcm(a.period, b.period)))


def connected(n: int, edges: Iterable[tuple[int, int]]) -> bool:
    """Every host reaches every other along the edges (strong connectivity)."""
    out: dict[int, set[int]] = {i: set() for i in range(n)}
    back: dict[int, set[int]] = {i: set() for i in range(n)}
    for a, b in edges:
        out[a].add(b)
        back[b].add(a)

    def reach(g: dict[int, set[int]]) -> int:
        seen, stack = {0}, [0]
        while stack:
            for b in g[stack.pop()] - seen:
                seen.add(b)
                stack.append(b)
        return len(seen)
    return n < 2 or (reach(out) == n and reach(back) == n)


def predict_one(net: Network, comp: Compute, nbytes: float, algorithm: str, topo_name: str,
                opts: Options, overlap: bool = True, used: set[tuple[int, int]] | None = None) -> float:
    """Predicted seconds per iteration of one decentralized contender (or 'ddp', topology 'ring' or
    'hierarchical'). `used` (max-plus and simulated contenders) collects the edges whose updates
    the mixes used in steady state."""
    n = net.n
    if comp.mean.shape != (n,):
        raise ValueError(f"compute: {comp.mean.shape[0]} hosts, network has {n}")
    if algorithm == DDP:
        allreduce = hierarchical_allreduce_time if topo_name == "hierarchical" else ring_allreduce_time
        bucket_times = [allreduce(net, b) for b in ddp_buckets(nbytes, opts)]
        if None in bucket_times:
            raise ValueError("topology: hierarchical All-Reduce needs at least two sites of two hosts")
        return ddp_iteration(bucket_times, comp, opts, overlap)
    if n == 1:
        return float(comp.mean[0] + opts.overheads(1)[0])
    fixed = registry.ALGORITHMS[algorithm].topology if algorithm in registry.ALGORITHMS else ""
    topo = topology.make(fixed or topo_name, n)
    if algorithm in ("d-psgd", "sgp"):
        return maxplus_iteration(net, comp, nbytes, topo, opts, overlap=overlap, used=used)
    if algorithm == "hop":
        return maxplus_iteration(net, comp, nbytes, topo, opts, overlap=overlap, max_ig=opts.max_ig, used=used)
    if opts.coalesce and overlap and algorithm in COALESCING_MAXPLUS:
        # Max-plus delivers every update; with coalescing a newer one replaces one still queued,
        # which only the simulator (SimSpec.coalesce, as the daemon sends) follows.
        return simulated_iteration(net, comp, nbytes, topo, topo_name, algorithm, opts, used)
    if algorithm == "hop-backup":
        return maxplus_iteration(net, comp, nbytes, topo, opts, overlap=overlap, backup=opts.backup,
                                 max_ig=opts.max_ig, used=used)
    if algorithm == "hop-staleness":
        return maxplus_iteration(net, comp, nbytes, topo, opts, overlap=overlap, staleness=opts.staleness,
                                 max_ig=max(opts.max_ig, opts.staleness + 1), used=used)
    if algorithm.startswith("netmax"):
        kind = {"netmax": "opt"}.get(algorithm, algorithm.partition("-")[2])
        return netmax_iteration(net, comp, nbytes, topo, opts, overlap, kind)
    if algorithm == "ad-psgd":
        return adpsgd_iteration(net, comp, nbytes, topo, opts, overlap)
    if method_of(algorithm) == "simulator":      # and any registered algorithm without a closed form
        if not overlap:
            raise ValueError(f"overlap: {algorithm} is simulated with overlap only")
        return simulated_iteration(net, comp, nbytes, topo, topo_name, algorithm, opts, used)
    raise ValueError(f"algorithm: no runtime model for {algorithm!r}")


def method_of(algorithm: str) -> str:
    if algorithm == DDP:
        return "all-reduce"
    if algorithm in ASYNC:
        return "closed-form"
    if algorithm in SYNC:
        return "max-plus"
    # Hop with skipping and AAU, and any registered algorithm the model has no formula for: the
    # simulator drives the real policies.
    return "simulator" if algorithm in SIMULATED or algorithm in registry.ALGORITHMS else "unknown"


def plan(net: Network, comp: Compute, nbytes: float, opts: Options | None = None, *,
         overlap_off: bool = True, algorithms: Iterable[str] | None = None) -> list[Prediction]:
    """Every contender, fastest first. Speedups are over ring All-Reduce with overlap."""
    opts = opts or Options()
    n = net.n
    keep = set(algorithms) if algorithms is not None else None
    cands: list[tuple[str, str, bool]] = [(DDP, "ring", True)]
    if overlap_off:
        cands.append((DDP, "ring", False))
    if hierarchical_allreduce_time(net, nbytes) is not None:
        cands += [(DDP, "hierarchical", True)] + ([(DDP, "hierarchical", False)] if overlap_off else [])
    if n > 1:
        for a, t in _rows(n):
            cands.append((a, t, True))
            if overlap_off and method_of(a) != "simulator":
                cands.append((a, t, False))
    out = []
    for a, t, ov in cands:
        if keep is not None and a not in keep and a != DDP:
            continue
        used: set[tuple[int, int]] = set()
        T = predict_one(net, comp, nbytes, a, t, opts, ov, used)
        conn = connected(n, used) if method_of(a) in ("max-plus", "simulator") else True
        out.append(Prediction(a, t, ov, float(T), method_of(a), runnable=ov, connected=bool(conn)))
    base = next(p.iter_time_s for p in out if p.algorithm == DDP and p.topology == "ring" and p.overlap)
    out = [replace(p, speedup=float(base / p.iter_time_s) if p.iter_time_s > 0 else math.inf) for p in out]
    out.sort(key=lambda p: (float(f"{p.iter_time_s:.6g}"), not p.runnable, _pref(p)))
    return out


def _pref(p: Prediction) -> tuple[int, int]:
    return (PREFERENCE.index(p.algorithm) if p.algorithm in PREFERENCE else 99,
            TOPO_PREFERENCE.index(p.topology) if p.topology in TOPO_PREFERENCE else 99)


PREFERENCE = [DDP, *registry.ALGORITHMS]              # ties go to the simpler, exact averaging first
TOPO_PREFERENCE = ["ring", "hierarchical", "exp", "exp-directed", "aer", "complete"]


def recommend(preds: list[Prediction], peerd_only: bool = False,
              tie: float = 0.02) -> tuple[Prediction, Prediction | None]:
    """(best, runner-up) among runnable rows whose mixes connect the hosts; `peerd_only` leaves DDP
    out (what `peerd train` runs). Rows within `tie` (relative) of the fastest count as tied and go
    by a fixed preference (DDP, then the registry's order; ring first), so hosts whose link
    estimates differ a little still choose the same."""
    ok = [p for p in preds if p.runnable and p.connected and (not peerd_only or p.algorithm != DDP)]
    if not ok:
        raise ValueError("plan: no runnable contender")

    def pick(rows: list[Prediction]) -> Prediction:
        fastest = min(p.iter_time_s for p in rows)
        tied = [p for p in rows if p.iter_time_s <= fastest * (1 + tie)]
        return min(tied, key=_pref)
    best = pick(ok)
    rest = [p for p in ok if (p.algorithm, p.topology) != (best.algorithm, best.topology)]
    return best, (pick(rest) if rest else None)
