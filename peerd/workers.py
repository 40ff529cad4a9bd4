"""The daemon's worker threads: named, and below its event loop in CPU priority.

Whole-model work (sums of a mix, checksums, snapshot copies, codecs) runs in worker threads so the
event loop only schedules. On a host with fewer cores than busy threads the OS still shares the
cores between them: measured on 2 cores with 4 daemons on a complete graph of 100 MB models, the
loop's timer fired 63 ms late at p99 with workers at the loop's priority and 40-42 ms with them at
nice +10, at the same seconds per iteration. The workers lose nothing by yielding: what they do is
bulk, and the loop's callbacks (gRPC messages, heartbeats, the trainer's calls) are short.

Niceness is per thread on Linux (a thread id is a process id to setpriority); elsewhere, and where
the call fails, the workers keep the loop's priority. Raising niceness never needs a privilege.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import threading

log = logging.getLogger(__name__)

MAX_NICE = 19
_extra_nice = 0        # set once at daemon start (configure); 0 in tests and tools: no change


def configure(extra_nice: int) -> None:
    """Worker threads started from now on run `extra_nice` above the process's niceness."""
    global _extra_nice
    _extra_nice = max(0, extra_nice)


def pool(threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads carry `name` (visible in top -H, ps -L, py-spy) and the
    configured lower priority."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name,
                                                 initializer=_start_worker, initargs=(name,))


def _start_worker(name: str) -> None:
    _set_os_name(name)
    if not _extra_nice or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + _extra_nice))
    except OSError as e:       # a sandbox that forbids it: same priority as the loop, as before
        log.debug("worker thread %s keeps its priority: %s", name, e)


def _set_os_name(name: str) -> None:
    """The kernel's name of the calling thread (15 bytes at most); Linux only."""
    try:
        libc = ctypes.CDLL(None)
        PR_SET_NAME = 15
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
