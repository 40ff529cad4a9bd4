"""The low-communication mode (DiLoCo, peerd.train.outer) in the runtime model: its rows and when
`peerd plan` recommends it.

Time and bytes only. DiLoCo changes what an inner step buys: H local steps between mixes converge
differently per step than a mix every step (DiLoCo reports its quality for H up to 500 on its own
models, Douillard et al. 2023). This module says how fast the steps go and what they send, never
how many a loss needs; `peerd sim --outer diloco` shows both on a synthetic objective.

Rows (ours, built on peerd.plan.model's max-plus recursion). A row is DiLoCo around D-PSGD on
`complete` (all-hosts: every host's model averaged, DiLoCo as published) or on `ring` (gossip,
decentralized DiLoCo), with H inner steps per round, F fragments, overlap tau and a codec. One sync
is one iteration of the run's D-PSGD; it moves fragment p of the model (Streaming DiLoCo, Douillard
et al. 2025), so it pushes
      m = M * c / F  bytes to each out-neighbour
(M the float32 model bytes; c the codec's wire bytes per float32 byte: none 1, fp16/bf16 1/2,
int8 1.03125/4, int4 0.53125/4: blockwise, one float32 scale per 128 values, peerd.net.quant), and
computes s = H // F inner steps (H // F as OuterOptimizer takes it). The overlap splits them:
tau steps between the publish of k and the mix of k, s - tau after it. So the recursion of
peerd.plan.model (overlap on: the push of k starts at P_j(k)) runs with, per host i,
      C'_i = tau * C_i            (Normal(tau mean_i, sqrt(tau) std_i): independent steps)
      O'_i = (s - tau) * mean_i + O_i     (O_i once per sync: publish, mix, outer step)
      P_i(k+1) = max(P_i(k) + C'_i(k), gather_i(k)) + O'_i
and T_sync = its steady-state seconds per sync, the per-inner-step time T_step = T_sync / s and the
round H * T_step. tau = 0 exposes the whole exchange every sync (T_sync ~ X + s C); tau >= X / C
hides it. tau is capped at s (a sync still pending holds the next publish back). The time budget
(--round-seconds) is not a row: with a budget R each host takes about R / C_i steps and nobody
waits for the slowest (peerd.sim's outer mode shows it); fixed H is the conservative case.
Bytes per host: per sync deg_out * m; per round deg_out * M * c (every fragment once); per inner
step deg_out * M * c / H, deg_out = n - 1 on complete, 2 on a ring (1 for two hosts). Static graphs
only, so no keyframes (peerd.net.copies); the first publish (the whole model) is left out.

Communication-bound (ours): the best per-iteration row B (peerd.plan.model.recommend) is predicted
again on an infinitely fast network (every pair unbounded, latency 0, nothing shared): that is its
compute-only pace T_c. Its exposed communication is E = T_B - T_c, and B is communication-bound
when E > T_c (the network costs it more than the compute per step).

The recommendation when B is communication-bound (ours): the smallest H that hides the exchange:
  - codec: the one given, else the first of none, fp16, int8, int4 with which some H <= H_max
    (Config.plan_outer_max_inner_steps, 500: DiLoCo's published H) hides it;
  - F: the one given, else the smallest of 1, 2, 4, 8, 16 whose sync crosses its slowest edge within
    tau_max (Config.plan_outer_max_overlap) steps of the fastest host: X_F = max_e (lat_e + m / r_e)
    <= tau_max * min_i C_i (r_e the edge's shared rate with every edge of the graph in flight); 16
    when none does;
  - tau: the one given, else ceil(X_F / min_i C_i), at most tau_max (and at most H_max // F);
  - H = F * s with the smallest s >= max(1, tau) whose T_step is within Config.plan_outer_hide_fraction
    of the same row's compute-only pace (the row on the infinitely fast network). The search starts
    at the closed form of the deterministic case, s0 = max(tau, Q / max_i C_i, (X_F - tau min_i C_i)
    / (hide * max_i C_i)) with Q = max_e (m / r_e + lat_e + lat_e') the ordered queue's time per sync
    (the push and its reply), then doubles and bisects on the recursion;
  - topology: the one of complete and ring with the smaller H (complete on a tie: DiLoCo as
    published, exact averaging).
When B is not communication-bound today's recommendation stands (the rows are still computed and
shown: what DiLoCo would need).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from peerd.config import Config
from peerd.plan.model import (Compute, Network, Options, Prediction, _edges, make_topology, maxplus_iteration,
                              predict_one)
from peerd.sim.outer import codec_factor
from peerd.sync import topology

CODEC_ORDER = ("none", "fp16", "int8", "int4")     # least lossy first
FRAGMENT_CHOICES = (1, 2, 4, 8, 16)
OUTER_TOPOLOGIES = {"complete": "all-hosts", "ring": "gossip"}


@dataclass(frozen=True)
class OuterOptions:
    """What the user fixed (0, -1 or "": computed) and the rule's bounds (Config.plan_outer_*)."""
    inner_steps: int = 0
    fragments: int = 0
    overlap: int = -1
    codec: str = ""
    max_inner_steps: int = 500
    max_overlap: int = 5
    hide_fraction: float = 0.05
    iterations: int = 120          # K of the max-plus sample path for these rows

    @classmethod
    def from_config(cls, cfg: Config, **given: Any) -> "OuterOptions":
        return cls(max_inner_steps=cfg.plan.outer_max_inner_steps, max_overlap=cfg.plan.outer_max_overlap,
                   hide_fraction=cfg.plan.outer_hide_fraction, iterations=cfg.plan.outer_iterations, **given)


@dataclass(frozen=True)
class OuterRow:
    topology: str
    inner_steps: int               # H
    fragments: int                 # F
    overlap: int                   # tau
    codec: str
    sync_s: float                  # T_sync
    step_s: float                  # T_step = T_sync / (H // F)
    compute_step_s: float          # the same row on an infinitely fast network
    bytes_sync: float              # per host, sent
    bytes_round: float
    bytes_step: float
    hidden: bool                   # step_s within hide_fraction of compute_step_s

    @property
    def name(self) -> str:
        return OUTER_TOPOLOGIES.get(self.topology, self.topology)

    def record(self) -> dict[str, Any]:
        return {"algorithm": "diloco", "topology": self.topology, "name": self.name,
                "inner_steps": self.inner_steps, "fragments": self.fragments, "overlap": self.overlap,
                "codec": self.codec, "sync_s": self.sync_s, "step_s": self.step_s,
                "compute_step_s": self.compute_step_s, "round_s": self.step_s * self.inner_steps,
                "bytes_sync": self.bytes_sync, "bytes_round": self.bytes_round, "bytes_step": self.bytes_step,
                "hidden": self.hidden}


@dataclass(frozen=True)
class OuterPlan:
    best: Prediction               # today's recommendation (per iteration)
    compute_s: float               # T_c: its compute-only pace
    exposed_s: float               # E = T_B - T_c
    communication_bound: bool
    rows: list[OuterRow]
    recommended: OuterRow | None
    why: str

    def record(self) -> dict[str, Any]:
        return {"per_iteration_best": self.best.record(), "compute_s": self.compute_s, "exposed_s": self.exposed_s,
                "communication_bound": self.communication_bound, "rows": [r.record() for r in self.rows],
                "recommended": self.recommended.record() if self.recommended else None, "why": self.why}


def infinitely_fast(net: Network) -> Network:
    """The same hosts on a network that costs nothing."""
    n = net.n
    return Network(np.full((n, n), 1e30), np.zeros((n, n)), (), net.sites, net.names)


def _out_degree(topo: Any) -> float:
    return float(np.mean([len(topo.out_neighbors(i)) for i in range(topo.n)]))


def row(net: Network, comp: Compute, nbytes: float, topo_name: str, H: int, F: int, tau: int, codec: str,
        opts: Options, oo: OuterOptions) -> OuterRow:
    """One DiLoCo row: the recursion of the module docstring at H, F, tau, codec."""
    topo = topology.make(topo_name, net.n)
    s = max(1, H // F)
    tau = min(max(0, tau), s)
    m = nbytes * codec_factor(codec) / F
    o = replace(opts, overhead=tuple((s - tau) * comp.mean + opts.overheads(net.n)), iterations=oo.iterations)
    pre = Compute(tau * comp.mean, math.sqrt(tau) * comp.std)
    sync = maxplus_iteration(net, pre, m, topo, o, overlap=True)
    ideal = maxplus_iteration(infinitely_fast(net), pre, m, topo, o, overlap=True)
    deg = _out_degree(topo)
    step, cstep = sync / s, ideal / s
    return OuterRow(topo_name, s * F, F, tau, codec, sync, step, cstep, deg * m, deg * m * F, deg * m * F / (s * F),
                    step <= (1 + oo.hide_fraction) * cstep)


def _wire(net: Network, topo_name: str, m: float) -> tuple[float, float]:
    """(X, Q): a sync's slowest push alone (latency + bytes at the shared rate) and the ordered
    queue's time per sync (the push and its reply), with every edge of the graph in flight."""
    es = _edges(topology.make(topo_name, net.n), 0)
    r = net.rates({e: 1.0 for e in es})
    X = max(net.latency[e] + m / r[e] for e in es)
    Q = max(m / r[e] + net.latency[e] + net.latency[e[::-1]] for e in es)
    return X, Q


def fit(net: Network, comp: Compute, nbytes: float, topo_name: str, codec: str, opts: Options,
        oo: OuterOptions) -> OuterRow:
    """The row with the smallest H that hides the exchange (module docstring), or the row at the
    largest H allowed when none does (hidden False)."""
    cmin, cmax = float(comp.mean.min()), float(comp.mean.max())
    if cmin <= 0:
        raise ValueError("step time: the low-communication rows need a step time > 0")
    F = oo.fragments
    if F <= 0:
        F = next((f for f in FRAGMENT_CHOICES
                  if _wire(net, topo_name, nbytes * codec_factor(codec) / f)[0] <= oo.max_overlap * cmin),
                 FRAGMENT_CHOICES[-1])
    X, Q = _wire(net, topo_name, nbytes * codec_factor(codec) / F)
    s_max = max(1, oo.max_inner_steps // F)
    tau = min(s_max, oo.overlap if oo.overlap >= 0 else min(oo.max_overlap, math.ceil(X / cmin)))
    s0 = max(1, tau, math.ceil(Q / cmax), math.ceil(max(0.0, X - tau * cmin) / (oo.hide_fraction * cmax)))
    at = lambda s: row(net, comp, nbytes, topo_name, s * F, F, tau, codec, opts, oo)  # noqa: E731
    lo, hi = max(1, tau) - 1, max(min(s0, s_max), max(1, tau))     # s = lo is below the smallest allowed
    r = at(hi)
    while not r.hidden and hi < s_max:           # double until hidden
        lo, hi = hi, min(2 * hi, s_max)
        r = at(hi)
    if not r.hidden:
        return r
    best = r
    while hi - lo > 1:                           # the smallest s that hides, between lo (not) and hi
        mid = (lo + hi) // 2
        rm = at(mid)
        if rm.hidden:
            hi, best = mid, rm
        else:
            lo = mid
    return best


def choose(net: Network, comp: Compute, nbytes: float, topo_name: str, opts: Options, oo: OuterOptions) -> OuterRow:
    """The first codec (given, else CODEC_ORDER) with which an H <= H_max hides the exchange, at its
    smallest H; the last codec's best try when none does."""
    r = None
    for codec in ([oo.codec] if oo.codec else CODEC_ORDER):
        r = fit(net, comp, nbytes, topo_name, codec, opts, oo)
        if r.hidden:
            return r
    assert r is not None
    return r


def plan_outer(net: Network, comp: Compute, nbytes: float, best: Prediction, opts: Options,
               oo: OuterOptions) -> OuterPlan | None:
    """The rows and the recommendation of the module docstring; None for one host."""
    n = net.n
    if n < 2:
        return None
    T_c = predict_one(infinitely_fast(net), comp, nbytes, best.algorithm, best.topology, opts, best.overlap)
    E = max(0.0, best.iter_time_s - T_c)
    bound = E > T_c
    rows = [choose(net, comp, nbytes, t, opts, oo) for t in OUTER_TOPOLOGIES if make_topology(t, n) is not None]
    if oo.inner_steps > 0:       # the user's H, with the F, tau and codec the rule chose for each graph
        rows += [row(net, comp, nbytes, r.topology, oo.inner_steps, r.fragments, r.overlap, r.codec, opts, oo)
                 for r in list(rows)]
    head = (f"{best.algorithm} on {best.topology} (the best per iteration, {best.iter_time_s:.3f} s) exposes "
            f"{E:.3f} s of communication per iteration against {T_c:.3f} s of compute (its pace on an "
            f"infinitely fast network)")
    if not bound:
        return OuterPlan(best, T_c, E, False, rows, None, head + ": not communication-bound, its recommendation stands")
    fits = [r for r in rows if r.hidden and oo.inner_steps <= 0] or [r for r in rows if r.hidden]
    if not fits:
        return OuterPlan(best, T_c, E, True, rows, None,
                         head + f": communication-bound, but no H <= {oo.max_inner_steps} hides DiLoCo's exchange "
                                f"either; the per-iteration recommendation stands")
    rec = min(fits, key=lambda r: (r.inner_steps, list(OUTER_TOPOLOGIES).index(r.topology)))
    why = (head + f": communication-bound (exposed > compute). DiLoCo on {rec.topology} ({rec.name}) with "
           f"H={rec.inner_steps}, F={rec.fragments}, tau={rec.overlap}, {rec.codec} sends {rec.bytes_sync / 1e6:.3g} MB "
           f"per host every {rec.inner_steps // rec.fragments} inner steps (one sync; its mix collected "
           f"{rec.overlap} steps after the publish) and hides the exchange within the round: "
           f"{rec.step_s:.3f} s per inner step against {rec.compute_step_s:.3f} s of compute (within "
           f"{oo.hide_fraction:.0%}), a round of {rec.step_s * rec.inner_steps:.1f} s, {rec.bytes_step / 1e6:.3g} MB "
           f"per host per inner step. A time budget per round of about that (OuterOptimizer's round_seconds) "
           f"instead of a fixed H keeps fast hosts from waiting for slow ones")
    return OuterPlan(best, T_c, E, True, rows, rec, why)
