"""Prometheus metrics of the daemon: `peerd up --metrics-port N` (docs/metrics.md lists them).

Nothing here counts anything. A custom collector reads, at scrape time, the state the daemon
already keeps for `peerd status`: the membership table, the link matrix, the data plane's
counters, the refusal gate, the event-loop watch, and the current training run (its progress,
its policy's wait, its mix ledger, its update checks). The HTTP server is prometheus_client's own
(a thread); the daemon's state belongs to its event loop, so a scrape hands the reading to the
loop and waits for it at most `metrics_scrape_timeout`. A loop that does not answer in time gets
`peerd_scrape_ok 0` and the process metrics only: a scrape never blocks the daemon, and never
reads a dict the loop is changing.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from peerd import PROTOCOL_VERSION, __version__
from peerd.node.convert import split_host_port
from peerd.node.run.progress import PARTIAL_REASONS

if TYPE_CHECKING:
    from peerd.node.run.run import TrainingRun

Daemon = Any     # peerd.node.daemon.Daemon, which imports this module; its public attributes are read

log = logging.getLogger("peerd.metrics")

PEER_STATES = ("alive", "suspect", "dead", "left")
RUN_STATES = ("waiting", "training", "restarting", "paused", "stopping", "done", "degraded", "failed")
# Why a policy waits (peerd.sync: Policy._wait): for its in-neighbours' updates, for tokens (Hop's
# gap bound), for a pulled peer's answer (NetMax, AD-PSGD), for a spanning tree (DSGD-AAU).
WAIT_REASONS = ("updates", "tokens", "pull", "tree neighbours")
DATAPLANE_EVENTS = ("pushes_sent", "pushes_received", "pushes_failed", "pulls_received", "pulls_served",
                    "pulls_failed")


class MetricsError(RuntimeError):
    """The metrics endpoint cannot start; the message says why."""


def bind_address(cfg) -> str:
    """metrics_address, or the host of --listen (a loopback daemon stays on loopback)."""
    n = cfg.node
    if n.metrics_address:
        return n.metrics_address.strip("[]")
    host, _ = split_host_port(n.listen, allow_zero=True)
    return host


class DaemonCollector(Collector):
    """Every peerd_* metric, read from the daemon on its event loop at each scrape."""

    def __init__(self, daemon: Daemon, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.daemon = daemon
        self.loop = loop
        self.timeout = timeout

    def collect(self) -> Iterator[Metric]:
        fut: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

        def read() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(list(families(self.daemon, time.monotonic())))
                except BaseException as e:  # noqa: BLE001 - the scrape reports it, the loop goes on
                    fut.set_exception(e)

        ok = GaugeMetricFamily("peerd_scrape_ok", "1 when the daemon's event loop answered this scrape in time "
                                                  "(metrics_scrape_timeout), else 0 (then only process metrics)")
        try:
            self.loop.call_soon_threadsafe(read)
            metrics = fut.result(self.timeout)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            fut.cancel()
            log.warning("metrics scrape: the event loop did not answer within %.1fs (%s)", self.timeout,
                        type(e).__name__)
            ok.add_metric([], 0)
            yield ok
            return
        except Exception:  # noqa: BLE001 - a bug in a reader must not take the endpoint down
            log.exception("metrics scrape failed")
            ok.add_metric([], 0)
            yield ok
            return
        ok.add_metric([], 1)
        yield ok
        yield from metrics


class MetricsServer:
    """prometheus_client's HTTP server in a thread, serving a registry of this daemon's collector
    and the process collector (memory, CPU, open files)."""

    def __init__(self, daemon: Daemon) -> None:
        cfg = daemon.cfg
        self.address = bind_address(cfg)
        self.port = cfg.node.metrics_port
        self.registry = CollectorRegistry()
        self.registry.register(DaemonCollector(daemon, asyncio.get_running_loop(), cfg.node.metrics_scrape_timeout))
        ProcessCollector(registry=self.registry)
        try:
            self.server, self.thread = start_http_server(self.port, addr=self.address, registry=self.registry)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {self.address}:{self.port}: {e.strerror or e}") from None
        self.port = self.server.server_address[1]
        host = f"[{self.address}]" if ":" in self.address else self.address
        self.url = f"http://{host}:{self.port}/metrics"
        log.info("serving Prometheus metrics on %s", self.url)

    async def stop(self) -> None:
        """Stop serving (the serve loop notices within half a second: off the event loop)."""
        await asyncio.to_thread(self.server.shutdown)
        self.server.server_close()


# ---- reading the daemon ---------------------------------------------------------------------

def families(d: Daemon, now: float) -> Iterable[Metric]:
    yield from node_families(d, now)
    yield from peer_families(d, now)
    yield from link_families(d, now)
    yield from dataplane_families(d)
    run = d.runs.training if d.runs is not None else None
    if run is not None:
        yield from run_families(run, now)


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels or ()))
    g.add_metric(list((labels or {}).values()), value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def node_families(d: Daemon, now: float) -> Iterable[Metric]:
    info = InfoMetricFamily("peerd", "this daemon: node id, peer address, run id, versions, event loop")
    info.add_metric([], {"node_id": d.me.node_id, "address": d.me.address, "run_id": d.cfg.node.run_id,
                         "version": __version__, "protocol": str(PROTOCOL_VERSION),
                         "incarnation": str(d.me.incarnation), "tls": str(bool(d.tls_on)).lower(), "tls_mode": d.cfg.auth.tls})
    yield info
    yield _gauge("peerd_uptime_seconds", "seconds since the daemon started", now - d.started_mono)
    gate = d.gate.state()
    yield _counter("peerd_refused_calls", "Peer RPCs refused for credentials (none, wrong, replayed, stale)",
                   gate["refused"])
    yield _counter("peerd_rate_limited_calls", "Peer RPCs refused unverified: their source spent its refusal burst",
                   gate["rate_limited"])
    yield _gauge("peerd_rate_limit_entries", "(address, claimed node) entries the refusal rate limiter holds",
                 gate["rate_limit_entries"])
    yield _gauge("peerd_event_loop_lag_p99_seconds", "how late a 50 ms timer of the event loop fires: p99 of "
                                                      "the last minute", d.loop_watch.quantile(0.99))
    yield _gauge("peerd_event_loop_lag_max_seconds", "how late that timer fired at worst since start",
                 d.loop_watch.worst)
    yield _gauge("peerd_event_loop_lag_own_p99_seconds", "the p99 lag less the time the loop's thread waited for "
                                                          "a CPU: the daemon's own share (Linux)",
                 d.loop_watch.quantile(0.99, own=True))
    yield _counter("peerd_event_loop_cpu_wait_seconds", "seconds the event loop's thread waited, runnable, for a "
                                                        "CPU (Linux): high on a host with more busy threads than cores",
                   d.loop_watch.cpu_wait_s)
    yield _counter("peerd_suspect_events", "times a peer was marked suspect or dead since start",
                   d.members.suspect_events)
    t = d.tunnels.status()
    yield _gauge("peerd_reachable", "1 when every peer that checked could dial this host back, 0 when none "
                                    "or only some could, -1 before any checked (docs/nat.md)",
                 {"yes": 1, "no": 0, "partly": 0}.get(t["reachability"].split()[0], -1))
    yield _gauge("peerd_tunnels_kept", "peers this host keeps tunnels to (they cannot dial it)", len(t["tunnels_to"]))
    yield _gauge("peerd_tunnels_used", "peers this host reaches through their tunnels", len(t["tunnels_from"]))
    yield _gauge("peerd_relayed_peers", "peers this host reaches through a relay", len(t["relayed_to"]))
    yield _counter("peerd_tunnelled_bytes", "bytes carried through tunnels and relay routes, both ways",
                   t["tunnelled_bytes"])
    yield _counter("peerd_relayed_bytes", "bytes this host relayed for others (--relay)", t["relayed_bytes"])


def peer_families(d: Daemon, now: float) -> Iterable[Metric]:
    members = sorted(d.members.table.members.values(), key=lambda m: m.node_id)
    state = GaugeMetricFamily("peerd_peer_state", "1 for the peer's membership state, 0 for the others",
                              labels=["peer", "state"])
    count = GaugeMetricFamily("peerd_peers", "peers in the membership table by state", labels=["state"])
    rtt = GaugeMetricFamily("peerd_peer_rtt_seconds", "smoothed RTT of the peer's heartbeats (0: not measured)",
                            labels=["peer"])
    heard = GaugeMetricFamily("peerd_peer_last_heard_seconds", "seconds since the peer was last heard from",
                              labels=["peer"])
    bad = CounterMetricFamily("peerd_peer_bad_updates", "updates of the peer refused as bad (NaN/Inf, too large, "
                                                        "wrong layout) since start", labels=["peer"])
    flagged = GaugeMetricFamily("peerd_peer_flagged_seconds", "seconds the peer's updates stay ignored after it "
                                                              "was flagged for bad updates (0: admitted)",
                                labels=["peer"])
    counts = dict.fromkeys(PEER_STATES, 0)
    for m in members:
        current = m.state.value
        counts[current] = counts.get(current, 0) + 1
        for s in dict.fromkeys((*PEER_STATES, current)):
            state.add_metric([m.node_id, s], 1.0 if s == current else 0.0)
        rtt.add_metric([m.node_id], m.rtt_s)
        heard.add_metric([m.node_id], max(0.0, now - m.last_heard))
        total, left, _ = d.offences.view(m.node_id)
        bad.add_metric([m.node_id], total)
        flagged.add_metric([m.node_id], left)
    for s, n in counts.items():
        count.add_metric([s], n)
    yield from (state, count, rtt, heard, bad, flagged)


def link_families(d: Daemon, now: float) -> Iterable[Metric]:
    own_only = d.cfg.node.metrics_links == "own"
    me = d.me.node_id
    labels = ["src", "dst"]
    cap = GaugeMetricFamily("peerd_link_capacity_bytes_per_second", "link capacity src -> dst: the highest "
                            "recent trusted bandwidth sample (0: not measured)", labels=labels)
    thr = GaugeMetricFamily("peerd_link_throughput_bytes_per_second", "link throughput src -> dst: the recent "
                            "average of all samples, data-plane transfers included", labels=labels)
    rtt = GaugeMetricFamily("peerd_link_rtt_seconds", "link RTT src -> dst (0: not measured)", labels=labels)
    age = GaugeMetricFamily("peerd_link_age_seconds", "seconds since the link's estimate was last updated",
                            labels=labels)
    for (src, dst), e in sorted(d.links.matrix.entries.items()):
        if own_only and src != me:
            continue
        cap.add_metric([src, dst], e.capacity_bytes_s)
        thr.add_metric([src, dst], e.throughput_bytes_s)
        rtt.add_metric([src, dst], e.rtt_s)
        age.add_metric([src, dst], max(0.0, now - e.updated_at))
    yield from (cap, thr, rtt, age)


def dataplane_families(d: Daemon) -> Iterable[Metric]:
    dp = d.dataplane
    c = {**dp.counters, **dp.senders.counts()}    # with the int8/int4 copies' keyframes and increments
    nbytes = CounterMetricFamily("peerd_dataplane_bytes", "tensor bytes over the data plane (out: pushes and "
                                 "pull answers sent; in: received)", labels=["direction"])
    nbytes.add_metric(["out"], c.get("bytes_sent", 0))
    nbytes.add_metric(["in"], c.get("bytes_received", 0))
    yield nbytes
    events = CounterMetricFamily("peerd_dataplane_transfers", "tensor transfers by event", labels=["event"])
    for name in sorted({*DATAPLANE_EVENTS, *c} - {"bytes_sent", "bytes_received"}):
        events.add_metric([name], c.get(name, 0))
    yield events
    refused = CounterMetricFamily("peerd_dataplane_refused", "transfers refused by the data plane, by reason",
                                  labels=["reason"])
    for reason, n in sorted(dp.rejected.items()):
        refused.add_metric([reason], n)
    yield refused
    yield _gauge("peerd_dataplane_held_bytes", "bytes of received tensors the data plane holds",
                 dp.budget.used_total)
    yield _gauge("peerd_dataplane_pool_idle_bytes", "bytes of idle receive buffers kept for reuse",
                 dp.pool.idle_bytes)


def run_families(run: "TrainingRun", now: float) -> Iterable[Metric]:
    p, spec, nodes = run.progress, run.spec, run.nodes
    info = InfoMetricFamily("peerd_run", "the training run on this host")
    info.add_metric([], {"tag": run.tag, "algorithm": spec.algorithm, "topology": spec.topology,
                         "rank": str(run.rank), "world": str(sum(map(bool, nodes)))})
    yield info
    state = GaugeMetricFamily("peerd_run_state", "1 for the run's state on this host, 0 for the others",
                              labels=["state"])
    for s in dict.fromkeys((*RUN_STATES, p.state)):
        state.add_metric([s], 1.0 if s == p.state else 0.0)
    yield state
    yield _gauge("peerd_run_iteration", "the iteration this host's trainer published last", p.iteration)
    yield _gauge("peerd_run_iterations_per_second", "this host's iteration rate (recent average)", p.rate)
    yield _gauge("peerd_run_loss", "the trainer's last reported training loss", p.loss)
    evaluation = GaugeMetricFamily("peerd_run_evaluation", "the last evaluation of the trainer's model "
                                   "(accuracy or loss; no sample before the first)", labels=["metric"])
    if p.metric_name:
        evaluation.add_metric([p.metric_name], p.metric)
    yield evaluation
    yield _gauge("peerd_run_elapsed_seconds", "seconds since the run started on this host", now - p.started)
    yield _gauge("peerd_run_gap_to_fastest_iterations", "newest iteration seen from any peer minus ours",
                 p.newest_seen - p.iteration if p.newest_seen >= 0 else 0)
    steps = p.step_time()
    yield _gauge("peerd_run_step_seconds", "mean seconds of a whole step, the wait for the mix included",
                 steps["step_mean_s"])
    yield _gauge("peerd_run_compute_seconds", "mean seconds of the trainer's gradient computation",
                 steps["compute_mean_s"])
    yield _counter("peerd_run_trainer_restarts", "times this host's trainer was restarted", p.restarts)
    yield _counter("peerd_run_skipped_iterations", "iterations skipped by the policy", p.skipped)
    yield _counter("peerd_run_checkpoint_failures", "checkpoints the trainer failed to write",
                   p.checkpoint_failures)
    yield _gauge("peerd_run_held_updates", "neighbours' updates held for a mix", len(run.updates.received))
    yield from _neighbour_families(run, now)
    yield from _mix_families(run)


def _peer_iterations(run: "TrainingRun", policy_state: dict) -> dict[int, int]:
    """Each neighbour's newest iteration: the policy's own record where it keeps one (Hop),
    else the newest update of it held for a mix."""
    seen = policy_state.get("peer_iteration")
    if isinstance(seen, dict) and seen:
        return {int(j): int(k) for j, k in seen.items()}
    out: dict[int, int] = {}
    for src, k in run.updates.received:
        out[src] = max(out.get(src, -1), k)
    return out


def _neighbour_families(run: "TrainingRun", now: float) -> Iterable[Metric]:
    nodes, me = run.nodes, run.rank
    policy = run.policy
    ours = run.progress.iteration
    peer_it = GaugeMetricFamily("peerd_run_peer_iteration", "a neighbour's newest iteration known here",
                                labels=["peer"])
    gap = GaugeMetricFamily("peerd_run_peer_gap_iterations", "a neighbour's newest iteration minus ours "
                            "(positive: it is ahead)", labels=["peer"])
    for j, k in sorted(_peer_iterations(run, policy.state()).items()):
        if 0 <= j < len(nodes) and j != me and nodes[j]:
            peer_it.add_metric([nodes[j]], k)
            gap.add_metric([nodes[j]], k - ours)
    yield from (peer_it, gap)
    w = policy.waiting
    waiting = GaugeMetricFamily("peerd_run_waiting", "1 while the policy waits for this reason (updates, tokens, "
                                "pull, tree neighbours), else 0", labels=["reason"])
    waited = GaugeMetricFamily("peerd_run_waiting_seconds", "how long the policy's current wait for this reason "
                               "has lasted (0: not waiting for it)", labels=["reason"])
    for reason in dict.fromkeys((*WAIT_REASONS, *([w.reason] if w.reason else []))):
        current = reason == w.reason and w.since is not None
        waiting.add_metric([reason], 1.0 if current else 0.0)
        waited.add_metric([reason], max(0.0, now - w.since) if current else 0.0)
    on = GaugeMetricFamily("peerd_run_waiting_on", "1 for each neighbour the policy's current wait is for",
                           labels=["peer"])
    for j in (w.on if w.reason else ()):
        if 0 <= j < len(nodes) and nodes[j]:
            on.add_metric([nodes[j]], 1.0)
    yield from (waiting, waited, on)
    absent = GaugeMetricFamily("peerd_run_peer_absent", "1 for a neighbour whose trainer does not contribute, "
                               "by why (restarting, finished, silent)", labels=["peer", "reason"])
    for j, why in sorted(run.liveness.absent.items()):
        if 0 <= j < len(nodes) and nodes[j]:
            absent.add_metric([nodes[j], why], 1.0)
    yield absent


def _mix_families(run: "TrainingRun") -> Iterable[Metric]:
    ledger = run.ledger
    yield _counter("peerd_run_mixes", "mixes answered to the trainer", ledger.total)
    yield _counter("peerd_run_partial_mixes", "mixes that left out a neighbour they should have had "
                   "(silent, dead, flagged, lost)", ledger.partial)
    left = CounterMetricFamily("peerd_run_left_out", "mixes that left this neighbour out, by reason; partial=true "
                               "for the reasons that make a mix partial", labels=["peer", "reason", "partial"])
    for (node, reason), n in sorted(ledger.left_out.items()):
        left.add_metric([node, reason, str(reason in PARTIAL_REASONS).lower()], n)
    yield left
    refused = CounterMetricFamily("peerd_run_updates_refused", "neighbours' updates refused by the run's checks "
                                  "(size, NaN/Inf, |value|, norm), by sender", labels=["peer"])
    for node, n in sorted(run.check.dropped_bad.items()):
        refused.add_metric([node], n)
    yield refused
    yield _counter("peerd_run_updates_nonfinite", "of them, updates refused for NaN/Inf",
                   run.check.dropped_nonfinite)
