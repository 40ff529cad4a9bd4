"""Start and stop real `peerd up` processes for tests, and read their state through `peerd status`."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from peerd.node.localswarm import LocalDaemon

FAST = ["--heartbeat-interval", "0.2", "--suspect-after", "1.0", "--dead-after", "2.0",
        "--rpc-timeout", "1.0", "--connect-retry-max", "1.0"]
SECRET = "test-secret-0123456789abcdef"


class Daemon(LocalDaemon):
    """A LocalDaemon with the fast failure-detector settings tests use."""

    def __init__(self, data_dir: Path, secret_file: Path, seeds=(), extra=()) -> None:
        super().__init__(data_dir, secret_file, seeds, [*FAST, *extra])


def peer_states(d: Daemon) -> dict[str, str]:
    return d.peer_states()


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
