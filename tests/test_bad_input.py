"""Bad input at a live daemon: each case gets a clear error and the daemon keeps serving."""
from __future__ import annotations

import time

import grpc
import pytest

from peerd import PROTOCOL_VERSION
from peerd.v1 import peer_pb2 as pb
from tests.daemons import peer_states, wait_for
from tests.members import as_daemon, call, member

HELLO = "/peerd.v1.Peer/SayHello"
PING = "/peerd.v1.Peer/Ping"


@pytest.fixture
def target(daemons):
    d = daemons("target")
    channel = grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 64 * 2**20)])
    yield d, channel
    channel.close()


def hello(node_id: str, **kw) -> pb.Hello:
    fields = dict(node_id=node_id, protocol_version=PROTOCOL_VERSION, run_id="default",
                  address="127.0.0.1:9", incarnation=1)
    fields.update(kw)
    return pb.Hello(**fields)


def still_serves(d, channel):
    reply = pb.PingReply.FromString(call(channel, PING, pb.PingRequest(nonce=7), member(), d.node_id))
    assert reply.nonce == 7
    assert d.status()["node_id"] == d.node_id


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_unauthenticated_and_wrong_secret_calls_are_refused(target):
    d, ch = target
    code, details = code_of(lambda: call(ch, PING, pb.PingRequest(), None, d.node_id))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "no credentials" in details
    wrong = member("some-other-secret-entirely")
    code, details = code_of(lambda: call(ch, PING, pb.PingRequest(), wrong, d.node_id))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "secret mismatch" in details
    still_serves(d, ch)


def test_replayed_call_is_refused(target):
    d, ch = target
    auth = member()
    body = pb.PingRequest().SerializeToString()
    md = auth.sign(PING, d.node_id, body)
    call(ch, PING, body, None, d.node_id, metadata=md, raw=True)
    code, details = code_of(lambda: call(ch, PING, body, None, d.node_id, metadata=md, raw=True))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "replayed" in details
    still_serves(d, ch)


def test_stale_timestamp_is_refused(target):
    d, ch = target
    auth = member(clock=lambda: time.time() - 3600)
    code, details = code_of(lambda: call(ch, PING, pb.PingRequest(), auth, d.node_id))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "clock skew" in details


def test_unknown_protocol_version_run_id_and_duplicate_id_are_refused(target):
    d, ch = target
    auth = member()
    me = auth.node_id
    code, details = code_of(lambda: call(ch, HELLO, hello(me, protocol_version=99), auth, d.node_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "protocol version 99" in details
    code, details = code_of(lambda: call(ch, HELLO, hello(me, run_id="other-run"), auth, d.node_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "run id" in details
    twin = as_daemon(d.data_dir)         # its own key, copied (a copied data dir)
    code, details = code_of(lambda: call(ch, HELLO, hello(d.node_id), twin, d.node_id))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "duplicate node id" in details
    # claiming another node id than the one authenticated as
    code, details = code_of(lambda: call(ch, HELLO, hello("0" * 32), auth, d.node_id))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert peer_states(d) == {}
    still_serves(d, ch)


def test_duplicate_node_id_alive_elsewhere_is_refused(daemons, target):
    d, ch = target
    other = daemons("other", seeds=[d.address])
    wait_for(lambda: peer_states(d).get(other.node_id) == "alive", 10, "peering")
    twin = as_daemon(other.data_dir)
    code, details = code_of(lambda: call(ch, HELLO, hello(other.node_id, address="127.0.0.1:1"), twin, d.node_id))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "alive at" in details
    assert peer_states(d) == {other.node_id: "alive"}


def test_malformed_and_oversized_messages(target):
    d, ch = target
    auth = member()
    code, details = code_of(lambda: call(ch, HELLO, b"\xff\xff\xff\x07garbage", auth, d.node_id, raw=True))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed peerd.v1.Hello" in details
    code, _ = code_of(lambda: call(ch, PING, pb.PingRequest(payload=bytes(5 * 2**20)), auth, d.node_id))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, details = code_of(lambda: call(ch, PING, pb.PingRequest(reply_bytes=2**31), auth, d.node_id))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max" in details
    md = [(k, "x" * 500 if k == "x-peerd-node" else v) for k, v in auth.sign(HELLO, d.node_id, b"")]
    code, details = code_of(lambda: call(ch, HELLO, b"", None, d.node_id, metadata=md, raw=True))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "malformed credentials" in details
    code, details = code_of(lambda: call(ch, HELLO, hello(auth.node_id, address="no-port"), auth, d.node_id))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bad address" in details
    still_serves(d, ch)


def test_seed_that_never_answers_is_logged_and_retried_with_bounded_backoff(daemons):
    d = daemons("lonely", seeds=["127.0.0.1:9"])  # discard port: nothing listens
    wait_for(lambda: "cannot reach seed 127.0.0.1:9" in d.read_log(), 10, "the log line")
    assert d.status()["peers"] == []
