"""Issue 36 at live daemons: replay to another daemon, wild incarnations, acting as another member,
floods that claim a peer, calls refused before their bodies are read, a bound on concurrent calls,
revocation and its spread, and data dirs of peerd before node keys."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from peerd import PROTOCOL_VERSION
from peerd.config import Config
from peerd.net.auth import NODE_KEY, RECEIVER_KEY
from peerd.net.dataplane import PUSH_METHOD, DataPlane, Outgoing, TransferError, grpc_options
from peerd.v1 import peer_pb2 as pb
from tests.daemons import peer_states, wait_for
from tests.members import as_daemon, call, member

PING = "/peerd.v1.Peer/Ping"
HELLO = "/peerd.v1.Peer/SayHello"
HEARTBEAT = "/peerd.v1.Peer/SendHeartbeat"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]   # channels of one process share TCP connections otherwise


def code_of(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


@pytest.fixture
def pair(daemons):
    a = daemons("a")
    b = daemons("b", seeds=[a.address])
    wait_for(lambda: peer_states(a).get(b.node_id) == "alive" and peer_states(b).get(a.node_id) == "alive",
             20, "a and b to peer")
    return a, b


# --- finding 1 ----------------------------------------------------------------------------------

def test_a_call_signed_for_one_daemon_is_refused_by_another_and_its_body_is_bound(pair):
    a, b = pair
    m = member()
    body = pb.PingRequest(nonce=42).SerializeToString()
    md = m.sign(PING, a.node_id, body)
    with grpc.insecure_channel(a.address) as cha, grpc.insecure_channel(b.address) as chb:
        assert pb.PingReply.FromString(call(cha, PING, body, None, "", metadata=md, raw=True)).nonce == 42
        err = code_of(lambda: call(chb, PING, body, None, "", metadata=md, raw=True))      # replayed to B
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and f"is for node {a.node_id}" in err.details()
        assert dict(err.trailing_metadata())[RECEIVER_KEY] == b.node_id                   # who B is: public
        other = pb.PingRequest(nonce=43, reply_bytes=1 << 20).SerializeToString()
        err = code_of(lambda: call(cha, PING, other, None, "", metadata=m.sign(PING, a.node_id, body), raw=True))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "body is not the one signed" in err.details()
        # the reply is signed by A for this caller: anyone else's signature would not verify
        call_ = cha.unary_unary(PING).with_call(body, metadata=(md := m.sign(PING, a.node_id, body)), timeout=3)
        raw, info = call_
        assert m.verify_reply(PING, a.node_id, dict(md)["x-peerd-nonce"], raw, info.trailing_metadata()) == a.node_id


# --- finding 2 ----------------------------------------------------------------------------------

def test_a_wild_incarnation_is_refused_and_the_peer_stays_alive(pair):
    a, b = pair
    as_b = as_daemon(b.data_dir)
    hello = pb.Hello(node_id=b.node_id, protocol_version=PROTOCOL_VERSION, run_id="default", address=b.address,
                     incarnation=2**64 - 1)
    hb = pb.Heartbeat(node_id=b.node_id, incarnation=2**64 - 1, address=b.address)
    with grpc.insecure_channel(a.address) as ch:
        err = code_of(lambda: call(ch, HELLO, hello, as_b, a.node_id))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "beyond this host's clock" in err.details()
        err = code_of(lambda: call(ch, HEARTBEAT, hb, as_b, a.node_id))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "beyond this host's clock" in err.details()
    time.sleep(2.5)                             # longer than dead_after: B's real heartbeats still count
    assert peer_states(a).get(b.node_id) == "alive"
    st = {p["node_id"]: p for p in a.status()["peers"]}
    assert int(st[b.node_id]["incarnation"]) < 2**63


# --- finding 3 ----------------------------------------------------------------------------------

async def _push(address: str, metadata, sender: str, receiver: str):
    cfg = Config()
    dp = DataPlane(cfg, sender, "default", on_received=lambda r: r.release())
    channel = grpc.aio.insecure_channel(address, options=grpc_options(cfg))
    try:
        return await dp.push(channel, receiver, Outgoing.of([torch.ones(256)]), metadata=metadata, iteration=1,
                             kind="probe")
    finally:
        await channel.close()
        dp.close()


def _refused(address: str, metadata, sender: str, receiver: str) -> TransferError:
    """The receiver's refusal of a push. grpc aio (grpc/grpc#36066) may replace it, on a loaded
    machine, with the sender's own failed write ("cut_short"): then the push is tried again, with
    freshly signed credentials (`metadata()`: a signature is good for one call)."""
    for _ in range(5):
        with pytest.raises(TransferError) as e:
            asyncio.run(_push(address, metadata(), sender, receiver))
        if e.value.reason != "cut_short":
            break
    return e.value


def test_a_member_cannot_act_as_another(pair):
    a, b = pair
    m = member()
    # M's credentials claiming B's node id; B's id first and M's second (a handler reading the first)
    def as_b():
        md = m.sign(PUSH_METHOD, a.node_id, None)
        return [(k, b.node_id if k == NODE_KEY else v) for k, v in md]
    e = _refused(a.address, as_b, b.node_id, a.node_id)
    assert e.code == grpc.StatusCode.UNAUTHENTICATED and "not the node of the certificate" in e.details
    e = _refused(a.address, lambda: [(NODE_KEY, b.node_id), *m.sign(PUSH_METHOD, a.node_id, None)],
                 b.node_id, a.node_id)
    assert e.code == grpc.StatusCode.UNAUTHENTICATED and "more than once" in e.details
    # as itself, M is a member and its push is taken
    assert asyncio.run(_push(a.address, m.sign(PUSH_METHOD, a.node_id, None), m.node_id, a.node_id)).nbytes == 1024
    st = a.status()
    assert int(st["refused_calls"]) >= 2


# --- finding 4 ----------------------------------------------------------------------------------

def test_a_flood_claiming_a_peer_does_not_lock_the_peer_out(daemons):
    a = daemons("a", extra=["--auth-refusal-burst", "5", "--auth-refusal-rate", "1"])
    b = daemons("b", seeds=[a.address])
    wait_for(lambda: peer_states(a).get(b.node_id) == "alive", 20, "a and b to peer")
    m = member()
    stop = threading.Event()
    codes: list[str] = []

    def flood():
        with grpc.insecure_channel(a.address, options=OWN_CONNECTION) as ch:
            while not stop.is_set():
                body = pb.PingRequest().SerializeToString()
                md = [(k, b.node_id if k == NODE_KEY else v) for k, v in m.sign(PING, a.node_id, body)]
                try:
                    call(ch, PING, body, None, "", metadata=md, raw=True, timeout=2)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)

    t = threading.Thread(target=flood)
    t0 = time.monotonic()
    t.start()
    try:
        time.sleep(3.0)                         # longer than dead_after (2 s)
        as_b = as_daemon(b.data_dir)
        with grpc.insecure_channel(a.address, options=OWN_CONNECTION) as ch:   # B's key, its connection: admitted
            assert pb.PingReply.FromString(call(ch, PING, pb.PingRequest(nonce=5), as_b, a.node_id)).nonce == 5
        assert peer_states(a).get(b.node_id) == "alive"   # B's own heartbeats kept counting
    finally:
        stop.set()
        t.join(10)
    flooded = time.monotonic() - t0
    assert "RESOURCE_EXHAUSTED" in codes and "OK" not in codes
    # its burst, and what it earned back at 1 refusal/s over however long the flood ran
    assert codes.count("UNAUTHENTICATED") <= 5 + 1 * flooded + 1, (codes.count("UNAUTHENTICATED"), flooded)


# --- finding 5 ----------------------------------------------------------------------------------

def test_a_refused_call_is_answered_before_its_body_is_read(daemons):
    """Every Peer method is served request-streaming behind the check: a caller that sends no
    message at all is still refused at once (a unary handler would wait for the whole message,
    up to 4 MiB, before anything could refuse it)."""
    a = daemons("a")
    never = threading.Event()

    def nothing():
        never.wait(20)
        return
        yield  # pragma: no cover

    stranger = member("not-the-cluster-secret-at-all")
    with grpc.insecure_channel(a.address) as ch:
        for md in (None, stranger.sign(PING, a.node_id, b"")):
            t0 = time.monotonic()
            err = code_of(lambda: ch.stream_unary(PING)(nothing(), metadata=md, timeout=10))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t0 < 5
    never.set()


def test_concurrent_calls_are_bounded(daemons):
    a = daemons("a", extra=["--auth-max-concurrent-calls", "6"])
    hold = threading.Event()
    members = [member() for _ in range(6)]

    def frames():
        hold.wait(30)
        return
        yield  # pragma: no cover

    with grpc.insecure_channel(a.address) as ch:
        calls = [ch.stream_unary(PUSH_METHOD).future(frames(), metadata=m.sign(PUSH_METHOD, a.node_id, None),
                                                     timeout=30) for m in members]
        # The six held calls are admitted as the daemon gets to them (a loaded machine: not
        # within a fixed sleep); a seventh is refused once they are. A broken bound never refuses.
        def refused():
            try:
                call(ch, PING, pb.PingRequest(), member(), a.node_id)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                return True
            return False
        wait_for(refused, 15, "a seventh concurrent call to be refused")
        hold.set()
        for c in calls:
            c.cancel()
        wait_for(lambda: _ping_ok(ch, a.node_id), 10, "the daemon to take calls again")
    assert a.status()["node_id"] == a.node_id


def _ping_ok(ch, node: str) -> bool:
    try:
        call(ch, PING, pb.PingRequest(), member(), node)
        return True
    except grpc.RpcError:
        return False


# --- revocation ---------------------------------------------------------------------------------

def test_a_revoked_node_is_dropped_everywhere_and_cannot_call_or_restart(daemons, tmp_path):
    a = daemons("a")
    b = daemons("b", seeds=[a.address])
    c = daemons("c", seeds=[b.address])
    wait_for(lambda: peer_states(a).get(c.node_id) == "alive" and peer_states(c).get(a.node_id) == "alive",
             20, "all three to peer")
    secret = tmp_path / "secret"
    out = CliRunner().invoke(cli, ["keys", "revoke", c.node_id, "--reason", "laptop stolen", "--secret-file",
                                   str(secret), "--data-dir", str(a.data_dir)])
    assert out.exit_code == 0 and "keeps and spreads it" in out.output, out.output
    # a has it; b learns it from a's heartbeats; both drop c
    wait_for(lambda: all(c.node_id not in peer_states(d) and int(d.status()["revoked_nodes"]) == 1 for d in (a, b)),
             15, "the revocation to reach a and b")
    assert "laptop stolen" in b.read_log()
    with grpc.insecure_channel(b.address) as ch:
        err = code_of(lambda: call(ch, PING, pb.PingRequest(), as_daemon(c.data_dir), b.node_id))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "is revoked" in err.details()
    # a forged revocation (another secret) is refused
    other = tmp_path / "other-secret"
    other.write_text("a-different-secret-0123456789\n")
    out = CliRunner().invoke(cli, ["keys", "revoke", b.node_id, "--secret-file", str(other), "--data-dir",
                                   str(a.data_dir)])
    assert out.exit_code != 0 and "not signed by this cluster's CA" in out.output
    assert b.node_id in peer_states(a)
    # offline: written to the data dir, and that node will not start
    c.stop()
    out = CliRunner().invoke(cli, ["keys", "revoke", c.node_id, "--secret-file", str(secret), "--data-dir",
                                   str(c.data_dir)])
    assert out.exit_code == 0 and "written to" in out.output
    c.start()
    c.proc.wait(timeout=60)
    assert c.proc.returncode == 2 and "is revoked" in c.read_log() and "peerd keys rotate" in c.read_log()
    # rotated: a new key, a new node id, a member again
    old = c.node_id
    out = CliRunner().invoke(cli, ["keys", "rotate", "--data-dir", str(c.data_dir), "--yes"])
    assert out.exit_code == 0, out.output
    c.proc = None
    c.start()
    st = c.wait_ready()
    assert st["node_id"] != old
    wait_for(lambda: peer_states(b).get(st["node_id"]) == "alive", 20, "the rotated node to be admitted")


# --- data dirs of peerd before node keys ------------------------------------------------------------

def test_an_old_data_dir_gets_a_key_and_a_new_id_and_says_so(daemons, tmp_path):
    d = daemons("old", start=False)
    d.data_dir.mkdir(parents=True)
    (d.data_dir / "node_id").write_text("0f1e2d3c4b5a6978\n")
    (d.data_dir / "incarnation").write_text("7\n")
    d.start()
    st = d.wait_ready()
    assert st["node_id"] != "0f1e2d3c4b5a6978" and len(st["node_id"]) == 32
    assert (d.data_dir / "node_id.v1").read_text().strip() == "0f1e2d3c4b5a6978"
    assert (d.data_dir / "node_id").read_text().strip() == st["node_id"]
    assert int(st["incarnation"]) > 7
    assert "came from a peerd before node keys" in d.read_log()
    assert oct((d.data_dir / "node_key.pem").stat().st_mode & 0o777) == "0o600"
    shown = CliRunner().invoke(cli, ["keys", "show", "--data-dir", str(d.data_dir)])
    assert shown.exit_code == 0 and st["node_id"] in shown.output
