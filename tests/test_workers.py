"""The daemon's worker threads: named, and niced below the event loop when configured."""
import os
import sys
import threading

import pytest

from peerd import workers
from peerd.config import Config, ConfigError, validate


def _probe() -> tuple[int, str]:
    tid = threading.get_native_id()
    comm = open(f"/proc/self/task/{tid}/comm").read().strip() if sys.platform == "linux" else ""
    return os.getpriority(os.PRIO_PROCESS, tid), comm


@pytest.fixture
def extra_nice():
    yield workers.configure
    workers.configure(0)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness and thread names are Linux's")
def test_workers_run_niced_and_named(extra_nice):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    extra_nice(5)
    with workers.pool(2, "peerd-test") as pool:
        nice, comm = pool.submit(_probe).result(timeout=10)
    assert nice == min(workers.MAX_NICE, base + 5)
    assert comm.startswith("peerd-test")
    # the calling thread (the event loop's, in the daemon) keeps its priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_unconfigured_workers_keep_the_priority(extra_nice):
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with workers.pool(1, "peerd-test") as pool:
        assert pool.submit(_probe).result(timeout=10)[0] == base


def test_worker_nice_is_validated():
    cfg = Config()
    cfg.node.worker_nice = 20
    with pytest.raises(ConfigError, match="worker_nice"):
        validate(cfg)
    cfg.node.worker_nice = 0
    validate(cfg)
