"""`peerd bench`: measurements of this machine and of peerd's own paths.

`peerd bench transport` compares, in one run and as ratios, (a) raw TCP between two processes
(the ceiling), (b) a peerd push of the same bytes between two data-plane processes on loopback,
and, as root, (c) both across two fresh network namespaces joined by a veth pair whose sending
side is shaped by htb to each of --rates. Throughput is bytes over the sender's wall time for one
transfer (first byte to the receiver's ack; peerd's includes its checksum pass), median of
--reps after one warm-up; raw and peerd transfers alternate, and the ratio is the median of the
per-pair ratios, so background load on a shared machine hits both alike. The receiver's peak extra memory is its VmHWM after the transfers minus
its VmRSS before them (the kernel's high-water mark is reset through /proc/self/clear_refs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import secrets
import statistics
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import click

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
REPLY_TIMEOUT = 900.0   # one command (1 GB over a shaped link included) must answer within this


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise click.BadParameter(f"size {text!r}: want e.g. 1MB, 25MB, 1GB, 4MiB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    # float32 test data: keep sizes a multiple of 4 bytes (1 MB, 100 MB and 1 GB already are)
    return n


def parse_rate(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)bit\s*", text.lower())
    if not m:
        raise click.BadParameter(f"rate {text!r}: want e.g. 100mbit, 1gbit")
    return int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]


def human(n: float) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}B"


class Peer:
    """A benchmark peer process and its JSON-lines conversation (every wait bounded)."""

    def __init__(self, node_id: str, host: str, netns: str | None = None, chunk_bytes: int | None = None):
        from peerd.net import benchnode  # imports torch: not at CLI start (every `peerd status`)

        self.id = node_id
        self.proc = benchnode.spawn(node_id, host, netns, chunk_bytes)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.address = self._read(60.0)["address"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise click.ClickException(f"bench peer {self.id} did not answer within {timeout}s") from None
        if line is None:
            raise click.ClickException(f"bench peer {self.id} exited (code {self.proc.wait(5)})")
        out = json.loads(line)
        if "error" in out:
            raise click.ClickException(f"bench peer {self.id}: {out['error']}")
        return out

    def ask(self, timeout: float = REPLY_TIMEOUT, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write('{"op": "quit"}\n')  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Record:
    path: str
    size: int
    raw_tcp_bytes_per_s: float
    peerd_bytes_per_s: float
    ratio: float                  # median of per-pair peerd/raw throughput ratios
    reps: int
    raw_tcp_seconds: list[float] = field(default_factory=list)
    peerd_seconds: list[float] = field(default_factory=list)
    rx_peak_extra_bytes: int | None = None
    shaped_bits_per_s: int | None = None
    raw_tcp_pct_of_shaped: float | None = None
    peerd_pct_of_shaped: float | None = None
    sealed: bool = False          # checksum computed before the timed push (as at publish)


def measure(path: str, sender: Peer, receiver: Peer, host: str, size: int, reps: int, warmup: int,
            shaped: int | None = None, timeout: float = REPLY_TIMEOUT, seal: bool = False) -> Record:
    """Alternate raw TCP and peerd transfers so both see the same background load."""
    n = reps + warmup
    port = receiver.ask(op="raw_listen", nbytes=size, reps=n)["port"]
    raw_to = f"{host}:{port}"
    base = receiver.ask(op="mem_reset")["rss"]   # after the raw receiver's buffer exists
    raw: list[float] = []
    ours: list[float] = []
    for _ in range(n):
        raw += sender.ask(op="raw_send", to=raw_to, nbytes=size, timeout=timeout)["seconds"]
        ours += sender.ask(op="push", to=receiver.address, peer=receiver.id, nbytes=size, reps=1,
                           seal=seal, timeout=timeout)["seconds"]
    sender.ask(op="raw_close", to=raw_to)
    peak = receiver.ask(op="mem")["peak"] - base
    raw, ours = raw[warmup:], ours[warmup:]
    raw_bps = size / statistics.median(raw)
    ours_bps = size / statistics.median(ours)
    # the ratio is the median over adjacent (raw, peerd) pairs: robust to load that drifts
    ratio = statistics.median(r / o for r, o in zip(raw, ours))
    rec = Record(path, size, raw_bps, ours_bps, ratio, reps, raw, ours, peak, sealed=seal)
    if shaped:
        rec.shaped_bits_per_s = shaped
        rec.raw_tcp_pct_of_shaped = 100 * raw_bps * 8 / shaped
        rec.peerd_pct_of_shaped = 100 * ours_bps * 8 / shaped
    return rec


def _sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise click.ClickException(f"{' '.join(args)}: {r.stderr.strip()}")


@contextlib.contextmanager
def lab_link() -> Iterator[tuple[str, str, str, str, str]]:
    """Two fresh namespaces joined by a veth pair; yields (ns_a, ns_b, ip_a, ip_b, dev_a).

    Unique names per run, private /30 addresses, no default route; deleted in `finally` (deleting
    a namespace removes its veth end, the peer end and every qdisc with them)."""
    tag = secrets.token_hex(2)
    ns_a, ns_b = f"pdbench-{tag}-a", f"pdbench-{tag}-b"
    dev_a, dev_b = f"pdb{tag}a", f"pdb{tag}b"
    octet = 1 + secrets.randbelow(250)
    ip_a, ip_b = f"10.254.{octet}.1", f"10.254.{octet}.2"
    made: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, ip in ((ns_a, dev_a, ip_a), (ns_b, dev_b, ip_b)):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, ip_a, ip_b, dev_a
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def shape(ns: str, dev: str, bits_per_s: int) -> None:
    """htb at `bits_per_s` on dev's egress. The leaf queue holds ~20 ms and at least 200 kB
    (a queue below one 64 KiB GSO packet stalls TCP, engineering.md §5)."""
    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
    _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
    _sh("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
        "rate", f"{bits_per_s}bit", "ceil", f"{bits_per_s}bit")
    limit = max(200_000, bits_per_s // 8 // 50)
    _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "bfifo", "limit", str(limit))


def run_transport(sizes: list[int], reps: int, shaped_sizes: list[int], rates: list[int], lab: bool,
                  chunk_bytes: int | None, log: Any = None, shaped_reps: int = 1,
                  seal: bool = False) -> list[Record]:
    out: list[Record] = []
    say = log or (lambda s: None)
    peers: list[Peer] = []
    try:
        a = Peer("bench-a", "127.0.0.1", chunk_bytes=chunk_bytes)
        peers.append(a)
        b = Peer("bench-b", "127.0.0.1", chunk_bytes=chunk_bytes)
        peers.append(b)
        for size in sizes:
            say(f"loopback {human(size)} ...")
            out.append(measure("loopback", a, b, "127.0.0.1", size, reps, warmup=1, seal=seal))
    finally:
        for p in peers:
            p.close()
    if not lab:
        return out
    with lab_link() as (ns_a, ns_b, ip_a, ip_b, dev_a):
        peers = []
        try:
            a = Peer("bench-a", ip_a, ns_a, chunk_bytes)
            peers.append(a)
            b = Peer("bench-b", ip_b, ns_b, chunk_bytes)
            peers.append(b)
            for rate in rates:
                shape(ns_a, dev_a, rate)
                measure(f"warmup", a, b, ip_b, 1 << 20, 1, warmup=0)  # connections up, slow start done
                for size in shaped_sizes:
                    say(f"shaped {rate // 10**6} Mbit {human(size)} ...")
                    bound = 120 + 3 * size * 8 / rate
                    out.append(measure(f"shaped-{rate // 10**6}mbit", a, b, ip_b, size, shaped_reps,
                                       warmup=0, shaped=rate, timeout=bound, seal=seal))
        finally:
            for p in peers:
                p.close()
    return out


def table(records: list[Record]) -> str:
    head = f"{'path':<16}{'size':>8}{'raw TCP MB/s':>14}{'peerd MB/s':>12}{'ratio':>8}{'% shaped raw/peerd':>20}{'rx peak':>10}"
    lines = [head, "-" * len(head)]
    for r in records:
        pct = (f"{r.raw_tcp_pct_of_shaped:.1f}/{r.peerd_pct_of_shaped:.1f}"
               if r.shaped_bits_per_s else "")
        peak = f"{r.rx_peak_extra_bytes / r.size:.2f}x" if r.rx_peak_extra_bytes is not None and r.size else ""
        lines.append(f"{r.path:<16}{human(r.size):>8}{r.raw_tcp_bytes_per_s / 1e6:>14.0f}"
                     f"{r.peerd_bytes_per_s / 1e6:>12.0f}{r.ratio:>8.2f}{pct:>20}{peak:>10}")
    return "\n".join(lines)


@click.group()
def bench() -> None:
    """Benchmarks of this machine and of peerd's own paths."""


@bench.command("transport")
@click.option("--sizes", default="1MB,25MB,100MB,1GB", show_default=True,
              help="comma-separated buffer sizes for the loopback comparison")
@click.option("--reps", default=5, show_default=True, help="timed transfers per size (after one warm-up)")
@click.option("--lab/--no-lab", default=None,
              help="also measure across two shaped namespaces (default: when run as root)")
@click.option("--rates", default="100mbit,1gbit", show_default=True, help="shaped link rates")
@click.option("--shaped-sizes", default="25MB,100MB", show_default=True, help="buffer sizes over shaped links")
@click.option("--shaped-reps", default=3, show_default=True, help="timed transfers per size over shaped links")
@click.option("--chunk-bytes", type=int, default=None, help="override dataplane_chunk_bytes")
@click.option("--seal", is_flag=True,
              help="checksum each buffer before its timed push, as the daemon does at publish")
@click.option("--json", "as_json", is_flag=True, help="one JSON record per (path, size)")
def transport(sizes: str, reps: int, lab: bool | None, rates: str, shaped_sizes: str, shaped_reps: int,
              chunk_bytes: int | None, seal: bool, as_json: bool) -> None:
    """Raw TCP vs peerd push, on loopback and (as root) over shaped lab links."""
    if lab is None:
        lab = os.geteuid() == 0
    elif lab and os.geteuid() != 0:
        raise click.ClickException("--lab needs root (network namespaces and tc)")
    if reps < 1 or shaped_reps < 1:
        raise click.BadParameter("--reps and --shaped-reps must be at least 1")
    records = run_transport([parse_size(s) for s in sizes.split(",") if s.strip()], reps,
                            [parse_size(s) for s in shaped_sizes.split(",") if s.strip()],
                            [parse_rate(r) for r in rates.split(",") if r.strip()], lab, chunk_bytes,
                            log=None if as_json else lambda s: click.echo(s, err=True), shaped_reps=shaped_reps,
                            seal=seal)
    if as_json:
        for r in records:
            click.echo(json.dumps(asdict(r)))
    else:
        click.echo(table(records))


if __name__ == "__main__":  # `python -m cli.bench transport ...` (the same as `peerd bench transport`)
    bench()


@bench.command("control")
@click.option("--params", default=25_000_000, show_default=True, help="model parameters (float32)")
@click.option("--iterations", default=6, show_default=True, help="timed iterations (the first is a warm-up)")
@click.option("--json", "as_json", is_flag=True, help="one JSON record per timed iteration and host")
@click.option("--copy-publish", is_flag=True,
              help="keep the parameters in the trainer's own buffer and copy them into a slot at every publish "
                   "(the default keeps them in the shared slot, as DecentralizedOptimizer does)")
@click.option("--settle", default=1.5, show_default=True,
              help="seconds each iteration waits before its Mix, for the neighbour's update to arrive")
def control(params: int, iterations: int, as_json: bool, copy_publish: bool, settle: float) -> None:
    """Cost of Publish + Mix through the daemon (shared memory, two hosts mixing), against the step.

    Starts two daemons on loopback and trains a linear layer of --params parameters with D-PSGD;
    each iteration waits until the neighbour's update has arrived, then times Publish and Mix (the
    mix copied into the model included) and compares them with the forward/backward step."""
    import json as jsonlib
    import os
    import statistics
    import tempfile
    from pathlib import Path

    from peerd.net.auth import new_secret
    from peerd.node.localswarm import LocalDaemon, peerd_cmd, wait_until

    with tempfile.TemporaryDirectory(prefix="peerd-bench-") as tmp:
        root = Path(tmp)
        secret = root / "secret"
        secret.write_text(new_secret())
        secret.chmod(0o600)
        hosts: list[LocalDaemon] = []
        # The trainer inherits the daemon's environment (not `peerd train`'s): set it before the daemons start.
        env = {**os.environ, "PEERD_BENCH_PARAMS": str(params), "PEERD_BENCH_ITERATIONS": str(iterations),
               "PEERD_BENCH_HOSTED": "0" if copy_publish else "1", "PEERD_BENCH_SETTLE": str(settle)}
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            for i in range(2):
                d = LocalDaemon(root / f"h{i}", secret, [hosts[0].address] if hosts else []).start()
                hosts.append(d)   # before wait_ready: one that never gets ready is stopped too
                d.wait_ready(60)  # a loaded machine starts a daemon slowly
            if not wait_until(lambda: all(len(d.peer_states()) == 1 for d in hosts), 30):
                raise click.ClickException("the two daemons did not find each other")
            script = Path(__file__).resolve().parent.parent / "peerd" / "train" / "benchcontrol.py"
            procs = [subprocess.Popen(peerd_cmd("train", "--data-dir", str(d.data_dir), "--script", str(script),
                                                "--world", "2", "--algo", "d-psgd", "--iterations", str(iterations)),
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for d in hosts]
            for p in procs:
                _, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise click.ClickException(f"peerd train failed: {err[-500:]}")
            records = []
            for rank, d in enumerate(hosts):
                log = next(d.data_dir.glob("trainer-*.log")).read_text()
                records += [dict(jsonlib.loads(line), host=rank) for line in log.splitlines() if line.startswith("{")]
        finally:
            os.environ.clear()
            os.environ.update(saved)
            for d in hosts:
                d.stop()
    timed = [r for r in records if r["iteration"] > 0]
    if as_json:
        for r in timed:
            click.echo(jsonlib.dumps(r))
        return
    med = {k: statistics.median(r[k] for r in timed) for k in ("step_s", "publish_s", "mix_s")}
    cost = med["publish_s"] + med["mix_s"]
    click.echo(f"model {timed[0]['bytes'] / 1e6:.0f} MB ({params / 1e6:.0f}M float32), two hosts, D-PSGD, "
               f"median of {len(timed)} iterations:")
    click.echo(f"  forward+backward step   {med['step_s'] * 1000:8.1f} ms")
    click.echo(f"  publish                 {med['publish_s'] * 1000:8.1f} ms")
    click.echo(f"  mix (copy-out included) {med['mix_s'] * 1000:8.1f} ms")
    click.echo(f"  publish + mix           {cost * 1000:8.1f} ms = {cost / med['step_s']:.1%} of the step")


@bench.command("scenarios")
@click.option("--quick", is_flag=True, help="100 iterations, target 80 %, 1 seed, contenders ddp, hop-backup-skip, netmax (~28 min)")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="also append each record here")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="run directory (default: bench-<time>); an existing one with the same settings is resumed: "
                   "runs already recorded there are skipped, the others added")
@click.option("--seeds", default=None, type=click.IntRange(1, 20), help="seeds per run (default 3; --quick: 1)")
@click.option("--scenario", "scenario_names", multiple=True, help="only these scenarios (repeat)")
@click.option("--contender", "contender_names", multiple=True, help="only these contenders (repeat): ddp or an algorithm")
@click.option("--hosts", type=click.IntRange(2, 12), help="override the host count of every scenario")
@click.option("--iterations", type=click.IntRange(2), help="iterations per run")
@click.option("--target", type=float, help="target test accuracy")
@click.option("--step-time", type=float, help="emulated compute seconds per step (x slowdown)")
@click.option("--topology", help="communication graph of every peerd contender (default ring; DDP is all-reduce)")
@click.option("--non-iid", is_flag=True, default=None,
              help="label-sorted data shards (each host sees few classes), for every contender")
@click.option("--async-budget", type=click.Choice(["host", "swarm"]), default=None,
              help="asynchronous contenders (netmax, ad-psgd): each host runs --iterations (host, the "
                   "default), or the hosts together run hosts x --iterations (swarm: `peerd train --budget`)")
@click.option("--daemon-arg", "daemon_args", multiple=True,
              help="extra flag for every lab daemon (repeat; e.g. --daemon-arg=--no-train-spread-slow-hosts "
                   "for an ablation); recorded in the settings and in each record")
def scenarios_cmd(quick: bool, json_file: str | None, out_dir: str | None, seeds: int | None,
                  scenario_names: tuple[str, ...], contender_names: tuple[str, ...], hosts: int | None,
                  iterations: int | None, target: float | None, step_time: float | None,
                  topology: str | None, non_iid: bool | None, async_budget: str | None,
                  daemon_args: tuple[str, ...]) -> None:
    """Heterogeneity benchmarks in the lab (root): every scenario with every contender, All-Reduce
    DDP included; JSON lines per (scenario, contender, seed), a table, and `peerd report` plots.
    Bounds come from the config (PEERD_* environment): bench_run_timeout, bench_gloo_timeout,
    bench_swarm_timeout, lab_ready_timeout (raise it on a loaded machine)."""
    import shlex
    import signal
    import time
    from pathlib import Path

    from peerd import config
    from peerd.bench import report, scenarios as sc

    st = sc.Settings.quick() if quick else sc.Settings()
    for key, value in dict(hosts=hosts, iterations=iterations, target=target, step_time=step_time,
                           topology=topology, non_iid=non_iid, async_budget=async_budget,
                           daemon_args=shlex.join(daemon_args) if daemon_args else None).items():
        if value is not None:
            setattr(st, key, value)
    names = list(scenario_names) or list(sc.SCENARIOS)
    contenders = list(contender_names) or (sc.QUICK_CONTENDERS if quick else sc.CONTENDERS)
    out = Path(out_dir or time.strftime("bench-%Y%m%d-%H%M%S")).resolve()
    click.echo(f"run directory {out}; {len(names)} scenario(s) x {len(contenders)} contender(s) x "
               f"{seeds or (1 if quick else 3)} seed(s); task {st.task} "
               f"({sc.model_bytes(st.task) / 1e6:.2f} MB per model), {st.iterations} iterations, "
               f"{st.step_time:g} s emulated compute per step, {st.topology} topology"
               f"{', non-iid shards' if st.non_iid else ''}"
               f"{', swarm budget for asynchronous contenders' if st.async_budget == 'swarm' else ''}"
               f"{', daemons with ' + st.daemon_args if st.daemon_args else ''}")
    def interrupted(signum, frame) -> None:
        # SIGTERM unwinds like Ctrl+C (a background job ignores SIGINT): the running contender's
        # processes are killed and the lab taken down; a second signal must not cut that short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    cfg = config.load()
    if quick:   # 30 minutes: no waiting minutes per lab for the link probing to settle
        cfg = dataclasses.replace(cfg, bench_settle_timeout=0.0)
    try:
        recs = sc.run(names, contenders, seeds or (1 if quick else 3), st, out, cfg,
                      echo=lambda m: (click.echo(m), sys.stdout.flush()), json_file=Path(json_file) if json_file else None)
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        raise click.ClickException(f"interrupted; the lab is down, and the same command resumes {out}") from None
    click.echo("\n" + report.table(recs))
    click.echo(f"plots and report.md: peerd report {out}")


@bench.command("retime")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def retime_cmd(run_dir: str) -> None:
    """Recompute the time fields of a `peerd bench scenarios` run's records (iteration time, per-host
    compute, time split) from its saved traces, with this version's definitions; the old
    results.jsonl is kept as results.jsonl.orig. A record whose run directory is gone (records
    copied from another run) is kept as it is, and named."""
    import json
    from pathlib import Path

    from peerd.bench import scenarios as sc
    from peerd.bench.report import load_records

    d = Path(run_dir)
    path = d / "results.jsonl"
    if not path.exists():
        raise click.ClickException(f"{path}: no results")
    new, kept = [], []
    try:
        for r in load_records(path):
            if not (d / r["scenario"] / r["contender"] / f"seed{r['seed']}").is_dir():
                kept.append(f"{r['scenario']}/{r['contender']}/seed {r['seed']}")
                new.append(r)
            else:
                new.append(sc.retime(d, r))
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise click.ClickException(f"{run_dir}: {e}") from None
    orig = d / "results.jsonl.orig"
    if not orig.exists():
        orig.write_text(path.read_text())
    path.write_text("".join(json.dumps(r) + "\n" for r in new))
    click.echo(f"{len(new) - len(kept)} records retimed in {path} (was: {orig})")
    if kept:
        click.echo(f"{len(kept)} kept as they were (no traces in {d}): {', '.join(kept)}")
