"""The one interface between a trainer's optimizer and whatever mixes parameters across workers.

An ``Exchange`` serves one worker. Per iteration k the optimizer calls ``publish(k, x_k)`` before
computing the gradient (the exchange runs while forward/backward do) and ``mix(k)`` when it needs
``mix_k = sum_j W_ij x_j^k``. Buffers are flat ``uint8`` tensors in the ``Layout`` the worker
attached with (peerd.train.flat), so the exchange never sees a model.

Contract (every implementation):
- ``attach(layout) -> start_iteration``: once, before anything else; refuses a layout that differs
  from the group's with ``LayoutMismatch`` naming the first difference.
- ``publish(k, buf, mass=1.0, ranges=None)``: non-blocking; snapshots ``buf`` before returning (the
  caller may overwrite it at once). Iterations strictly increase. ``mass`` weighs this buffer in
  every mix that uses it, relative to the others' (DiLoCo: the inner steps it took); ``ranges``:
  the (start, end) byte pairs that changed since the previous publish (a hint: the daemon then
  sends only those, as changes of a public copy; peerd.net.copies).
- ``mix(k) -> MixResult``: blocks (bounded by a timeout) until the mix for k is ready. The
  returned ``params`` buffer is valid until this worker's next ``publish`` or ``mix``. ``params``
  is None when there was nothing to mix (the trainer keeps its own x_k). ``skip_to``: after
  applying this iteration, continue at that iteration instead of k+1 (Hop's skipping).
- ``rank`` and ``world`` attributes: this worker's place in the run (valid after attach), which
  picks its data shard.
- A buffer holding NaN or Inf is never mixed: it is dropped, the remaining weights renormalised,
  and the drop counted in ``MixResult.dropped``.

``LocalGroup`` is the in-process implementation (N workers, one process, threads or phased
stepping in one thread): synchronous neighbour averaging, D-PSGD's rule, with fixed weights.

The daemon-backed implementation (control.proto) maps one to one:
- attach: ``Attach(layout=[LayoutEntry(name, dtype, shape) for layout.specs()],
  total_bytes=layout.total_bytes)``; the daemon rebuilds ``Layout.build(specs)`` and refuses with
  ``its_layout.diff(sent)``; the reply's ``start_iteration`` is returned, its ``rank`` and
  ``world`` become the attributes.
- publish: copy ``buf`` into the next of the double-buffered shared-memory slots (the one memcpy;
  from a GPU, a device-to-host copy), then ``Publish(k, slot, seq)`` without waiting for the reply
  longer than needed to know it was accepted. An optional ``param_home(device)`` offers a slot for
  the caller's parameters to live in (the DecentralizedOptimizer takes it on CPU): publishing that
  buffer copies nothing, and every mix goes to the other slot.
- mix: ``Mix(k, slot)``; on the reply, ``params`` is a uint8 tensor over that slot's memory
  (``torch.frombuffer``), ``skip_to`` the reply's skip_to when non-zero, ``used`` the number of
  entries. The optimizer copies out of the slot before the next publish can reuse it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from peerd.config import Config
from peerd.train.flat import Layout, LayoutMismatch, all_finite


@dataclass(frozen=True)
class MixResult:
    iteration: int
    params: torch.Tensor | None       # uint8, attached layout; None: keep own x_k
    skip_to: int | None = None        # continue at this iteration after applying this one
    used: int = 0                     # buffers averaged, own included
    dropped: int = 0                  # buffers refused (NaN/Inf)
    staged: Any = None                # params still arriving on the device in chunks (peerd.train.device.StagedMix)


class Exchange(Protocol):
    rank: int
    world: int

    def attach(self, layout: Layout) -> int: ...
    def publish(self, iteration: int, buf: torch.Tensor, *, mass: float = 1.0,
                ranges: Sequence[int] | None = None) -> None: ...
    def mix(self, iteration: int) -> MixResult: ...
    def close(self) -> None: ...


def topology_weights(world: int, topology: str | Sequence[Sequence[float]] | torch.Tensor) -> torch.Tensor:
    """Mixing matrix W (W[i, j]: weight worker i gives worker j's buffer); rows sum to 1.

    "ring": self and the two ring neighbours, uniform; "complete": 1/world everywhere; or an
    explicit matrix. (Time-varying topologies and Metropolis-Hastings weights live in peerd.sync.)
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if isinstance(topology, str):
        if topology == "complete":
            return torch.full((world, world), 1.0 / world, dtype=torch.float64)
        if topology == "ring":
            w = torch.zeros(world, world, dtype=torch.float64)
            for i in range(world):
                nb = sorted({i, (i - 1) % world, (i + 1) % world})
                w[i, nb] = 1.0 / len(nb)
            return w
        raise ValueError(f"unknown topology {topology!r} (ring, complete, or a weight matrix)")
    w = torch.as_tensor(topology, dtype=torch.float64)
    if w.shape != (world, world):
        raise ValueError(f"weight matrix has shape {list(w.shape)}, expected [{world}, {world}]")
    if (w < 0).any() or not torch.allclose(w.sum(1), torch.ones(world, dtype=torch.float64)):
        raise ValueError("weight matrix must be non-negative with rows summing to 1")
    return w


@dataclass
class _Slot:
    buf: torch.Tensor
    finite: bool
    refs: int          # mixes still to read it
    mass: float = 1.0


class LocalGroup:
    """N workers in one process, synchronous neighbour averaging with fixed weights.

    Use from one thread per worker, or from one thread in phases (every worker publishes
    iteration k before any mixes it). ``mix`` waits at most ``timeout`` seconds for a neighbour.
    """

    def __init__(self, world: int, topology: str | Sequence[Sequence[float]] | torch.Tensor = "ring",
                 timeout: float | None = None):
        self.world = world
        self.weights = topology_weights(world, topology)
        self.timeout = Config().train.mix_timeout if timeout is None else timeout
        self._sources = [[j for j in range(world) if self.weights[i, j] > 0] for i in range(world)]
        self._readers = [sum(1 for i in range(world) if self.weights[i, j] > 0) for j in range(world)]
        self._cv = threading.Condition()
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._pool: list[list[torch.Tensor]] = [[] for _ in range(world)]
        self._out: list[torch.Tensor | None] = [None] * world
        self._last: list[int] = [-1] * world
        self._layout: Layout | None = None
        self._layout_rank = -1
        self._skips: dict[int, int] = {}
        self.nonfinite_published = [0] * world   # buffers a worker published with NaN/Inf
        self.dropped = [0] * world               # buffers left out of a worker's mixes

    def worker(self, rank: int) -> "LocalExchange":
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        return LocalExchange(self, rank)

    def schedule_skip(self, at: int, to: int) -> None:
        """Every worker's mix of iteration ``at`` tells it to continue at ``to`` (all jump)."""
        if to <= at + 1:
            raise ValueError(f"skip target {to} must be beyond {at + 1}")
        self._skips[at] = to

    # -- called through LocalExchange ------------------------------------------------------
    def _attach(self, rank: int, layout: Layout) -> int:
        with self._cv:
            if self._layout is None:
                self._layout, self._layout_rank = layout, rank
            else:
                layout.check(self._layout, here=f"at rank {rank}", there=f"at rank {self._layout_rank}")
        return 0

    def _publish(self, rank: int, k: int, buf: torch.Tensor, mass: float = 1.0) -> None:
        if self._layout is None:
            raise RuntimeError(f"rank {rank} publishes before attach")
        if k <= self._last[rank]:
            raise ValueError(f"rank {rank} publishes iteration {k} after {self._last[rank]}")
        pool = self._pool[rank]
        snap = pool.pop() if pool else torch.empty_like(buf)
        snap.copy_(buf)
        finite = all(all_finite(t) for t in self._layout.typed(snap))
        with self._cv:
            if not finite:
                self.nonfinite_published[rank] += 1
            self._last[rank] = k
            self._slots[(rank, k)] = _Slot(snap, finite, self._readers[rank], mass)
            self._cv.notify_all()

    def _mix(self, rank: int, k: int) -> MixResult:
        assert self._layout is not None
        srcs = self._sources[rank]
        deadline = time.monotonic() + self.timeout
        with self._cv:
            if self.weights[rank, rank] > 0 and (rank, k) not in self._slots:
                raise RuntimeError(f"rank {rank} mixes iteration {k} before publishing it")
            while True:
                missing = [j for j in srcs if (j, k) not in self._slots]
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {rank}, iteration {k}: no buffer from rank(s) {missing} "
                                       f"within {self.timeout:g}s")
                self._cv.wait(left)
            slots = [(j, self._slots[(j, k)]) for j in srcs]
        good = [(j, s) for j, s in slots if s.finite]
        dropped = len(slots) - len(good)
        out = None
        if good:
            total = float(sum(self.weights[rank, j] * s.mass for j, s in good))
            out = self._out[rank]
            if out is None:
                out = self._out[rank] = torch.zeros_like(good[0][1].buf)   # padding stays 0
            for t_out, *t_src in zip(self._layout.typed(out), *(self._layout.typed(s.buf) for _, s in good)):
                for n, ((j, s), src) in enumerate(zip(good, t_src)):
                    w = float(self.weights[rank, j]) * s.mass / total
                    if n == 0:
                        torch.mul(src, w, out=t_out)
                    else:
                        t_out.add_(src, alpha=w)
        with self._cv:
            self.dropped[rank] += dropped
            for j, s in slots:
                s.refs -= 1
                if s.refs == 0:
                    del self._slots[(j, k)]
                    self._pool[j].append(s.buf)
        return MixResult(k, out, self._skips.get(k), len(good), dropped)


class LocalExchange:
    """One worker's handle on a LocalGroup (implements Exchange)."""

    def __init__(self, group: LocalGroup, rank: int):
        self.group, self.rank = group, rank
        self.world = group.world

    def attach(self, layout: Layout) -> int:
        return self.group._attach(self.rank, layout)

    def publish(self, iteration: int, buf: torch.Tensor, *, mass: float = 1.0,
                ranges: Sequence[int] | None = None) -> None:
        self.group._publish(self.rank, iteration, buf, mass)

    def mix(self, iteration: int) -> MixResult:
        return self.group._mix(self.rank, iteration)

    def close(self) -> None:
        pass


__all__ = ["Exchange", "MixResult", "LocalGroup", "LocalExchange", "LayoutMismatch", "topology_weights"]
