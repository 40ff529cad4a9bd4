"""Run `peerd up` processes on this machine and read their state: for the demo, tests and benches.

Each daemon is a separate process in its own session (so a signal reaches the whole group), and
its state is read through `peerd status --json` on its control socket, the way a user would.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def peerd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def run_cli(*args: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(peerd_cmd(*args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"peerd {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def control_status(data_dir: Path, timeout: float = 3.0) -> dict | None:
    """`peerd status --json` of the daemon of `data_dir`, asked in-process over its control socket
    (every field, defaults included); None when it does not answer. Starting the CLI costs seconds
    on a loaded machine (it imports torch); this costs milliseconds."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from peerd.v1 import control_pb2, control_pb2_grpc
    sock = Path(data_dir) / "peerd.sock"
    if not sock.exists():
        return None
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        try:
            reply = control_pb2_grpc.ControlStub(ch).Status(control_pb2.StatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class LocalDaemon:
    """One `peerd up` process on this machine."""

    def __init__(self, data_dir: Path, secret_file: Path, seeds: list[str] = (), extra: list[str] = (),
                 listen: str = "127.0.0.1:0") -> None:
        self.data_dir, self.secret_file = Path(data_dir), Path(secret_file)
        self.seeds, self.extra, self.listen = list(seeds), list(extra), listen
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.address = ""
        self.node_id = ""
        self._log = None

    def start(self) -> "LocalDaemon":
        args = ["up", "--listen", self.listen, "--data-dir", str(self.data_dir),
                "--secret-file", str(self.secret_file), *self.extra]
        for s in self.seeds:
            args += ["--peer", s]
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(peerd_cmd(*args), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def status(self, timeout: float = 2.0) -> dict | None:
        proc = run_cli("status", "--json", "--data-dir", str(self.data_dir), "--timeout", str(timeout),
                       check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def peer_states(self) -> dict[str, str]:
        st = self.status() or {}
        return {p["node_id"]: p["state"] for p in st.get("peers", [])}

    def wait_ready(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.read_log()}")
            st = self.status()
            if st:
                self.address, self.node_id = st["address"], st["node_id"]
                return st
            time.sleep(0.1)
        raise RuntimeError(f"daemon not ready within {timeout}s:\n{self.read_log()}")

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 10) -> None:
        if self.running():
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 8) -> None:
        """SIGTERM, then SIGKILL if it has not exited within the bound."""
        if self.running():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None


def wait_until(predicate, timeout: float, interval: float = 0.2):
    """The predicate's first truthy value, or None when `timeout` seconds pass without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None
