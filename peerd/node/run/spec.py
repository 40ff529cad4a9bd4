"""What a `peerd train` asks for: the run's spec, checked, and the error a run reports."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from peerd.net.wirecheck import clip, cut
from peerd.sync import registry, topology
from peerd.v1 import control_pb2 as cpb

TOPOLOGIES = ("ring", "torus", "complete", "exp", "exp-directed", "aer")
MAX_WORLD = 256            # default of train_max_world_limit (peerd.config)
MAX_ITERATIONS = 1 << 53
MAX_SLOWDOWN = 1000.0
MAX_TEXT = 256             # task, algorithm, topology, option names
MAX_VALUE = 4096           # an option's value, a script argument
MAX_OPTIONS = 64
MAX_SCRIPT_ARGS = 256
INT_OPTIONS = ("backup", "staleness", "max_ig", "max_skip")
FLOAT_OPTIONS = ("step_time", "step_time_std", "model_bytes")


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why."""


@dataclass
class RunSpec:
    task: str
    algorithm: str
    topology: str
    world: int
    iterations: int
    seed: int
    non_iid: bool
    slowdown: float
    options: dict[str, str]
    script: list[str]
    eval_every: int
    join_timeout: float
    max_world: int = 0          # ranks a run may grow to by late joiners (>= world)

    @classmethod
    def from_request(cls, r: cpb.TrainRequest, default_join: float, default_max_world: int = 0,
                     world_limit: int = MAX_WORLD) -> "RunSpec":
        """The spec a TrainRequest asks for, every field checked (RunError names the first that is
        not acceptable: the Train RPC answers it as INVALID_ARGUMENT)."""
        _check_strings(r)
        algo = registry.canonical(r.algorithm or "hop")
        if algo != "auto" and algo not in registry.ALGORITHMS:
            raise RunError(f"algorithm: unknown {clip(r.algorithm)}; known: {', '.join(registry.ALGORITHMS)}")
        topo = r.topology or "ring"
        if topo not in TOPOLOGIES:
            raise RunError(f"topology: unknown {clip(topo)}; known: {', '.join(TOPOLOGIES)}")
        if not r.task and not r.script:
            raise RunError("task: name a built-in task (digits, svm, lm) or a script")
        if r.world < 1:
            raise RunError("world: must be at least 1")
        if r.iterations > MAX_ITERATIONS:
            raise RunError(f"iterations: {r.iterations} is beyond {MAX_ITERATIONS}")
        if r.options.get("budget", "host") not in ("host", "swarm"):
            raise RunError(f"budget: expected host or swarm, got {clip(r.options['budget'])}")
        _check_options(r.options)
        _check_script(r)
        max_world = r.max_world or default_max_world or r.world
        if max_world < r.world:
            raise RunError(f"max-world: {max_world} is below world {r.world}")
        if max_world > world_limit:
            raise RunError(f"max-world: {max_world} is beyond this daemon's limit of {world_limit} ranks "
                           f"(train_max_world_limit)")
        _check_graph(algo, topo, max_world)
        slowdown = r.slowdown or 1.0
        if not (math.isfinite(slowdown) and 0 < slowdown <= MAX_SLOWDOWN):
            raise RunError(f"slowdown: {slowdown} is not a number in (0, {MAX_SLOWDOWN:g}]")
        join = r.join_timeout_s
        if not (math.isfinite(join) and join >= 0):
            raise RunError(f"join-timeout: {join} is not a number of seconds >= 0 (0: the default)")
        return cls(r.task, algo, topo, r.world, r.iterations, r.seed, r.non_iid, slowdown, dict(r.options),
                   list(r.script), r.eval_every, join or default_join, max_world)

    @property
    def swarm_budget(self) -> bool:
        """--budget swarm: the iterations are a budget for the run's hosts together."""
        return self.options.get("budget", "host") == "swarm"


def _check_graph(algo: str, topo: str, ranks: int) -> None:
    """The run's graph exists for its ranks (a ring needs 2, exp and aer a power of two): said now,
    not once every host has come."""
    if algo == "auto":
        return
    name = registry.get(algo).topology or topo
    try:
        topology.make(name, ranks)
    except ValueError as e:
        hint = "; one host alone: --topology complete" if ranks == 1 else ""
        raise RunError(f"topology: {name} cannot hold {ranks} ranks (--max-world, else --world): {e}{hint}") from None


def _check_script(r: cpb.TrainRequest) -> None:
    """The directory `peerd train` ran in exists here, and so does the script it names (found
    from there): a wrong path is an error now, not a trainer that crashes at every restart."""
    if not r.script:
        return
    cwd = r.options.get("cwd")
    if cwd is not None and not (os.path.isabs(cwd) and os.path.isdir(cwd)):
        raise RunError(f"cwd: {clip(cwd)} is not a directory on this host (peerd train runs the script "
                       f"from the directory it was started in)")
    first = r.script[0]
    if not first.startswith("-") and not os.path.isfile(os.path.join(cwd or os.getcwd(), first)):
        raise RunError(f"script: {clip(first)} is not a file (looked for in {clip(cwd or os.getcwd())})")


def _check_strings(r: cpb.TrainRequest) -> None:
    for name in ("task", "algorithm", "topology"):
        value = getattr(r, name)
        if len(value) > MAX_TEXT or not value.isprintable():
            raise RunError(f"{name}: {clip(value)} is not a short printable name")
    if len(r.options) > MAX_OPTIONS:
        raise RunError(f"options: {len(r.options)} given (at most {MAX_OPTIONS})")
    for key, value in r.options.items():
        if len(key) > MAX_TEXT or not key.replace("_", "").replace("-", "").isalnum():
            raise RunError(f"options: name {clip(key)} is not a short name")
        if len(value) > MAX_VALUE or not value.isprintable():
            raise RunError(f"options: {key} = {clip(value)} is not a printable value of at most {MAX_VALUE} characters")
    if len(r.script) > MAX_SCRIPT_ARGS or any(len(a) > MAX_VALUE or "\0" in a for a in r.script):
        raise RunError(f"script: at most {MAX_SCRIPT_ARGS} arguments of at most {MAX_VALUE} characters, no NUL")


def _check_options(options) -> None:
    """The options the daemon itself reads (the trainer checks its own)."""
    for key in INT_OPTIONS:
        if key in options:
            try:
                value = int(options[key])
            except ValueError:
                raise RunError(f"{key}: {clip(options[key])} is not an integer") from None
            if not 0 <= value <= 1_000_000:
                raise RunError(f"{key}: {value} is outside 0..1000000")
    for key in FLOAT_OPTIONS:
        if key in options:
            try:
                value = float(options[key])
            except ValueError:
                raise RunError(f"{key}: {clip(options[key])} is not a number") from None
            if not (math.isfinite(value) and value >= 0):
                raise RunError(f"{key}: {value} is not a finite number >= 0")


PER_HOST = ("slowdown", "join_timeout")   # spec fields each host may set for itself
# options each host may set for itself: its device, where its copy of the --init file lies (the
# file's sha256, init_sha256, is shared: every host starts from the same weights), and the
# directory `peerd train` ran in, where a --script's relative paths start (each host's clone may
# lie elsewhere)
PER_HOST_OPTIONS = ("device", "init", "cwd")


def shared_spec(spec: RunSpec) -> dict[str, Any]:
    """The part of a spec every host of a run must share."""
    d = dataclasses.asdict(spec)
    for key in PER_HOST:
        d.pop(key, None)
    d["options"] = {k: v for k, v in d.get("options", {}).items() if k not in PER_HOST_OPTIONS}
    return d


def run_tag(spec: RunSpec, founders: list[str]) -> str:
    """Every host of a run derives the same tag: the shared spec and the founding members."""
    return hashlib.sha1(json.dumps([shared_spec(spec), founders], sort_keys=True).encode()).hexdigest()[:12]


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field (in a fixed order) where two shared specs differ, as 'field: X here, Y in
    the run'; None when they agree. `--algo auto` here agrees with whatever the run resolved."""
    skip = {"algorithm", "topology"} if ours.get("algorithm") == "auto" else set()
    for key in sorted(set(ours) | set(theirs)):
        if key in skip:
            continue
        a, b = ours.get(key), theirs.get(key)
        if a != b:
            name = key.replace("_", "-") if key.replace("_", "").isalnum() else repr(key)
            return f"{cut(name, 40)}: {cut(repr(a))} here, {cut(repr(b))} in the run"
    return None
