"""`peerd bench scenarios`: every contender on every heterogeneity scenario, in the lab.

Design choices:
- One lab (network namespaces, shaped links, one daemon per host) per scenario, reused by every
  contender and seed of that scenario; torn down in `finally`, whatever happens.
- peerd contenders run exactly as users run them: `peerd train` on every host. The All-Reduce
  baseline runs as torchrun users run it: `python -m torch.distributed.run --nnodes N --node-rank
  R --master-addr <h1> ...` inside each host's namespace (peerd/bench/ddp_worker.py), next to the
  idle daemons, so both see the same background traffic.
- Compute is emulated (peerd/train/pace.py): each step is padded with `sleep` to `step_time`
  times the host's slowdown (and, in the random-slowdown scenario, times 5 with probability 0.1
  per iteration, deterministic in seed/rank/iteration). Six hosts on two cores are then not
  CPU-bound, and compute, not per-iteration overhead, is the unit of time.
- The model is `digits-wide` (1.1 MB of float32 parameters), so an exchange costs ~9 ms at 1 Gbit
  and ~176 ms at 50 Mbit: communication matters. Bytes sent are each host's eth0 tx counter from
  the first step of the run to its last (everything the host sent, the daemons' heartbeats and
  link probes included, for DDP runs too: the daemons stay up).
- Time to target is measured from the first step any host starts until the mean of the hosts'
  newest evaluated accuracies reaches the target (DDP's ranks hold the same model); null when
  the run ends first. Final accuracy is that of the average of the hosts' final models.
"""
from __future__ import annotations

import collections
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from peerd.bench.report import load_records
from peerd.config import Config
from peerd.lab import lab, profile


@dataclass(frozen=True)
class Scenario:
    name: str
    profile: str
    hosts: int
    description: str
    slow_prob: float = 0.0
    slow_factor: float = 1.0


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("homogeneous", "lan", 6, "6 hosts, every pair 1 Gbit"),
    Scenario("straggler", "straggler", 6, "6 hosts at 1 Gbit, h1 computes 4x slower"),
    Scenario("random-slowdowns", "lan", 6, "6 hosts at 1 Gbit, each iteration each host 5x slower with p=0.1",
             slow_prob=0.1, slow_factor=5.0),
    Scenario("two-sites", "two-sites-6", 6, "3+3 hosts, 1 Gbit inside a site, 50 Mbit / 20 ms between"),
    Scenario("mixed-links", "star-6", 6, "star of 6 hosts with 10/10/100/100/1000/1000 Mbit access links"),
    # Reachability (docs/nat.md): the same 2+2 lab with and without site b behind NAT. Not in the
    # default set; DDP cannot run behind NAT (its ranks dial each other directly).
    Scenario("two-sites-4", "two-sites", 4, "2+2 hosts, 1 Gbit inside a site, 50 Mbit / 20 ms between"),
    Scenario("two-sites-nat", "two-sites-nat", 4, "two-sites-4 with site b behind NAT: peerd tunnels"),
]}
DEFAULT_SCENARIOS = ["homogeneous", "straggler", "random-slowdowns", "two-sites", "mixed-links"]
CONTENDERS = ["ddp", "d-psgd", "ad-psgd", "hop", "hop-backup-skip", "hop-staleness", "aau", "netmax"]
# D-PSGD is left out of --quick to fit 30 minutes (Settings.quick); the full run has it.
QUICK_CONTENDERS = ["ddp", "hop-backup-skip", "netmax"]
BASELINES = ("ddp", "d-psgd")
# Faster failure detection than the defaults; nothing that changes what is measured.
DAEMON_ARGS = ("--heartbeat-interval", "0.5")


@dataclass
class Settings:
    task: str = "digits-wide"
    iterations: int = 200
    eval_every: int = 10
    target: float = 0.85
    step_time: float = 0.1        # emulated compute seconds per step on a host with slowdown 1
    topology: str = "ring"
    non_iid: bool = False         # label-sorted shards: each host sees few classes, so mixing decides accuracy
    async_budget: str = "host"    # asynchronous contenders: each host's iterations, or the swarm's (--budget)
    hosts: int | None = None      # override every scenario's host count (tests)
    daemon_args: str = ""         # extra `peerd up` flags for every lab daemon, space-separated (ablations)

    @classmethod
    def quick(cls) -> "Settings":
        """Sized for 30 minutes on this 2-core machine. Estimate (2026-12-02): the runtime model
        on the scenario profiles puts the training walls of the quick runs at 100 iterations at
        ~11 min (with D-PSGD: ~16 min; mixed-links dominates, 10 Mbit access links make an exchange
        ~0.9 s; measured walls ran up to 1.4x the model under load); each run adds start-up and
        wrap-up (torch imports, the world forming, the averaged model's evaluation): 29-41 s per
        run at load 14-18, up to 210 s at load 45; each lab ~45 s. Quiet machine: ~11-15 + 15 x
        0.5 + 4 = ~23-27 min. Fewer iterations do not help: at 60 the hosts' mean accuracy reaches
        80 % only at the last evaluation or not at all. Since each lab waits for its link
        warm-up (65-75 s, _wait_quiet), the whole quick run took 27.7 min (2026-12-03)."""
        return cls(iterations=100, target=0.8)


# --- helpers ----------------------------------------------------------------------------------

def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


class TxSampler:
    """Each lab host's eth0 tx byte counter and its TCP segment counters (sent, retransmitted),
    sampled every `interval` seconds from /proc/<daemon pid>/net/{dev,snmp} (the daemon lives in
    the host's namespace; no process spawned per sample), so a run's bytes count only between its
    first step and its last, not its startup. Retransmissions say how much of a shaped link's time
    went to resending what its queue dropped."""

    BYTES, TCP_OUT, TCP_RETRANS = 1, 2, 3    # fields of a sample (0 is its time)

    def __init__(self, lb: lab.Lab, interval: float) -> None:
        pids = {p["role"]: p["pid"] for p in lb.state["processes"]}
        self.paths = {h: Path(f"/proc/{pids[f'daemon:{h}']}/net/dev") for h in lb.hosts}
        self.samples: dict[str, list[tuple[float, int, int, int]]] = {h: [] for h in lb.hosts}
        self.cpu: list[tuple[float, int, int]] = []   # (time, busy jiffies, all jiffies) of the machine
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def counters(self, h: str) -> tuple[int, int, int]:
        """(eth0 bytes sent, TCP segments sent, TCP segments retransmitted) of host h now."""
        tx = None
        for line in self.paths[h].read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                tx = int(rest.split()[8])
        if tx is None:
            raise RuntimeError(f"{h}: no eth0 in {self.paths[h]}")
        # /proc/net/snmp: a "Tcp:" line of names, then one of values
        tcp = [line.split()[1:] for line in (self.paths[h].parent / "snmp").read_text().splitlines()
               if line.startswith("Tcp:")]
        counters = dict(zip(tcp[0], map(int, tcp[1]))) if len(tcp) == 2 else {}
        return tx, counters.get("OutSegs", 0), counters.get("RetransSegs", 0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    @staticmethod
    def cpu_jiffies() -> tuple[int, int]:
        """(busy, all) jiffies of every core since boot, from /proc/stat's "cpu" line (user nice
        system idle iowait irq softirq steal ...; guest time is inside user)."""
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    def sample(self) -> None:
        try:
            self.cpu.append((time.time(), *self.cpu_jiffies()))
        except (OSError, ValueError, IndexError):
            pass
        for h in self.samples:
            try:
                self.samples[h].append((time.time(), *self.counters(h)))
            except (OSError, RuntimeError):
                pass  # the daemon is gone: the run's own error says why

    def __enter__(self) -> "TxSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def between(self, h: str, t0: float, t1: float, field: int = BYTES) -> int:
        """Bytes (or another field's count) from wall time t0 to t1, linearly interpolated
        between samples."""
        pts = [(p[0], p[field]) for p in self.samples[h]]
        return int(_interpolate(pts, t1) - _interpolate(pts, t0))

    def cpu_busy(self, t0: float, t1: float) -> float | None:
        """Share of the machine's CPU time (all cores) that was busy from t0 to t1. Near 1, the
        hosts queued for cores, which the runtime model (a core per host) does not know."""
        busy = [(t, b) for t, b, _ in self.cpu]
        total = [(t, a) for t, _, a in self.cpu]
        spent = _interpolate(total, t1) - _interpolate(total, t0)
        return (_interpolate(busy, t1) - _interpolate(busy, t0)) / spent if spent > 0 else None

    def retransmitted(self, h: str, t0: float, t1: float) -> float | None:
        """Share of the TCP segments h sent from t0 to t1 that were retransmissions."""
        out = self.between(h, t0, t1, self.TCP_OUT)
        return self.between(h, t0, t1, self.TCP_RETRANS) / out if out > 0 else None


def _interpolate(pts: list[tuple[float, float]], t: float) -> float:
    """A counter's value at time t from (time, value) samples, linear between them."""
    if not pts:
        return 0.0
    if t <= pts[0][0]:
        return pts[0][1]
    for (ta, a), (tb, b) in zip(pts, pts[1:]):
        if ta <= t <= tb:
            return a + (b - a) * (t - ta) / max(tb - ta, 1e-9)
    return pts[-1][1]


def _mean_known(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _cli_json(lb: lab.Lab, host: str, *args: str, timeout: float = 60.0) -> Any:
    """`peerd ARGS --json` on host; None when it fails or exceeds timeout (a loaded machine)."""
    try:
        p = lb.run(host, _py("-m", "cli.main", *args, "--json"), timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(p.stdout) if p.returncode == 0 else None


def quiet_limits(egress: dict[str, float], cfg: Config) -> dict[str, float]:
    """Bytes/s each host must send less than for the lab to count as quiet: bench_quiet_rate, and
    at most bench_quiet_share of its own egress rate (a 10 Mbit host never sends 1 MB/s, so a
    fixed rate would call it quiet in the middle of its warm-up)."""
    return {h: min(cfg.bench.quiet_rate, cfg.bench.quiet_share * rate) for h, rate in egress.items()}


def _wait_quiet(lb: lab.Lab, cfg: Config, echo: Callable[[str], None], egress: dict[str, float]) -> float | None:
    """Seconds until no host sent more than its quiet_limits rate over one bench_quiet_window;
    None when bench_quiet_timeout passed first. A new lab's daemons warm up their link estimates
    with back-to-back probes over every link for a minute or two (measured on two-sites-6: 2-30 MB/s
    per host, thousands of TCP retransmissions across the 50 Mbit cut, then 0.05 MB/s of
    heartbeats with a settle probe now and then); a scenario's first contender measured during
    that shares its links with the probes, which is not what a user of either tool sees."""
    sampler = TxSampler(lb, cfg.bench.quiet_window)
    limits = quiet_limits({h: egress.get(h, float(cfg.plan.unshaped_rate)) for h in lb.hosts}, cfg)
    t0 = time.monotonic()
    prev = {h: sampler.counters(h)[0] for h in lb.hosts}
    while time.monotonic() - t0 < cfg.bench.quiet_timeout:
        time.sleep(cfg.bench.quiet_window)
        cur = {h: sampler.counters(h)[0] for h in lb.hosts}
        rates = {h: (cur[h] - prev[h]) / cfg.bench.quiet_window for h in lb.hosts}
        loud = sorted((h for h in lb.hosts if rates[h] >= limits[h]), key=lambda h: -rates[h] / limits[h])
        if not loud:
            return time.monotonic() - t0
        echo("       waiting for the daemons' link warm-up to end: " +
             ", ".join(f"{h} sends {rates[h] / 1e6:.2f} MB/s (quiet below {limits[h] / 1e6:.2f})" for h in loud[:3]))
        prev = cur
    return None


def unsettled_links(links_by_host: dict[str, Any]) -> dict[str, list[str]]:
    """host -> its own links whose bandwidth probing is not steady yet (`peerd links --json`'s
    probe_phase); a host whose daemon did not answer counts as one unsettled link."""
    out: dict[str, list[str]] = {}
    for h, reply in links_by_host.items():
        if not reply:
            out[h] = ["(no answer)"]
            continue
        me = reply.get("node_id")
        rows = [e for e in reply.get("links", []) if e.get("measurer") == me]
        late = [f"{e.get('target', '?')[:8]}:{e.get('probe_phase') or '?'}" for e in rows
                if e.get("probe_phase") != "steady"]
        if late or not rows:
            out[h] = late or ["(no links yet)"]
    return out


def _wait_links_steady(lb: lab.Lab, cfg: Config, echo: Callable[[str], None]) -> float | None:
    """Seconds until every daemon's probing of every link is steady (one probe per period, within
    link_probe_budget); None when bench_settle_timeout passed first. After the warm-up the probes
    come 4, 8, 16, 32, 64 s apart: a byte-rate check passes in one of those gaps, and the next
    probes (25-100 MB each at 1 Gbit, to every peer) then fall into the first run, which sent
    about twice the bytes per step of the same contender's later seeds."""
    if cfg.bench.settle_timeout <= 0:
        return None
    t0 = time.monotonic()
    while True:
        late = unsettled_links({h: _cli_json(lb, h, "links", timeout=30.0) for h in lb.hosts})
        if not late:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= cfg.bench.settle_timeout:
            return None
        phases = collections.Counter(x.rpartition(":")[2] or x for v in late.values() for x in v)
        echo(f"       waiting for the daemons' link probing to settle ({time.monotonic() - t0:.0f}s): "
             + ", ".join(f"{n} {ph}" for ph, n in phases.most_common()) + f" on {len(late)} host(s)")
        time.sleep(10.0)


def _wait_swarm(lb: lab.Lab, timeout: float) -> dict[str, str]:
    """host -> node id, once every daemon lists every other as alive."""
    deadline = time.monotonic() + timeout
    while True:
        status = {h: _cli_json(lb, h, "status", timeout=max(1.0, deadline - time.monotonic())) for h in lb.hosts}
        if all(status.values()):
            ids = {h: s["node_id"] for h, s in status.items()}
            if all({p["node_id"] for p in s.get("peers", []) if p.get("state") == "alive"} >= set(ids.values()) - {ids[h]}
                   for h, s in status.items()):
                return ids
        if time.monotonic() > deadline:
            raise RuntimeError(f"lab {lb.id}: the daemons did not all see each other within {timeout:g}s "
                               f"(bench_swarm_timeout); logs in {lb.dir}")
        time.sleep(1.0)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a killed process
    return out


def _wait_all(procs: list[subprocess.Popen], timeout: float, what: str, watch: Callable[[], str],
              echo: Callable[[str], None], every: float = 10.0) -> None:
    """Wait for every process, printing `watch()` every `every` seconds; kill all on timeout or
    on the first failure (a dead rank would otherwise leave the others waiting)."""
    start = time.monotonic()
    last = start
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"{what}: a host's process exited with code {failed[0].returncode}")
            now = time.monotonic()
            if now - start > timeout:
                raise RuntimeError(f"{what}: did not finish within {timeout:g}s (bench_run_timeout)")
            if now - last >= every:
                last = now
                echo(f"    {now - start:5.0f}s  {watch()}")
            time.sleep(0.5)
        failed = [p for p in procs if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{what}: a host's process exited with code {failed[0].returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


# --- one run ----------------------------------------------------------------------------------

@dataclass
class RunFiles:
    """Per host: progress records (peerd train --json shape), per-iteration trace, final model."""
    progress: dict[str, Path] = field(default_factory=dict)
    trace: dict[str, Path] = field(default_factory=dict)
    models: list[Path] = field(default_factory=list)
    error: str | None = None      # the run failed or hung; what it recorded until then still counts


def _iter_watch(files: RunFiles) -> Callable[[], str]:
    def watch() -> str:
        its = []
        for h, path in files.trace.items():
            try:
                last = path.read_bytes().rstrip().rsplit(b"\n", 1)[-1]
                its.append(f"{h}:{json.loads(last)['it']}")
            except (OSError, ValueError, KeyError, IndexError):
                its.append(f"{h}:-")
        return "iterations " + " ".join(its)
    return watch


def budget(contender: str, st: Settings) -> str:
    """`peerd train --budget` of a contender: the swarm's only for asynchronous ones, when asked."""
    from peerd.sync.registry import ASYNCHRONOUS
    return "swarm" if st.async_budget == "swarm" and contender in ASYNCHRONOUS else "host"


def run_peerd(lb: lab.Lab, sc: Scenario, algo: str, seed: int, st: Settings, run_dir: Path, cfg: Config,
              echo: Callable[[str], None]) -> RunFiles:
    files = RunFiles()
    before = {h: set(_checkpoint_dirs(lb, h)) for h in lb.hosts}
    procs = []
    for h in lb.hosts:
        files.progress[h] = run_dir / f"{h}.progress.jsonl"
        argv = _py("-m", "cli.main", "train", "--task", st.task, "--algo", algo, "--world", str(len(lb.hosts)),
                   "--iterations", str(st.iterations), "--seed", str(seed), "--eval-every", str(st.eval_every),
                   "--topology", st.topology, "--slowdown", f"{lb.slowdown(h):g}", "--step-time", str(st.step_time),
                   "--slow-prob", str(sc.slow_prob), "--slow-factor", str(sc.slow_factor), "--trace", "--json",
                   "--join-timeout", str(cfg.bench.swarm_timeout), *(["--non-iid"] if st.non_iid else []),
                   "--budget", budget(algo, st))
        with open(files.progress[h], "w") as fh:  # a file, not a pipe: a full pipe would stall the stream
            procs.append(lb.popen(h, argv, stdout=fh, stderr=subprocess.STDOUT, text=True))
    # the trainers' checkpoint dirs appear once the run forms; the watcher finds them as they do
    def locate() -> None:
        for h in lb.hosts:
            if h not in files.trace:
                new = [d for d in _checkpoint_dirs(lb, h) if d not in before[h]]
                if new:
                    files.trace[h] = new[0] / "trace.jsonl"
    watch = _iter_watch(files)

    def watch_and_locate() -> str:
        locate()
        return watch()
    try:
        _wait_all(procs, cfg.bench.run_timeout, f"{sc.name}/{algo}/seed {seed}", watch_and_locate, echo)
    except RuntimeError as e:
        files.error = str(e)
    locate()
    missing = [h for h in lb.hosts if h not in files.trace]
    if missing:
        raise RuntimeError(f"{sc.name}/{algo}: no checkpoint directory of this run on {', '.join(missing)}"
                           + (f" ({files.error})" if files.error else ""))
    for h in lb.hosts:  # keep the traces with the run; the lab's data dirs go with the lab
        trace = run_dir / f"{h}.trace.jsonl"
        trace.write_bytes(files.trace[h].read_bytes() if files.trace[h].exists() else b"")
        files.trace[h] = trace
    files.models = [d for d in (_newest_model(lb, h, before[h]) for h in lb.hosts) if d is not None]
    return files


def _checkpoint_dirs(lb: lab.Lab, host: str) -> list[Path]:
    root = Path(lb.state["hosts"][host]["data_dir"]) / "checkpoints"
    return sorted(root.iterdir()) if root.exists() else []


def _newest_model(lb: lab.Lab, host: str, before: set[Path]) -> Path | None:
    new = [d / "latest.pt" for d in _checkpoint_dirs(lb, host) if d not in before and (d / "latest.pt").exists()]
    return new[0] if new else None


def run_ddp(lb: lab.Lab, sc: Scenario, seed: int, st: Settings, run_dir: Path, cfg: Config, port: int,
            echo: Callable[[str], None]) -> RunFiles:
    files = RunFiles()
    master = lb.ip(lb.hosts[0])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    procs = []
    model = run_dir / "ddp-model.pt"
    for rank, h in enumerate(lb.hosts):
        files.progress[h] = run_dir / f"{h}.progress.jsonl"
        files.trace[h] = run_dir / f"{h}.trace.jsonl"
        argv = _py("-m", "torch.distributed.run", "--nnodes", str(len(lb.hosts)), "--node-rank", str(rank),
                   "--master-addr", master, "--master-port", str(port), "--nproc-per-node", "1",
                   "-m", "peerd.bench.ddp_worker", "--task", st.task, "--iterations", str(st.iterations),
                   "--seed", str(seed), "--eval-every", str(st.eval_every), "--step-time", str(st.step_time),
                   "--slowdown", f"{lb.slowdown(h):g}", "--slow-prob", str(sc.slow_prob),
                   "--slow-factor", str(sc.slow_factor), "--timeout", str(cfg.bench.gloo_timeout),
                   "--trace", str(files.trace[h]), "--progress", str(files.progress[h]), "--model-out", str(model),
                   *(["--non-iid"] if st.non_iid else []))
        with open(run_dir / f"{h}.log", "w") as fh:
            procs.append(lb.popen(h, argv, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env))
    try:
        _wait_all(procs, cfg.bench.run_timeout, f"{sc.name}/ddp/seed {seed}", _iter_watch(files), echo)
    except RuntimeError as e:
        files.error = str(e)
    files.models = [model] if model.exists() else []
    return files


# --- metrics ----------------------------------------------------------------------------------

def time_to_target(progress: dict[str, list[dict]], target: float, t0: float) -> float | None:
    """Seconds from t0 until the mean of the hosts' newest evaluated accuracies reaches target
    (a host not evaluated yet counts as 0)."""
    events = sorted((r["t"], h, r["metric"]) for h, recs in progress.items() for r in recs
                    if r.get("metric_name") == "accuracy")
    latest = dict.fromkeys(progress, 0.0)
    for t, h, metric in events:
        latest[h] = metric
        if sum(latest.values()) / len(latest) >= target:
            return t - t0
    return None


def averaged_accuracy(task_name: str, models: list[Path]) -> float | None:
    import torch

    from peerd.train.tasks import evaluate_average, get_task

    if not models:
        return None
    task = get_task(task_name)
    nets = []
    for path in models:
        m = task.build(0)
        m.load_state_dict(torch.load(path, weights_only=True, map_location="cpu")["model"])
        nets.append(m)
    return evaluate_average(task, nets)["accuracy"]


def model_bytes(task_name: str) -> int:
    from peerd.train.tasks import get_task

    return sum(p.numel() * p.element_size() for p in get_task(task_name).build(0).parameters())


WARMUP_FRACTION = 0.1   # a host's first iterations (joining, first transfers) are left out of its times
MIX_FLOOR_QUANTILE = 0.1


def _quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else 0.0


def host_times(trace: list[dict], warmup: float = WARMUP_FRACTION, until: float | None = None) -> dict[str, Any]:
    """One host's times from its trace, over its steady part: the steps after the first
    ceil(warmup * steps) (at least one) that ended by `until` (the wall time the first host of the
    run finished: after it the others run a different swarm; a host with fewer than two such
    steps: see below).

    iter_time_s: wall seconds per iteration, from the end of the last warm-up step to the end of
    the host's last one, divided by the iterations its counter advanced in between (skipped
    iterations count, as the trainer's counter counts them). THE iteration time: `peerd plan`
    predicts exactly this, and a record's iter_time_s is its mean over the hosts.
    A host that finished fewer than two steps after its warm-up by `until` (an asynchronous
    swarm's slowest host: AD-PSGD's active on a 10 Mbit link pulls a few times while the others
    run 100 iterations) is timed over what it did while the swarm ran, from its first step's
    start to `until`: iter_time_s = that wall / the iterations it finished by then (at least 1,
    so a host that finished none gets a lower bound), `window_short` set. Its steps after
    `until` are local steps in a swarm that has ended and say nothing of its pace in it.
    Per computed step (the split): step_s = wall / steps computed; compute_mean_s / compute_std_s
    (the paced gradient time: emulated + real compute); mix_s: mean seconds in the mix call
    (waiting for the neighbours' updates, and the mix itself; DDP: backward + all-reduce +
    optimizer step); other_s = step_s - compute - mix (publish, evaluation every eval_every,
    checkpoint, progress report, trace)."""
    k = min(max(1, math.ceil(warmup * len(trace))), len(trace) - 1)
    steady = trace[k:] if len(trace) > 1 else trace
    short = False
    if until is not None:
        ended = [r for r in steady if r["t"] <= until + 1e-9]
        if len(ended) >= 2:
            steady = ended
        elif trace[0]["start"] < until:
            short = True
    if short:
        done = [r for r in trace if r["t"] <= until + 1e-9]
        t_from, t_to = trace[0]["start"], until
        its = max(1, done[-1]["it"] - trace[0]["it"] + 1) if done else 1
        steady = done or trace[:1]
    else:
        t_from = trace[k - 1]["t"] if len(trace) > 1 else trace[0]["start"]
        t_to = steady[-1]["t"]
        its = steady[-1]["it"] - trace[k - 1]["it"] if len(trace) > 1 else 1
    wall = t_to - t_from
    comp = [r["compute_s"] for r in steady]
    mix = [r["mix_s"] for r in steady if "mix_s" in r]
    # per computed step: up to the last one's end (a short window's only step may be unfinished)
    step = (min(steady[-1]["t"], t_to) - t_from) / len(steady)
    out = {"window": [t_from, t_to], "window_steps": len(steady), "window_iterations": its,
           "iter_time_s": wall / max(1, its), "step_s": step,
           "compute_mean_s": statistics.mean(comp), "compute_std_s": statistics.pstdev(comp),
           "mix_s": statistics.mean(mix) if len(mix) == len(steady) else None}
    out["other_s"] = None if out["mix_s"] is None else max(0.0, step - out["compute_mean_s"] - out["mix_s"])
    out["mix_samples"] = mix
    if short:
        out["window_short"] = True
    return out


def split_times(per_host: dict[str, dict[str, Any]], contender: str, egress_bytes_s: dict[str, float]) -> float | None:
    """Add each host's time split (seconds per iteration) in place; return the record's mix floor.

    The mix floor is the MIX_FLOOR_QUANTILE quantile of every host's steady mix_s: what a mix
    costs when the updates are already in hand (in most runs some host in some iteration has
    them). Limit: where every host waits in nearly every iteration (a slow cut, D-PSGD on
    two-sites) the floor holds waiting too, so mix_overhead_s overstates and wait_s understates;
    the trainer cannot tell the two apart (the daemon would have to report its hold time).
    Per host: wait_s = mix_s - floor (waiting for the neighbours), mix_overhead_s = the floor.
    overhead_s = other_s: what the runtime model gets as its per-step overhead, everything outside
    compute and the mix call, so no waiting can leak into the model's inputs; the mix call's
    whole time stays on the predicted side (its own cost, a few ms, is not modelled). DDP: its
    mix_s is the all-reduce itself, so wait_s = mix_s. transfer_s = bytes the host sent per steady step
    / its egress rate (its access link, else the fastest rate out of it): the link's busy time,
    mostly overlapped with compute, so not a term of the sum."""
    samples = [x for v in per_host.values() for x in (v.pop("mix_samples", None) or [])]
    if any(v.get("mix_s") is None for v in per_host.values()) or not samples:
        return None
    floor = 0.0 if contender == "ddp" else _quantile(samples, MIX_FLOOR_QUANTILE)
    for h, v in per_host.items():
        v["mix_overhead_s"] = min(floor, v["mix_s"])
        v["wait_s"] = v["mix_s"] - v["mix_overhead_s"]
        v["overhead_s"] = v["other_s"]
        sent = v.get("window_bytes_sent")
        v["transfer_s"] = None if sent is None or not egress_bytes_s.get(h) else \
            sent / v["window_steps"] / egress_bytes_s[h]
    return floor


def egress_rates(prof: profile.Profile) -> dict[str, float]:
    """Bytes/s out of each host of a lab profile, as its eth0 counts them (whole frames): its
    access link, else its fastest pair, else the runtime model's unshaped rate."""
    unshaped = float(Config().plan.unshaped_rate)
    out = {}
    for h in prof.hosts:
        rates = [prof.pair_rates[(h.name, o.name)] / 8 if (h.name, o.name) in prof.pair_rates else unshaped
                 for o in prof.hosts if o is not h]
        out[h.name] = h.link_bps / 8 if h.link_bps else max(rates, default=unshaped)
    return out


def summarize(sc: Scenario, contender: str, seed: int, st: Settings, hosts: list[str], files: RunFiles,
              sampler: TxSampler | None, prof_name: str, egress: dict[str, float] | None = None) -> dict[str, Any]:
    """One JSON record from a run's files (sampler None: bytes unknown)."""
    traces = {h: _read_jsonl(files.trace[h]) for h in hosts}
    progress = {h: _read_jsonl(files.progress[h]) for h in hosts}
    if not all(traces.values()):
        raise RuntimeError(f"{sc.name}/{contender}: empty trace on "
                           f"{', '.join(h for h, t in traces.items() if not t)}")
    t0 = min(t[0]["start"] for t in traces.values())
    t_end = max(t[-1]["t"] for t in traces.values())
    tx = {h: sampler.between(h, t0, t_end) if sampler else None for h in hosts}
    per_host = {}
    first_done = min(t[-1]["t"] for t in traces.values())
    for h, tr in traces.items():
        dur = tr[-1]["t"] - t0
        comp = sum(r["compute_s"] for r in tr)
        v = host_times(tr, until=first_done)
        v["window_bytes_sent"] = sampler.between(h, *v.pop("window")) if sampler else None
        ranks = [r["rank"] for r in progress[h] if r.get("state") != "waiting" and isinstance(r.get("rank"), int)]
        per_host[h] = {"rank": ranks[-1] if ranks else None,   # the ring order of the run
                       "steps": len(tr), "last_iteration": tr[-1]["it"], "duration_s": dur,
                       "it_per_s": len(tr) / dur, "idle_fraction": max(0.0, 1 - comp / dur),
                       "bytes_sent": tx[h],
                       "tcp_retransmitted": sampler.retransmitted(h, t0, t_end) if sampler else None, **v}
    times = host_summary(per_host, contender, egress or {})
    ttt = time_to_target(progress, st.target, t0)
    steps = sum(v["steps"] for v in per_host.values())
    sent = sum(tx.values()) if sampler else None
    return {
        "scenario": sc.name, "contender": contender, "seed": seed, "profile": prof_name, "hosts": len(hosts),
        "task": st.task, "model_bytes": model_bytes(st.task), "iterations": st.iterations, "target": st.target,
        "budget": budget(contender, st), "topology": "ring" if contender == "ddp" else st.topology,  # DDP: gloo's ring
        "daemon_args": st.daemon_args,
        "time_to_target_s": ttt, "reached_target": ttt is not None,
        "wall_s": max(v["duration_s"] for v in per_host.values()),
        "it_per_s": statistics.mean(v["it_per_s"] for v in per_host.values()),
        "idle_fraction": statistics.mean(v["idle_fraction"] for v in per_host.values()),
        "bytes_sent": sent, "bytes_per_step": None if sent is None else sent / steps,
        "tcp_retransmitted": _mean_known(v.get("tcp_retransmitted") for v in per_host.values()),
        # the machine's busy share of all its cores over the run, and how many there are
        "cpu_busy": sampler.cpu_busy(t0, t_end) if sampler else None, "cpus": os.cpu_count(),
        "final_accuracy": averaged_accuracy(st.task, files.models),
        **times,
        "step_time_setting": st.step_time, "slow_prob": sc.slow_prob, "slow_factor": sc.slow_factor,
        "per_host": per_host,
    }


def retime(run_dir: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """A record with its time fields recomputed from the run's saved traces (records written before
    per-host times existed, or by an older summarize). Bytes in the steady window are the host's
    bytes in proportion to its steps there (the tx samples are not kept)."""
    if "per_host" not in rec or rec.get("error"):
        return rec
    d = run_dir / rec["scenario"] / rec["contender"] / f"seed{rec['seed']}"
    prof = profile.load(rec["profile"], rec["hosts"])
    per_host = {}
    traces = {h: _read_jsonl(d / f"{h}.trace.jsonl") for h in rec["per_host"]}
    if not all(traces.values()):
        raise RuntimeError(f"{d}: no trace of {', '.join(h for h, t in traces.items() if not t)}")
    first_done = min(t[-1]["t"] for t in traces.values())
    for h, old in rec["per_host"].items():
        tr = traces[h]
        prog = _read_jsonl(d / f"{h}.progress.jsonl")
        v = host_times(tr, until=first_done)
        v.pop("window")
        sent = old.get("bytes_sent")
        v["window_bytes_sent"] = None if sent is None else sent * v["window_steps"] / len(tr)
        ranks = [r["rank"] for r in prog if r.get("state") != "waiting" and isinstance(r.get("rank"), int)]
        per_host[h] = {**old, "rank": ranks[-1] if ranks else None, **v}
    return {**rec, **host_summary(per_host, rec["contender"], egress_rates(prof)), "per_host": per_host}


def host_summary(per_host: dict[str, dict[str, Any]], contender: str, egress: dict[str, float]) -> dict[str, Any]:
    """The record's time fields from its hosts' (split_times adds each host's split in place):
    iter_time_s (THE iteration time: the hosts' mean), the hosts' mean split, and pooled compute."""
    floor = split_times(per_host, contender, egress)
    split = {k: statistics.mean(v[k] for v in per_host.values())
             for k in ("compute_mean_s", "wait_s", "mix_overhead_s", "other_s", "overhead_s", "transfer_s")
             if all(v.get(k) is not None for v in per_host.values())}
    return {"iter_time_s": statistics.mean(v["iter_time_s"] for v in per_host.values()),
            "mix_floor_s": floor, "split": split,
            # summaries over the hosts; `peerd plan check` reads per_host
            "step_time_mean": statistics.mean(v["compute_mean_s"] for v in per_host.values()),
            "step_time_std": statistics.mean(v["compute_std_s"] for v in per_host.values())}


# --- the whole benchmark ----------------------------------------------------------------------


def code_version() -> str:
    """peerd's version and, in a git checkout, its commit ("+dirty" with uncommitted changes): a
    resumed run directory may hold records of several versions."""
    from peerd import __version__
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return __version__
    if head.returncode != 0:
        return __version__
    return f"{__version__} {head.stdout.strip()}{'+dirty' if dirty.stdout.strip() else ''}"


def run(scenarios: list[str], contenders: list[str], seeds: int, st: Settings, out: Path,
        cfg: Config | None = None, echo: Callable[[str], None] = print,
        json_file: Path | None = None) -> list[dict[str, Any]]:
    """Run every (scenario, contender, seed); append each record to out/results.jsonl (and
    json_file) as it completes; return the records."""
    cfg = cfg or Config()
    for name in scenarios:
        if name not in SCENARIOS:
            raise ValueError(f"scenario: unknown {name!r}; known: {', '.join(SCENARIOS)}")
    for c in contenders:
        if c != "ddp":
            from peerd.sync.registry import ALGORITHMS
            if c not in ALGORITHMS:
                raise ValueError(f"contender: unknown {c!r}; known: ddp, {', '.join(ALGORITHMS)}")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"settings": asdict(st), "seeds": seeds, "scenarios": scenarios, "contenders": contenders,
            "started": time.time(), "model_bytes": model_bytes(st.task),
            "descriptions": {s: SCENARIOS[s].description for s in scenarios}}
    if (out / "meta.json").exists():  # adding scenarios or contenders to a run: same settings only
        old = json.loads((out / "meta.json").read_text())
        # a setting added since that run (e.g. non_iid) counts as its default
        if {**asdict(Settings()), **old["settings"]} != meta["settings"]:
            raise ValueError(f"{out} holds a run with other settings ({old['settings']}); use another --out")
        meta["scenarios"] = old["scenarios"] + [s for s in scenarios if s not in old["scenarios"]]
        meta["contenders"] = old["contenders"] + [c for c in contenders if c not in old["contenders"]]
        meta["descriptions"] = {**old["descriptions"], **meta["descriptions"]}
        meta["started"], meta["seeds"] = old["started"], max(old["seeds"], seeds)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    results_path = out / "results.jsonl"
    # Resuming: a run already recorded here (failed ones too: a failure is a result) is not run
    # again, so a matrix of hours can be run in parts, or finished after an interruption.
    wanted = {(s, c, k) for s in scenarios for c in contenders for k in range(seeds)}
    records = [r for r in load_records(results_path) if (r["scenario"], r["contender"], r["seed"]) in wanted]
    done = {(r["scenario"], r["contender"], r["seed"]) for r in records}
    total = len(wanted) - len(done)
    if done:
        echo(f"{len(done)} of {len(wanted)} runs are already recorded in {results_path}; running the other {total}")
    n = 0
    started, code = time.monotonic(), code_version()
    port = cfg.bench.master_port
    for name in scenarios:
        if all((name, c, k) in done for c in contenders for k in range(seeds)):
            continue
        sc = SCENARIOS[name]
        hosts = st.hosts or sc.hosts
        prof = profile.load(sc.profile, hosts)
        lab_dir = out / name / "lab"
        if lab_dir.exists():
            lab.down(lab_dir, cfg, purge=True)
        echo(f"== scenario {name}: {sc.description} (profile {sc.profile}, {hosts} hosts); starting the lab")
        lab.up(prof, lab_dir, cfg, daemon_args=DAEMON_ARGS + tuple(shlex.split(st.daemon_args)))
        try:
            lb = lab.Lab(lab_dir)
            waits = _prepare_lab(lb, prof, cfg, echo, out / name / "hosts.json")
            for seed in range(seeds):
                for contender in contenders:
                    if (name, contender, seed) in done:
                        continue
                    n += 1
                    run_dir = out / name / contender / f"seed{seed}"
                    run_dir.mkdir(parents=True, exist_ok=True)
                    echo(f"[{n}/{total}] {name} / {contender} / seed {seed}   "
                         f"(elapsed {time.monotonic() - started:.0f}s)")
                    if contender == "ddp":
                        port += 1  # a fresh rendezvous port per run: no TIME_WAIT clash
                    rec = _one_run(lb, sc, prof, contender, seed, st, run_dir, cfg, port, echo, waits)
                    rec["code"] = code
                    records.append(rec)
                    for path in (results_path, json_file):
                        if path is not None:
                            with open(path, "a") as fh:
                                fh.write(json.dumps(rec) + "\n")
                    _echo_result(rec, st, echo)
            links = {h: _cli_json(lb, h, "links") for h in lb.hosts}
            (out / name / "links.json").write_text(json.dumps(links, indent=2))
        finally:
            lab.down(lab_dir, cfg, purge=False)
            for h in prof.hosts:  # checkpoints are large; logs and traces stay
                shutil.rmtree(lab_dir / h.name / "data" / "checkpoints", ignore_errors=True)
    return records


def _prepare_lab(lb: lab.Lab, prof: profile.Profile, cfg: Config, echo: Callable[[str], None],
                 hosts_file: Path) -> dict[str, float | None]:
    """Wait for the swarm, steady link probing and a quiet lab; write the hosts' ids. Returns how
    long the settling and the quiet took (None: not reached), for the records."""
    ids = _wait_swarm(lb, cfg.bench.swarm_timeout)
    settled_after = _wait_links_steady(lb, cfg, echo)
    if settled_after is not None:
        echo(f"    link probing steady after {settled_after:.0f}s")
    else:
        echo("    " + (f"link probing not steady within {cfg.bench.settle_timeout:g}s (bench_settle_timeout)"
                      if cfg.bench.settle_timeout > 0 else "not waiting for the link probing to settle")
             + ": the first runs may share the links with settle probes")
    quiet_after = _wait_quiet(lb, cfg, echo, egress_rates(prof))
    echo(f"    lab quiet after {quiet_after:.0f}s" if quiet_after is not None else
         f"    the lab did not quiet down within {cfg.bench.quiet_timeout:g}s (bench_quiet_timeout): "
         "the first runs share the links with the daemons' link probes")
    hosts_file.write_text(json.dumps(
        {h: {"node_id": ids[h], "ip": lb.ip(h), "slowdown": lb.slowdown(h)} for h in lb.hosts}, indent=2))
    return {"quiet": quiet_after, "settled": settled_after}


def _one_run(lb: lab.Lab, sc: Scenario, prof: profile.Profile, contender: str, seed: int, st: Settings,
             run_dir: Path, cfg: Config, port: int, echo: Callable[[str], None],
             waits: dict[str, float | None]) -> dict[str, Any]:
    """One contender, one seed: its record (a failed run is a record too)."""
    t, load0 = time.monotonic(), os.getloadavg()[0]
    try:
        with TxSampler(lb, cfg.bench.tx_interval) as tx:
            if contender == "ddp":
                files = run_ddp(lb, sc, seed, st, run_dir, cfg, port, echo)
            else:
                files = run_peerd(lb, sc, contender, seed, st, run_dir, cfg, echo)
        rec = summarize(sc, contender, seed, st, lb.hosts, files, tx, prof.name, egress_rates(prof))
        if files.error:  # measured until it failed: times count, the run is marked
            rec["error"] = files.error
            echo(f"    FAILED (measured until then): {files.error}")
    except RuntimeError as e:
        rec = {"scenario": sc.name, "contender": contender, "seed": seed, "profile": prof.name,
               "hosts": len(lb.hosts), "error": str(e), "time_to_target_s": None, "reached_target": False}
        echo(f"    FAILED: {e}")
    rec["run_s"] = time.monotonic() - t
    rec["lab_quiet_after_s"] = None if waits["quiet"] is None else round(waits["quiet"], 1)
    rec["lab_settled_after_s"] = None if waits["settled"] is None else round(waits["settled"], 1)
    # the machine's 1-minute load average before and after: timings on a shared machine are only
    # comparable at like loads
    rec["load_avg"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    # TCP's congestion control changes what a shallow queue behind a faster link costs
    rec["tcp_congestion_control"] = lb.state.get("tcp_congestion_control")
    return rec


def _echo_result(rec: dict[str, Any], st: Settings, echo: Callable[[str], None]) -> None:
    if "it_per_s" not in rec:
        return
    ttt = rec["time_to_target_s"]
    acc = rec["final_accuracy"]
    echo(f"    {'missed the target' if ttt is None else f'target {st.target:.0%} after {ttt:.1f}s'}"
         f"; {rec['it_per_s']:.2f} it/s per host, idle {rec['idle_fraction']:.0%}, "
         f"{rec['bytes_per_step'] / 1e6:.2f} MB sent per step, averaged model {acc if acc is None else round(acc, 3)}")
