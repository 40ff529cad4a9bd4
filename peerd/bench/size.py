"""`peerd bench size`: how the daemon moves models of 1 MB to 1 GB, against plain TCP and gRPC.

For each case (hosts on a topology, a model size) it starts that many daemons on loopback, runs a
zero-compute trainer on each (peerd.train.benchsize: publish, mix, copy back) with D-PSGD, then
moves the same bytes over the same graph with the same weighted sum over plain TCP
(peerd.bench.rawtcp) and over plain gRPC streams (peerd.bench.rawgrpc: the floor of any transport
on gRPC, which peerd's tensors use), one after the other on the same machine. It reports seconds
per iteration (the trainer's publish, its wait for the mix, its copy back; the daemon's snapshot
copy, update checks and weighted sums), peak resident memory of every daemon and trainer, the
daemons' event loop lag (p99), peers marked suspect, and partial mixes.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from peerd.net.auth import new_secret
from peerd.node.localswarm import LocalDaemon, peerd_cmd, wait_until
from peerd.train.benchsize import peak_rss_bytes

WARMUP = 2     # iterations left out of the medians (connections, first allocations)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux); 0 where unknown."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class Case:
    hosts: int
    topology: str
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.topology}-{self.hosts} {self.nbytes / 1e6:g} MB"


@dataclass
class Result:
    case: Case
    iterations: int
    peerd_s: float | None = None                      # seconds per iteration, the slowest host's median
    publish_s: float | None = None
    mix_wait_s: float | None = None
    copy_back_s: float | None = None
    daemon: dict[str, Any] = field(default_factory=dict)   # per host: rss, loop lag, suspects, partial mixes, timings
    trainer_rss: list[int] = field(default_factory=list)
    tcp_wire_s: float | None = None
    tcp_total_s: float | None = None                  # wire + the weighted sum
    tcp_rss: list[int] = field(default_factory=list)
    grpc_wire_s: float | None = None                  # the same over plain gRPC streams (peerd.bench.rawgrpc)
    grpc_total_s: float | None = None
    grpc_rss: list[int] = field(default_factory=list)
    grpc_lag_ms: float | None = None                  # the plain gRPC workers' event loop lag, p99 (worst worker)
    grpc_own_lag_ms: float | None = None              # the same less their loop thread's wait for a CPU
    error: str = ""

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = {**asdict(self.case), "name": self.case.name}
        if self.peerd_s and self.tcp_total_s:
            d["ratio_to_tcp"] = self.peerd_s / self.tcp_total_s
        if self.peerd_s and self.grpc_total_s:
            d["ratio_to_grpc"] = self.peerd_s / self.grpc_total_s
        return d


def _median_per_host(rows: dict[int, list[dict]], key: str) -> float:
    """The slowest host's median of `key` over the timed iterations."""
    return max(statistics.median(r[key] for r in rs[WARMUP:] or rs) for rs in rows.values())


def run_peerd(case: Case, iterations: int, root: Path, echo: Callable[[str], None],
              daemon_args: list[str]) -> Result:
    res = Result(case, iterations)
    secret = root / "secret"
    secret.write_text(new_secret())
    secret.chmod(0o600)
    env = {"PEERD_BENCH_BYTES": str(case.nbytes), "PEERD_BENCH_ITERATIONS": str(iterations)}
    saved = dict(os.environ)
    os.environ.update(env)        # the trainers inherit the daemons' environment
    hosts: list[LocalDaemon] = []
    try:
        for i in range(case.hosts):
            d = LocalDaemon(root / f"h{i}", secret, [hosts[0].address] if hosts else [], extra=daemon_args).start()
            hosts.append(d)
            d.wait_ready(60)
        if not wait_until(lambda: all(list(d.peer_states().values()).count("alive") == case.hosts - 1
                                      for d in hosts), 60):
            raise RuntimeError("the daemons did not all find each other within 60 s")
        cpu0 = {i: cpu_seconds(d.proc.pid) for i, d in enumerate(hosts)}
        script = Path(__file__).resolve().parent.parent / "train" / "benchsize.py"
        procs = [subprocess.Popen(peerd_cmd("train", "--data-dir", str(d.data_dir), "--script", str(script),
                                            "--world", str(case.hosts), "--algo", "d-psgd", "--topology", case.topology,
                                            "--iterations", str(iterations), "--json"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d in hosts]
        finals = []
        for p in procs:
            out, err = p.communicate(timeout=60 + 30 * iterations * max(1.0, case.nbytes / 100e6))
            lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            finals.append(lines[-1] if lines else {})
            if p.returncode != 0:
                res.error = f"peerd train exited {p.returncode}: {err.strip()[-400:]}"
        rows: dict[int, list[dict]] = {}
        for i, d in enumerate(hosts):
            log = next(d.data_dir.glob("trainer-*.log")).read_text()
            recs = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
            rows[i] = [r for r in recs if "iteration" in r]
            res.trainer_rss += [r["peak_rss_bytes"] for r in recs if "peak_rss_bytes" in r]
            st = d.status() or {}
            run = json.loads(st.get("last_training_json") or "{}")
            res.daemon[f"h{i}"] = {"peak_rss_bytes": peak_rss_bytes(d.proc.pid),
                                   "cpu_s_per_iteration": (cpu_seconds(d.proc.pid) - cpu0[i]) / iterations,
                                   "loop_lag_p99_ms": st.get("loop_lag_p99_ms"),
                                   "loop_lag_max_ms": st.get("loop_lag_max_ms"),
                                   "loop_lag_own_p99_ms": st.get("loop_lag_own_p99_ms"),
                                   "suspect_events": int(st.get("suspect_events", 0) or 0),
                                   "mixes": run.get("mixes"), "timings": run.get("timings"), "sums": run.get("sums"),
                                   "snapshot_buffers": run.get("snapshot_buffers"),
                                   "final_state": finals[i].get("state"), "final_message": finals[i].get("message")}
        if all(len(r) > WARMUP for r in rows.values()):
            times = {i: [{"it_s": b["t"] - a["t"], **b} for a, b in zip(rs, rs[1:])] for i, rs in rows.items()}
            res.peerd_s = _median_per_host(times, "it_s")
            res.publish_s = _median_per_host(rows, "publish_s")
            res.mix_wait_s = _median_per_host(rows, "mix_s")
            res.copy_back_s = _median_per_host(rows, "copy_s")
        elif not res.error:
            res.error = "too few iterations recorded"
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for d in hosts:
            d.stop()
    return res


def _baseline(res: Result, module: str, iterations: int, *extra: str) -> list[dict] | None:
    """Run `module`'s workers (peerd.bench.rawtcp or rawgrpc) for res.case; their JSON lines, or
    None with res.error set."""
    case = res.case
    port_base = 20000 + (os.getpid() % 2000) * 8
    procs = [subprocess.Popen([sys.executable, "-m", module, str(i), str(case.hosts), case.topology,
                               str(case.nbytes), str(iterations), str(port_base), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(case.hosts)]
    outs, failed = [], ""
    for p in procs:
        try:
            out, err = p.communicate(timeout=120 + 10 * iterations * max(1.0, case.nbytes / 100e6))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            failed = failed or f"{module} worker timed out: {err.strip()[-300:]}"
            continue
        if p.returncode != 0:
            failed = failed or f"{module} worker failed: {err.strip()[-300:]}"
        else:
            outs.append(json.loads(out.strip().splitlines()[-1]))
    if failed:
        res.error = (res.error + "; " if res.error else "") + failed
        return None
    return outs


def _slowest(outs: list[dict], key: str) -> float:
    return max(statistics.median(o[key][WARMUP:] or o[key]) for o in outs)


def run_tcp(res: Result, iterations: int) -> None:
    if outs := _baseline(res, "peerd.bench.rawtcp", iterations):
        res.tcp_wire_s, res.tcp_total_s = _slowest(outs, "wire_s"), _slowest(outs, "total_s")
        res.tcp_rss = [o["peak_rss_bytes"] for o in outs]


def run_grpc(res: Result, iterations: int, chunk_bytes: int) -> None:
    if outs := _baseline(res, "peerd.bench.rawgrpc", iterations, str(chunk_bytes)):
        res.grpc_wire_s, res.grpc_total_s = _slowest(outs, "wire_s"), _slowest(outs, "total_s")
        res.grpc_rss = [o["peak_rss_bytes"] for o in outs]
        res.grpc_lag_ms = max(o["loop_lag_p99_ms"] for o in outs)
        res.grpc_own_lag_ms = max(o["loop_lag_own_p99_ms"] for o in outs)


def run(cases: list[Case], iterations: int, echo: Callable[[str], None] = print,
        daemon_args: list[str] | None = None, chunk_bytes: int = 1 << 20) -> list[Result]:
    results = []
    for case in cases:
        echo(f"== {case.name}: {case.hosts} daemons, D-PSGD, {iterations} iterations")
        with tempfile.TemporaryDirectory(prefix="peerd-size-") as tmp:
            t0 = time.monotonic()
            res = run_peerd(case, iterations, Path(tmp), echo, list(daemon_args or []))
            echo(f"   peerd {res.peerd_s if res.peerd_s is None else round(res.peerd_s, 3)} s/iter "
                 f"({time.monotonic() - t0:.0f} s){'; ' + res.error if res.error else ''}")
        run_tcp(res, iterations)
        echo(f"   raw TCP {res.tcp_total_s if res.tcp_total_s is None else round(res.tcp_total_s, 3)} s/iter")
        run_grpc(res, iterations, chunk_bytes)
        echo(f"   plain gRPC {res.grpc_total_s if res.grpc_total_s is None else round(res.grpc_total_s, 3)} s/iter")
        results.append(res)
    return results


def _mb(n: float | None) -> str:
    return "-" if not n else f"{n / 1e6:.0f}"


def table(results: list[Result]) -> str:
    head = ("| case | peerd s/iter | publish | wait for mix | copy back | raw TCP (+ sum) | ratio | "
            "plain gRPC (+ sum) | ratio | "
            "daemon peak RSS MB (x model) | trainer peak RSS MB | loop lag p99 ms (plain gRPC) | "
            "own loop lag p99 ms (plain gRPC) | suspects | "
            "partial mixes |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        c = r.case
        d = list(r.daemon.values())
        rss = max((x["peak_rss_bytes"] for x in d), default=0)
        lag = max((x["loop_lag_p99_ms"] or 0 for x in d), default=0)
        own = max((x.get("loop_lag_own_p99_ms") or 0 for x in d), default=0)
        sus = sum(x["suspect_events"] for x in d)
        partial = sum((x.get("mixes") or {}).get("partial", 0) for x in d)
        total = sum((x.get("mixes") or {}).get("total", 0) for x in d)
        f = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
        glag = "-" if r.grpc_lag_ms is None else f"{r.grpc_lag_ms:.0f}"
        gown = "-" if r.grpc_own_lag_ms is None else f"{r.grpc_own_lag_ms:.0f}"
        rows.append(f"| {c.name} | {f(r.peerd_s)} | {f(r.publish_s)} | {f(r.mix_wait_s)} | {f(r.copy_back_s)} | "
                    f"{f(r.tcp_wire_s)} ({f(r.tcp_total_s)}) | "
                    f"{'-' if not (r.peerd_s and r.tcp_total_s) else f'{r.peerd_s / r.tcp_total_s:.2f}x'} | "
                    f"{f(r.grpc_wire_s)} ({f(r.grpc_total_s)}) | "
                    f"{'-' if not (r.peerd_s and r.grpc_total_s) else f'{r.peerd_s / r.grpc_total_s:.2f}x'} | "
                    f"{_mb(rss)} ({rss / c.nbytes:.1f}x) | {_mb(max(r.trainer_rss, default=0))} | {lag:.0f} ({glag}) | "
                    f"{own:.0f} ({gown}) | {sus} | "
                    f"{partial} of {total} |" + (f" {r.error}" if r.error else ""))
    return "\n".join(rows)
