"""A few network namespaces joined by a bridge, for tests that need real multicast between stacks.

Layout: namespace `<prefix>b` holds bridge `br0`; namespaces `<prefix>1..N` each hold `eth0`
(a veth whose peer is enslaved to the bridge) with 10.A.B.(i)/24 and no default route. Names carry a
random suffix so parallel runs never collide; `close()` deletes every namespace it created, which
removes the veths and the bridge with them.
"""
from __future__ import annotations

import os
import queue
import random
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lab_available() -> str | None:
    """None when namespaces can be made here, else the reason to skip."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` unavailable: {r.stderr.strip()}"
    return None


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """One line of a child's stdout ('' at EOF), or AssertionError after `timeout` s (never a hang).

    A reader thread feeds a queue: select() on the pipe would miss lines already buffered by
    Python's text wrapper. Use either this or communicate() on a process, not both at once.
    """
    q = _QUEUES.get(proc.pid)
    if q is None:
        q = _QUEUES[proc.pid] = queue.Queue()

        def pump() -> None:
            for line in iter(proc.stdout.readline, ""):
                q.put(line)
            q.put("")
        threading.Thread(target=pump, daemon=True).start()
    try:
        return q.get(timeout=max(0.0, timeout))
    except queue.Empty:
        raise AssertionError(f"no output from {proc.args[-3:]} within {timeout} s") from None


def rest(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """What is left of stdout and all of stderr once the process ends (bounded)."""
    proc.wait(timeout=timeout)
    err = proc.stderr.read()
    lines = []
    while (line := readline(proc, timeout)) != "":
        lines.append(line)
    return "".join(lines), err


_QUEUES: dict[int, queue.Queue] = {}


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class NetnsLab:
    def __init__(self, hosts: int) -> None:
        tag = secrets.token_hex(2)
        self.prefix = f"pdd{tag}"
        # A private /24 outside 10.250.*; the namespaces are isolated, the randomness is belt and braces.
        self.net = f"10.{random.randint(100, 199)}.{random.randint(0, 255)}"
        self.bridge_ns = f"{self.prefix}b"
        self.hosts = [f"{self.prefix}h{i}" for i in range(1, hosts + 1)]
        self.ips = [f"{self.net}.{i}" for i in range(1, hosts + 1)]
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in [self.bridge_ns, *self.hosts]:
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        for i, (ns, ip) in enumerate(zip(self.hosts, self.ips), start=1):
            host_end, br_end = f"{self.prefix}h{i}", f"{self.prefix}p{i}"
            _ip("link", "add", host_end, "netns", ns, "type", "veth", "peer", "name", br_end,
                "netns", self.bridge_ns)
            _ip("link", "set", host_end, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", br_end, "master", "br0", ns=self.bridge_ns)
            _ip("link", "set", br_end, "up", ns=self.bridge_ns)

    def popen(self, host: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start `python argv...` inside host namespace `host` (0-based); killed by close()."""
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], sys.executable, *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, **kw)
        self.procs.append(p)
        return p

    def run(self, host: int, argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
        p = self.popen(host, argv)
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.created.clear()
