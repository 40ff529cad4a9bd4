"""Start and stop real `peerd up` processes for tests, and read their state through `peerd status`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAST = ["--heartbeat-interval", "0.2", "--suspect-after", "1.0", "--dead-after", "2.0",
        "--rpc-timeout", "1.0", "--connect-retry-max", "1.0"]
SECRET = "test-secret-0123456789abcdef"


def peerd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def run_cli(*args: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"peerd {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


class Daemon:
    """One `peerd up` process; always stopped by the fixture that made it."""

    def __init__(self, data_dir: Path, secret_file: Path, seeds: list[str] = (), extra: list[str] = (),
                 listen: str = "127.0.0.1:0") -> None:
        self.data_dir, self.secret_file = data_dir, secret_file
        self.seeds, self.extra, self.listen = list(seeds), list(extra), listen
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    def start(self) -> "Daemon":
        args = ["up", "--listen", self.listen, "--data-dir", str(self.data_dir),
                "--secret-file", str(self.secret_file), *FAST, *self.extra]
        for s in self.seeds:
            args += ["--peer", s]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(peerd_cmd(*args), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def status(self, timeout: float = 2.0) -> dict | None:
        proc = run_cli("status", "--json", "--data-dir", str(self.data_dir), "--timeout", str(timeout), check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def wait_ready(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.read_log()}")
            st = self.status()
            if st:
                self.address = st["address"]
                self.node_id = st["node_id"]
                return st
            time.sleep(0.1)
        raise AssertionError(f"daemon not ready within {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=8)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.kill()
        if getattr(self, "log", None):
            self.log.close()


def peer_states(d: Daemon) -> dict[str, str]:
    st = d.status() or {}
    return {p["node_id"]: p["state"] for p in st.get("peers", [])}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    p = tmp_path / "secret"
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return p


@pytest.fixture
def daemons(tmp_path: Path):
    """Factory: make(name, seeds=..., extra=...) starts a daemon; all are stopped at the end."""
    made: list[Daemon] = []

    def make(name: str, seeds: list[str] = (), extra: list[str] = (), secret: Path | None = None,
             start: bool = True) -> Daemon:
        secret = secret or tmp_path / "secret"
        if not secret.exists():
            secret.write_text(SECRET + "\n")
            secret.chmod(0o600)
        d = Daemon(tmp_path / name, secret, seeds, extra)
        made.append(d)
        if start:
            d.start()
            d.wait_ready()
        return d

    yield make
    for d in made:
        d.stop()
