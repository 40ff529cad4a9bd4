"""Run the probes a LinkTable asks for, over any transport, with bounded waits.

The daemon supplies `run_probe(probe) -> seconds`: it sends `probe.size_bytes` to `probe.peer` on the
path the data plane uses (a ping for RTT probes, a timed bulk transfer for bandwidth probes) and
returns the seconds from the first byte sent to the peer's acknowledgement, or raises. This module
owns the rest: when to probe, at most one bulk probe at a time (parallel bulk probes would share
this host's uplink and each measure a fraction of it), every probe bounded by its deadline, and
failures (peer died mid-transfer, refused, timed out) reported to the table, which backs off.
Liveness is not decided here; the failure detector owns it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from peerd.net.links import BW, LinkTable, Probe

log = logging.getLogger("peerd.links")


async def probe_loop(table: LinkTable, run_probe: Callable[[Probe], Awaitable[float]], stop: asyncio.Event, *,
                     clock: Callable[[], float] = time.monotonic, max_pings: int = 16, tick_max: float = 1.0,
                     on_update: Callable[[str, str], None] | None = None) -> None:
    """Probe until `stop` is set; then cancel what is in flight (bounded) and return.

    `on_update(peer, kind)` runs after each successful probe, e.g. to refresh the link matrix.
    `clock` must be the clock the daemon passes to the table elsewhere.
    """
    bulk = asyncio.Semaphore(1)
    pings = asyncio.Semaphore(max_pings)
    running: dict[tuple[str, str], asyncio.Task] = {}
    failures_logged: set[tuple[str, str]] = set()

    async def one(p: Probe) -> None:
        async with bulk if p.kind == BW else pings:
            try:
                seconds = await asyncio.wait_for(run_probe(p), p.deadline_s)
            except Exception as e:  # noqa: BLE001 - any transport error is a failed probe
                table.probe_failed(p.peer, p.kind, clock())
                reason = "timed out" if isinstance(e, (TimeoutError, asyncio.TimeoutError)) else \
                    f"{type(e).__name__}: {str(e)[:200]}"
                if (p.peer, p.kind) not in failures_logged:
                    failures_logged.add((p.peer, p.kind))
                    log.info("%s probe to %s failed (%s); backing off", p.kind, p.peer, reason)
                return
        failures_logged.discard((p.peer, p.kind))
        now = clock()
        ok = table.observe_transfer(p.peer, p.size_bytes, seconds, now, probe=True) if p.kind == BW \
            else table.observe_rtt(p.peer, seconds, now)
        if ok and on_update is not None:
            on_update(p.peer, p.kind)

    try:
        while not stop.is_set():
            now = clock()
            for p in table.due_probes(now):
                key = (p.peer, p.kind)
                if key in running:
                    continue        # still queued or running past the table's deadline: it will report
                if p.kind != BW and (p.peer, BW) in running:
                    continue        # a ping behind our own bulk probe measures its queue, not the path
                task = asyncio.get_running_loop().create_task(one(p), name=f"probe {p.kind} {p.peer}")
                running[key] = task
                task.add_done_callback(lambda _t, key=key: running.pop(key, None))
            due = table.next_due(clock())
            wait = tick_max if due is None else min(tick_max, max(0.01, due - clock()))
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except (TimeoutError, asyncio.TimeoutError):
                pass
    finally:
        tasks = list(running.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=tick_max)
