"""The mix of one iteration summed while the updates arrive (the daemon's incremental mix).

Hop's backup and staleness modes decide their mix only when the trainer asks for it (Mix(k)): they
use whatever qualifying updates are in hand then. Computing the whole weighted sum at that moment
puts one pass over the parameters per entry on the trainer's critical path. Instead the daemon
keeps a running sum, from Publish(k) on, of the entries the policy would use if it decided now
(`Policy.preview(k)`, topology weights before renormalisation):

    acc = sum of w_e * x_e over the previewed entries in hand

- an entry that joins the preview is added as its buffer arrives (one pass, off the critical
  path: the trainer is computing its gradient meanwhile);
- an entry that leaves it (the policy drops an update it replaced, staleness mode) is subtracted
  before its buffer is freed; a weight that changes (the graph was repaired) restarts the sum;
- at Mix(k, entries) the mix is acc * (1 / sum of w_e) over the mix's entries: no pass at all
  when every in-neighbour's update was summed already (the row sums to 1); one pass for each
  entry still missing (typically the update whose arrival decided the mix) or summed but unused,
  and one to rescale when some in-neighbours are left out.

Only float32/float64 layouts are summed this way (subtracting and rescaling in 16-bit floats
would lose more than a direct weighted sum does); others take the direct path.

The bookkeeping (which entries are in the sum, with what weight) is decided here, on the caller's
thread; the arithmetic goes to `run` (the run's pass thread, peerd.node.run.passes), which runs
it in order. Without `run`, the arithmetic runs at once (tests).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from peerd.train.flat import Layout

Key = tuple[int, int]                          # (source rank, iteration)
BufferOf = Callable[[int, int], "torch.Tensor | None"]
SUMMABLE = {"float32", "float64"}


def summable(layout: Layout) -> bool:
    return all(run.dtype in SUMMABLE for run in layout.runs())


class MixAccumulator:
    """One running sum at a time, written into `out` (the slot the trainer's Mix(k) will read)."""

    def __init__(self, layout: Layout, run: Callable[..., object] | None = None) -> None:
        self.layout = layout
        self.run = run or (lambda fn, *args: fn(*args))
        self.k = -1
        self.out: torch.Tensor | None = None
        self.parts: dict[Key, float] = {}      # entries summed into out, with their weights
        self.passes = 0                        # passes over the parameters (observability, tests)
        self.hits = 0                          # mixes answered from the sum
        self.misses = 0                        # mixes whose entries differed: computed in full

    def start(self, k: int, out: torch.Tensor) -> None:
        self.k, self.out, self.parts = k, out, {}

    def stop(self) -> None:
        self.k, self.out, self.parts = -1, None, {}

    def _add(self, buf: torch.Tensor, w: float) -> None:
        self.run(_add_into, self.layout, self.out, buf, w, not self.parts)
        self.passes += 1

    def sync(self, preview: Iterable[tuple[int, int, float]] | None, buffer_of: BufferOf) -> None:
        """Bring the sum up to the policy's current preview (None: nothing to sum any more)."""
        if self.k < 0:
            return
        if preview is None:
            self.stop()
            return
        want = {(src, k): w for src, k, w in preview}
        if any(want.get(key) != w for key, w in self.parts.items()):
            self.parts = {}                    # a weight changed (graph repaired): start again
        for key, w in want.items():
            if key not in self.parts and w > 0 and (buf := buffer_of(*key)) is not None:
                self._add(buf, w)
                self.parts[key] = w

    def withdraw(self, key: Key, buf: torch.Tensor) -> None:
        """`key` is about to be freed: take it out of the sum while its buffer is still valid."""
        w = self.parts.pop(key, None)
        if w is not None and self.parts:
            self._add(buf, -w)

    def finish(self, k: int, entries: Iterable[tuple[int, int, float]], buffer_of: BufferOf) -> int | None:
        """Complete the mix of k in `out`; the number of buffers used, or None when the sum cannot
        become it (the caller then computes the mix in full). The entries the sum lacks (an update
        whose arrival decided the mix) are added now, those it has and the mix does not use are
        taken out; the sum is over either way."""
        try:
            if k != self.k or not self.parts:
                return None
            present = {(s, i): w for s, i, w in entries if w > 0 and buffer_of(s, i) is not None}
            total = sum(present.values())
            common = present.keys() & self.parts.keys()
            if not common:
                self.misses += 1
                return None
            scale = None           # the mix's weight of each summed entry: ours times one factor
            for key in common:
                f = present[key] / total / self.parts[key]
                if scale is None:
                    scale = f
                elif not math.isclose(f, scale, rel_tol=1e-9):
                    self.misses += 1
                    return None
            for key in self.parts.keys() - common:
                buf = buffer_of(*key)
                if buf is None:
                    self.misses += 1
                    return None
                self.withdraw(key, buf)
            for key in present.keys() - common:
                self._add(buffer_of(*key), present[key] / total / scale)
                self.parts[key] = present[key]
            if not math.isclose(scale, 1.0, rel_tol=1e-12):
                self.run(_scale, self.layout, self.out, scale)
                self.passes += 1
            self.hits += 1
            return len(present)
        finally:
            self.stop()


def _add_into(layout: Layout, out: torch.Tensor, buf: torch.Tensor, w: float, first: bool) -> None:
    for o, t in zip(layout.typed(out), layout.typed(buf)):
        if first:
            torch.mul(t, w, out=o)
        else:
            o.add_(t, alpha=w)


def _scale(layout: Layout, out: torch.Tensor, factor: float) -> None:
    for o in layout.typed(out):
        o.mul_(factor)
