"""What a user sees of a run: Prometheus metrics, the live view of `peerd train`, `peerd top`.

One loopback run of two daemons with --metrics-port: host A's `peerd train` runs on a pty (its
terminal view), host B's writes to a pipe with --no-progress (plain lines). During the run the
test scrapes both metrics endpoints over HTTP and parses them with prometheus_client's own parser,
and takes one frame of `peerd top`. No screenshots: the pty's bytes, escapes stripped, are checked.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import termios
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peerd.node.localswarm import peerd_cmd
from tests.daemons import control_status, wait_for

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
ITERATIONS = 250   # after iteration 30, ~18 s of paced run left for the scrapes and `peerd top`


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus_client; the
    metric families (also those without samples yet) under ("family", name)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        out[("family", fam.name)] = 1
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def dashboard_metrics() -> set[str]:
    """The metric names the shipped Grafana dashboard queries."""
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"]]
    return {m for e in exprs for m in re.findall(r"\b(?:peerd|process)_[a-z0-9_]+", e)}


def exported(samples, name: str) -> bool:
    fams = {key[1] for key in samples if key[0] == "family"}
    return any(key[0] == name for key in samples) or name in fams or \
        any(name == f + suffix for f in fams for suffix in ("_total", "_info"))


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


class PtyRun:
    """A command on a pseudo-terminal of 140 x 40; its output is read by a thread as it comes."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
        env = {k: v for k, v in os.environ.items()
               if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES", "TERM", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
        env["TERM"] = "xterm-256color"
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.master, self.raw = master, b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            r, _, _ = select.select([self.master], [], [], 0.5)
            if r:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    return
                if not data:
                    return
                self.raw += data
            elif self.proc.poll() is not None:
                return

    def text(self) -> str:
        return ANSI.sub("\n", self.raw.decode("utf-8", "replace"))

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.thread.join(10)
        os.close(self.master)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def iteration(d) -> int:
    st = control_status(d) or {}
    run = json.loads(st["training_json"]) if st.get("training_json") else {}
    return int((run.get("policy") or {}).get("iteration", -1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_metrics_live_view_and_top_during_a_training_run(daemons):
    ports = [free_port(), free_port()]
    a = daemons("a", extra=["--metrics-port", str(ports[0])])
    b = daemons("b", seeds=[a.address], extra=["--metrics-port", str(ports[1])])
    wait_for(lambda: {p["node_id"]: p["state"] for p in (control_status(a) or {}).get("peers", [])}
             .get(b.node_id) == "alive", 30, "a swarm of two")
    url = control_status(a)["metrics_url"]
    assert url == f"http://127.0.0.1:{ports[0]}/metrics"   # the listen host: loopback stays loopback
    opts = ["--task", "digits", "--world", "2", "--iterations", str(ITERATIONS), "--step-time", "0.08",
            "--eval-every", "50"]
    view = PtyRun(peerd_cmd("train", "--data-dir", str(a.data_dir), *opts))
    plain = subprocess.Popen(peerd_cmd("train", "--data-dir", str(b.data_dir), *opts, "--no-progress",
                                       "--progress-every", "1"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: iteration(a) >= 30 and iteration(b) >= 30, 240, "the run to pass iteration 30")
        samples = scrape(url)
        other = scrape(f"http://127.0.0.1:{ports[1]}/metrics")
        top = subprocess.run(peerd_cmd("top", "--data-dir", str(a.data_dir), "--once"), capture_output=True,
                             text=True, timeout=120)
        code = view.finish(240)
        out, err = plain.communicate(timeout=240)
    finally:
        view.kill()
        if plain.poll() is None:
            os.killpg(plain.pid, 9)
            plain.wait(10)
    screen = view.text()
    assert code == 0, screen[-3000:]
    assert plain.returncode == 0, err[-3000:]

    # metrics, read from the live daemon mid-run
    assert value(samples, "peerd_scrape_ok") == 1
    assert value(samples, "peerd_dataplane_bytes_total", direction="out") > 0
    assert value(samples, "peerd_dataplane_bytes_total", direction="in") > 0
    assert value(samples, "peerd_run_iteration") >= 30
    assert value(other, "peerd_run_iteration") >= 30
    assert value(samples, "peerd_run_state", state="training") == 1
    assert value(samples, "peerd_run_mixes_total") > 0
    assert value(samples, "peerd_run_iterations_per_second") > 0
    assert value(samples, "peerd_peer_state", peer=b.node_id, state="alive") == 1
    assert value(samples, "peerd_peers", state="alive") == 1
    assert value(samples, "peerd_peer_rtt_seconds", peer=b.node_id) > 0
    assert value(samples, "peerd_link_capacity_bytes_per_second", src=a.node_id, dst=b.node_id) > 0
    assert abs(value(samples, "peerd_run_peer_gap_iterations", peer=b.node_id)) <= 2   # Hop: max gap 1 edge
    assert value(samples, "peerd_run_trainer_restarts_total") == 0
    assert value(samples, "peerd_run_partial_mixes_total") == 0
    assert value(samples, "peerd_event_loop_lag_max_seconds") is not None
    assert value(samples, "peerd_event_loop_lag_own_p99_seconds") is not None
    assert value(samples, "peerd_event_loop_cpu_wait_seconds_total") is not None
    assert value(samples, "process_resident_memory_bytes") > 0
    assert len(dashboard_metrics()) >= 15
    missing = sorted(m for m in dashboard_metrics() if not exported(samples, m))
    assert not missing, f"docs/grafana-dashboard.json queries metrics the daemon does not export: {missing}"
    info = [labels for (name, labels) in samples if name == "peerd_run_info"]
    assert info and dict(info[0])["algorithm"] == "hop" and dict(info[0])["rank"] in ("0", "1")
    node_info = dict(next(labels for (name, labels) in samples if name == "peerd_info"))
    assert (node_info["tls"], node_info["tls_mode"]) == ("false", "auto"), node_info  # --tls auto, on loopback

    # peerd top: this host, its run, the peer with its own iteration, the matrix
    assert top.returncode == 0, top.stderr
    assert f"node {a.node_id}" in top.stdout and "training  hop on ring" in top.stdout, top.stdout
    row = next(line for line in top.stdout.splitlines() if line.strip().startswith(b.node_id[:11]))
    assert " alive " in row and re.search(r"\b\d+\b", row), row
    assert "link capacity, Mbit/s" in top.stdout

    # the terminal view: bar with count, percentage, ETA, it/s, loss and accuracy; the peer line
    assert "━" in screen and f"/{ITERATIONS}" in screen and "eta " in screen, screen[-3000:]
    assert re.search(r"\d+\.\d it/s", screen) and "loss " in screen and "accuracy " in screen
    peer = [line for line in screen.splitlines() if line.strip().startswith(b.node_id[:11])]
    assert peer and any(" alive " in line and "gap " in line and "link out " in line for line in peer), \
        screen[-3000:]
    assert f"{ITERATIONS}/{ITERATIONS}" in screen and "100%" in screen     # a finished run: the whole bar
    assert "done: trainer finished" in screen

    # plain lines: no escapes, a progress line per second or so, the state changes
    assert "\x1b[" not in err and "━" not in err
    lines = [line for line in err.splitlines() if line.startswith("[#") or line.startswith("[-")]
    assert len(lines) >= 3 and all(" it/s " in line and " eta " in line for line in lines), err
    assert "waiting: world formed" in err and "done: trainer finished" in err
    assert out.strip().splitlines()[-1].startswith("[####")


def test_a_scrape_never_waits_on_a_busy_event_loop_longer_than_its_bound():
    """A loop that does not answer within metrics_scrape_timeout gets peerd_scrape_ok 0, at once
    after the bound, and nothing read from the daemon."""
    from peerd.node.metrics import DaemonCollector

    loop = asyncio.new_event_loop()
    started = threading.Event()

    def busy() -> None:
        loop.call_soon(started.set)
        loop.call_soon(time.sleep, 2.0)     # the loop is stuck for 2 s
        loop.run_until_complete(asyncio.sleep(2.2))

    t = threading.Thread(target=busy)
    t.start()
    started.wait(5)
    t0 = time.monotonic()
    metrics = list(DaemonCollector(None, loop, 0.3).collect())
    took = time.monotonic() - t0
    t.join()
    loop.close()
    assert [m.name for m in metrics] == ["peerd_scrape_ok"] and metrics[0].samples[0].value == 0
    assert 0.3 <= took < 1.5


def test_metrics_port_in_use_is_a_clear_startup_error(daemons):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        d = daemons("busy", extra=["--metrics-port", str(s.getsockname()[1])], start=False)
        d.start()
        code = d.proc.wait(timeout=120)
    assert code == 2 and "cannot serve metrics on 127.0.0.1" in d.read_log(), d.read_log()[-2000:]
