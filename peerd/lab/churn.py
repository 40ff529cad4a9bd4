"""Churn in the lab: cut and heal the links between sites, kill and restart hosts, and the chaos run
behind `peerd lab chaos`, which does both at random during a training run and reports what it did.

Design choices:
- A cut takes a site's uplink port off the core bridge (`ip link set PORT nomaster` inside the
  switch namespace); a heal puts it back. No device is deleted or set down, so shaping, the delay
  wires and every address survive a cut untouched: packets between sites simply find no path, as
  in a WAN outage, while traffic inside a site is unaffected. The cut sites are recorded in the
  lab's state file, so `heal` works after a crashed `cut`, and `down` needs nothing special.
- Killing a host SIGKILLs every process in its namespace (daemon, trainer, `peerd train`): a
  machine gone at once, no goodbye. A restart starts the daemon again with its recorded command
  line and data dir (same node id, same checkpoints), as a rebooted machine would.
- Chaos kills a random live host every `kill_every` s and restarts it `down_for` s later, then
  starts `peerd train` there again with the run's arguments: the run's world stays the same set of
  hosts, so the host rejoins the same run (same tag) and starts from a neighbour's parameters.
  Downtimes overlap (up to `max_down` hosts down or rejoining at once; restarts run in parallel,
  only their spawn holds the lab's lock): a restart costs a daemon, a `peerd train` and a trainer
  start, tens of seconds on a loaded machine, so one host at a time fits few cycles in a run. A
  host restarted before its neighbours' failure detector saw it dead is a new incarnation to them,
  which they treat as a crash and a return. Stalls are measured per live host from its own
  progress records (their `t`, the daemon's clock: wall time between iteration advances, up to the
  host's own end of the run); a host's stall while it is down or rejoining does not count, its
  re-admission time does (daemon restart -> first progress record past its join iteration with a
  peer in its last mix).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerd.config import Config
from peerd.lab import lab as lab_mod
from peerd.lab import netns
from peerd.lab.netns import LabError


# --- partitions ---------------------------------------------------------------------------------

def cut(lab_dir: str | Path, sites: list[str] | None = None, cfg: Config | None = None) -> list[str]:
    """Cut `sites` (default: every site) off the core: no traffic between sites until `heal`.
    Returns the sites cut now."""
    cfg = cfg or Config()
    netns.require_root()
    lab_dir = Path(lab_dir)
    with lab_mod._locked(lab_dir):
        state = lab_mod.read_state(lab_dir)
        ups = state.get("uplinks") or {}
        if not ups:
            raise LabError(f"lab {state['id']} has one site (or predates cut/heal): nothing to cut")
        want = list(ups) if not sites else sites
        bad = [s for s in want if s not in ups]
        if bad:
            raise LabError(f"site: unknown {', '.join(bad)} (sites: {', '.join(ups)})")
        done = set(state.get("cut", []))
        now = [s for s in want if s not in done]
        if now:
            netns.batch("ip", state["switch"], [f"link set {ups[s]} nomaster" for s in now], cfg.lab.cmd_timeout)
        state["cut"] = sorted(done | set(now))
        lab_mod._save(lab_dir, state)
        return now


def heal(lab_dir: str | Path, cfg: Config | None = None) -> list[str]:
    """Undo every cut; returns the sites healed."""
    cfg = cfg or Config()
    netns.require_root()
    lab_dir = Path(lab_dir)
    with lab_mod._locked(lab_dir):
        state = lab_mod.read_state(lab_dir)
        ups, was = state.get("uplinks") or {}, state.get("cut", [])
        if was:
            netns.batch("ip", state["switch"], [f"link set {ups[s]} master {state['core']}" for s in was],
                        cfg.lab.cmd_timeout)
        state["cut"] = []
        lab_mod._save(lab_dir, state)
        return was


# --- hosts --------------------------------------------------------------------------------------

def kill_host(lab_dir: str | Path, host: str, cfg: Config | None = None) -> list[int]:
    """SIGKILL every process in `host`'s namespace; returns their pids."""
    cfg = cfg or Config()
    lb = lab_mod.Lab(lab_dir)
    pids = netns.ns_pids(lb.ns(host), cfg.lab.cmd_timeout)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + cfg.lab.stop_grace + 5
    while netns.ns_pids(lb.ns(host), cfg.lab.cmd_timeout):
        if time.monotonic() > deadline:
            raise LabError(f"host {host}: processes {netns.ns_pids(lb.ns(host), cfg.lab.cmd_timeout)} survive SIGKILL")
        time.sleep(0.05)
    return pids


def restart_host(lab_dir: str | Path, host: str, cfg: Config | None = None) -> int:
    """Start `host`'s daemon again (its recorded command line, its data dir); returns its pid once
    its control socket is there."""
    proc = spawn_daemon(lab_dir, host)
    await_daemon(lab_dir, host, proc, cfg)
    return proc.pid


def spawn_daemon(lab_dir: str | Path, host: str) -> subprocess.Popen:
    """The first half of `restart_host`: start the daemon and record it in the lab's state (the
    part that holds the lab's lock), without waiting for it."""
    lab_dir = Path(lab_dir)
    state = lab_mod.read_state(lab_dir)
    h = state["hosts"].get(host)
    if h is None or "argv" not in h:
        raise LabError(f"host {host!r}: no recorded daemon command line in lab {state['id']}")
    (Path(h["data_dir"]) / "peerd.sock").unlink(missing_ok=True)   # a SIGKILLed daemon's: readiness is the new one
    proc = netns.spawn(h["ns"], h["argv"], env=lab_mod._child_env({"PEERD_SLOWDOWN": f"{h['slowdown']:g}"}),
                       log=lab_dir / host / "daemon.log")
    with lab_mod._locked(lab_dir):
        lab_mod._record(lab_dir, lab_mod.read_state(lab_dir), f"daemon:{host}", proc.pid)
    return proc


def await_daemon(lab_dir: str | Path, host: str, proc: subprocess.Popen, cfg: Config | None = None) -> None:
    """The second half of `restart_host`: wait (at most lab_ready_timeout) for its control socket."""
    cfg = cfg or Config()
    lab_dir = Path(lab_dir)
    sock = Path(lab_mod.read_state(lab_dir)["hosts"][host]["data_dir"]) / "peerd.sock"
    log = lab_dir / host / "daemon.log"
    deadline = time.monotonic() + cfg.lab.ready_timeout
    while not sock.exists():
        if proc.poll() is not None:
            raise LabError(f"daemon of {host} exited with code {proc.returncode} on restart; log {log}")
        if time.monotonic() > deadline:
            raise LabError(f"daemon of {host} not ready {cfg.lab.ready_timeout:g} s after restart; log {log}")
        time.sleep(0.05)


# --- training runs in the lab -------------------------------------------------------------------

class TrainStream:
    """One `peerd train --json` inside a host's namespace; its records read by a thread."""

    def __init__(self, lb: lab_mod.Lab, host: str, args: list[str]) -> None:
        self.host, self.records = host, []
        self.proc = lb.popen(host, [sys.executable, "-m", "cli.main", "train", "--json", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    pass

    def iteration(self) -> int:
        return max((r.get("iteration", 0) for r in self.records), default=0)

    def last(self) -> dict[str, Any]:
        return self.records[-1] if self.records else {}

    def finish(self, timeout: float) -> list[dict]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(5)
        return self.records


def stall_bound(cfg: Config, overlapping: bool, silent: float | None = None) -> float:
    """How long a live host may go without an iteration under churn: one wait for a neighbour that
    crashed (dead_after) or whose restarted trainer is not contributing yet (train_silent_peer_timeout,
    or `silent` where the daemons run with another), plus churn_stall_slack. Two waits where
    downtimes overlap: a host then re-admits neighbours coming back one after another, each at a
    lower iteration than its own, and waits each time for a fresh trainer to compute its way up
    (measured in a 6-host chaos run with 4 down at once: three re-admissions 2 s apart stalled two
    hosts 7.0 and 7.4 s, no single wait reaching the silent bound)."""
    one = max(cfg.membership.dead_after, cfg.train.silent_peer_timeout if silent is None else silent)
    return (2 if overlapping else 1) * one + cfg.lab.churn_stall_slack


def longest_stall(records: list[dict], t0: float, t1: float, exclude: list[tuple[float, float]] = ()) -> float:
    """Longest wall time within [t0, t1] between two advances of a host's iteration, not counting
    the intervals in `exclude` (the host down or rejoining)."""
    return longest_stall_window(records, t0, t1, exclude)[0]


def longest_stall_window(records: list[dict], t0: float, t1: float,
                         exclude: list[tuple[float, float]] = ()) -> tuple[float, float, float]:
    """longest_stall, with the advances that bound it: (stall, from, to)."""
    points, last_k, worst, last_t = [], -1, (0.0, t0, t0), t0
    for r in records:
        t = r.get("t", 0)
        if t0 <= t <= t1 and r.get("iteration", 0) > last_k:
            last_k = r["iteration"]
            points.append(t)
    for t in [*points, t1]:
        gap = t - last_t
        for a, b in exclude:  # minus the part of the gap inside an excluded interval
            gap -= max(0.0, min(t, b) - max(last_t, a))
        if gap > worst[0]:
            worst = (gap, last_t, t)
        last_t = t
    return worst


@dataclass
class ChaosReport:
    duration_s: float
    kills: list[dict] = field(default_factory=list)        # host, killed_at, restarted_at, readmitted_s
    stalls: dict[str, float] = field(default_factory=dict)  # host -> longest stall while live (s)
    stall_windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # host -> its (from, to), run time
    accuracy: dict[str, float] = field(default_factory=dict)
    calm_accuracy: dict[str, float] = field(default_factory=dict)
    cuts: list[dict] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        readm = [k["readmitted_s"] for k in self.kills if k.get("readmitted_s") is not None]
        return {"duration_s": round(self.duration_s, 1), "kills": self.kills, "cuts": self.cuts,
                "longest_stall_s": round(max(self.stalls.values(), default=0.0), 2),
                "stall_per_host_s": {h: round(s, 2) for h, s in self.stalls.items()},
                # when the longest stall of each host began and ended (s into the run: compare with
                # the kills' killed_at and restarted_at, those of its neighbours above all)
                "stall_window_per_host_s": {h: [round(a, 2), round(b, 2)] for h, (a, b) in self.stall_windows.items()},
                "readmission_s_max": round(max(readm), 2) if readm else None,
                "not_readmitted": [k["host"] for k in self.kills if k.get("readmitted_s") is None],
                "final_accuracy": self.accuracy, "calm_accuracy": self.calm_accuracy, "final_state": self.states}


def train_all(lb: lab_mod.Lab, args: list[str], timeout: float) -> dict[str, list[dict]]:
    """A calm run: `peerd train` on every host, to the end."""
    streams = [TrainStream(lb, h, args) for h in lb.hosts]
    return {s.host: s.finish(timeout) for s in streams}


def chaos(lab_dir: str | Path, train_args: list[str], *, duration: float, kill_every: float, down_for: float,
          cut_links: bool = False, cut_for: float = 3.0, seed: int = 0, timeout: float = 600.0,
          max_kills: int | None = None, max_down: int | None = None, cfg: Config | None = None,
          log=print) -> ChaosReport:
    """Train on every host of the lab and, for `duration` seconds once all are training, kill a
    random host every `kill_every` s; each killed host is restarted (daemon, then `peerd train`)
    `down_for` s later, in the background. A host is killed again only once it is back in the run,
    and at most `max_down` (default: a third of the hosts) are down or rejoining at once. With
    `cut_links`, every third cycle cuts the sites apart for `cut_for` s instead. `max_kills` ends
    the chaos after that many kills. Then wait for the re-admissions and the end of the run, and
    report (see ChaosReport)."""
    cfg = cfg or Config()
    lb = lab_mod.Lab(lab_dir)
    rng = random.Random(seed)
    max_down = max(1, len(lb.hosts) // 3) if max_down is None else max_down
    streams = {h: TrainStream(lb, h, train_args) for h in lb.hosts}
    retired: dict[str, list[TrainStream]] = {h: [] for h in lb.hosts}
    report = ChaosReport(duration)
    down: dict[str, list[tuple[float, float]]] = {h: [] for h in lb.hosts}
    away: set[str] = set()                 # killed, not yet back in the run
    state_lock = threading.Lock()          # the lab's state file: one writer at a time
    errors: list[str] = []
    _await_training(streams, time.monotonic() + cfg.lab.ready_timeout + 120)
    t_start = time.time()

    def bring_back(host: str, entry: dict) -> None:
        time.sleep(down_for)
        t_restart = time.time()
        try:
            with state_lock:     # only the spawn: restarts of several hosts overlap
                proc = spawn_daemon(lab_dir, host)
            await_daemon(lab_dir, host, proc, cfg)
        except LabError as e:
            errors.append(str(e))
            return
        entry["restarted_at"] = round(t_restart - t_start, 2)
        entry["daemon_ready_s"] = round(time.time() - t_restart, 2)
        retired[host].append(streams[host])
        streams[host] = TrainStream(lb, host, train_args)
        entry["_t"] = t_restart   # last: re-admission is read from the new stream only

    threads = []
    end = time.monotonic() + duration
    cycle = 0
    multi = len(lab_mod.read_state(lab_dir).get("uplinks") or {}) > 1
    while time.monotonic() < end and (max_kills is None or len(report.kills) < max_kills) and not errors:
        cycle += 1
        t_cycle = time.monotonic()
        _note_readmissions(report, streams, down, away)
        if cut_links and multi and cycle % 3 == 0:
            t0 = time.time()
            with state_lock:
                cut(lab_dir, cfg=cfg)
            time.sleep(cut_for)
            with state_lock:
                heal(lab_dir, cfg=cfg)
            report.cuts.append({"at": round(t0 - t_start, 2), "for_s": cut_for})
            log(f"chaos: cycle {cycle}: sites cut for {cut_for:g} s")
        else:
            ready = [h for h, st in streams.items() if h not in away and st.proc.poll() is None]
            if not ready or len(away) >= max_down:
                time.sleep(0.2)
                cycle -= 1
                continue
            host = rng.choice(ready)
            t_kill = time.time()
            kill_host(lab_dir, host, cfg)
            streams[host].finish(5)
            away.add(host)
            down[host].append((t_kill, float("inf")))
            entry = {"host": host, "killed_at": round(t_kill - t_start, 2), "_kill": t_kill}
            report.kills.append(entry)
            th = threading.Thread(target=bring_back, args=(host, entry), daemon=True)
            th.start()
            threads.append(th)
            log(f"chaos: cycle {cycle}: killed {host} ({len(report.kills)} kills)")
        time.sleep(max(0.0, kill_every - (time.monotonic() - t_cycle)))
    for th in threads:
        th.join(down_for + cfg.lab.ready_timeout + 10)
    # Wait for the last re-admissions (bounded), then for the end of the run.
    t_wait = time.monotonic() + cfg.lab.churn_readmit_bound + 30
    while away and time.monotonic() < t_wait:
        _note_readmissions(report, streams, down, away)
        time.sleep(0.2)
    _conclude(report, streams, retired, down, t_start, timeout)
    if errors:
        raise LabError("chaos: " + "; ".join(errors))
    return report


def _await_training(streams: dict[str, "TrainStream"], deadline: float) -> None:
    """Until every host's run has published its first iteration (LabError past `deadline`)."""
    while not all(s.iteration() >= 1 for s in streams.values()):
        if time.monotonic() > deadline:
            raise LabError("chaos: the run did not start on every host: "
                           + "; ".join(f"{h}: {s.last()}" for h, s in streams.items()))
        time.sleep(0.2)


def _conclude(report: "ChaosReport", streams: dict[str, "TrainStream"], retired: dict[str, list["TrainStream"]],
              down: dict[str, list[tuple[float, float]]], t_start: float, timeout: float) -> None:
    """Wait for the end of the run on every host, then fill in states, accuracy and stalls."""
    t_chaos_end = time.time()
    for h, st in streams.items():
        st.finish(timeout)
        last = st.last()
        report.states[h] = last.get("state", "none")
        report.accuracy[h] = round(float(last.get("metric", 0.0)), 4)
    for k in report.kills:
        k.pop("_t", None)
        k.pop("_kill", None)
        k.setdefault("readmitted_s", None)
    for h in streams:
        recs = [r for st in [*retired[h], streams[h]] for r in st.records]
        recs.sort(key=lambda r: r.get("t", 0))
        # Up to its end of the run: a host that finished first is done, not stalled.
        t_end = min([r["t"] for r in recs if r.get("state") == "done" and "t" in r] + [t_chaos_end])
        stall, a, b = longest_stall_window(recs, t_start, t_end, down[h])
        report.stalls[h], report.stall_windows[h] = stall, (a - t_start, b - t_start)


def _note_readmissions(report: ChaosReport, streams: dict[str, TrainStream],
                       down: dict[str, list[tuple[float, float]]], away: set[str]) -> None:
    """A restarted host is re-admitted when its new `peerd train` reports an iteration past the one
    it joined at with at least one peer in its last mix (it trains and mixes again); its down
    interval ends there."""
    for k in report.kills:
        if "readmitted_s" in k or "_t" not in k:
            continue
        st = streams[k["host"]]
        recs = [r for r in st.records if r.get("state") == "training" and r.get("iteration", 0) > 0]
        joined = recs[0]["iteration"] if recs else None
        back = next((r for r in recs if r["iteration"] > joined and r.get("peers_in_last_mix", 0) >= 1), None)
        if back is not None:
            t = back["t"]
            k["readmitted_s"] = round(t - k["_t"], 2)
            k["back_after_kill_s"] = round(t - k["_kill"], 2)
            k["joined_at_iteration"] = joined
            k["join_note"] = next((r.get("message", "") for r in st.records if "from" in r.get("message", "")), "")
            a, _ = down[k["host"]][-1]
            down[k["host"]][-1] = (a, t)
            away.discard(k["host"])
