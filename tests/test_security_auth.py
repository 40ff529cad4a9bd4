"""Issue 36, pure units: node identity, call and reply signatures, replay, the refusal gate's keys,
revocations, membership's incarnation and gossip rules, wire checks. No daemon here (the live
cases are in test_security_live.py and test_security_control.py)."""
from __future__ import annotations

import base64
import json

import grpc
import pytest

from peerd.net import pki
from peerd.net.auth import (BODY_KEY, CERT_KEY, NODE_KEY, SIG_KEY, TO_KEY, UNKNOWN_RECEIVER, Authenticator,
                            Refusal, ReplayCache, body_hash, secrets_of)
from peerd.net.membership import Membership, State, Timing
from peerd.net.wirecheck import clip, split_address, strict_json_value

SECRET = b"unit-secret-0123456789abcdef"
M = "/peerd.v1.Peer/Ping"


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def node(secret: bytes = SECRET, clock=None, key=None, revoked=None) -> Authenticator:
    trust = pki.ClusterTrust.from_secrets([secret])
    return Authenticator(pki.Credentials.issued(trust, key), trust, revoked, max_skew=30,
                         clock=clock or Clock())


def refusal(fn) -> Refusal:
    with pytest.raises(Refusal) as e:
        fn()
    return e.value


# --- identity -----------------------------------------------------------------------------------

def test_node_id_is_the_hash_of_the_public_key_and_the_ca_is_the_secrets():
    a, b = node(), node()
    assert a.node_id == pki.node_id_of(a.creds.key.public_key()) and pki.is_node_id(a.node_id)
    assert a.node_id != b.node_id
    # every holder of the secret derives the same CA; another secret another one
    assert pki.derive_ca_key(SECRET).private_numbers() == pki.derive_ca_key(SECRET).private_numbers()
    assert pki.ClusterTrust.from_secrets([SECRET]).check(b.creds.cert) == b.node_id
    with pytest.raises(pki.PkiError, match="cluster secret mismatch"):
        pki.ClusterTrust.from_secrets([b"another-secret-entirely!"]).check(b.creds.cert)
    # a keyring of two secrets trusts both CAs and issues with the first
    both = pki.ClusterTrust.from_secrets([b"the-new-secret-0123456", SECRET])
    assert both.check(b.creds.cert) == b.node_id
    assert pki.ClusterTrust.from_secrets([b"the-new-secret-0123456"]).check(
        pki.Credentials.issued(both).cert)
    assert secrets_of(b"new-one\n\n old-one \n") == [b"new-one", b"old-one"]


def test_certificates_name_no_address_only_the_node_and_peerd():
    from cryptography import x509
    cert = node().creds.cert
    assert pki.cert_names(cert) == {"peerd", f"{pki.node_id_of(cert.public_key())}.peerd"}
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == []     # nothing that changes behind NAT


# --- finding 1: a call is bound to its receiver, its body, its method; replay refused -------------

def test_call_is_bound_to_receiver_body_and_method_and_cannot_be_replayed():
    clock = Clock()
    alice, a_srv, b_srv = node(clock=clock), node(clock=clock), node(clock=clock)
    body = b"\x08\x07"
    md = alice.sign(M, a_srv.node_id, body)
    caller = a_srv.verify(M, md)
    assert caller.node == alice.node_id and caller.body == body_hash(body)
    assert refusal(lambda: a_srv.verify(M, md)).reason == "replayed call"              # same daemon
    r = refusal(lambda: b_srv.verify(M, md))                                            # another daemon
    assert "is for node" in r.reason and r.receiver == b_srv.node_id
    assert "bad signature" in refusal(lambda: a_srv.verify("/peerd.v1.Peer/SayHello", alice.sign(
        M, a_srv.node_id, body))).reason                                                # another method
    forged = [(k, body_hash(b"other") if k == BODY_KEY else v) for k, v in alice.sign(M, a_srv.node_id, body)]
    assert "bad signature" in refusal(lambda: a_srv.verify(M, forged)).reason         # another body
    unknown = alice.sign(M, UNKNOWN_RECEIVER, body)
    assert refusal(lambda: a_srv.verify(M, unknown)).receiver == a_srv.node_id        # who are you: answered


def test_stale_and_future_calls_are_refused():
    clock = Clock()
    alice, srv = node(clock=Clock(clock.t - 31)), node(clock=clock)
    assert "clock skew" in refusal(lambda: srv.verify(M, alice.sign(M, srv.node_id, b""))).reason
    ahead = node(clock=Clock(clock.t + 31))
    assert "clock skew" in refusal(lambda: srv.verify(M, ahead.sign(M, srv.node_id, b""))).reason


def test_replies_are_signed_by_the_node_the_call_was_for():
    alice, srv, other = node(), node(), node()
    md = dict(alice.sign(M, srv.node_id, b""))
    caller = srv.verify(M, list(md.items()))
    raw = b"\x08\x07"
    trailing = srv.sign_reply(M, caller, raw)
    assert alice.verify_reply(M, srv.node_id, md["x-peerd-nonce"], raw, trailing) == srv.node_id
    assert "altered" in refusal(lambda: alice.verify_reply(M, srv.node_id, md["x-peerd-nonce"], b"x", trailing)).reason
    assert "signed by node" in refusal(lambda: alice.verify_reply(M, other.node_id, md["x-peerd-nonce"], raw,
                                                                  trailing)).reason
    assert "not signed" in refusal(lambda: alice.verify_reply(M, srv.node_id, md["x-peerd-nonce"], raw, ())).reason
    impostor = node(b"not-this-cluster-secret!!")
    forged = impostor.sign_reply(M, caller, raw)
    assert "cluster secret mismatch" in refusal(
        lambda: alice.verify_reply(M, UNKNOWN_RECEIVER, md["x-peerd-nonce"], raw, forged)).reason


def test_replay_cache_is_bounded_and_never_forgets_a_call_it_would_admit():
    c = ReplayCache(capacity=100, window=30.0)
    for i in range(1000):
        assert c.check_and_add(("n", f"{i}"), ts=float(i) / 100, now=5.0) == ""
    assert len(c) <= 100
    # the forgotten ones are below the floor: a replay of any of them is refused
    assert "replay cache is full" in c.check_and_add(("n", "0"), ts=0.0, now=5.0)
    assert c.check_and_add(("n", "999"), ts=9.99, now=5.0) == "replayed call"
    # entries older than the window leave by themselves
    c2 = ReplayCache(capacity=10, window=30.0)
    c2.check_and_add(("n", "a"), ts=0.0, now=0.0)
    c2.check_and_add(("n", "b"), ts=40.0, now=40.0)
    assert len(c2) == 1


# --- finding 3: identity, not membership; one value per credential header ------------------------

def test_no_member_can_sign_as_another():
    alice, bob, srv = node(), node(), node()
    md = alice.sign(M, srv.node_id, b"")
    as_bob = [(k, bob.node_id if k == NODE_KEY else v) for k, v in md]
    assert "is not the node of the certificate" in refusal(lambda: srv.verify(M, as_bob)).reason
    # Bob's certificate with Alice's signature (she cannot sign with his key)
    swapped = [(k, bob.creds.cert_b64 if k == CERT_KEY else bob.node_id if k == NODE_KEY else v) for k, v in md]
    assert "bad signature" in refusal(lambda: srv.verify(M, swapped)).reason
    # a certificate the cluster's CA did not issue, for any key
    stranger = node(b"a-stranger-has-no-secret")
    assert "cluster secret mismatch" in refusal(lambda: srv.verify(M, stranger.sign(M, srv.node_id, b""))).reason


def test_a_repeated_credential_header_is_refused():
    alice, bob, srv = node(), node(), node()
    md = alice.sign(M, srv.node_id, b"")
    assert "more than once" in refusal(lambda: srv.verify(M, [(NODE_KEY, bob.node_id), *md])).reason
    assert "more than once" in refusal(lambda: srv.verify(M, [*md, (SIG_KEY, "AAAA")])).reason


def test_over_tls_the_signer_must_be_the_tls_peer():
    alice, srv = node(), node()
    md = alice.sign(M, srv.node_id, b"")
    r = refusal(lambda: srv.verify(M, md, transport_node=node().node_id))
    assert "TLS connection of node" in r.reason and r.code == grpc.StatusCode.PERMISSION_DENIED
    assert srv.verify(M, alice.sign(M, srv.node_id, b""), transport_node=alice.node_id).node == alice.node_id


def test_protocol_1_credentials_are_named():
    srv = node()
    assert "protocol 1" in refusal(lambda: srv.verify(M, [("x-peerd-mac", "ab" * 32)])).reason


# --- revocations --------------------------------------------------------------------------------

def test_revocations_are_signed_by_the_ca_verified_bounded_and_persisted(tmp_path):
    trust = pki.ClusterTrust.from_secrets([SECRET])
    victim = node()
    path = tmp_path / "revoked.json"
    store = pki.Revocations(trust, path, capacity=3)
    rev = trust.revoke(victim.node_id, "key leaked")
    assert store.add([rev]) == [rev] and victim.node_id in store and store.add([rev]) == []
    forged = pki.ClusterTrust.from_secrets([b"not-the-cluster-secret!"]).revoke(node().node_id, "x")
    assert store.add([forged]) == [] and len(store) == 1
    tampered = pki.Revocation(node().node_id, rev.at, rev.reason, rev.signature)
    assert store.add([tampered]) == []
    assert pki.Revocations(trust, path).by_node == store.by_node                       # kept across restarts
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    for _ in range(5):
        store.add([trust.revoke(node().node_id)])
    assert len(store) == 3                                                              # bounded
    # a revoked node's calls are refused
    srv = node(revoked=store)
    srv_store = srv.revoked
    assert srv_store is store
    r = refusal(lambda: srv.verify(M, victim.sign(M, srv.node_id, b"")))
    assert "is revoked" in r.reason and r.code == grpc.StatusCode.PERMISSION_DENIED
    a, b = pki.Revocations(trust), pki.Revocations(trust)
    a.add([rev]), b.add([rev])
    assert a.digest == b.digest != pki.Revocations(trust).digest


# --- finding 4: the gate's key is what was authenticated ---------------------------------------

def test_gate_keys_are_connections_or_tls_nodes_so_a_flood_cannot_spend_another_nodes_refusals():
    """The interceptor's key for a plaintext call is its connection (address and port), for a TLS
    call the node of the TLS certificate: a flood naming node B from B's host spends its own
    connection's bucket, never B's (tests/test_security_live.py floods a live daemon)."""
    from peerd.net.auth import AuthInterceptor, RefusalGate

    class Ctx:
        def __init__(self, peer, pem=None):
            self._peer, self._pem = peer, pem

        def peer(self):
            return self._peer

        def auth_context(self):
            return {"x509_pem_cert": [self._pem]} if self._pem else {}

    srv, bob = node(), node()
    icpt = AuthInterceptor(srv, RefusalGate(burst=2, rate=0.0))
    flood_key, _, _ = icpt._transport(Ctx("ipv4:10.0.0.2:50001"))
    bob_key, _, _ = icpt._transport(Ctx("ipv4:10.0.0.2:50002"))
    assert flood_key != bob_key
    for _ in range(3):
        icpt.gate.charge(flood_key)
    assert icpt.gate.limited(flood_key) and not icpt.gate.limited(bob_key)
    tls_key, _, tls_node = icpt._transport(Ctx("ipv4:10.0.0.2:50003", bob.creds.cert_pem))
    assert tls_key == ("tls", bob.node_id) and tls_node == bob.node_id


# --- finding 2: incarnations ---------------------------------------------------------------------

def table() -> Membership:
    return Membership("me", Timing(suspect_after=3, dead_after=6, forget_dead_after=100, retry_base=1, retry_max=8))


def test_a_wild_incarnation_cannot_silence_a_live_peer_for_good():
    m = table()
    m.admit("b", "h:1", "r", 100, {}, now=0.0)
    assert m.heard_from("b", 1.0, incarnation=2**64 - 1) is None     # (the service refuses these: bound)
    # its real heartbeats (incarnation 100) are ignored while the wild one is fresh ...
    assert m.heard_from("b", 2.0, incarnation=100) is None and m.members["b"].incarnation == 2**64 - 1
    for t in (3.0, 5.0, 7.5):
        m.tick(t)
    assert m.members["b"].state is State.DEAD
    # ... but once it has been silent for dead_after, B's own contact is B again
    tr = m.heard_from("b", 8.0, incarnation=100)
    assert tr is not None and tr.new is State.ALIVE and m.members["b"].incarnation == 100


def test_the_service_bounds_incarnations_by_the_clock():
    import time

    from peerd.node.membership_service import hello_refusal
    from peerd.v1 import peer_pb2 as pb
    bound = int((time.time() + 30) * 1000)
    hello = pb.Hello(node_id="a" * 32, protocol_version=2, run_id="r", incarnation=2**64 - 1)
    code, text = hello_refusal("b" * 32, "r", hello, bound)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "beyond this host's clock" in text
    hello.incarnation = bound - 1000
    assert hello_refusal("b" * 32, "r", hello, bound) is None


# --- finding 8: gossiped addresses, clipped strings, strict JSON ------------------------------------

def test_gossiped_addresses_are_checked_and_bounded():
    m = table()
    rows = [{"node_id": f"n{i}", "address": f"10.0.0.1:{1000 + i}", "incarnation": 1, "state": State.ALIVE}
            for i in range(1024)]
    bad = [{"node_id": "u", "address": "unix:///tmp/peerd.sock", "incarnation": 1, "state": State.ALIVE},
           {"node_id": "d", "address": "dns:///evil:53", "incarnation": 1, "state": State.ALIVE},
           {"node_id": "z", "address": "0.0.0.0:7070", "incarnation": 1, "state": State.ALIVE},
           {"node_id": "l", "address": "127.0.0.1:7070", "incarnation": 1, "state": State.ALIVE},
           {"node_id": "w", "address": "a b:1", "incarnation": 1, "state": State.ALIVE}]
    skipped = m.merge_gossip(bad + rows, now=0.0, allow_loopback=False, max_new=32)
    assert skipped == 5 and len(m.candidates) == 32
    assert all(split_address(a) for a in m.candidates)
    assert m.merge_gossip(bad[3:4], now=0.0, allow_loopback=True) == 0     # a loopback swarm gossips loopback


def test_split_address_takes_host_port_only():
    assert split_address("10.1.2.3:7070") == ("10.1.2.3", 7070)
    assert split_address("[::1]:7070") == ("::1", 7070)
    assert split_address("Host-1.example:80") == ("host-1.example", 80)
    for bad in ("unix:///x:1", "unix:/x:1", "dns:///h:1", "h:0", "h:65536", "h", ":1", "h/x:1", "user@h:1",
                "h:1 ", "x" * 300 + ":1", "1.2.3:1", "[zz]:1", "h\n:1"):
        assert split_address(bad) is None, bad


def test_strings_from_the_wire_are_clipped_and_json_is_strict():
    long = "x" * 100_000
    assert len(clip(long)) < 200 and "100000 characters" in clip(long)
    assert clip("a\nb") == "'a\\nb'"
    value = {"loss": float("nan"), "rows": [1.0, float("inf")], "ok": 2.5}
    text = json.dumps(strict_json_value(value), allow_nan=False)
    assert json.loads(text) == {"loss": None, "rows": [1.0, None], "ok": 2.5}


def test_signature_header_is_bounded_base64():
    alice, srv = node(), node()
    md = [(k, "!" * 80 if k == SIG_KEY else v) for k, v in alice.sign(M, srv.node_id, b"")]
    assert "malformed signature" in refusal(lambda: srv.verify(M, md)).reason
    md = [(k, base64.b64encode(b"x" * 2000).decode() if k == SIG_KEY else v) for k, v in alice.sign(M, srv.node_id, b"")]
    assert refusal(lambda: srv.verify(M, md)).reason == "malformed credentials"
    md = [(k, "?" if k == TO_KEY else v) for k, v in alice.sign(M, srv.node_id, b"")]
    assert "bad signature" in refusal(lambda: srv.verify(M, md)).reason


def test_your_own_ca_certifies_nodes_and_signs_revocations(tmp_path):
    """An operator's CA (files, as `--tls-ca` and `peerd keys revoke --ca-cert --ca-key` read them):
    it issues, verifies, and revokes; the derived CA of a secret does not trust its nodes."""
    from cryptography.hazmat.primitives import serialization
    ca_key = pki.new_key()
    own = pki.ClusterTrust([pki._ca_certificate(ca_key)], ca_key)
    (tmp_path / "ca.pem").write_bytes(own.pem)
    (tmp_path / "ca.key").write_bytes(pki.key_pem(ca_key))
    trust = pki.ClusterTrust.from_files(str(tmp_path / "ca.pem"))
    signer = pki.ClusterTrust.from_files(str(tmp_path / "ca.pem"), str(tmp_path / "ca.key"))
    creds = pki.Credentials.issued(signer)
    (tmp_path / "n.pem").write_bytes(creds.cert_pem)
    (tmp_path / "n.key").write_bytes(creds.key_pem)
    loaded = pki.Credentials.from_files(str(tmp_path / "n.pem"), str(tmp_path / "n.key"), trust)
    assert loaded.node_id == creds.node_id == trust.check(creds.cert)
    with pytest.raises(pki.PkiError, match="cluster secret mismatch"):
        pki.ClusterTrust.from_secrets([SECRET]).check(creds.cert)
    rev = signer.revoke(creds.node_id, "retired")
    assert trust.verify_revocation(rev) and not pki.ClusterTrust.from_secrets([SECRET]).verify_revocation(rev)
    with pytest.raises(pki.PkiError, match="cannot issue"):
        trust.issue(pki.new_key().public_key())
    other = pki.new_key()
    (tmp_path / "x.key").write_bytes(other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    with pytest.raises(pki.PkiError, match="do not match"):
        pki.Credentials.from_files(str(tmp_path / "n.pem"), str(tmp_path / "x.key"), trust)


def test_a_plaintext_loopback_port_has_a_fixed_small_window():
    """Finding 5: gRPC reads a refused call's body into its receive window before any handler can
    refuse it; BDP probing grows that window to megabytes per stream. The plaintext port (loopback,
    --tls auto) gets a fixed window of auth_plaintext_window instead; TLS ports keep BDP probing
    (nobody without a cluster certificate gets a stream there). `peerd bench redteam` measures it."""
    from peerd.config import Config
    from peerd.node.daemon import Daemon
    d = Daemon(Config(), b"x" * 32)
    plain, tls = dict(d.server_options(plaintext_loopback=True)), dict(d.server_options())
    assert plain["grpc.http2.bdp_probe"] == 0 and plain["grpc.http2.lookahead_bytes"] == Config().auth.plaintext_window
    assert tls["grpc.http2.bdp_probe"] == 1 and "grpc.http2.lookahead_bytes" not in tls
    assert plain["grpc.max_concurrent_streams"] == Config().auth.max_streams_per_connection
