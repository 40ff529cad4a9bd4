"""Start and stop real `peerd up` processes for tests, and read their state through `peerd status`."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from peerd.node import localswarm
from peerd.node.localswarm import LocalDaemon

# Fast failure detection, and bandwidth probes of at most 1 MB: at the default 64 MB a loopback
# link's warm-up probes cost 4 daemons about 6 s of CPU in their first 30 s (on a 2-core box).
FAST = ["--heartbeat-interval", "0.2", "--suspect-after", "1.0", "--dead-after", "2.0",
        "--rpc-timeout", "1.0", "--connect-retry-max", "1.0", "--link-probe-max-bytes", str(1 << 20)]
SECRET = "test-secret-0123456789abcdef"


class Daemon(LocalDaemon):
    """A LocalDaemon with the fast failure-detector settings tests use."""

    def __init__(self, data_dir: Path, secret_file: Path, seeds=(), extra=()) -> None:
        super().__init__(data_dir, secret_file, seeds, [*FAST, *extra])

    def status(self, timeout: float = 5.0) -> dict | None:
        """`peerd status --json`, asked in-process (tests of the CLI itself call it explicitly)."""
        return control_status(self, timeout)

    def wait_ready(self, timeout: float = 90.0) -> dict:
        """Ready when the control socket answers, asked in-process: on a loaded machine the CLI
        alone takes longer to start than the daemon."""
        start_ready(self, timeout)
        return control_status(self)


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


def print_log_tails(daemons, lines: int = 40) -> None:
    """The end of each daemon's and trainer's log: what a failed test's report shows (CI keeps
    no files)."""
    for d in daemons:
        for log in [d.log_path, *sorted(Path(d.data_dir).glob("*.log"))]:
            if not log.exists():
                continue
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- {log} (last {len(tail)} lines) -----", *tail, sep="\n")


@pytest.fixture
def daemons(tmp_path: Path, request):
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
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print_log_tails(made)


def control_status(d, timeout: float = 5.0) -> dict | None:
    """`peerd status --json` of `d`, asked in-process (peerd.node.localswarm.control_status)."""
    return localswarm.control_status(d.data_dir, timeout)


def start_ready(d, timeout: float = 90.0):
    """Start `d` (if not yet) and wait, in-process, until its control socket answers."""
    if d.proc is None:
        d.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"daemon exited {d.proc.returncode}:\n{d.read_log()}")
        st = control_status(d)
        if st:
            d.address, d.node_id = st["address"], st["node_id"]
            return d
        time.sleep(0.1)
    raise RuntimeError(f"daemon not ready within {timeout}s:\n{d.read_log()}")
