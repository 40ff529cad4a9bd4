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
                measure("warmup", a, b, ip_b, 1 << 20, 1, warmup=0)  # connections up, slow start done
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


@bench.command("size")
@click.option("--case", "cases", multiple=True, metavar="TOPOLOGY:HOSTS:SIZE",
              help="one case, e.g. ring:3:100MB (repeatable); default: ring:3 and complete:4 at 1, 10, 100 and "
                   "400 MB, and ring:2 at 1 GB")
@click.option("--iterations", default=8, show_default=True, help="iterations per case (the first 2 are not timed)")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), default=None,
              help="also write one JSON record per case to this file")
@click.option("--daemon-arg", "daemon_args", multiple=True, help="extra flag for every daemon (repeatable)")
def size_cmd(cases: tuple[str, ...], iterations: int, json_file: str | None, daemon_args: tuple[str, ...]) -> None:
    """Models of 1 MB to 1 GB through the daemon, against plain TCP and plain gRPC moving the same bytes.

    For each case: that many daemons on loopback, a zero-compute trainer on each (publish, mix, copy
    back) with D-PSGD; then plain TCP, then plain gRPC streams (the floor of a transport on gRPC),
    between processes over the same graph doing the same weighted sum. Prints seconds per
    iteration, peak memory of daemons and trainers (x the model), the daemons' event-loop lag,
    peers marked suspect and partial mixes."""
    import json as jsonlib

    from peerd.bench import size
    from peerd.config import load

    if not cases:
        cases = tuple(f"{t}:{n}:{mb}MB" for mb in (1, 10, 100, 400) for t, n in (("ring", 3), ("complete", 4))) \
            + ("ring:2:1GB",)
    parsed = []
    for c in cases:
        try:
            topo, hosts, sz = c.split(":")
            parsed.append(size.Case(int(hosts), topo, parse_size(sz)))
        except ValueError:
            raise click.BadParameter(f"{c!r}: expected TOPOLOGY:HOSTS:SIZE, e.g. ring:3:100MB") from None
    results = size.run(parsed, iterations, echo=lambda m: click.echo(m, err=True), daemon_args=list(daemon_args),
                       chunk_bytes=load().dataplane.chunk_bytes)
    if json_file:
        with open(json_file, "a") as fh:
            for r in results:
                fh.write(jsonlib.dumps(r.record()) + "\n")
    click.echo(size.table(results))


@bench.command("scenarios")
@click.option("--quick", is_flag=True, help="100 iterations, target 80 %, 1 seed, contenders ddp, hop-backup-skip, netmax (~28 min)")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="also append each record here")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="run directory (default: bench-<time>); an existing one with the same settings is resumed: "
                   "runs already recorded there are skipped, the others added")
@click.option("--seeds", default=None, type=click.IntRange(1, 20), help="seeds per run (default 3; --quick: 1)")
@click.option("--scenario", "scenario_names", multiple=True,
              help="only these scenarios (repeat); two-sites-4 and two-sites-nat (docs/nat.md) run only when named")
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
    names = list(scenario_names) or list(sc.DEFAULT_SCENARIOS)
    contenders = list(contender_names) or (sc.QUICK_CONTENDERS if quick else sc.CONTENDERS)
    out = Path(out_dir or time.strftime("bench-%Y%m%d-%H%M%S")).resolve()
    click.echo(f"run directory {out}; {len(names)} scenario(s) x {len(contenders)} contender(s) x "
               f"{seeds or (1 if quick else 3)} seed(s); task {st.task} "
               f"({sc.model_bytes(st.task) / 1e6:.2f} MB per model), {st.iterations} iterations, "
               f"{st.step_time:g} s emulated compute per step, {st.topology} topology"
               f"{', non-iid shards' if st.non_iid else ''}"
               f"{', swarm budget for asynchronous contenders' if st.async_budget == 'swarm' else ''}"
               f"{', daemons with ' + st.daemon_args if st.daemon_args else ''}")
    _unwind_on_signals()
    cfg = config.load()
    if quick:   # 30 minutes: no waiting minutes per lab for the link probing to settle
        cfg = cfg.replace(bench_settle_timeout=0.0)
    try:
        recs = sc.run(names, contenders, seeds or (1 if quick else 3), st, out, cfg,
                      echo=lambda m: (click.echo(m), sys.stdout.flush()), json_file=Path(json_file) if json_file else None)
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        raise click.ClickException(f"interrupted; the lab is down, and the same command resumes {out}") from None
    click.echo("\n" + report.table(recs))
    click.echo(f"plots and report.md: peerd report {out}")


def _unwind_on_signals() -> None:
    """SIGTERM unwinds like Ctrl+C (a background job ignores SIGINT): the running contender's
    processes are killed and the lab taken down; a second signal must not cut that short."""
    import signal

    def interrupted(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)


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


@bench.command("device")
@click.option("--model-size", default="tiny", show_default=True, help="gpt model size: tiny, small, base")
@click.option("--iterations", default=40, show_default=True, help="iterations per host (the first 5 are a warm-up)")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N")
@click.option("--staging", type=click.Choice(["auto", "none", "thread"]), default="auto", show_default=True,
              help="thread: run the GPU path's staged exchange on the CPU (copies on a thread)")
@click.option("--batch-size", type=int, default=None, help="default: the model size's")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
def device_cmd(model_size: str, iterations: int, device: str, staging: str, batch_size: int | None,
               as_json: bool) -> None:
    """Train the gpt task on two loopback daemons; print step time, copy time and how much of the
    copies overlapped compute (on a GPU; without CUDA it says so and trains on the CPU)."""
    from peerd.bench import device_check
    try:
        result = device_check.run(model_size, iterations, device, staging, batch_size,
                                  log=lambda s: click.echo(s, err=True))
    except (RuntimeError, TimeoutError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result) if as_json else device_check.table(result))


@bench.command("redteam")
@click.option("--seconds", default=60.0, show_default=True, help="how long the hostile load lasts")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON record")
@click.option("--dir", "root", default=None, help="where the two daemons' data dirs and logs go (default: a new temp dir)")
@click.option("--tls", default="auto", show_default=True, type=click.Choice(["auto", "on", "off"]),
              help="the daemons' --tls (on loopback, auto is plaintext)")
def redteam(seconds: float, as_json: bool, root: str | None, tls: str) -> None:
    """Hostile load on a live daemon with no run (peerd.bench.redteam): fuzzed bodies on every Peer
    RPC, bad and replayed credentials, bursts of connections, 4 MiB bodies, rounds of 128 concurrent
    unauthenticated calls; its peak RSS, its Status latency, and whether it still does its job. As
    root it runs in a network namespace of its own (only loopback), removed afterwards."""
    from pathlib import Path

    from peerd.bench import redteam as rt

    r = rt.run_isolated(seconds, Path(root) if root else None, log=lambda s: click.echo(s, err=True), tls=tls)
    click.echo(rt.to_json(r) if as_json else rt.table(r))


@bench.command("tls")
@click.option("--sizes", default="16MiB,64MiB,256MiB", show_default=True, help="comma-separated buffer sizes")
@click.option("--reps", default=5, show_default=True, help="timed pushes per size and mode (after one warm-up)")
@click.option("--json", "as_json", is_flag=True, help="one JSON record per (mode, size)")
def tls_bench(sizes: str, reps: int, as_json: bool) -> None:
    """Data-plane push throughput on loopback, plaintext against mutual TLS (peerd.bench.tlsbench)."""
    from peerd.bench import tlsbench

    records = tlsbench.run([parse_size(s) for s in sizes.split(",") if s.strip()], reps,
                           log=lambda s: click.echo(s, err=True))
    click.echo(tlsbench.records_json(records) if as_json else tlsbench.table(records))


@bench.command("lowcomm")
@click.option("--init", "init_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="the shared warm start of the small gpt model (docs/real-size.md)")
@click.option("--contenders", default="ddp,diloco-all-int8,diloco-all,diloco-ring-int8,netmax,ad-psgd,d-psgd,"
              "straggler-ddp,straggler-fixed-h,straggler-budget", show_default=True,
              help="comma-separated; ddp and straggler-ddp are torch DDP, ddp-reference DDP's loss in one process")
@click.option("--seeds", default=1, show_default=True)
@click.option("--steps", default=60, show_default=True, help="inner steps per host (DiLoCo: STEPS / H rounds)")
@click.option("--inner-steps", default=10, show_default=True, help="H of the DiLoCo contenders")
@click.option("--step-time", default=2.5, show_default=True, help="paced seconds per inner step")
@click.option("--batch-size", default=2, show_default=True, help="per host and inner step (DDP's batch: hosts x this)")
@click.option("--target", default=2.60, show_default=True, help="validation loss to reach (nats per byte)")
@click.option("--wall-limit", default=900.0, show_default=True, help="seconds after which a run is stopped")
@click.option("--ddp-steps", default=0, show_default=True,
              help="steps of the ddp contenders (0: --steps); each all-reduces the whole model")
@click.option("--straggler", default="h1", show_default=True, help="the 2x slower host of the straggler contenders")
@click.option("--profile", "profile_name", default="two-sites", show_default=True,
              help="lab profile (two-sites-2: one host per site, the regime of fast compute and a slow cut)")
@click.option("--out", "out_dir", default="bench-lowcomm", show_default=True)
@click.option("--daemon-arg", "daemon_args", multiple=True,
              help="extra flag for every lab daemon (repeatable), e.g. --daemon-arg=--train-mix-timeout=240")
def lowcomm_cmd(init_path: str, contenders: str, seeds: int, steps: int, inner_steps: int, step_time: float,
                batch_size: int, target: float, wall_limit: float, ddp_steps: int, straggler: str, profile_name: str,
                out_dir: str, daemon_args: tuple[str, ...]) -> None:
    """The low-communication mode against today's algorithms with the 25M gpt on the two-sites lab
    (root): time to a target validation loss, final loss, bytes per host per inner step
    (peerd.bench.lowcomm). Records in OUT/results.jsonl, the table on stdout."""
    from pathlib import Path

    from peerd.bench import lowcomm

    st = lowcomm.LowCommSettings(init=str(Path(init_path).absolute()), steps=steps, inner_steps=inner_steps,
                                 step_time=step_time, batch_size=batch_size, target=target, wall_limit=wall_limit,
                                 ddp_steps=ddp_steps, daemon_args=tuple(daemon_args))
    _unwind_on_signals()
    try:
        records = lowcomm.run([c.strip() for c in contenders.split(",") if c.strip()], seeds, st, Path(out_dir),
                              straggler, profile_name, echo=lambda s: click.echo(s, err=True))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except KeyboardInterrupt:
        raise click.ClickException(f"interrupted; the lab is down, and the same command resumes {out_dir}") from None
    click.echo(lowcomm.table(records))


@bench.command("lowcomm-report")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--target", type=float, default=None, help="time to this validation loss (default: the runs' own)")
def lowcomm_report(out_dir: str, target: float | None) -> None:
    """The table of a `peerd bench lowcomm` directory, optionally to another target loss."""
    from pathlib import Path

    from peerd.bench import lowcomm
    from peerd.bench.scenarios import _read_jsonl

    click.echo(lowcomm.table(_read_jsonl(Path(out_dir) / "results.jsonl"), target))


@bench.command("warm-start")
@click.option("--model-size", default="small", show_default=True, help="of the gpt task")
@click.option("--context", default=128, show_default=True)
@click.option("--steps", default=240, show_default=True)
@click.option("--batch-size", default=16, show_default=True)
@click.option("--lr", type=float, default=None, help="default: the task's")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=2, show_default=True, help="torch threads")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
def warm_start_cmd(model_size: str, context: int, steps: int, batch_size: int, lr: float | None, seed: int,
                   threads: int, out_path: str) -> None:
    """Train the gpt model in this process and save it with its Adam moments: the `--init` every
    contender of `peerd bench lowcomm` starts from (peerd/train/warmstart.py)."""
    import torch

    from peerd.train import warmstart
    from peerd.train.tasks import get_task

    torch.set_num_threads(threads)
    task = get_task("gpt", model_size=model_size, context=context)
    warmstart.make(task, steps, batch_size, out_path, seed=seed, lr=lr, echo=lambda s: click.echo(s, err=True))
