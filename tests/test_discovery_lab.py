"""Discovery across real network stacks: namespaces joined by a bridge, real multicast.

Each daemon stand-in is `python -m peerd.net.discovery` (MdnsDiscovery printing JSON lines) in its
own namespace; a raw-zeroconf rogue announces hostile and garbage records next to them.
"""
from __future__ import annotations

import json
import secrets
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mdns_rogue import rogues  # noqa: E402
from netns_lab import NetnsLab, lab_available  # noqa: E402

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
    ready = rogue.stdout.readline()
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
            assert c["run_id"] == run_id and c["protocol_version"] == 1
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
    rogue.communicate(timeout=20)


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
