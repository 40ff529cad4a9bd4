"""Shutdown hygiene (issue 8 item 6): Ctrl+C (SIGINT) or SIGTERM on `peerd up`, `peerd train` and
`peerd lab up --foreground` stops everything it started within 5 s, every time: no trainer left,
no control socket, no shared-memory slot, no namespace. Each case runs three times."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from peerd.node.localswarm import LocalDaemon, peerd_cmd
from tests.daemons import FAST, SECRET, control_status, start_ready, wait_for

pytestmark = pytest.mark.slow

BOUND = 5.0
ROUNDS = [signal.SIGINT, signal.SIGTERM, signal.SIGINT]


def children(pid: int) -> set[int]:
    """Direct children of `pid`, from /proc."""
    out: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out.update(int(c) for c in (task / "children").read_text().split())
    except FileNotFoundError:
        pass
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):   # gone before the open, or between open and read
        return False
    return state != "Z"


def exits_within(proc: subprocess.Popen, bound: float) -> float:
    t0 = time.monotonic()
    try:
        proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args[3:5]} still running {bound}s after the signal")
    return time.monotonic() - t0


def gone_within(pids: set[int], bound: float, what: str) -> None:
    deadline = time.monotonic() + bound
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} {sorted(p for p in pids if alive(p))} alive {bound}s after the signal")
        time.sleep(0.05)


def start_train(data_dir: Path, iterations: int = 1_000_000) -> subprocess.Popen:
    """A run of this host alone (a run forms among the hosts that ask for it; the partner asks for
    none), each step padded to a second, so the trainer lives, mostly idle, as long as we like."""
    return subprocess.Popen(peerd_cmd("train", "--data-dir", str(data_dir), "--json", "--task", "svm",
                                      "--world", "1", "--topology", "complete", "--algo", "hop-backup",
                                      "--step-time", "1", "--iterations", str(iterations)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def trainer_of(daemon_pid: int, timeout: float = 90) -> int:
    return wait_for(lambda: next(iter(p for p in children(daemon_pid)
                                      if "peerd.train.worker" in Path(f"/proc/{p}/cmdline").read_text()), None),
                    timeout, "the trainer to start")


def slots(daemon_pid: int, node_id: str) -> list[str]:
    """The run's shared-memory slots the daemon holds: anonymous memory files (memfd) it opened,
    or, where memfd_create is missing, files in /dev/shm."""
    held = []
    try:
        for fd in Path(f"/proc/{daemon_pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(f"/memfd:peerd-{node_id}-"):
                held.append(target)
    except OSError:
        pass          # the daemon is gone
    return held + [str(p) for p in Path("/dev/shm").glob(f"peerd-{node_id}-*")]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret"
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return p


@pytest.fixture
def partner(tmp_path: Path, secret: Path):
    d = LocalDaemon(tmp_path / "partner", secret, [], FAST)
    try:
        yield start_ready(d)
    finally:
        d.stop()


def test_peerd_up_stops_with_its_trainer_on_sigint_and_sigterm(tmp_path, secret, partner):
    """The daemon is mid-run with a trainer; the signal goes to the daemon's process group, as
    Ctrl+C at its terminal does (SIGINT) or to the daemon alone, as `kill` does (SIGTERM)."""
    times = []
    for i, sig in enumerate(ROUNDS):
        d = LocalDaemon(tmp_path / f"up{i}", secret, [partner.address], FAST)
        train = None
        try:
            start_ready(d)
            train = start_train(d.data_dir)
            trainer = trainer_of(d.proc.pid)
            wait_for(lambda: slots(d.proc.pid, d.node_id), 90, "the trainer to attach (its slots)")
            if sig == signal.SIGINT:
                os.killpg(d.proc.pid, sig)
            else:
                os.kill(d.proc.pid, sig)
            times.append(exits_within(d.proc, BOUND))
            gone_within({trainer}, 0.5, "trainer")
            assert d.proc.returncode == 0, d.read_log()[-2000:]
            assert not (d.data_dir / "peerd.sock").exists()
            assert not slots(d.proc.pid, d.node_id)
            assert "stopped" in d.read_log()
        finally:
            d.stop()
            if train is not None:
                train.kill()
                train.wait(timeout=10)
    print(f"\npeerd up with a trainer: exits {', '.join(f'{t:.2f}' for t in times)} s after the signal")


def test_peerd_train_interrupted_stops_its_trainer_and_the_daemon_serves_on(tmp_path, secret, partner):
    d = LocalDaemon(tmp_path / "tr", secret, [partner.address], FAST)
    times = []
    try:
        start_ready(d)
        for sig in ROUNDS:
            train = start_train(d.data_dir)
            trainer = trainer_of(d.proc.pid)
            os.killpg(train.pid, sig)          # Ctrl+C (or kill) at `peerd train`'s terminal
            t0 = time.monotonic()
            exits_within(train, BOUND)
            gone_within({trainer}, max(0.1, BOUND - (time.monotonic() - t0)), "trainer")
            times.append(time.monotonic() - t0)
            assert train.returncode != 0
            wait_for(lambda: not slots(d.proc.pid, d.node_id), BOUND, "the slots to be closed")
            st = wait_for(lambda: (lambda s: s if s and not s["training_json"] else None)(control_status(d)), 10,
                          "the daemon to end the run")
            assert st["node_id"] == d.node_id      # the daemon itself serves on
        assert d.running()
        assert not children(d.proc.pid) - {p for p in children(d.proc.pid) if not alive(p)}
    finally:
        d.stop()
    print(f"\npeerd train: trainer gone {', '.join(f'{t:.2f}' for t in times)} s after the signal")


def lab_namespaces(lab_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"peerd-{lab_id}-")]


def test_lab_up_foreground_takes_the_lab_down_on_sigint_and_sigterm(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    conf = tmp_path / "lab.toml"
    conf.write_text("lab_ready_timeout = 120.0\n")   # daemons start slowly on a loaded host
    times = []
    for i, sig in enumerate(ROUNDS):
        lab_dir = tmp_path / f"lab{i}"
        proc = subprocess.Popen(peerd_cmd("lab", "up", "-n", "2", "--dir", str(lab_dir), "--foreground",
                                          "--config", str(conf)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        lab_id = None
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 180
            line, seen = "", []
            while "lab up in the foreground" not in line:
                assert time.monotonic() < deadline and proc.poll() is None, f"lab did not come up: {seen}"
                line = proc.stderr.readline()
                seen.append(line)
            state = json.loads((lab_dir / "state.json").read_text())
            lab_id = state["id"]
            pids = {p["pid"] for p in state["processes"]}
            assert pids and all(alive(p) for p in pids)
            assert len(lab_namespaces(lab_id)) == 3
            os.killpg(proc.pid, sig)
            times.append(exits_within(proc, BOUND))
            assert proc.returncode == 0, proc.stderr.read()
            assert lab_namespaces(lab_id) == []
            assert not any(alive(p) for p in pids)
            assert not (lab_dir / "state.json").exists()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if lab_dir.joinpath("state.json").exists():
                subprocess.run(peerd_cmd("lab", "down", "--dir", str(lab_dir)), timeout=120)
    print(f"\npeerd lab up --foreground: down {', '.join(f'{t:.2f}' for t in times)} s after the signal")


def test_a_restarted_daemon_removes_slot_files_its_killed_incarnation_left(daemons):  # noqa: F811
    """SIGKILL leaves no chance to clean up: the next start of the same data dir (same node id,
    held under the data dir's exclusive lock) removes that node's slot files, and no one else's."""
    d = daemons("k")
    node = d.node_id
    d.kill()
    mine = [Path("/dev/shm") / f"peerd-{node}-deadsession-{i}" for i in range(2)]
    other = Path("/dev/shm") / f"peerd-{node[::-1]}x-deadsession-0"   # another node's: kept
    try:
        for p in [*mine, other]:
            p.write_bytes(b"\0" * 64)
        d.start()
        d.wait_ready()
        assert d.node_id == node
        assert not any(p.exists() for p in mine), "stale slot files of this node were kept"
        assert other.exists(), "another node's slot file was removed"
    finally:
        for p in [*mine, other]:
            p.unlink(missing_ok=True)


def test_a_sigkilled_daemon_leaves_no_slot_memory_behind(tmp_path, secret, partner):
    """SIGKILL the daemon mid-run: its slots are anonymous memory files (memfd), so nothing of them
    is left in /dev/shm, and their memory goes with the last mapping: the trainer, which sees its
    daemon gone and exits. A restart of the same data dir trains again."""
    d = LocalDaemon(tmp_path / "killed", secret, [partner.address], FAST)
    train = None
    try:
        start_ready(d)
        node = d.node_id
        train = start_train(d.data_dir)
        trainer = trainer_of(d.proc.pid)
        wait_for(lambda: slots(d.proc.pid, node), 90, "the trainer to attach (its slots)")
        assert not list(Path("/dev/shm").glob(f"peerd-{node}-*")), "slots went to /dev/shm files"
        maps = Path(f"/proc/{trainer}/maps").read_text()
        assert f"/memfd:peerd-{node}-" in maps, "the trainer maps the daemon's memfd slots"
        d.kill()
        gone_within({trainer}, 60, "trainer (its daemon was killed)")
        assert not list(Path("/dev/shm").glob(f"peerd-{node}-*"))
        d.start()                          # the same data dir, the same node: it starts clean
        start_ready(d)
        assert d.node_id == node and not slots(d.proc.pid, node)
    finally:
        d.stop()
        if train is not None:
            train.kill()
            train.wait(timeout=10)


def test_peerd_down_stops_the_daemon_as_sigterm_does(tmp_path, secret):
    """`peerd down` (the Control API's Shutdown): the daemon mid-run stops its trainer, tells its
    peer it leaves (the partner marks it "left", not "dead"), removes its socket and slots, exits 0.
    Default failure-detector timings here: the FAST ones call a peer dead after 2 s, which a loaded
    CI host's starved heartbeats reach before the goodbye."""
    partner = LocalDaemon(tmp_path / "partner-down", secret, [], ["--link-probe-max-bytes", str(1 << 20)])
    d = LocalDaemon(tmp_path / "down", secret, [], ["--link-probe-max-bytes", str(1 << 20), "--log-format", "json"])
    train = None
    try:
        start_ready(partner)
        d.seeds = [partner.address]
        start_ready(d)
        wait_for(lambda: {p["node_id"]: p["state"] for p in (control_status(partner) or {}).get("peers", [])}
                 .get(d.node_id) == "alive", 30, "the partner to see it")
        train = start_train(d.data_dir)
        trainer = trainer_of(d.proc.pid)
        wait_for(lambda: slots(d.proc.pid, d.node_id), 90, "the trainer to attach (its slots)")
        t0 = time.monotonic()
        out = subprocess.run(peerd_cmd("down", "--data-dir", str(d.data_dir)), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and f"pid {d.proc.pid}" in out.stdout, (out.stdout, out.stderr)
        exits_within(d.proc, BOUND)
        took = time.monotonic() - t0
        gone_within({trainer}, 0.5, "trainer")
        assert d.proc.returncode == 0
        assert not (d.data_dir / "peerd.sock").exists()
        assert not slots(d.proc.pid, d.node_id)
        wait_for(lambda: {p["node_id"]: p["state"] for p in (control_status(partner) or {}).get("peers", [])}
                 .get(d.node_id) == "left", 10, "the partner to see it leave")
        # --log-format json: every line of its log is one JSON object with time, level, logger, message
        records = [json.loads(line) for line in d.read_log().splitlines() if line.strip()]
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
        assert any(r["message"].startswith("shutdown requested through the control socket") for r in records)
        again = subprocess.run(peerd_cmd("down", "--data-dir", str(d.data_dir)), capture_output=True, text=True,
                               timeout=120)
        assert again.returncode == 1 and "no daemon control socket" in again.stderr
    finally:
        d.stop()
        partner.stop()
        if train is not None:
            train.kill()
            train.wait(timeout=10)
    print(f"\npeerd down with a trainer: the daemon exited {took:.2f} s after the command started")
