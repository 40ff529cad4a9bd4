"""`peerd train --algo auto`: choose the algorithm and topology with the runtime model, and re-plan.

At world formation the daemon plans from its link matrix (the run's nodes only), the step time
the caller gave (`step_time` option, else Config.plan_default_step_time) and the model size
(`model_bytes` option, else the built-in task's parameter bytes, else 4 MB). It logs the choice
and the runner-up. Every Config.plan_interval seconds (at a progress tick) it compares the current
inputs with those of the last plan; when a pair's bandwidth or latency or this host's measured
step time moved by more than Config.plan_change_fraction, it re-plans.

Switching is NOT done mid-run: the policy is built once per run, and every host would have to
change policy at the same iteration (a Hop worker waits for updates a NetMax peer never sends);
there is no agreement protocol for that yet. A re-plan that recommends something else is logged
(warning) with both predictions, to apply at the next run.

One plan per run: the run's first founder (rank 0 of `form_world`) plans on its view of the
swarm and forms the run; the other founders wait for it (peerd.node.run.joining.place) and take its
algorithm and topology from DescribeRun, as a late joiner does. Planning on every host's own view
split runs near a tie (views are gossiped and nearly equal; a uniform LAN is all ties), and hosts
whose choices differ derive different run tags and never mix. Only the planning host re-plans.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from peerd.config import Config
from peerd.node.run.env import RunEnv
from peerd.plan import model, sources
from peerd.train.tasks import get_task

log = logging.getLogger("peerd.plan")

DEFAULT_MODEL_BYTES = 4_000_000


@dataclass
class Inputs:
    net: model.Network
    comp: model.Compute
    model_bytes: float
    warnings: list[str]

    def moved(self, other: "Inputs", frac: float) -> str | None:
        """Why other differs from self by more than frac, or None."""
        def rel(a: np.ndarray, b: np.ndarray) -> float:
            return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))) if a.size else 0.0
        if self.net.names != other.net.names:
            return "the run's nodes changed"
        off = ~np.eye(self.net.n, dtype=bool)
        for what, a, b in (("bandwidth", other.net.bandwidth[off], self.net.bandwidth[off]),
                           ("latency", other.net.latency[off], self.net.latency[off]),
                           ("step time", other.comp.mean, self.comp.mean)):
            r = rel(a, b)
            if r > frac:
                return f"{what} moved by {r:.0%}"
        return None


def model_bytes_of(task: str, options: dict[str, str]) -> float:
    if "model_bytes" in options:
        return float(options["model_bytes"])
    if task:
        try:
            m = get_task(task).build(0)
            return float(sum(p.numel() * p.element_size() for p in m.parameters()))
        except Exception:  # noqa: BLE001 - a task we cannot build here: fall back to the default
            pass
    return float(DEFAULT_MODEL_BYTES)


def gather(env: RunEnv, nodes: list[str], model_bytes: float, step_mean: float,
           step_std: float) -> Inputs:
    cfg = env.cfg
    matrix = env.link_matrix.to_dict(time.monotonic()) if env.link_matrix is not None else {"links": []}
    net, warnings = sources.network_from_links(matrix, nodes, cfg)
    return Inputs(net, model.Compute.of(len(nodes), step_mean, step_std), model_bytes, warnings)


def decide(inp: Inputs, cfg: Config) -> tuple[model.Prediction, model.Prediction | None]:
    """(best, runner-up) among what `peerd train` runs; pure and slow-ish (run it off the loop)."""
    preds = model.plan(inp.net, inp.comp, inp.model_bytes, model.Options.from_config(cfg), overlap_off=False)
    return model.recommend(preds, peerd_only=True, tie=cfg.plan.tie_fraction)


def describe(p: model.Prediction | None) -> str:
    if p is None:
        return "none"
    return f"{p.algorithm} on {p.topology} ({p.iter_time_s:.3f} s/iteration, {p.speedup:.2f}x All-Reduce)"


class Replanner:
    """Holds the last plan of a running `--algo auto` run; `check` re-plans when inputs moved."""

    def __init__(self, cfg: Config, running: tuple[str, str], inputs: Inputs) -> None:
        self.cfg = cfg
        self.running = running
        self.last = inputs
        self.last_check = 0.0
        self.recommended = running

    def due(self, now: float) -> bool:
        return now - self.last_check >= self.cfg.plan.interval

    def check(self, now: float, current: Inputs) -> str | None:
        """Re-plan if the inputs moved; returns the log line when the recommendation differs from
        what runs (and logs it), else None."""
        self.last_check = now
        why = self.last.moved(current, self.cfg.plan.change_fraction)
        if why is None:
            return None
        self.last = current
        best, second = decide(current, self.cfg)
        rec = (best.algorithm, best.topology)
        log.info("re-planned (%s): best %s; runner-up %s", why, describe(best), describe(second))
        if rec == self.running or rec == self.recommended:
            self.recommended = rec
            return None
        self.recommended = rec
        msg = (f"re-plan ({why}) recommends {describe(best)} instead of the running {self.running[0]} on "
               f"{self.running[1]}; not switched: switching mid-run is unsafe (every host must change "
               f"policy at the same iteration), start the next run with it")
        log.warning("%s", msg)
        return msg
