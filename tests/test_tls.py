"""Optional TLS on the Peer service: daemons with certificates from one CA peer; a plaintext one cannot."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.daemons import peer_states, wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def make_certs(d: Path) -> dict[str, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=peerd-test-ca")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=peerd")
    run("x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "host.pem", "-days", "1", "-extfile", "san.cnf")
    return {"cert": d / "host.pem", "key": d / "host.key", "ca": d / "ca.pem"}


def test_tls_daemons_peer_and_plaintext_daemon_cannot_join(daemons, tmp_path):
    certs = make_certs(tmp_path)
    tls = ["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]), "--tls-ca", str(certs["ca"])]
    a = daemons("ta", extra=tls)
    b = daemons("tb", seeds=[a.address], extra=tls)
    wait_for(lambda: peer_states(a).get(b.node_id) == "alive", 15, "TLS daemons to peer")
    assert a.status()["tls"] is True
    plain = daemons("tp", seeds=[a.address])
    time.sleep(2)
    assert plain.node_id not in peer_states(a)
    assert peer_states(plain) == {}
