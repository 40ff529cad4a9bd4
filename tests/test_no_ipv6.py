"""A host (or container) without IPv6: the daemon starts without grpc's error line about [::1].

It listens on every interface with TLS and, as `--tls auto` says, in plaintext on loopback; it
tried [::1] through grpc, which printed "E... Failed to add port to server ... [::1]" at every
start of a container without IPv6 before the bind failed quietly. Run in a network namespace of
its own with IPv6 disabled (root; no traffic leaves it)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemons import SECRET

NS = f"peerd-nov6-{os.getpid()}"
pytestmark = [pytest.mark.lab,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="needs root and iproute2 for a network namespace")]


@pytest.fixture
def namespace():
    subprocess.run(["ip", "netns", "add", NS], check=True)
    try:
        run = ["ip", "netns", "exec", NS]
        subprocess.run([*run, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"], check=True)
        subprocess.run([*run, "ip", "link", "set", "lo", "up"], check=True)
        yield run
    finally:
        subprocess.run(["ip", "netns", "delete", NS], check=False)


def test_a_daemon_without_ipv6_starts_without_grpcs_error_line(namespace, tmp_path: Path):
    probe = subprocess.run([*namespace, sys.executable, "-c",
                            "from peerd.node.daemon import has_ipv6_loopback as f; print(f())"],
                           capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert probe.stdout.strip() == "False", probe.stderr
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*namespace, sys.executable, "-m", "cli.main", "up", "--listen", "0.0.0.0:0",
                                 "--data-dir", str(tmp_path / "data"), "--secret-file", str(secret),
                                 "--no-mdns"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
    try:
        deadline = time.monotonic() + 90
        while "serving peers" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        text = log.read_text(errors="replace")
        assert "(TLS)" in text and "Failed to add port" not in text, text[-3000:]
        assert "could not also listen in plaintext" not in text, text[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
