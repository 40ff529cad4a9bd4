"""Link estimates against a real, shaped link: htb between two namespaces, gRPC Ping probes."""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.netns_lab import NetnsLab, lab_available

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


def test_estimates_follow_a_shaped_link_and_its_change(lab):
    # h0 -> h1 shaped at 40 Mbit (goodput about 95.7 % of that, engineering.md §5), later 8 Mbit.
    tc(lab, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "99", "r2q", "1000")
    tc(lab, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:99", "htb", "rate", "10gbit")
    tc(lab, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "40mbit",
       "ceil", "40mbit")
    tc(lab, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
       "match", "ip", "dst", f"{lab.ips[1]}/32", "flowid", "1:10")
    server = lab.popen(1, [HELPER, "serve", "7300"])
    assert server.stdout.readline().strip() == "ready"
    with tempfile.TemporaryDirectory() as d:
        flag = Path(d) / "changed"
        prober = lab.popen(0, [HELPER, "probe", f"{lab.ips[1]}:7300", "9", str(flag)])
        time.sleep(4.5)
        tc(lab, "class", "change", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "8mbit",
           "ceil", "8mbit")
        flag.touch()
        out, err = prober.communicate(timeout=30)
    assert prober.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    data_plane = next(i for i, e in enumerate(events) if e["kind"] == "data-plane")
    before = [e for e in events[:data_plane] if e["kind"] == "bw"]
    after = [e for e in events[data_plane + 1:] if e["kind"] == "bw"]
    print(*events[:data_plane + 3], sep="\n")
    assert 0.85 * 40 < before[-1]["mbit_s"] <= 40.0 * 1.05
    assert before[-1]["rtt_ms"] < 20
    # The slow data-plane transfer made a probe due at once, the probe confirmed, the estimate jumped.
    # (the periodic schedule would have waited link_bw_interval, 60 s or more; the probe itself
    # takes about 0.8 s at 8 Mbit)
    assert after and after[0]["t"] - events[data_plane]["t"] < 3.0
    assert 0.85 * 8 < after[0]["mbit_s"] <= 8.0 * 1.15      # htb keeps some burst across `class change`
    server.kill()
