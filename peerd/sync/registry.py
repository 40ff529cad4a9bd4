"""Policies by name, so the daemon, the simulator and the CLI build them the same way.

    policies = build("hop", n, topology, backup=1, skip=True)   # one per worker
"""
from __future__ import annotations

from typing import Any

from peerd.sync.policy import Policy
from peerd.sync.topology import Topology

# name -> (description, default options)
ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "d-psgd": ("synchronous neighbour averaging (all in-neighbours every iteration)", {}),
    "hop": ("Hop standard mode: all in-neighbours, token queues bound the gap", {}),
    "hop-backup": ("Hop with b backup in-neighbours", {"backup": 1}),
    "hop-staleness": ("Hop with bounded staleness s", {"staleness": 2}),
    "hop-backup-skip": ("Hop, backup b + iteration skipping", {"backup": 1, "skip": True}),
    "hop-staleness-skip": ("Hop, staleness s + iteration skipping", {"staleness": 2, "skip": True}),
    "aau": ("DSGD-AAU: wait for a spanning tree of fastest links, use the rest when fresh", {}),
    "netmax": ("NetMax: one-peer pull, probabilities optimised for time to converge", {"probs": "opt"}),
    "netmax-uniform": ("NetMax pull with uniform peer probabilities (ablation)", {"probs": "uniform"}),
    "netmax-inv": ("NetMax pull with p ~ 1/t (ablation)", {"probs": "inv"}),
    "netmax-invsqrt": ("NetMax pull with p ~ 1/sqrt(t) (ablation)", {"probs": "invsqrt"}),
    "ad-psgd": ("asynchronous pairwise averaging, bipartite active/passive, uniform peers", {}),
    "sgp": ("stochastic gradient push, directed one-peer exponential graph", {}),
}

# No barrier: each worker runs at its own pace (what `peerd train --budget swarm` is for).
ASYNCHRONOUS = frozenset({"netmax", "netmax-uniform", "netmax-inv", "netmax-invsqrt", "ad-psgd"})

# Which LinkEstimates matrix each algorithm consumes (see peerd.sim.engine.Simulator.estimates).
ESTIMATES = {"aau": "arrival", "netmax": "pull", "netmax-uniform": "pull", "netmax-inv": "pull",
             "netmax-invsqrt": "pull"}


def build(name: str, n: int, topo: Topology, *, seed: int = 0, **opts: Any) -> list[Policy]:
    from peerd.sync.aau import AAU
    from peerd.sync.baselines import ADPSGD, DPSGD, SGP
    from peerd.sync.hop import Hop
    from peerd.sync.netmax import NetMax

    if name not in ALGORITHMS:
        raise ValueError(f"algorithm: unknown {name!r}; known: {', '.join(ALGORITHMS)}")
    if topo.n != n:
        raise ValueError(f"topology: has {topo.n} workers, expected {n}")
    o = {**ALGORITHMS[name][1], **opts}
    if name == "d-psgd":
        return [DPSGD(i, topo) for i in range(n)]
    if name.startswith("hop"):
        keys = ("max_ig", "backup", "staleness", "skip", "max_skip")
        return [Hop(i, topo, **{k: o[k] for k in keys if k in o}) for i in range(n)]
    if name == "aau":
        keys = ("staleness",)
        return [AAU(i, topo, **{k: o[k] for k in keys if k in o}) for i in range(n)]
    if name.startswith("netmax"):
        keys = ("probs", "gamma", "gap_weight", "resolve_frac", "consensus", "smoothing", "switch_frac",
                "pull_backoff", "pull_backoff_first")
        return [NetMax(i, topo, seed=seed, **{k: o[k] for k in keys if k in o}) for i in range(n)]
    if name == "ad-psgd":
        return [ADPSGD(i, topo, seed=seed, **{k: o[k] for k in ("pull_backoff", "pull_backoff_first") if k in o}) for i in range(n)]
    if name == "sgp":
        return [SGP(i, n=n) for i in range(n)]
    raise AssertionError(name)


def options(cfg: Any, algorithm: str | None = None) -> dict[str, Any]:
    """Policy options for `build` from a peerd Config (the daemon's and `peerd sim`'s defaults)."""
    name = algorithm or cfg.sync_algorithm
    o: dict[str, Any] = {}
    if name.startswith("hop"):
        o["max_ig"] = cfg.hop_max_ig
        o["max_skip"] = cfg.hop_max_skip
        if "backup" in name:
            o["backup"] = cfg.hop_backup
        if "staleness" in name:
            o["staleness"] = cfg.hop_staleness if cfg.hop_staleness >= 0 else 2
    elif name == "aau":
        o["staleness"] = cfg.aau_staleness
    elif name.startswith("netmax"):
        o.update(gamma=cfg.netmax_gamma, gap_weight=cfg.netmax_gap_weight, resolve_frac=cfg.netmax_resolve_frac,
                 consensus=cfg.netmax_consensus, smoothing=cfg.netmax_smoothing,
                 switch_frac=cfg.netmax_switch_frac, pull_backoff=cfg.train_pull_backoff,
                 pull_backoff_first=cfg.train_pull_backoff_first)
    elif name == "ad-psgd":
        o.update(pull_backoff=cfg.train_pull_backoff, pull_backoff_first=cfg.train_pull_backoff_first)
    return o
