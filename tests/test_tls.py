"""TLS on the Peer service: daemons certified by the cluster secret's CA peer over mutual TLS; daemons
of your own CA (certificates made with openssl) peer without any secret; nobody else gets in."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from peerd.net import pki
from tests.daemons import peer_states, wait_for


def make_certs(d: Path, hosts: list[str]) -> dict[str, dict[str, Path]]:
    """An EC P-256 CA and one certificate per host, as an operator would make them with openssl.
    No address in them: each names `peerd` (its CN here; a SAN DNS:peerd does too)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=60)
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
        "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=peerd-test-ca")
    out = {}
    for h in hosts:
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            f"{h}.key", "-out", f"{h}.csr", "-subj", "/O=test-cluster/CN=peerd")
        run("x509", "-req", "-in", f"{h}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{h}.pem", "-days", "1")
        out[h] = {"cert": d / f"{h}.pem", "key": d / f"{h}.key", "ca": d / "ca.pem"}
    return out


def flags(c: dict[str, Path]) -> list[str]:
    return ["--tls", "on", "--tls-cert", str(c["cert"]), "--tls-key", str(c["key"]), "--tls-ca", str(c["ca"])]


def test_secret_ca_daemons_peer_over_mutual_tls(daemons):
    a = daemons("sa", extra=["--tls", "on"])
    b = daemons("sb", seeds=[a.address], extra=["--tls", "on"])
    wait_for(lambda: peer_states(a).get(b.node_id) == "alive" and peer_states(b).get(a.node_id) == "alive",
             20, "the two daemons to peer over TLS")
    st = a.status()
    assert st["tls"] is True and st["tls_mode"] == "on" and st["trust"] == "the cluster secret"
    plain = daemons("sp", seeds=[a.address], extra=["--tls", "off"])   # same secret, no TLS: no connection
    time.sleep(2)
    assert plain.node_id not in peer_states(a) and peer_states(plain) == {}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_own_ca_daemons_peer_without_a_secret_and_others_cannot_join(daemons, tmp_path):
    certs = make_certs(tmp_path, ["ha", "hb", "hc"])
    a = daemons("ta", extra=flags(certs["ha"]))
    b = daemons("tb", seeds=[a.address], extra=flags(certs["hb"]))
    wait_for(lambda: peer_states(a).get(b.node_id) == "alive", 20, "TLS daemons of one CA to peer")
    st = a.status()
    assert st["tls"] is True and st["trust"].startswith("CA ")
    # the node id is the hash of the certificate's key, not its CN
    from cryptography import x509
    key = x509.load_pem_x509_certificate(certs["ha"]["cert"].read_bytes()).public_key()
    assert a.node_id == pki.node_id_of(key)
    # a daemon certified by the cluster secret (not by this CA) cannot join, with or without TLS
    for name, extra in (("secret-tls", ["--tls", "on"]), ("plain", ["--tls", "off"])):
        other = daemons(name, seeds=[a.address], extra=extra)
        time.sleep(2)
        assert other.node_id not in peer_states(a) and peer_states(other) == {}
