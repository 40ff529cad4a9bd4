"""Issue 4 on the lab, with real daemons: discovery by mDNS alone (and a rogue that is never adopted),
and the link matrix each host reports on the two-site profile.

Runs as root (CI does); skips only where network namespaces cannot be made.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.config import Config
from peerd.lab import lab, profile, shaping
from tests.netns_lab import readline, rest


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "lab tests need root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "lab tests need iproute2 (`ip netns`, `tc`)"
    name = f"peerd-probe-{os.urandom(3).hex()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns add` is refused here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


_WHY = _netns_unavailable()
pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]
ROGUE = str(Path(__file__).parent / "rogue_peer.py")
# Faster failure detection and probing than the defaults; nothing that changes what is measured.
FAST = ("--heartbeat-interval", "0.5", "--link-min-probe-gap", "1")
DISCOVERY_BOUND = 30.0       # seconds from `lab up` returning until every daemon lists the other 3
# Seconds until every host's matrix is complete and accurate. Warm-up takes ~15 s; a link whose
# warm-up probes all met a site neighbour's probes on the shared uplink reads low until a later,
# sparser settle probe (2, 4, 8, 16, 32 ... s apart with --link-min-probe-gap 1) gets through.
MATRIX_BOUND = 230.0   # CI: passed after 131-160 s on a loaded machine


@pytest.fixture
def make_lab(tmp_path):
    made: list[Path] = []

    def make(prof: profile.Profile, **kw) -> lab.Lab:
        d = tmp_path / f"lab{len(made)}"
        made.append(d)
        # Daemons start slowly on a machine shared by many test runs (seen: > 15 s at load 25).
        lab.up(prof, d, Config(lab_ready_timeout=max(60.0, Config().lab.ready_timeout)), **kw)
        return lab.Lab(d)

    yield make
    for d in made:
        lab.down(d, Config(), purge=False)


def cli_json(lb: lab.Lab, host: str, *args: str, timeout: float = 30):
    p = lb.run(host, [sys.executable, "-m", "cli.main", *args, "--json"], timeout=timeout)
    return json.loads(p.stdout) if p.returncode == 0 else None


def cli_json_patient(lb: lab.Lab, host: str, *args: str):
    """cli_json where a CLI start may take long (a machine shared by many test runs): one retry."""
    for timeout in (30, 90):
        try:
            return cli_json(lb, host, *args, timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    return None


def node_ids(lb: lab.Lab) -> dict[str, str]:
    return {h: cli_json(lb, h, "status")["node_id"] for h in lb.hosts}


def test_mdns_alone_forms_the_swarm_and_a_rogue_without_the_secret_is_never_adopted(make_lab):
    lb = make_lab(profile.load("lan", 4), seeds=False, daemon_args=FAST)
    started = time.monotonic()
    logs = {h: lb.dir / h / "daemon.log" for h in lb.hosts}
    rogue_id = f"rogue-{secrets.token_hex(3)}"
    rogue = lb.popen("h4", [sys.executable, ROGUE, lb.ip("h4"), "7171", lb.run_id, rogue_id, "25"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        early = []
        while "ready" not in (line := readline(rogue, 20)):
            assert line, "the rogue exited before it was ready"
            early.append(line)
        ids = node_ids(lb)
        want = {h: {ids[o] for o in lb.hosts if o != h} for h in lb.hosts}
        seen: dict[str, set[str]] = {}
        while time.monotonic() - started < DISCOVERY_BOUND:
            seen = {h: {p["node_id"] for p in cli_json(lb, h, "peers") or [] if p["state"] == "alive"}
                    for h in lb.hosts}
            if seen == want:
                break
            time.sleep(0.3)
        took = time.monotonic() - started
        assert seen == want, f"after {took:.1f} s: {seen}"
        print(f"every daemon lists the other 3 (mDNS only) {took:.1f} s after `lab up` returned")
        for h, log in logs.items():
            text = log.read_text()
            assert "mDNS bound to eth0 " + lb.ip(h) in text, text[-2000:]
            assert "Hello to seed" not in text
        # Every daemon dials the rogue it discovered, and never adopts it: the lab's addresses are not
        # loopback, so they speak mutual TLS, and the rogue has no certificate of the cluster.
        failed = f"cannot reach mdns {lb.ip('h4')}:7171 yet: UNAVAILABLE; the TLS handshake failed"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(failed in log.read_text() for log in logs.values()):
            time.sleep(0.5)
        for h, log in logs.items():
            assert failed in log.read_text(), h
        for h in lb.hosts:
            listed = cli_json(lb, h, "peers")
            assert rogue_id not in {p["node_id"] for p in listed}
            assert f"{lb.ip('h4')}:7171" not in {p["address"] for p in listed}
            assert {p["node_id"] for p in listed} == want[h]
    finally:
        rogue.kill()
        out, _ = rest(rogue, 10)
    hellos = {json.loads(line)["hello_from"] for line in [*early, *out.splitlines()] if "hello_from" in line}
    assert hellos == set()         # not one Hello (nor anything else of the cluster) reached it


def _goodput_bps(lb: lab.Lab) -> dict[tuple[str, str], float]:
    """(src host, dst host) -> the payload rate the lab's shaping gives that path, bit/s: the
    bottleneck htb rate times the share of it TCP payload gets (shaping.GOODPUT_RATIO)."""
    out = {}
    for link in lb.state["links"]:
        rates = [r for r in (link["rate_bps"], link["site_rate_bps"]) if r]
        out[(link["src"], link["dst"])] = float(min(rates)) * shaping.GOODPUT_RATIO
    return out


def test_two_sites_every_host_ranks_intra_site_links_above_inter_site_within_25_percent(make_lab):
    t0 = time.monotonic()
    lb = make_lab(profile.load("two-sites"), daemon_args=FAST)
    started = time.monotonic()
    ids = {h: cli_json_patient(lb, h, "status")["node_id"] for h in lb.hosts}
    host_of = {v: k for k, v in ids.items()}
    want = _goodput_bps(lb)
    site = {h: lb.state["hosts"][h]["site"] for h in lb.hosts}
    pairs = [(a, b) for a in lb.hosts for b in lb.hosts if a != b]

    def ratios(view: dict) -> dict[tuple[str, str], float]:
        """Measured capacity / expected goodput for each link this view has."""
        got = {(host_of.get(r["measurer"]), host_of.get(r["target"])): r["capacity_mbit_s"] for r in view["links"]}
        return {p: got[p] * 1e6 / want[p] for p in pairs if got.get(p, 0) > 0}

    def problems(view: dict) -> list[str]:
        # Issue 4's criterion, per link: every rate within 25 % of the shaped goodput, and every
        # intra-site link above every inter-site link.
        r = ratios(view)
        bad = [f"{a}->{b} missing" for a, b in pairs if (a, b) not in r]
        bad += [f"{a}->{b} at {r[(a, b)]:.0%} of {want[(a, b)] / 1e6:.1f} Mbit/s" for a, b in r
                if abs(r[(a, b)] - 1) > 0.25]
        if bad:
            return bad
        mbit = {p: r[p] * want[p] / 1e6 for p in pairs}
        intra = [mbit[p] for p in pairs if site[p[0]] == site[p[1]]]
        inter = [mbit[p] for p in pairs if site[p[0]] != site[p[1]]]
        if min(intra) <= max(inter):
            bad.append(f"intra-site {min(intra):.1f} not above inter-site {max(inter):.1f}")
        return bad

    def view(h: str) -> dict:
        try:
            return cli_json(lb, h, "links", timeout=60) or {"links": []}
        except subprocess.TimeoutExpired:       # a CLI start on a loaded machine; the loop is bounded
            return {"links": []}

    views: dict[str, dict] = {}
    # Ends in time to report what failed within the module's 300 s timeout (lab up included).
    end = min(started + MATRIX_BOUND, t0 + 245)
    with concurrent.futures.ThreadPoolExecutor(len(lb.hosts)) as pool:   # 4 CLI starts at once
        while True:
            views = dict(zip(lb.hosts, pool.map(view, lb.hosts)))
            failing = {h: problems(v) for h, v in views.items()}
            if not any(failing.values()) or time.monotonic() > end:
                break
            time.sleep(1.0)
    took = time.monotonic() - started
    for h, v in views.items():
        print(f"{h} ({ids[h]}) after {took:.0f} s: " + ", ".join(
            f"{host_of.get(r['measurer'])}->{host_of.get(r['target'])} cap {r['capacity_mbit_s']:.0f} "
            f"thr {r['throughput_mbit_s']:.0f}+-{r['throughput_mbit_s_spread']:.0f} Mbit/s "
            f"{r['rtt_ms']:.1f} ms" for r in v["links"]))
    worst = max(((abs(x - 1), h, p, x) for h, v in views.items() for p, x in ratios(v).items()), default=None)
    if worst:
        print(f"worst link: {worst[2][0]}->{worst[2][1]} in {worst[1]}'s view, {worst[3]:.1%} of the shaped goodput")
    assert not any(failing.values()), failing
    # each daemon says how far its probing of its own links has come (the bench waits for steady)
    phases = {r["probe_phase"] for h, v in views.items() for r in v["links"] if r["measurer"] == ids[h]}
    assert phases and phases <= {"warm-up", "settling", "steady"}, phases
    text = lb.run("h1", [sys.executable, "-m", "cli.main", "links"], timeout=20).stdout
    assert "capacity, Mbit/s" in text and "throughput, Mbit/s" in text and "rtt, ms" in text
    assert f"links seen by {ids['h1']}" in text
