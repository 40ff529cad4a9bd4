"""What `peerd train` shows of a run: its state, the trainer's metrics, and their rates."""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from peerd.net.links import Ewma
from peerd.v1 import control_pb2 as cpb

log = logging.getLogger("peerd.train")

STEP_EWMA = 0.1   # weight of one step in the step-time averages


@dataclass
class Progress:
    state: str = "waiting"
    message: str = ""
    iteration: int = 0
    loss: float = 0.0
    rate: float = 0.0
    peers_in_last_mix: int = 0
    newest_seen: int = -1
    metric_name: str = ""
    metric: float = 0.0
    restarts: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.monotonic)
    compute_s: Ewma = field(default_factory=Ewma)   # the trainer's gradient time (`peerd plan` reads it)
    step_s: Ewma = field(default_factory=Ewma)      # a whole step, the wait for the mix included
    checkpoint_failures: int = 0                    # as the trainer reports them
    _last_publish: float | None = None

    def published(self, k: int) -> None:
        """Iteration k was published: the iteration rate follows."""
        now = time.monotonic()
        if self._last_publish is not None:
            dt = now - self._last_publish
            self.rate = 1 / dt if self.rate == 0 else 0.8 * self.rate + 0.2 / dt
        self._last_publish = now
        self.iteration = k

    def on_metric(self, m: cpb.Metric) -> None:
        self.loss = m.loss
        if m.extra.get("compute_s", 0) > 0:
            self.compute_s.add(m.extra["compute_s"], STEP_EWMA)
        if m.step_time_s > 0:
            self.step_s.add(m.step_time_s, STEP_EWMA)
        failures = int(m.extra.get("checkpoint_failures", 0))
        if failures > self.checkpoint_failures:
            self.checkpoint_failures = failures
            self.message = (f"checkpoint at iteration {m.iteration} FAILED ({failures} so far; disk full?): "
                            f"training goes on, the previous checkpoint is kept; see the trainer log")
            log.error("%s", self.message)
        if "accuracy" in m.extra:
            self.metric_name, self.metric = "accuracy", m.extra["accuracy"]
        elif "eval_loss" in m.extra:
            self.metric_name, self.metric = "loss", m.extra["eval_loss"]

    def to_message(self, rank: int, world: int, mixes: "MixLedger") -> cpb.TrainProgress:
        gap = self.newest_seen - self.iteration if self.newest_seen >= 0 else 0
        return cpb.TrainProgress(state=self.state, message=self.message, iteration=self.iteration, loss=self.loss,
                                 iterations_per_s=self.rate, peers_in_last_mix=self.peers_in_last_mix,
                                 gap_to_fastest=gap, elapsed_s=time.monotonic() - self.started,
                                 metric_name=self.metric_name, metric=self.metric, rank=rank, world=world,
                                 trainer_restarts=self.restarts, skipped=self.skipped, wall_time=time.time(),
                                 mixes=mixes.total, partial_mixes=mixes.partial, partial_note=mixes.note())

    def step_time(self) -> dict[str, float]:
        return {"compute_mean_s": self.compute_s.mean, "compute_std_s": self.compute_s.spread,
                "step_mean_s": self.step_s.mean, "step_std_s": self.step_s.spread, "samples": self.compute_s.n}


# Why a neighbour was not in a mix. These make the mix partial: the host mixed without a neighbour
# it should have had, and nobody told it why ("lost": its update came, but in a running sum that a
# failed transfer spoiled, peerd.node.run.eagersum). The others do not: "restarting" and "finished" are
# announced by the neighbour's daemon (a crashed trainer restarts a bounded number of times,
# train_max_restarts; a finished one is done), "not waited" is the algorithm's own choice (backup
# workers, staleness, one pulled peer).
PARTIAL_REASONS = ("silent", "dead", "flagged", "lost")


class MixLedger:
    """Every mix answered: how many, how many partial, and who was left out why. A run whose
    mixes were mostly partial ends "degraded", never a plain "done" (D-PSGD that mixed alone is
    local SGD)."""

    def __init__(self) -> None:
        self.total = 0
        self.partial = 0
        self.after_all_finished = 0   # mixes with no neighbour because every one had finished
        self.left_out: collections.Counter[tuple[str, str]] = collections.Counter()   # (node, reason)

    def record(self, left_out: dict[str, str], alone: bool = False) -> None:
        self.total += 1
        for node, reason in left_out.items():
            self.left_out[(node, reason)] += 1
        if any(reason in PARTIAL_REASONS for reason in left_out.values()):
            self.partial += 1
        elif alone and left_out and all(reason == "finished" for reason in left_out.values()):
            self.after_all_finished += 1

    def alone_note(self, hint: str = "") -> str:
        """What the end of a run says when its host went on alone once its neighbours were done
        (with a per-host budget the slow host of an asynchronous algorithm does; "" when it did
        not)."""
        if not self.after_all_finished:
            return ""
        return (f"{self.after_all_finished} of {self.total} mixes had no neighbour: they had all finished"
                + (f" ({hint})" if hint else ""))

    def mostly_partial(self, share: float) -> bool:
        return self.total > 0 and self.partial > share * self.total

    def note(self, most: int = 3) -> str:
        worst = [(k, n) for k, n in self.left_out.most_common() if k[1] in PARTIAL_REASONS][:most]
        return ", ".join(f"{node} {reason} x{n}" for (node, reason), n in worst)

    def state(self) -> dict:
        by: dict[str, dict[str, int]] = {}
        for (node, reason), n in self.left_out.items():
            by.setdefault(node, {})[reason] = n
        return {"total": self.total, "partial": self.partial, "after_all_finished": self.after_all_finished,
                "left_out": by}


class Timings:
    """Seconds spent in the daemon's own passes over a model (means, for status and benchmarks)."""

    def __init__(self) -> None:
        self.sum: collections.Counter[str] = collections.Counter()
        self.count: collections.Counter[str] = collections.Counter()

    def add(self, what: str, seconds: float) -> None:
        self.sum[what] += seconds
        self.count[what] += 1

    def state(self) -> dict[str, float]:
        return {f"{what}_ms": round(1000 * self.sum[what] / n, 3) for what, n in self.count.items()}
