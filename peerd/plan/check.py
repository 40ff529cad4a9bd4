"""`peerd plan check`: the runtime model against measured iteration times.

Input: JSON lines, one measured contender each (`peerd bench scenarios` records), with at least
    scenario, contender, profile, model_bytes, iter_time_s, hosts, per_host
(contender: the algorithm as `peerd train --algo` names it, or "ddp" for All-Reduce; optional
topology, default ring, exp-directed for sgp).

One definition of iteration time on both sides: a host's wall seconds per iteration (skipped
ones count) over its steady part (after its first 10 % of steps, until the first host of the run
finished: every host running), averaged over the hosts (record field
iter_time_s; peerd.bench.scenarios.host_times). For synchronous contenders every host runs at the
same pace, for asynchronous ones (NetMax, AD-PSGD) each at its own; the model predicts that mean.

Inputs to the model, all measured in the record, nothing from the profile on top of them:
- per host compute (per_host[h].compute_mean_s / compute_std_s: the paced gradient time, the
  straggler's slowdown and random slowdowns included as they happened);
- per host overhead O (per_host[h].overhead_s: the step's time outside compute and the mix call:
  publish, evaluation, checkpoint, progress reports, trace; so no waiting leaks in, and the mix
  call's own cost of a few ms is on the predicted side, unmodelled); absent (older records):
  Config.plan_overhead;
- the ring order (per_host[h].rank; absent: host order);
- the network from the profile (links are not measured per run); the model's links are ideal TCP
  at the goodput of their rate, which a lab host on cubic matches (docs/bench/experiments/
  allreduce_tcp.py: gloo's all-reduce of 1.1 MB on the star, 1.529 s against the ring's 1.53 s)
  and one on bbr does not behind a shallow queue fed by a faster link (1.743 s, some 250
  retransmitted segments per all-reduce from each 100 Mbit host); the table's tcp column says
  which ran (record field tcp_congestion_control);
- DDP without overlap: the benchmark pads compute before backward(), so its all-reduces hide
  behind nothing.
Records older than per-host compute (no compute_mean_s) fall back to each host's busy share
(1 - idle_fraction) * duration_s / steps with no spread, and say so.

Per record: the predicted iteration time, the relative error (predicted - measured) / measured,
flagged beyond 25 %, and the machine's busy share of its cores over the run (record field
cpu_busy; at 90 % or more the hosts queued for cores, which the model, a core per host, does not
know: asynchronous contenders never idle, so six of them on two cores are CPU-bound). Per scenario: the contender the model recommends among those measured, and
whether it was the measured fastest or within 10 % of it; with several seeds, both compare each
contender's median over its seeds.

Pure apart from `profile_loader` (the caller's way of reading a profile by name or path).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from peerd.config import Config
from peerd.lab.profile import Profile
from peerd.plan import model, sources

REQUIRED = ("scenario", "contender", "profile", "model_bytes", "iter_time_s", "hosts", "per_host")
ALIASES = {"dpsgd": "d-psgd", "adpsgd": "ad-psgd", "allreduce": "ddp", "all-reduce": "ddp"}
ERROR_BOUND = 0.25
RECOMMEND_BOUND = 0.10
CPU_SATURATED = 0.9   # a machine this busy over a run ran its hosts short of cores


class CheckError(ValueError):
    """A results file the check cannot use; the message names the line and field."""


@dataclass
class Row:
    scenario: str
    contender: str
    topology: str
    measured: float
    predicted: float
    exact: bool = True          # per-host compute measured (False: an older record's busy share)
    overhead: bool = True       # per-host overhead measured (False: Config.plan_overhead)
    load: float | None = None   # the machine's load average during the run (record's load_avg, max)
    tcp: str | None = None      # the lab hosts' TCP congestion control (None: an older record)
    cpu: float | None = None    # the machine's busy share of all cores over the run (record's cpu_busy)

    @property
    def cpu_saturated(self) -> bool:
        """The hosts queued for cores: the model, which gives each host a core, does not apply."""
        return self.cpu is not None and self.cpu >= CPU_SATURATED

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def flagged(self) -> bool:
        return bool(abs(self.error) > ERROR_BOUND)


@dataclass
class Scenario:
    name: str
    rows: list[Row]
    recommended: Row
    fastest: Row

    @property
    def recommendation_ok(self) -> bool:
        return bool(self.recommended.measured <= (1 + RECOMMEND_BOUND) * self.fastest.measured)

    def record(self) -> dict[str, Any]:
        return {"scenario": self.name, "recommended": self.recommended.contender,
                "measured_fastest": self.fastest.contender, "recommendation_ok": self.recommendation_ok,
                "rows": [{"contender": r.contender, "topology": r.topology, "measured_s": r.measured,
                          "predicted_s": r.predicted, "error": r.error, "flagged": r.flagged,
                          "compute_measured_per_host": r.exact, "overhead_measured": r.overhead,
                          "load_avg": r.load, "tcp_congestion_control": r.tcp, "cpu_busy": r.cpu,
                          "cpu_saturated": r.cpu_saturated}
                         for r in self.rows]}


def parse_lines(lines: Iterable[str], source: str = "results",
                skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of a results file; a failed run's record (field error) is an error, or, given
    `skipped`, left out and noted there."""
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CheckError(f"{source}:{no}: not JSON: {e}") from None
        if not isinstance(rec, dict):
            raise CheckError(f"{source}:{no}: expected a JSON object")
        if rec.get("error"):  # a failed run's times are not an iteration time
            if skipped is None:
                raise CheckError(f"{source}:{no}: {rec.get('scenario')}/{rec.get('contender')} failed: {rec['error']}")
            skipped.append(f"{source}:{no}: {rec.get('scenario')}/{rec.get('contender')} failed, left out")
            continue
        for key in REQUIRED:
            if key not in rec:
                raise CheckError(f"{source}:{no}: missing field {key!r} (needs {', '.join(REQUIRED)})")
        if not isinstance(rec["per_host"], dict) or not rec["per_host"]:
            raise CheckError(f"{source}:{no}: per_host must be an object host -> times")
        for key in ("model_bytes", "iter_time_s", "hosts"):
            v = rec[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise CheckError(f"{source}:{no}: {key}={v!r} is not a number >= 0")
        if rec["iter_time_s"] <= 0 or int(rec["hosts"]) < 1:
            raise CheckError(f"{source}:{no}: iter_time_s must be > 0 and hosts >= 1")
        out.append(rec)
    if not out:
        raise CheckError(f"{source}: no records")
    return out


def host_inputs(rec: dict[str, Any], prof: Profile) -> tuple[list[int], model.Compute, tuple[float, ...] | None, bool]:
    """(order, compute, overheads, exact) of a record, in rank order: order[r] is the profile's
    index of the host with rank r; overheads None where the record has none; exact False for the
    older records whose compute is a busy share without spread."""
    ph = rec["per_host"]
    names = [h.name for h in prof.hosts][: int(rec["hosts"])]
    missing = [h for h in names if h not in ph]
    if missing:
        raise CheckError(f"scenario {rec['scenario']}, contender {rec['contender']}: per_host lacks {', '.join(missing)}")
    ranks = [ph[h].get("rank") for h in names]
    order = list(range(len(names)))
    if all(isinstance(r, int) for r in ranks) and sorted(ranks) == order:
        order = sorted(order, key=lambda i: ranks[i])
    hs = [ph[names[i]] for i in order]
    if all("compute_mean_s" in v for v in hs):
        comp = model.Compute([v["compute_mean_s"] for v in hs], [v.get("compute_std_s", 0.0) for v in hs])
        exact = True
    elif all({"steps", "duration_s", "idle_fraction"} <= v.keys() for v in hs):
        comp = model.Compute([(1 - v["idle_fraction"]) * v["duration_s"] / v["steps"] for v in hs], [0.0] * len(hs))
        exact = False
    else:
        raise CheckError(f"scenario {rec['scenario']}, contender {rec['contender']}: per_host needs "
                         f"compute_mean_s (or steps, duration_s, idle_fraction) on every host")
    over = tuple(float(v["overhead_s"]) for v in hs) if all(v.get("overhead_s") is not None for v in hs) else None
    return order, comp, over, exact


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _load(rec: dict[str, Any]) -> float | None:
    la = rec.get("load_avg")
    if isinstance(la, list) and la and all(isinstance(x, (int, float)) for x in la):
        return float(max(la))
    return None


def check(records: list[dict[str, Any]], profile_loader: Callable[[str, int], Profile],
          cfg: Config | None = None) -> list[Scenario]:
    cfg = cfg or Config()
    opts = model.Options.from_config(cfg)
    profs: dict[tuple[str, int], Profile] = {}
    by_scen: dict[str, list[Row]] = {}
    for rec in records:
        key = (str(rec["profile"]), int(rec["hosts"]))
        if key not in profs:
            profs[key] = profile_loader(*key)
        prof = profs[key]
        order, comp, over, exact = host_inputs(rec, prof)
        net = sources.permute(sources.network_from_profile(prof, cfg), order)
        algo = str(rec["contender"])
        algo = ALIASES.get(algo, algo)
        topo = str(rec.get("topology") or ("exp-directed" if algo == "sgp" else "ring"))
        o = replace(opts, overhead=over) if over is not None else opts
        if "--train-coalesce-updates" in str(rec.get("daemon_args") or "").split():
            o = replace(o, coalesce=True)     # the lab's daemons coalesced queued updates
        try:
            # The benchmark's DDP worker pads its compute before backward(), where DDP all-reduces,
            # so nothing hides its communication; peerd's trainer always overlaps.
            pred = model.predict_one(net, comp, float(rec["model_bytes"]), algo, topo, o,
                                     overlap=algo != model.DDP)
        except ValueError as e:
            raise CheckError(f"scenario {rec['scenario']}, contender {algo}: {e}") from None
        by_scen.setdefault(str(rec["scenario"]), []).append(
            Row(str(rec["scenario"]), algo, topo, float(rec["iter_time_s"]), float(pred), exact, over is not None,
                _load(rec), rec.get("tcp_congestion_control"), _number(rec.get("cpu_busy"))))
    out = []
    for name, rows in by_scen.items():
        per = medians(rows)
        out.append(Scenario(name, rows, min(per, key=lambda r: r.predicted), min(per, key=lambda r: r.measured)))
    return out


def medians(rows: list[Row]) -> list[Row]:
    """One row per (contender, topology): the median measured and predicted time over its seeds, so
    the recommendation compares contenders, not one contender's lucky seed with another's."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.contender, r.topology), []).append(r)
    return [Row(g[0].scenario, c, t, statistics.median(r.measured for r in g),
                statistics.median(r.predicted for r in g), all(r.exact for r in g), all(r.overhead for r in g))
            for (c, t), g in groups.items()]


def render(scens: list[Scenario]) -> str:
    lines = [f"{'scenario':16s} {'contender':20s} {'topology':12s} {'measured_s':>10s} {'predicted_s':>11s} "
             f"{'error':>7s} {'load':>5s} {'cpu':>4s} {'tcp':>5s}"]
    lines.append("-" * len(lines[0]))
    for s in scens:
        for r in s.rows:
            lines.append(f"{s.name:16s} {r.contender:20s} {r.topology:12s} {r.measured:10.4f} {r.predicted:11.4f} "
                         f"{r.error:+7.1%} {'' if r.load is None else f'{r.load:5.1f}':>5s} "
                         f"{'?' if r.cpu is None else f'{r.cpu:.0%}':>4s} {r.tcp or '?':>5s}"
                         f"{'  > 25 %' if r.flagged else ''}"
                         f"{'  (CPU saturated: the hosts queued for cores)' if r.cpu_saturated else ''}"
                         f"{'' if r.exact else '  (old record: busy share, no spread)'}"
                         f"{'' if r.overhead or not r.exact else '  (no measured overhead)'}")
    lines.append("")
    for s in scens:
        verdict = "ok" if s.recommendation_ok else "MISSED"
        lines.append(f"{s.name}: recommends {s.recommended.contender} (measured {s.recommended.measured:.4f} s), "
                     f"measured fastest {s.fastest.contender} ({s.fastest.measured:.4f} s): {verdict}")
    bad = sum(r.flagged for s in scens for r in s.rows)
    total = sum(len(s.rows) for s in scens)
    lines.append(f"{total - bad} of {total} predictions within 25 %; "
                 f"{sum(s.recommendation_ok for s in scens)} of {len(scens)} recommendations within 10 % of the fastest")
    starved = [r for s in scens for r in s.rows if r.cpu_saturated]
    if starved:
        fed = total - len(starved)
        lines.append(f"{len(starved)} run(s) on a machine at least {CPU_SATURATED * 100:.0f} % busy "
                     f"({sum(r.flagged for r in starved)} of them beyond 25 %): the model gives each host a core; "
                     f"{fed - (bad - sum(r.flagged for r in starved))} of the other {fed} within 25 %")
    return "\n".join(lines)
