"""`peerd plan check`: the runtime model against measured iteration times.

Input: JSON lines, one measured contender each, with at least
    scenario, contender, profile, model_bytes, step_time_mean, step_time_std, iter_time_s, hosts
(contender: the algorithm as `peerd train --algo` names it, or "ddp" for All-Reduce; optional
topology, default ring, exp-directed for sgp). Per record: the predicted iteration time from the
profile's network (with `hosts` hosts) and those step times, the relative error
(predicted - measured) / measured, flagged beyond 25 %. Per scenario: the contender the model
recommends among those measured, and whether it was the measured fastest or within 10 % of it.

Pure apart from `profile_loader` (the caller's way of reading a profile by name or path).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from peerd.config import Config
from peerd.lab.profile import Profile
from peerd.plan import model, sources

REQUIRED = ("scenario", "contender", "profile", "model_bytes", "step_time_mean", "step_time_std",
            "iter_time_s", "hosts")
ALIASES = {"dpsgd": "d-psgd", "adpsgd": "ad-psgd", "allreduce": "ddp", "all-reduce": "ddp"}
ERROR_BOUND = 0.25
RECOMMEND_BOUND = 0.10


class CheckError(ValueError):
    """A results file the check cannot use; the message names the line and field."""


@dataclass
class Row:
    scenario: str
    contender: str
    topology: str
    measured: float
    predicted: float

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
                          "predicted_s": r.predicted, "error": r.error, "flagged": r.flagged} for r in self.rows]}


def parse_lines(lines: Iterable[str], source: str = "results") -> list[dict[str, Any]]:
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
        for key in REQUIRED:
            if key not in rec:
                raise CheckError(f"{source}:{no}: missing field {key!r} (needs {', '.join(REQUIRED)})")
        for key in ("model_bytes", "step_time_mean", "step_time_std", "iter_time_s", "hosts"):
            v = rec[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise CheckError(f"{source}:{no}: {key}={v!r} is not a number >= 0")
        if rec["iter_time_s"] <= 0 or int(rec["hosts"]) < 1:
            raise CheckError(f"{source}:{no}: iter_time_s must be > 0 and hosts >= 1")
        out.append(rec)
    if not out:
        raise CheckError(f"{source}: no records")
    return out


def check(records: list[dict[str, Any]], profile_loader: Callable[[str, int], Profile],
          cfg: Config | None = None) -> list[Scenario]:
    cfg = cfg or Config()
    opts = model.Options.from_config(cfg)
    nets: dict[tuple[str, int], tuple[Profile, model.Network]] = {}
    by_scen: dict[str, list[Row]] = {}
    for rec in records:
        key = (str(rec["profile"]), int(rec["hosts"]))
        if key not in nets:
            prof = profile_loader(*key)
            nets[key] = (prof, sources.network_from_profile(prof, cfg))
        prof, net = nets[key]
        comp = sources.compute_from_profile(prof, float(rec["step_time_mean"]), float(rec["step_time_std"]))
        algo = str(rec["contender"])
        algo = ALIASES.get(algo, algo)
        topo = str(rec.get("topology") or ("exp-directed" if algo == "sgp" else "ring"))
        try:
            pred = model.predict_one(net, comp, float(rec["model_bytes"]), algo, topo, opts, overlap=True)
        except ValueError as e:
            raise CheckError(f"scenario {rec['scenario']}, contender {algo}: {e}") from None
        by_scen.setdefault(str(rec["scenario"]), []).append(
            Row(str(rec["scenario"]), algo, topo, float(rec["iter_time_s"]), float(pred)))
    out = []
    for name, rows in by_scen.items():
        out.append(Scenario(name, rows, min(rows, key=lambda r: r.predicted), min(rows, key=lambda r: r.measured)))
    return out


def render(scens: list[Scenario]) -> str:
    lines = [f"{'scenario':16s} {'contender':20s} {'topology':12s} {'measured_s':>10s} {'predicted_s':>11s} "
             f"{'error':>7s}"]
    lines.append("-" * len(lines[0]))
    for s in scens:
        for r in s.rows:
            lines.append(f"{s.name:16s} {r.contender:20s} {r.topology:12s} {r.measured:10.4f} {r.predicted:11.4f} "
                         f"{r.error:+7.1%}{'  > 25 %' if r.flagged else ''}")
    lines.append("")
    for s in scens:
        verdict = "ok" if s.recommendation_ok else "MISSED"
        lines.append(f"{s.name}: recommends {s.recommended.contender} (measured {s.recommended.measured:.4f} s), "
                     f"measured fastest {s.fastest.contender} ({s.fastest.measured:.4f} s): {verdict}")
    bad = sum(r.flagged for s in scens for r in s.rows)
    total = sum(len(s.rows) for s in scens)
    lines.append(f"{total - bad} of {total} predictions within 25 %; "
                 f"{sum(s.recommendation_ok for s in scens)} of {len(scens)} recommendations within 10 % of the fastest")
    return "\n".join(lines)
