"""Thin, checked wrappers around `ip` and `tc` for namespaces, links and processes.

Every call has a timeout and raises LabError carrying the command and its stderr. Commands for one
namespace go through `ip -batch` / `tc -batch` (one process instead of dozens); a failing line is
reported as the original command. Nothing here touches an object it was not named.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


class LabError(RuntimeError):
    """A lab operation failed; the message says what and how to recover."""


def require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("peerd lab needs root (it creates network namespaces and tc qdiscs); "
                       "run it as root, e.g. with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabError(f"peerd lab needs the `{tool}` command (iproute2), which is not on PATH")


def run(argv: list[str], timeout: float, input: str | None = None, check: bool = True) -> str:
    try:
        p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    if check and p.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def batch(tool: str, ns: str | None, lines: list[str], timeout: float) -> None:
    """Run `lines` through `ip -batch -` or `tc -batch -` in namespace `ns` (None: here)."""
    if not lines:
        return
    argv = [tool] + (["-n", ns] if ns else []) + ["-batch", "-"]
    try:
        p = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"{tool} -batch in {ns or 'root namespace'} did not finish within {timeout:g} s") from None
    if p.returncode != 0:
        err = p.stderr.strip()
        # iproute2 reports "Command failed -:N" with N the 1-based line number.
        bad = next((ln for ln in err.splitlines() if "Command failed -:" in ln), "")
        n = bad.rsplit(":", 1)[-1].strip()
        cmd = lines[int(n) - 1] if n.isdigit() and 0 < int(n) <= len(lines) else "?"
        raise LabError(f"`{tool} {'-n ' + ns + ' ' if ns else ''}{cmd}` failed: {err}")


def ns_list() -> set[str]:
    out = run(["ip", "netns", "list"], timeout=10)
    return {ln.split()[0] for ln in out.splitlines() if ln.strip()}


def ns_add(name: str, timeout: float) -> None:
    run(["ip", "netns", "add", name], timeout)


def ns_delete(name: str, timeout: float) -> None:
    if name in ns_list():
        run(["ip", "netns", "delete", name], timeout)


def ns_pids(name: str, timeout: float) -> list[int]:
    if not Path("/run/netns", name).exists():
        return []
    out = run(["ip", "netns", "pids", name], timeout, check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): with the pid, a
    unique identity, so a recycled pid is never signalled."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, started: int | None) -> bool:
    st = start_time(pid)
    if st is None or (started is not None and st != started):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop(procs: list[tuple[int, int | None]], grace: float) -> list[int]:
    """SIGTERM each (pid, start time) that is still that process, SIGKILL what survives `grace`
    seconds. Returns pids still alive after the SIGKILL wait (normally none)."""
    live = [(p, s) for p, s in procs if alive(p, s)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        for p, _ in live:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            for p, _ in live:  # reap our own children so they do not linger as zombies
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass
            live = [(p, s) for p, s in live if alive(p, s)]
            if live:
                time.sleep(0.02)
        if not live:
            return []
    return [p for p, _ in live]


def spawn(ns: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
          stdout_pipe: bool = False) -> subprocess.Popen:
    """Start argv inside namespace `ns` in its own session, so it outlives `lab up`."""
    out = subprocess.PIPE if stdout_pipe else (open(log, "ab") if log else subprocess.DEVNULL)
    err = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True, close_fds=True)
    finally:
        for f in (out, err):
            if hasattr(f, "close") and f not in (subprocess.PIPE, subprocess.DEVNULL):
                f.close()
