"""Real daemons on loopback: peering through gossip, failure detection, restart, wrong secret, shutdown."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from peerd import PROTOCOL_VERSION
from peerd.node.localswarm import peerd_cmd, run_cli
from tests.daemons import peer_states, wait_for

DETECTION_BOUND = 2.0 + 0.2 + 1.5  # dead_after + one heartbeat interval + scheduling slack


def test_chain_of_seeds_gossips_to_full_membership_then_detects_crash_and_readmits(daemons):
    d1 = daemons("n1")
    d2 = daemons("n2", seeds=[d1.address])
    d3 = daemons("n3", seeds=[d2.address])
    d4 = daemons("n4", seeds=[d3.address])
    ds = [d1, d2, d3, d4]
    ids = {d.node_id for d in ds}
    assert len(ids) == 4

    def all_see_all():
        return all(peer_states(d) == {o: "alive" for o in ids - {d.node_id}} for d in ds)
    wait_for(all_see_all, 15, "every daemon to list the other 3 as alive")

    victim_id = d3.node_id
    first_incarnation = int(d3.status()["incarnation"])
    killed_at = time.time()
    d3.kill(signal.SIGKILL)
    wait_for(lambda: all(peer_states(d).get(victim_id) == "dead" for d in (d1, d2, d4)),
             30, "the others to mark the killed daemon dead")
    # When each daemon decided, from its own event log (polling `peerd status` is slow on a busy host)
    for d in (d1, d2, d4):
        events = [json.loads(line) for line in (d.data_dir / "events.jsonl").read_text().splitlines()]
        [dead_at] = [e["t"] for e in events if e.get("peer") == victim_id and e.get("new") == "dead"]
        assert dead_at - killed_at < DETECTION_BOUND, (d.node_id, dead_at - killed_at)

    d3.start()
    st = d3.wait_ready()
    assert st["node_id"] == victim_id, "restart with the same data dir keeps the node id"
    assert int(st["incarnation"]) > first_incarnation   # the start time in ms, and always one more
    wait_for(all_see_all, 15, "the restarted daemon to be alive everywhere again")


def test_wrong_secret_is_refused_by_all_and_never_enters_a_table(daemons, tmp_path):
    d1 = daemons("g1")
    d2 = daemons("g2", seeds=[d1.address])
    wait_for(lambda: peer_states(d1).get(d2.node_id) == "alive", 10, "g1 and g2 to peer")
    bad_secret = tmp_path / "bad-secret"
    bad_secret.write_text("not-the-cluster-secret-at-all\n")
    bad_secret.chmod(0o600)
    intruder = daemons("intruder", seeds=[d1.address, d2.address], secret=bad_secret)
    # It also tries to be found: the good daemons must not adopt it from its heartbeats either.
    time.sleep(3)
    for d in (d1, d2):
        assert intruder.node_id not in peer_states(d)
    assert peer_states(intruder) == {}
    assert "cluster secret mismatch" in intruder.read_log()     # the refused side says why
    assert "cluster secret mismatch" in d1.read_log()           # and so does the refusing side
    # ... and its `peerd status`, not only its log
    seeds = {s["address"]: s for s in intruder.status()["seeds"]}
    assert set(seeds) == {d1.address, d2.address}
    assert all(s["failures"] and "secret mismatch" in s["last_error"] for s in seeds.values()), seeds
    text = run_cli("status", "--data-dir", str(intruder.data_dir)).stdout
    assert f"seeds     {d1.address}  no node joined there; failing: refused us: " in text, text
    assert [s["node_id"] for s in d2.status()["seeds"]] == [d1.node_id]


def test_status_json_is_parseable_and_complete(daemons):
    d1 = daemons("s1")
    d2 = daemons("s2", seeds=[d1.address])
    wait_for(lambda: peer_states(d1).get(d2.node_id) == "alive", 10, "peering")
    # status answers in milliseconds now: give d1 its first heartbeat round trip to d2
    st = wait_for(lambda: (lambda s: s if s["peers"][0]["rtt_ms"] > 0 else None)(d1.status()), 10, "an RTT")
    assert st["node_id"] == d1.node_id
    assert st["address"] == d1.address
    assert st["uptime_s"] > 0
    assert st["protocol_version"] == PROTOCOL_VERSION
    [peer] = st["peers"]
    assert peer["node_id"] == d2.node_id and peer["state"] == "alive"
    assert peer["last_heartbeat_age_s"] < 2.0 and peer["rtt_ms"] > 0


def test_event_loop_is_uvloop_by_default_and_asyncio_on_request(daemons):
    assert daemons("l1").status()["event_loop"] == "uvloop.Loop"
    stock = daemons("l2", extra=["--event-loop", "asyncio"]).status()["event_loop"]
    assert stock.startswith("asyncio.") and "uvloop" not in stock


def test_sigterm_stops_within_5s_tells_peers_and_cleans_up(daemons):
    # Slower failure detection than FAST's 2 s: on a loaded machine starved heartbeats could mark a
    # peer dead before the goodbye, and a dead peer gets none.
    patient = ["--suspect-after", "5", "--dead-after", "10"]
    d1 = daemons("t1", extra=patient)
    d2 = daemons("t2", seeds=[d1.address], extra=patient)
    wait_for(lambda: peer_states(d1).get(d2.node_id) == "alive", 10, "peering")
    sock = d2.data_dir / "peerd.sock"
    assert sock.exists()
    t0 = time.monotonic()
    os.kill(d2.proc.pid, signal.SIGTERM)
    d2.proc.wait(timeout=5)
    assert time.monotonic() - t0 < 5
    assert d2.proc.returncode == 0
    assert not sock.exists(), "the control socket is removed"
    # it said goodbye: the other side marks it left, not dead after a timeout
    wait_for(lambda: peer_states(d1).get(d2.node_id) == "left", 15, "goodbye to reach t1")
    # no child process left behind
    children = subprocess.run(["pgrep", "-P", str(d2.proc.pid)], capture_output=True, text=True).stdout
    assert children.strip() == ""


def test_sigint_stops_too(daemons):
    d = daemons("i1")
    t0 = time.monotonic()
    os.kill(d.proc.pid, signal.SIGINT)
    d.proc.wait(timeout=5)
    assert time.monotonic() - t0 < 5 and d.proc.returncode == 0


def test_second_daemon_on_same_data_dir_is_refused_clearly(daemons):
    d = daemons("dup")
    other = daemons("dup", start=False)
    other.start()
    assert other.proc.wait(timeout=15) == 2
    assert "in use by another peerd daemon" in other.read_log()
    assert d.status() is not None


def test_second_daemon_on_a_port_in_use_is_refused_clearly(daemons):
    """gRPC binds with SO_REUSEPORT: without a check the second daemon listened too, and the
    kernel dealt connections between the two."""
    d = daemons("port1")
    other = daemons("port2", extra=["--listen", d.address], start=False)
    other.start()
    assert other.proc.wait(timeout=15) == 2
    assert f"cannot listen on {d.address}: address already in use" in other.read_log()
    assert d.status() is not None


def test_ipv6_loopback_peers_gossip_dialable_addresses(daemons):
    a = daemons("v6a", extra=["--listen", "[::1]:0"])
    b = daemons("v6b", seeds=[a.address], extra=["--listen", "0.0.0.0:0"])
    c = daemons("v6c", seeds=[a.address])
    wait_for(lambda: peer_states(b).get(c.node_id) == "alive" and peer_states(c).get(b.node_id) == "alive",
             15, "b and c to find each other through a's gossip")
    for p in a.status()["peers"]:
        assert "%" not in p["address"]


def test_a_stale_control_socket_is_named_not_a_grpc_error(tmp_path):
    """A daemon killed with SIGKILL leaves its socket file: the CLI says no daemon answers there."""
    import socket as socket_mod

    path = tmp_path / "peerd.sock"
    with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as s:
        s.bind(str(path))                  # the file exists, nobody listens
    p = subprocess.run(peerd_cmd("status", "--data-dir", str(tmp_path)), capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "no daemon answers on" in p.stderr and "UNAVAILABLE" not in p.stderr, p.stderr


def test_port_check_ignores_connections_left_in_time_wait():
    """A daemon restarted after SIGKILL finds its port's accepted connections in TIME_WAIT: that
    port is free to listen on (the chaos test's restarted hosts were refused as "in use")."""
    import socket as socket_mod

    from peerd.node.daemon import port_held

    listener = socket_mod.socket()
    listener.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_REUSEADDR, 1)
    listener.setsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert port_held("127.0.0.1", port) == "address already in use"
    client = socket_mod.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()                    # the server side closes first: its end waits in TIME_WAIT
    client.close()
    listener.close()
    assert port_held("127.0.0.1", port) == ""
