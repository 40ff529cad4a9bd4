"""What `peerd train` shows while it runs, and `peerd top`: the swarm seen from this host.

Both read the local daemon only. Progress comes on the Train stream; the per-peer lines come from
the daemon's Swarm call (its membership table, its link matrix, and each peer's own word on its
run, which the daemon asks for): polled by a thread every PEER_POLL seconds, on a terminal only.

On a terminal `peerd train` draws a rich progress bar (iteration of --iterations, ETA from the
daemon's it/s, loss and the last evaluation) with a line per peer; without a terminal, or with
`--no-progress`, it prints plain lines: one at each state change and one every --progress-every
seconds. Partial mixes (mixes that left out a neighbour they should have had) are shown in red on
the terminal and as a WARNING line at once in plain mode.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field

import click
import grpc

PEER_POLL = 2.0             # seconds between Swarm calls of the live view
# Deadline of one Swarm call: above the daemon's own bound on the peers' answers (swarm_timeout,
# 2 s by default), which the CLI cannot read (the daemon may run with another config).
SWARM_CALL_TIMEOUT = 10.0
TOP_PLAIN_WIDTH = 200       # columns of `peerd top` written to a pipe
STATE_LINES = ("waiting", "restarting", "paused", "failed", "done", "degraded")


# ---- the swarm, as the daemon tells it -------------------------------------------------------------

def fetch_swarm(stub, timeout: float):
    from peerd.v1 import control_pb2 as cpb

    return stub.Swarm(cpb.SwarmRequest(), timeout=timeout)


@dataclass
class PeerLine:
    node_id: str
    state: str = "?"            # membership state here
    rtt_ms: float = 0.0
    iteration: int = -1         # the peer's own word (-1: none, or it did not answer)
    run: str = ""               # "training", "idle", or why it did not answer
    out_mbit: tuple[float, float] = (0.0, 0.0)   # this host -> the peer: capacity, throughput (Mbit/s)
    in_mbit: tuple[float, float] = (0.0, 0.0)    # the peer -> this host, as the peer measured it
    absent: str = ""            # the run here treats it as absent: restarting, finished, silent
    left_out: dict[str, int] = field(default_factory=dict)   # mixes without it, by reason

    def gap(self, ours: int) -> int | None:
        return self.iteration - ours if self.iteration >= 0 and ours >= 0 else None


def training_of(reply) -> dict:
    try:
        return json.loads(reply.status.training_json) if reply.status.training_json else {}
    except ValueError:
        return {}


def peer_lines(reply, only_run: bool = False) -> list[PeerLine]:
    """One line per peer: the run's other members when `only_run` and a run is on, else every peer."""
    me = reply.status.node_id
    members = {p.node_id: p for p in reply.status.peers}
    asked = {p.node_id: p for p in reply.peers}
    links = {(e.measurer, e.target): e for e in reply.links.links}
    training = training_of(reply)
    ids = [n for n in training.get("nodes", []) if n and n != me] if only_run and training else sorted(members)
    absent = training.get("absent") or {}
    left_out = (training.get("mixes") or {}).get("left_out") or {}
    out = []
    for node in ids:
        line = PeerLine(node)
        m = members.get(node)
        if m is not None:
            line.state, line.rtt_ms = m.state, m.rtt_ms
        a = asked.get(node)
        if a is not None:
            line.iteration = a.iteration if a.answered else -1
            line.run = ("training" if a.run_active else "idle") if a.answered else (a.error or "not asked")
        for key, attr in (((me, node), "out_mbit"), ((node, me), "in_mbit")):
            e = links.get(key)
            if e is not None:
                setattr(line, attr, (e.capacity_bytes_s * 8 / 1e6, e.throughput_bytes_s * 8 / 1e6))
        line.absent = str(absent.get(node, ""))
        line.left_out = {str(k): int(v) for k, v in (left_out.get(node) or {}).items()}
        out.append(line)
    return out


def short(node: str, width: int = 12) -> str:
    return node if len(node) <= width else node[:width - 1] + "~"


def mbit(pair: tuple[float, float]) -> str:
    cap, thr = pair
    if cap <= 0 and thr <= 0:
        return "-"
    return f"{cap:.0f}/{thr:.0f}" if cap > 0 else f"?/{thr:.0f}"


def describe_peer(p: PeerLine, ours: int) -> str:
    """The peer line of the live view: state, its iteration and gap to ours, link rates."""
    gap = p.gap(ours)
    parts = [f"{short(p.node_id):<12}", f"{p.state:<7}",
             f"it {p.iteration:>6}" if p.iteration >= 0 else f"it {'-':>6}",
             f"gap {gap:+d}" if gap is not None else "gap  -",
             f"link out {mbit(p.out_mbit)} in {mbit(p.in_mbit)} Mbit/s",
             f"rtt {p.rtt_ms:.1f} ms" if p.rtt_ms else "rtt -"]
    if p.absent:
        parts.append(f"ABSENT ({p.absent})")
    if p.run and p.run not in ("training", "idle"):
        parts.append(f"({p.run})")
    return "  ".join(parts)


class SwarmPoller:
    """The latest Swarm reply, fetched every PEER_POLL seconds by a thread (a slow peer answer
    never holds up the progress stream)."""

    def __init__(self, stub, timeout: float) -> None:
        self.stub, self.timeout = stub, timeout
        self.reply = None
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peerd-swarm-poll", daemon=True)

    def start(self) -> "SwarmPoller":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reply, self.error = fetch_swarm(self.stub, self.timeout), ""
            except grpc.RpcError as e:
                self.error = f"{e.code().name}: {e.details()}"
            self._stop.wait(PEER_POLL)

    def stop(self) -> None:
        self._stop.set()


# ---- `peerd train`: plain lines ----------------------------------------------------------------------

def iterations_done(p, iterations: int) -> int:
    """Of --iterations: `p.iteration` is the last one published (0-based), and a run that finished
    has done them all (its last line said 39/40 for 40)."""
    return iterations if p.state in ("done", "degraded") else min(p.iteration, iterations)


def eta(p, iterations: int) -> str:
    left = iterations - iterations_done(p, iterations)
    if p.iterations_per_s <= 0 or left <= 0:
        return "-:--:--" if left > 0 else "0:00:00"
    s = int(left / p.iterations_per_s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


BYTE_LEVEL = ("gpt",)   # built-in tasks whose loss is per byte: bits per byte = loss / ln 2


def bits_per_byte(task: str, p) -> float | None:
    """Bits per byte of the last evaluation, for a byte-level task (None otherwise)."""
    if task in BYTE_LEVEL and p.metric_name == "loss" and p.metric > 0:
        return p.metric / math.log(2)
    return None


def metric_text(p, task: str = "") -> str:
    if (bpb := bits_per_byte(task, p)) is not None:
        return f"  val loss {p.metric:.3f} ({bpb:.3f} bits/byte)"
    return f"  {p.metric_name} {p.metric:.3f}" if p.metric_name else ""


def plain_line(p, iterations: int, width: int = 28, task: str = "") -> str:
    count = iterations_done(p, iterations)
    done = count / iterations if iterations else 0.0
    bar = "#" * int(done * width) + "-" * (width - int(done * width))
    metric = metric_text(p, task)
    skipped = f"  skipped {p.skipped}" if p.skipped else ""
    skipped += f"  PARTIAL {p.partial_mixes}/{p.mixes} ({p.partial_note})" if p.partial_mixes else ""
    return (f"[{bar}] it {count}/{iterations}  loss {p.loss:.4f}{metric}  {p.iterations_per_s:.1f} it/s"
            f"  eta {eta(p, iterations)}  mixed with {p.peers_in_last_mix}  gap {p.gap_to_fastest:+d}{skipped}"
            f"  {p.elapsed_s:.0f}s")


class PlainView:
    """Lines for a log or a pipe: state changes and messages at once, a progress line every
    `every` seconds, a WARNING line whenever more partial mixes appeared since the last one."""

    def __init__(self, iterations: int, every: float, task: str = "") -> None:
        self.iterations, self.every, self.task = iterations, every, task
        self.last_print = 0.0
        self.last_state = self.last_message = ""
        self.partial_warned = 0

    def update(self, p) -> None:
        if p.state != self.last_state or (p.message and p.message != self.last_message):
            if p.state in STATE_LINES or p.message:
                self._echo(f"{p.state}: {p.message}" if p.message else p.state)
            self.last_state, self.last_message = p.state, p.message
        if p.partial_mixes > self.partial_warned and time.monotonic() - self.last_print >= self.every:
            self._echo(f"WARNING: {p.partial_mixes} of {p.mixes} mixes were partial (a neighbour left out): "
                       f"{p.partial_note}")
            self.partial_warned = p.partial_mixes
        if p.state == "training" and time.monotonic() - self.last_print >= self.every:
            self._echo(plain_line(p, self.iterations, task=self.task))
            self.last_print = time.monotonic()

    def _echo(self, text: str) -> None:
        click.echo(text, err=True)

    def close(self) -> None:
        pass


# ---- `peerd train`: the terminal view --------------------------------------------------------------

class RichView:
    """A rich progress bar and a line per peer, redrawn in place on the terminal (stderr)."""

    def __init__(self, iterations: int, poller: SwarmPoller | None, task: str = "") -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn

        view = self

        class _Progress(Progress):
            def get_renderables(self):
                yield self.make_tasks_table(self.tasks)
                yield from view.lines()

        self.iterations, self.poller, self.task = iterations, poller, task
        self.p = None
        self.notes: list[str] = []
        self.console = Console(stderr=True, highlight=False)
        self.progress = _Progress(BarColumn(bar_width=None), MofNCompleteColumn(), TaskProgressColumn(),
                                  TextColumn("eta {task.fields[eta]}"), TextColumn("{task.fields[rate]}"),
                                  TextColumn("{task.fields[stats]}"), console=self.console,
                                  refresh_per_second=4, redirect_stdout=False, redirect_stderr=False)
        self.task = self.progress.add_task("train", total=iterations, eta="-:--:--", rate="", stats="")
        self.progress.start()

    def update(self, p) -> None:
        if self.p is None or p.state != self.p.state or (p.message and p.message != self.p.message):
            if p.state in STATE_LINES or p.message:
                self.progress.console.print(f"{p.state}: {p.message}" if p.message else p.state)
        self.p = p
        metric = metric_text(p, self.task)
        self.progress.update(self.task, completed=iterations_done(p, self.iterations), eta=eta(p, self.iterations),
                             rate=f"{p.iterations_per_s:.1f} it/s", stats=f"loss {p.loss:.4f}{metric}")

    def lines(self):
        from rich.text import Text

        p = self.p
        if p is None:
            return
        reply = self.poller.reply if self.poller is not None else None
        training = training_of(reply) if reply is not None else {}
        algo = f"  {training.get('algorithm')} on {training.get('topology')}" if training else ""
        yield Text(f"{p.state}  rank {p.rank} of {p.world}{algo}  mixed with {p.peers_in_last_mix}"
                   f"  gap to fastest {p.gap_to_fastest:+d}  skipped {p.skipped}  restarts {p.trainer_restarts}"
                   f"  {p.elapsed_s:.0f}s")
        if p.partial_mixes:
            yield Text(f"PARTIAL MIXES {p.partial_mixes}/{p.mixes}: {p.partial_note}", style="bold red")
        if reply is not None:
            for line in peer_lines(reply, only_run=True):
                yield Text("  " + describe_peer(line, p.iteration),
                           style="yellow" if line.state != "alive" or line.absent else "")
        elif self.poller is not None and self.poller.error:
            yield Text(f"  peers: {self.poller.error}", style="yellow")

    def close(self) -> None:
        if self.poller is not None:
            self.poller.stop()
        self.progress.refresh()
        self.progress.stop()


def make_view(tty: bool, no_progress: bool, iterations: int, every: float, stub, task: str = ""):
    if tty and not no_progress:
        return RichView(iterations, SwarmPoller(stub, SWARM_CALL_TIMEOUT).start(), task)
    return PlainView(iterations, every, task)


# ---- `peerd top` ----------------------------------------------------------------------------------------

def top_renderables(reply):
    """The frame of `peerd top`: this daemon, its run, a line per peer, the capacity matrix."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    st = reply.status
    alive = sum(p.state == "alive" for p in st.peers)
    yield Text(f"node {st.node_id}  {st.address}  run {st.run_id}  uptime {st.uptime_s:.0f}s  "
               f"peers {alive} alive of {len(st.peers)}  loop lag p99 {st.loop_lag_p99_ms:.1f} ms "
               f"(own {st.loop_lag_own_p99_ms:.1f})"
               + (f"  metrics {st.metrics_url}" if st.metrics_url else ""), style="bold")
    training = training_of(reply)
    p = reply.progress if reply.HasField("progress") else None
    ours = -1
    if training and p is not None:
        ours = p.iteration
        mixes = training.get("mixes") or {}
        waiting = (training.get("policy") or {}).get("waiting") or {}
        yield Text(f"training  {training.get('algorithm')} on {training.get('topology')}, rank {p.rank} of "
                   f"{p.world}  state {p.state}  it {p.iteration}  {p.iterations_per_s:.1f} it/s  loss {p.loss:.4f}"
                   + (f"  {p.metric_name} {p.metric:.3f}" if p.metric_name else "")
                   + (f"  waiting for {waiting.get('reason')}" if waiting.get("reason") else ""))
        if mixes.get("partial"):
            yield Text(f"PARTIAL MIXES {mixes['partial']}/{mixes.get('total', 0)}: {p.partial_note}",
                       style="bold red")
    else:
        yield Text("no training run on this host")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("PEER", "STATE", "RTT MS", "RUN", "ITER", "GAP", "OUT MBIT/S cap/thr", "IN MBIT/S cap/thr",
                "LEFT OUT"):
        table.add_column(col, no_wrap=True)
    for line in peer_lines(reply):
        gap = line.gap(ours)
        left = ", ".join(f"{r} x{n}" for r, n in sorted(line.left_out.items()))
        table.add_row(short(line.node_id, 16), line.state + (f" ({line.absent})" if line.absent else ""),
                      f"{line.rtt_ms:.2f}" if line.rtt_ms else "-", line.run[:40] or "-",
                      str(line.iteration) if line.iteration >= 0 else "-", f"{gap:+d}" if gap is not None else "-",
                      mbit(line.out_mbit), mbit(line.in_mbit), left or "-")
    yield table
    yield from _matrix(reply)


def _matrix(reply):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rows = list(reply.links.links)
    if not rows:
        yield "no link measured yet"
        return
    me = reply.status.node_id
    nodes = sorted({e.measurer for e in rows} | {e.target for e in rows}, key=lambda n: (n != me, n))
    cell = {(e.measurer, e.target): e for e in rows}
    yield Text("link capacity, Mbit/s (each row measures towards each column)")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("from \\ to", no_wrap=True)
    for n in nodes:
        table.add_column(short(n), justify="right", no_wrap=True)
    for m in nodes:
        cells = []
        for t in nodes:
            e = cell.get((m, t))
            cells.append("-" if m == t else "." if e is None else
                         f"{e.capacity_bytes_s * 8 / 1e6:.0f}" if e.capacity_bytes_s else "?")
        table.add_row(short(m), *cells)
    yield table


@click.command()
@click.option("--data-dir", default=None, help="the daemon's data dir (as for `peerd status`)")
@click.option("--interval", type=float, default=2.0, show_default=True, help="seconds between refreshes")
@click.option("--once", is_flag=True, help="print one frame and exit (the default when not on a terminal)")
@click.option("--json", "as_json", is_flag=True, help="print the Swarm reply as JSON once")
@click.option("--timeout", type=float, default=SWARM_CALL_TIMEOUT, show_default=True,
              help="seconds to wait for the daemon (it waits at most its swarm_timeout for the peers)")
def top(data_dir: str | None, interval: float, once: bool, as_json: bool, timeout: float) -> None:
    """The whole swarm from this host: this daemon, its run, each peer's state, iteration, gap and
    links, and the link matrix. Peers' iterations are their own answers, asked by this host's
    daemon (the CLI talks to it only). Ctrl+C quits."""
    from rich.console import Console, Group
    from rich.live import Live

    from cli.daemon_cmds import control_stub, status_dict

    channel, stub = control_stub(data_dir)

    def frame():
        try:
            return fetch_swarm(stub, timeout)
        except grpc.RpcError as e:
            raise click.ClickException(f"daemon did not answer: {e.code().name}: {e.details()}") from None

    try:
        if as_json:
            click.echo(json.dumps(status_dict(frame()), indent=2))
            return
        tty = sys.stdout.isatty()
        # Not a terminal (a pipe, a log): wide enough that no column is cut; lines may be long.
        console = Console(highlight=False, width=None if tty else TOP_PLAIN_WIDTH)
        if once or not tty:
            console.print(Group(*top_renderables(frame())))
            return
        with Live(Group(*top_renderables(frame())), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(Group(*top_renderables(frame())), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        channel.close()
