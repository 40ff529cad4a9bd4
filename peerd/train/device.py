"""Training on an accelerator: the model and its flat buffer on the device, the exchange in host memory.

The daemon's exchange lives in host memory (its shared-memory slots). A CPU trainer's parameters
live in slot 0 itself and nothing is copied. A GPU trainer keeps them on the GPU, so every
iteration moves x_k down (device to host, for Publish) and mix_k up (host to device). Both copies
run on a copy stream of their own, so that they overlap compute:

- publish(k): the device-to-host copy of x_k is queued behind the compute queued so far (x_k is
  final) and runs while forward and backward run; a helper thread sends Publish(k) to the daemon
  the moment the copy has landed, so the daemon gets x_k as early as on a CPU host.
- mix(k): the host-to-device copy of mix_k is cut into chunks (train_device_chunk_bytes);
  the optimizer applies x_{k+1} = mix_k - lr*d chunk by chunk, each waiting only for its own
  chunk, so the update of chunk i runs while chunk i+1 is copied. Before the update overwrites
  x_k in place, the compute waits for the device-to-host copy to have read it.
- Host memory is page-locked, as asynchronous copies need: the daemon's slots are registered with
  CUDA (cudaHostRegister) where that works; otherwise copies bounce through pinned buffers of our
  own and a host memcpy (done by the helper thread for x_k, chunk by chunk for the mix).

``StagedExchange`` is that orchestration, written against a small ``CopyEngine`` interface:
``CudaEngine`` (CUDA streams and events), and ``ThreadEngine``, a host-memory engine whose copy
"stream" is a thread. ThreadEngine lets the orchestration run, with real concurrency, on a
machine without a GPU: tests and `peerd bench device` use it there. The timeline it records per
iteration (copy intervals, compute intervals: forward/backward and each chunk's update) gives
the copy time and how much of it overlapped compute; on CUDA the marks are CUDA events, read one
iteration later when they are sure to have completed.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from peerd.train.exchange import MixResult
from peerd.train.flat import ALIGN, Layout

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """"auto": CUDA when this torch has it and a GPU is visible, else the CPU; "cpu"; "cuda"
    (or "cuda:N"), refused with a clear error where there is no GPU."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise RuntimeError(f"--device {name}: no CUDA device (torch {torch.__version__} is {build}); "
                               "use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
        return dev
    raise ValueError(f"unknown device {name!r}: auto, cpu, cuda or cuda:N")


# -- copy engines ---------------------------------------------------------------------------------

@dataclass
class Ticket:
    """One queued copy: its start and end marks (the engine's kind of timestamp)."""
    start: Any = None
    end: Any = None
    done: threading.Event | None = None      # ThreadEngine
    error: list = field(default_factory=list)


class CopyEngine:
    """Copies between a device buffer and host memory, off the compute stream.

    ``d2h(src, dst)`` and ``h2d(src, dst, after)`` queue a copy on the copy stream (in call order)
    and return a Ticket. d2h is ordered after all compute queued so far; h2d after the mark
    ``after`` (None: no constraint). ``wait_host`` blocks the calling thread until a copy is done;
    ``wait_compute`` orders the compute queued from now on after it. ``mark()`` is a timestamp on
    the compute stream; ``seconds(a, b)`` the time between two completed marks."""
    kind = "none"

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def pin(self, host: torch.Tensor) -> bool:
        """Make ``host`` usable as the host side of asynchronous copies; False: bounce instead."""
        return True

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        raise NotImplementedError

    def h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Any = None) -> Ticket:
        raise NotImplementedError

    def wait_host(self, t: Ticket, timeout: float) -> None:
        raise NotImplementedError

    def wait_compute(self, t: Ticket) -> None:
        raise NotImplementedError

    def mark(self) -> Any:
        raise NotImplementedError

    def seconds(self, a: Any, b: Any) -> float:
        raise NotImplementedError

    def sync_compute(self) -> None:
        """Block until the compute queued so far has run (to time a step)."""

    def close(self) -> None:
        pass


class ThreadEngine(CopyEngine):
    """Host-memory copies on a thread of their own, in call order (a copy stream for the CPU).

    CPU compute is synchronous, so "after the compute queued so far" holds when a copy is queued;
    ``wait_compute`` is a wait on the calling thread."""
    kind = "thread"

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="peerd-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            src, dst, t = job
            t.start = time.perf_counter()
            try:
                dst.copy_(src)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                t.error.append(e)
            t.end = time.perf_counter()
            t.done.set()

    def _queue(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        t = Ticket(done=threading.Event())
        self._q.put((src, dst, t))
        return t

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        return self._queue(src, dst)

    def h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Any = None) -> Ticket:
        return self._queue(src, dst)

    def wait_host(self, t: Ticket, timeout: float) -> None:
        assert t.done is not None
        if not t.done.wait(timeout):
            raise TimeoutError(f"a host copy did not finish within {timeout:g}s")
        if t.error:
            raise t.error[0]

    def wait_compute(self, t: Ticket) -> None:
        self.wait_host(t, 3600.0)

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5.0)


class CudaEngine(CopyEngine):
    """CUDA: a copy stream of its own, events for ordering and timing, pinned host memory."""
    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._registered: list[int] = []

    def _event(self) -> "torch.cuda.Event":
        return torch.cuda.Event(enable_timing=True)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def pin(self, host: torch.Tensor) -> bool:
        """cudaHostRegister the memory of ``host`` (e.g. a shared-memory slot) for DMA."""
        if host.is_pinned():
            return True
        try:
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
        except Exception:  # noqa: BLE001 - an older torch without the binding: bounce instead
            return False
        if int(getattr(err, "value", err)) != 0:
            return False
        self._registered.append(host.data_ptr())
        return True

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, wait: Any) -> Ticket:
        t = Ticket(start=self._event(), end=self._event())
        with torch.cuda.stream(self.stream):
            if wait is not None:
                self.stream.wait_event(wait)
            t.start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            t.end.record(self.stream)
        return t

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> Ticket:
        return self._copy(src, dst, self.mark())

    def h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Any = None) -> Ticket:
        return self._copy(src, dst, after)

    def wait_host(self, t: Ticket, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not t.end.query():        # Event.synchronize() has no timeout
            if time.monotonic() > deadline:
                raise TimeoutError(f"a device copy did not finish within {timeout:g}s")
            time.sleep(0.0002)

    def wait_compute(self, t: Ticket) -> None:
        torch.cuda.current_stream(self.device).wait_event(t.end)

    def mark(self) -> "torch.cuda.Event":
        e = self._event()
        e.record(torch.cuda.current_stream(self.device))
        return e

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3

    def sync_compute(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()


def make_engine(device: torch.device, staging: str = "auto") -> CopyEngine | None:
    """The engine a trainer on ``device`` uses: CUDA streams on a GPU, none on the CPU (the
    parameters live in the daemon's slot); ``staging="thread"`` forces the host-memory engine
    (the GPU path's orchestration on a CPU, for tests and `peerd bench device`)."""
    if staging == "thread":
        if device.type != "cpu":
            raise ValueError("--staging thread runs on the CPU only")
        return ThreadEngine()
    if staging not in ("auto", "none"):
        raise ValueError(f"unknown staging {staging!r}: auto, none or thread")
    if device.type == "cuda" and staging == "auto":
        return CudaEngine(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device} is not supported (cpu or cuda)")
    return None


# -- the timeline of one iteration ------------------------------------------------------------

def _union_length(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(iv):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection_length(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of (union of xs) intersected with (union of ys)."""
    both = [(max(a, c), min(b, d)) for a, b in xs for c, d in ys if min(b, d) > max(a, c)]
    return _union_length(both)


@dataclass
class StepTimes:
    iteration: int
    d2h_s: float
    h2d_s: float
    compute_s: float     # forward/backward span plus the chunk updates, on the compute stream
    overlap_s: float     # copy time during which the compute stream was busy

    @property
    def copy_s(self) -> float:
        return self.d2h_s + self.h2d_s

    def as_dict(self) -> dict[str, float]:
        return {"d2h_s": round(self.d2h_s, 6), "h2d_s": round(self.h2d_s, 6), "copy_s": round(self.copy_s, 6),
                "copy_overlap_s": round(self.overlap_s, 6), "device_compute_s": round(self.compute_s, 6)}


@dataclass
class _Record:
    iteration: int
    base: Any = None
    compute_end: Any = None
    d2h: Ticket | None = None
    h2d: list[Ticket] = field(default_factory=list)
    updates: list[tuple[Any, Any]] = field(default_factory=list)

    def resolve(self, engine: CopyEngine) -> StepTimes | None:
        if self.base is None or self.compute_end is None or self.d2h is None:
            return None
        s = lambda m: engine.seconds(self.base, m)  # noqa: E731
        compute = [(0.0, s(self.compute_end))] + [(s(a), s(b)) for a, b in self.updates]
        d2h = [(s(self.d2h.start), s(self.d2h.end))]
        h2d = [(s(t.start), s(t.end)) for t in self.h2d]
        return StepTimes(self.iteration, _union_length(d2h), _union_length(h2d), _union_length(compute),
                         _intersection_length(d2h + h2d, compute))


# -- the staged exchange --------------------------------------------------------------------------

class StagedMix:
    """A mix on its way to the device: ``chunks`` are byte ranges of the layout, ascending.

    The optimizer calls ``arrive(i)`` before it uses chunk i (its compute then waits for that
    chunk's copy) and ``applied(i)`` once chunk i's update is queued."""

    def __init__(self, owner: "StagedExchange", chunks: list[tuple[int, int]], tickets: list[Ticket],
                 record: _Record) -> None:
        self.owner, self.chunks, self.tickets, self.record = owner, chunks, tickets, record
        self._pending: Any = None

    def arrive(self, i: int) -> None:
        self.owner.engine.wait_compute(self.tickets[i])
        self._pending = self.owner.engine.mark()

    def applied(self, i: int) -> None:
        end = self.owner.engine.mark()
        self.record.updates.append((self._pending, end))
        if i == len(self.chunks) - 1:
            self.owner._mix_free = end     # the next mix may overwrite the device buffer after this

    def arrive_all(self) -> None:
        """Order the compute after every chunk's copy (for an update that needs the whole mix)."""
        for t in self.tickets:
            self.owner.engine.wait_compute(t)
        self._pending = self.owner.engine.mark()


def chunk_ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges of at most ``chunk`` bytes (rounded to the layout alignment) covering total."""
    chunk = max(ALIGN, chunk // ALIGN * ALIGN)
    return [(lo, min(lo + chunk, total)) for lo in range(0, total, chunk)] or [(0, 0)]


class StagedExchange:
    """An Exchange for a trainer whose parameters live on a device, over an exchange whose buffers
    live in host memory (the daemon's, or any other). See the module's docstring."""

    def __init__(self, inner: Any, device: torch.device, engine: CopyEngine,
                 chunk_bytes: int | None = None, timeout: float | None = None) -> None:
        from peerd.config import Config
        cfg = Config()
        self.inner, self.device, self.engine = inner, torch.device(device), engine
        self.chunk_bytes = chunk_bytes or cfg.train.device_chunk_bytes
        self.timeout = timeout or getattr(inner, "timeout", None) or cfg.train.mix_timeout
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="peerd-publish")
        self._announce: Future | None = None
        self._d2h: Ticket | None = None
        self._mix_free: Any = None
        self._record: _Record | None = None
        self._last: _Record | None = None
        self.times: list[StepTimes] = []          # one per completed iteration, oldest first (bounded)
        self.direct = False                       # the host slots themselves are pinned (no bounce)
        self.initial = None
        self.join_note = ""

    # the attributes the trainer reads from an exchange
    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world(self) -> int:
        return self.inner.world

    # what passes through to the inner exchange untouched (never param_home: the parameters stay
    # on the device, and never host_buffer: the slots are ours to fill)
    _PASS = frozenset({"report", "flush", "directives", "next_directive", "node_id", "session"})

    def __getattr__(self, name: str) -> Any:
        if name in StagedExchange._PASS:
            return getattr(self.__dict__["inner"], name)
        raise AttributeError(name)

    def attach(self, layout: Layout) -> int:
        start = self.inner.attach(layout)
        n = layout.total_bytes
        self._layout = layout
        self._dev_mix = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._chunks = chunk_ranges(n, self.chunk_bytes)
        host_buffer = getattr(self.inner, "host_buffer", None)
        self._slots = [host_buffer(0), host_buffer(1)] if host_buffer is not None else \
            [self.engine.alloc_host(n), self.engine.alloc_host(n)]
        self._zero_copy = host_buffer is not None
        distinct = {s.data_ptr(): s for s in self._slots}.values()
        self.direct = all(self.engine.pin(s) for s in distinct)
        if not self.direct:   # x_k bounces through one of two pinned buffers, the mix through a third
            self._bounce = [self.engine.alloc_host(n), self.engine.alloc_host(n)]
            self._bounce_mix = self.engine.alloc_host(n)
        self.initial = getattr(self.inner, "initial", None)
        self.join_note = getattr(self.inner, "join_note", "")
        return start

    def _slot(self, iteration: int) -> torch.Tensor:
        host_buffer = getattr(self.inner, "host_buffer", None)
        return host_buffer(iteration) if host_buffer is not None else self._slots[iteration % 2]

    def publish(self, iteration: int, buf: torch.Tensor, *, mass: float = 1.0,
                ranges: Sequence[int] | None = None) -> None:
        self._settle_announce()
        rec = self._record = _Record(iteration, base=self.engine.mark())
        host = self._slot(iteration)
        target = host if self.direct else self._bounce[iteration % 2]
        rec.d2h = self._d2h = self.engine.d2h(buf, target)
        self._announce = self._pool.submit(self._send, iteration, rec.d2h, target, host, mass, ranges)

    def _send(self, iteration: int, ticket: Ticket, target: torch.Tensor, host: torch.Tensor,
              mass: float, ranges: Sequence[int] | None) -> None:
        self.engine.wait_host(ticket, self.timeout)
        if target is not host:
            host.copy_(target)                       # bounce: pinned buffer -> the daemon's slot
        self.inner.publish(iteration, host, mass=mass, ranges=ranges)   # the slot itself: the daemon's exchange copies nothing

    def _settle_announce(self) -> None:
        fut, self._announce = self._announce, None
        if fut is not None:
            fut.result(timeout=self.timeout)         # raises the daemon's refusal, if any

    def mix(self, iteration: int) -> MixResult:
        rec = self._record
        if rec is None or rec.iteration != iteration:
            raise RuntimeError(f"mix of iteration {iteration} before its publish")
        rec.compute_end = self.engine.mark()
        self._settle_announce()                      # Publish(k) reached the daemon before Mix(k)
        self._resolve(self._last)                    # the previous iteration's marks have completed
        assert self._d2h is not None
        self.engine.wait_compute(self._d2h)          # the update overwrites x_k: not before it is copied
        res = self.inner.mix(iteration)
        self._last, self._record = rec, None
        if res.params is None:
            return res
        src = res.params
        tickets = []
        for i, (lo, hi) in enumerate(self._chunks):
            part = src[lo:hi]
            if not self.direct:                      # bounce: the slot -> a pinned buffer, chunk by chunk
                stage = self._bounce_mix[lo:hi]     # free: the last mix's copies ended before Publish(k)
                stage.copy_(part)
                part = stage
            tickets.append(self.engine.h2d(part, self._dev_mix[lo:hi], self._mix_free if i == 0 else None))
        rec.h2d = tickets
        return MixResult(iteration, self._dev_mix, res.skip_to, res.used, res.dropped,
                         staged=StagedMix(self, self._chunks, tickets, rec))

    def _resolve(self, rec: _Record | None) -> None:
        if rec is None:
            return
        st = rec.resolve(self.engine)
        if st is not None:
            self.times.append(st)
            del self.times[:-1000]

    def last_times(self) -> StepTimes | None:
        return self.times[-1] if self.times else None

    def close(self) -> None:
        try:
            self._settle_announce()
        finally:
            self._pool.shutdown(wait=True)
            try:
                self.engine.close()
            finally:
                close = getattr(self.inner, "close", None)
                if close is not None:
                    close()


def device_ranges(chunks: Sequence[tuple[int, int]], segments: Sequence[Any]) -> list[list[tuple[int, int, int]]]:
    """Per chunk, the pieces (segment index, first element, end element) of the flat segments it
    covers (segments: objects with ``offset`` (bytes), ``numel`` and ``dtype``)."""
    out: list[list[tuple[int, int, int]]] = []
    for lo, hi in chunks:
        pieces = []
        for i, s in enumerate(segments):
            size = s.dtype.itemsize
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel * size)
            if b > a:
                pieces.append((i, (a - s.offset) // size, (b - s.offset + size - 1) // size))
        out.append(pieces)
    return out
