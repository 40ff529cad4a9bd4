"""Link probes against a real, shaped link: htb between two namespaces, gRPC Ping as the transport."""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.netns_lab import NetnsLab, lab_available, readline, rest

pytestmark = [pytest.mark.lab, pytest.mark.timeout(90)]
HELPER = str(Path(__file__).parent / "links_lab_peer.py")


@pytest.fixture
def lab():
    reason = lab_available()
    if reason:
        pytest.skip(reason)
    lab = NetnsLab(2)
    try:
        yield lab
    finally:
        lab.close()


def tc(lab, *args):
    subprocess.run(["ip", "netns", "exec", lab.hosts[0], "tc", *args], check=True, capture_output=True, timeout=10)


def shape(lab, rate: str, change: bool = False) -> None:
    """h0 -> h1 through an htb class at `rate`; everything else unshaped."""
    if change:
        tc(lab, "class", "change", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", rate,
           "ceil", rate)
        return
    tc(lab, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "99", "r2q", "1000")
    tc(lab, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:99", "htb", "rate", "10gbit")
    tc(lab, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate)
    tc(lab, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
       "match", "ip", "dst", f"{lab.ips[1]}/32", "flowid", "1:10")


def start_server(lab):
    server = lab.popen(1, [HELPER, "serve", "7300"])
    assert readline(server, 20).strip() == "ready"
    return server


def test_estimates_follow_a_shaped_link_and_its_change(lab):
    shape(lab, "40mbit")          # goodput is about 95.7 % of the htb rate (engineering.md §5)
    server = start_server(lab)
    with tempfile.TemporaryDirectory() as d:
        flag = Path(d) / "changed"
        # 12 s: the change at 4.5 s, a probe in flight then (up to its ~3 s deadline), then the
        # confirming probe (~2 s at 8 Mbit).
        prober = lab.popen(0, [HELPER, "probe", f"{lab.ips[1]}:7300", "12", str(flag), "0.2"])
        # At 4.5 s of the prober's own clock (its start, imports included, can take seconds on
        # a loaded machine, and its 12 s count from there).
        seen = []
        while not seen or json.loads(seen[-1])["t"] < 4.5:
            line = readline(prober, 20)
            assert line, f"the prober ended early: {prober.wait(10)} {prober.stderr.read()[-2000:]}"
            seen.append(line)
        shape(lab, "8mbit", change=True)
        flag.touch()
        out, err = rest(prober, 30)
    assert prober.returncode == 0, err
    events = [json.loads(line) for line in [*seen, *out.splitlines()] if line.strip()]
    print(*[e for e in events if e.get("kind") != "rtt"], sep="\n")
    dp = next(i for i, e in enumerate(events) if e["event"] == "observed")
    before = [e for e in events[:dp] if e["event"] == "estimate" and e["kind"] == "bw"]
    # The estimates after the first bandwidth probe that started after the slow transfer was seen
    # (one already in flight then, a settle probe, may straddle the change and does not confirm it).
    first = next(i for i, e in enumerate(events) if i > dp and e["event"] == "start" and e["kind"] == "bw")
    after = [e for e in events[first + 1:] if e["event"] == "estimate" and e["kind"] == "bw"]
    # The capacity (probes that met the harness's own traffic or a busy CPU read low, never high).
    assert 0.85 * 40 < before[-1]["cap_mbit_s"] <= 40.0 * 1.05
    assert before[-1]["rtt_ms"] < 20
    # The slow data-plane transfer made a probe due at once (the periodic schedule would wait 60 s
    # or more; the probe itself takes about 1.2 s at 8 Mbit, after one in flight if there was one);
    # it confirmed, and the estimate jumped.
    assert after and after[0]["t"] - events[dp]["t"] < 5.0
    assert 0.85 * 8 < after[0]["mbit_s"] <= 8.0 * 1.15      # htb keeps some burst across `class change`
    server.kill()


def test_a_peer_that_dies_mid_transfer_fails_the_probe_and_nothing_else(lab):
    shape(lab, "4mbit")
    server = start_server(lab)
    # Bandwidth probes sized to last ~2 s, so the kill lands inside one.
    prober = lab.popen(0, [HELPER, "probe", f"{lab.ips[1]}:7300", "7", "/nonexistent", "2.0"])
    started = None
    while started is None:
        e = json.loads(readline(prober, 20))
        if e["kind"] == "bw" and e["event"] == "start" and e["size"] > 200_000:
            started = e
    time.sleep(0.5)
    server.kill()
    out, err = rest(prober, 30)
    assert prober.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    errors = [e for e in events if e["event"] == "error"]
    assert errors and errors[0]["kind"] == "bw", events
    assert "bw probe to echo failed" in err                 # logged once, clearly
    assert err.count("bw probe to echo failed") == 1
    assert events[-1]["event"] == "exit" and events[-1]["t"] < 7 + 3   # stop stays bounded
    # Backed off: failed probes to the dead peer are spaced out, not hammered.
    starts = [e["t"] for e in events if e["event"] == "start" and e["t"] > started["t"] and e["kind"] == "bw"]
    assert len(starts) <= 3
