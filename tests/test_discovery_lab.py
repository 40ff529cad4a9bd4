"""Discovery across real network stacks: namespaces joined by a bridge, real multicast.

Each daemon stand-in is `python -m peerd.net.discovery` (MdnsDiscovery printing JSON lines) in its
own namespace; a raw-zeroconf rogue announces hostile and garbage records next to them.
"""
from __future__ import annotations

import json
import secrets
import textwrap
from pathlib import Path

import pytest

from peerd import PROTOCOL_VERSION
from tests.mdns_rogue import rogues
from tests.netns_lab import NetnsLab, lab_available, readline, rest

pytestmark = [pytest.mark.lab, pytest.mark.timeout(90)]
ROGUE = str(Path(__file__).parent / "mdns_rogue.py")


@pytest.fixture
def lab():
    reason = lab_available()
    if reason:
        pytest.skip(reason)
    lab = NetnsLab(3)
    try:
        yield lab
    finally:
        lab.close()


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_daemons_find_each_other_and_ignore_rogue_records(lab):
    run_id = f"lab-{secrets.token_hex(2)}"
    ids = ["node-a", "node-b", "node-c"]
    rogue = lab.popen(2, [ROGUE, lab.ips[2], run_id, "node-a", "12"])
    ready = readline(rogue, 20)
    assert "ready" in ready, rogue.stderr.read() if rogue.poll() is not None else ready
    # node-c leaves early (clean goodbye) so the others must report it gone, as a hint.
    durations = [6.0, 6.0, 4.0]
    procs = [lab.popen(i, ["-m", "peerd.net.discovery", "--node-id", ids[i], "--run-id", run_id,
                           "--port", str(7000 + i), "--device-kind", "cpu",
                           "--duration", str(durations[i])]) for i in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        results.append((_lines(out), err))
    expected_rogues = rogues(run_id, "node-a")
    for i, (events, err) in enumerate(results):
        bound = next(e for e in events if e["event"] == "bound")
        assert bound["interfaces"] == [["eth0", lab.ips[i]]]
        cands = {e["node_id"]: e for e in events if e["event"] == "candidate"}
        others = {ids[j]: j for j in range(3) if j != i}
        assert set(cands) == set(others), f"{ids[i]} saw {sorted(cands)}"
        for node, j in others.items():
            c = cands[node]
            assert c["addresses"] == [f"{lab.ips[j]}:{7000 + j}"]
            assert c["run_id"] == run_id and c["protocol_version"] == PROTOCOL_VERSION
            assert c["capabilities"]["device_kind"] == "cpu"
            assert isinstance(c["capabilities"]["cpu_count"], int)
            print(f"{ids[i]} discovered {node} at t={c['t']:.3f} s after start")
        ignored = next(e for e in events if e["event"] == "ignored")["ignored"]
        for name, (_, _, reason) in expected_rogues.items():
            full = f"{name}._peerd._tcp.local."
            assert full in ignored, f"{ids[i]} did not see/ignore {name}: {sorted(ignored)}"
            assert reason in ignored[full], (name, ignored[full])
        # logged once per (name, reason), with the reason in the line
        assert err.count("ignoring 'rogue-badver._peerd._tcp.local.'") == 1
        if ids[i] != "node-c":
            assert [e["node_id"] for e in events if e["event"] == "gone"][:1] == ["node-c"]
    rest(rogue, 20)


def test_interface_choice_skips_virtual_interfaces(lab):
    ns = lab.hosts[0]
    import subprocess

    def ip(*args):
        subprocess.run(["ip", "netns", "exec", ns, "ip", *args], check=True, capture_output=True, timeout=10)

    # Typical clutter on a GPU box: a docker bridge, a compose bridge, a container veth.
    ip("link", "add", "docker0", "type", "bridge")
    ip("addr", "add", "172.31.0.1/16", "dev", "docker0")
    ip("link", "add", "br-0a1b2c3d", "type", "bridge")
    ip("addr", "add", "172.30.0.1/16", "dev", "br-0a1b2c3d")
    ip("link", "add", "veth0abc", "type", "veth", "peer", "name", "veth1abc")
    ip("addr", "add", "172.29.0.1/16", "dev", "veth0abc")
    script = textwrap.dedent("""
        import json
        from peerd.net.discovery import choose_interfaces, DiscoveryError
        out = {"default": choose_interfaces(None, None),
               "by_name": choose_interfaces("docker0", None),
               "by_ip": choose_interfaces("172.30.0.1", None),
               "advertise": choose_interfaces(None, "172.29.0.1:7070"),
               "advertise_nat": choose_interfaces(None, "203.0.113.7:7070")}
        try:
            choose_interfaces("wlan9", None)
        except DiscoveryError as e:
            out["error"] = str(e)
        print(json.dumps(out))
    """)
    r = lab.run(0, ["-c", script])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    eth0 = ["eth0", lab.ips[0]]
    assert out["default"] == [eth0]
    assert out["by_name"] == [["docker0", "172.31.0.1"]]
    assert out["by_ip"] == [["br-0a1b2c3d", "172.30.0.1"]]
    assert out["advertise"] == [["veth0abc", "172.29.0.1"]]
    assert out["advertise_nat"] == [eth0]
    assert "wlan9" in out["error"] and "eth0" in out["error"]
    # Nothing but virtual interfaces: fall back to them, never to loopback first.
    ip("link", "del", "eth0")
    r = lab.run(0, ["-c", "import json; from peerd.net.discovery import choose_interfaces; "
                          "print(json.dumps(choose_interfaces(None, None)))"])
    assert r.returncode == 0, r.stderr
    assert sorted(map(tuple, json.loads(r.stdout))) == [
        ("br-0a1b2c3d", "172.30.0.1"), ("docker0", "172.31.0.1"), ("veth0abc", "172.29.0.1")]


def test_start_fails_cleanly_and_stop_is_bounded(lab):
    script = textwrap.dedent("""
        import asyncio, json, time
        from peerd.config import Config
        from peerd.net.discovery import MdnsDiscovery, DiscoveryError
        async def main():
            out = {}
            d = MdnsDiscovery(node_id="x1", run_id="r", protocol_version=1, port=7070, addresses=[],
                              capabilities={}, interfaces=[("eth9", "10.9.9.9")], on_candidate=print)
            try:
                await d.start()
            except DiscoveryError as e:
                out["bind_error"] = str(e)
            await d.stop()                      # after a failed start: a no-op, not a crash
            cfg = Config(mdns_stop_timeout=0.5)
            d = MdnsDiscovery(node_id="x2", run_id="r", protocol_version=1, port=7070, addresses=[],
                              capabilities={}, interfaces=[("eth0", "%s")], on_candidate=print, cfg=cfg)
            await d.start()
            t = time.monotonic(); await d.stop(); out["stop_s"] = time.monotonic() - t
            await d.stop()                      # twice is fine
            print(json.dumps(out))
        asyncio.run(main())
    """ % lab.ips[0])
    r = lab.run(0, ["-c", script])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert "10.9.9.9" in out["bind_error"]
    assert out["stop_s"] < 0.5 + 2 * 0.5 + 1.0   # stop and close are each bounded by mdns_stop_timeout


@pytest.fixture
def lab2():
    reason = lab_available()
    if reason:
        pytest.skip(reason)
    lab = NetnsLab(2)
    try:
        yield lab
    finally:
        lab.close()


def _wait_for(proc, event: str, timeout: float = 15.0) -> dict:
    import time
    end = time.monotonic() + timeout
    while True:
        line = readline(proc, max(0.0, end - time.monotonic()))
        if not line:
            raise AssertionError(f"{proc.args[-3:]} exited before a {event!r} event")
        if line.startswith("{") and json.loads(line)["event"] == event:
            return json.loads(line)


def test_late_joiner_and_standard_dns_tools_see_the_service(lab2):
    import shutil
    import subprocess

    a = lab2.popen(0, ["-m", "peerd.net.discovery", "--node-id", "node-a", "--run-id", "r1", "--port", "7070",
                       "--device-kind", "cuda", "--duration", "7", "--update-at", "5",
                       "--update-device-kind", "mps"])
    _wait_for(a, "registered")
    b = lab2.popen(1, ["-m", "peerd.net.discovery", "--node-id", "node-b", "--run-id", "r1", "--port", "7071",
                       "--duration", "5"])
    seen = _wait_for(b, "candidate")
    assert seen["node_id"] == "node-a" and seen["capabilities"]["device_kind"] == "cuda"
    # Browse-first: the late joiner finds a running peer before its own registration (~1.2 s) ends.
    registered = _wait_for(b, "registered")
    print(f"late joiner found node-a at t={seen['t']:.3f} s, registered at t={registered['t']:.3f} s")
    assert seen["t"] < registered["t"]
    assert _wait_for(a, "candidate")["node_id"] == "node-b"
    # A re-announcement with new capabilities reaches the other side as a changed candidate.
    updated = _wait_for(b, "candidate", timeout=10)
    assert updated["node_id"] == "node-a" and updated["capabilities"]["device_kind"] == "mps"
    if shutil.which("dig") is None:
        rest(b, 10)
        rest(a, 10)
        pytest.skip("dig not installed: the standard-tool half of this test did not run")
    answers = {}
    for name, rtype in (("_peerd._tcp.local", "PTR"), ("node-a._peerd._tcp.local", "SRV"),
                        ("node-a._peerd._tcp.local", "TXT")):
        r = subprocess.run(["ip", "netns", "exec", lab2.hosts[1], "dig", "+time=2", "+tries=1", "+short",
                            "-p", "5353", f"@{lab2.ips[0]}", name, rtype],
                           capture_output=True, text=True, timeout=10)
        answers[rtype] = r.stdout
    assert "node-a._peerd._tcp.local." in answers["PTR"]
    assert "7070 peerd-node-a.local." in answers["SRV"]
    assert f'"id=node-a" "v={PROTOCOL_VERSION}" "run=r1" "dev=mps"' in answers["TXT"]
    rest(b, 10)
    rest(a, 10)


def test_two_daemons_on_one_host_over_loopback(lab2):
    # Both in one namespace, bound to lo: the co-located case (shared port 5353) and loopback addresses.
    procs = [lab2.popen(0, ["-m", "peerd.net.discovery", "--node-id", f"n{i}", "--port", str(7070 + i),
                            "--interface", "lo", "--duration", "3.5"]) for i in range(2)]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        cands = [e for e in _lines(out) if e["event"] == "candidate"]
        assert [(c["node_id"], c["addresses"]) for c in cands] == [(f"n{1 - i}", [f"127.0.0.1:{7071 - i}"])]
