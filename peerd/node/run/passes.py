"""Whole-buffer work of a run, off the event loop: one worker thread, in submission order.

Every pass over a model-sized buffer (the snapshot copy at publish, the weighted sums of a mix,
the incremental mix's adds and subtractions, a clone an AD-PSGD average keeps) runs here, so the
event loop only schedules: heartbeats and gRPC keep flowing while a 1 GB model is summed (torch
releases the GIL). One thread, first in first out, keeps the order the loop decided: a buffer
released after a mix was submitted goes back to its pool only once that mix has read it
(`after`), and a later pass sees every earlier one done.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from peerd import workers


class Passes:
    def __init__(self) -> None:
        self._pool = workers.pool(1, "peerd-pass")
        self._loop = asyncio.get_running_loop()
        self.pending = 0
        self.closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) after every pass submitted before; its result as a future of the loop.
        Once closed (the run stopped), a cancelled future: a timer or a stream still finishing
        asks for a pass that nobody needs any more."""
        if self.closed:
            fut = self._loop.create_future()
            fut.cancel()
            return fut
        self.pending += 1
        fut = asyncio.wrap_future(self._pool.submit(fn, *args), loop=self._loop)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: asyncio.Future) -> None:
        self.pending -= 1

    def after(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the loop once every pass submitted so far is done (at once when
        none is pending): e.g. free a buffer a submitted mix still reads."""
        if not self.pending:
            callback()
            return
        self.submit(lambda: None).add_done_callback(lambda _f: callback())

    async def close(self) -> None:
        """Wait for the passes submitted (a buffer they read must not be freed before), then stop."""
        self.closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)
