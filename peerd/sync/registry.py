"""Algorithms by name, so the daemon, the simulator, `peerd plan` and the CLI build them the same way.

    policies = build("hop", n, topology, backup=1, skip=True)   # one per worker

Each algorithm module (peerd/sync/<module>.py) defines its Policy subclass and an ALGORITHMS tuple
of `peerd.sync.policy.Algorithm` entries (name, description, options, preference). To add an
algorithm, write its module and add the module's name to MODULES below: that is the one
registration line (docs/ARCHITECTURE.md, "Adding a sync algorithm").
"""
from __future__ import annotations

import importlib
from typing import Any

from peerd.sync import topology
from peerd.sync.policy import Algorithm, Policy
from peerd.sync.topology import Topology

MODULES = ("baselines", "hop", "aau", "netmax")


def _collect() -> dict[str, Algorithm]:
    found: list[Algorithm] = []
    for module in MODULES:
        found += importlib.import_module(f"peerd.sync.{module}").ALGORITHMS
    names = [a.name for a in found]
    if len(set(names)) != len(names):
        raise AssertionError(f"two algorithms share a name: {sorted(names)}")
    return {a.name: a for a in sorted(found, key=lambda a: a.preference)}


# name -> Algorithm, in `peerd plan`'s tie preference (simple, exact averaging first)
ALGORITHMS: dict[str, Algorithm] = _collect()
ALIASES = {"dpsgd": "d-psgd", "adpsgd": "ad-psgd"}
# Derived from the policies' declarations, for callers that know only a name.
ASYNCHRONOUS = frozenset(n for n, a in ALGORITHMS.items() if a.policy.asynchronous)
ESTIMATES = {n: a.policy.estimates for n, a in ALGORITHMS.items() if a.policy.estimates != "none"}


def canonical(name: str) -> str:
    """The registered name for `name` (aliases such as dpsgd resolved); unknown names unchanged."""
    return ALIASES.get(name, name)


def get(name: str) -> Algorithm:
    algo = ALGORITHMS.get(canonical(name))
    if algo is None:
        raise ValueError(f"algorithm: unknown {name!r}; known: {', '.join(ALGORITHMS)}")
    return algo


def build(name: str, n: int, topo: Topology, *, seed: int = 0, **opts: Any) -> list[Policy]:
    """One policy per worker. Options the algorithm does not take are ignored (a run's --backup
    means nothing to NetMax)."""
    return [build_one(name, n, topo, i, seed=seed, **opts) for i in range(n)]


def build_one(name: str, n: int, topo: Topology, me: int, *, seed: int = 0, **opts: Any) -> Policy:
    """Worker `me`'s policy alone, as `build` makes it (a daemon runs one worker: building all n
    cost O(n) policies, each O(n) or more, on the event loop)."""
    algo = get(name)
    if algo.topology:
        topo = topology.make(algo.topology, n)
    if topo.n != n:
        raise ValueError(f"topology: has {topo.n} workers, expected {n}")
    given = {**algo.defaults, **opts, "seed": seed}
    kwargs = {k: v for k, v in given.items() if k in algo.accepts}
    return algo.policy(me, topo, **kwargs)


def options(cfg: Any, algorithm: str | None = None) -> dict[str, Any]:
    """Policy options for `build` from a peerd Config (the daemon's and `peerd sim`'s defaults)."""
    algo = get(algorithm or cfg.sync.algorithm)
    return algo.from_config(cfg, algo.name) if algo.from_config is not None else {}
