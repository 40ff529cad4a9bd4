"""The eager mix summed as the bytes arrive: a neighbour's update never waits whole in memory.

For a policy whose mix of k is every live in-neighbour's iteration-k update (`Policy.eager_mix`:
D-PSGD, Hop's standard mode), the mix is sum_j w_j x_j^k + w_me x_me^k, and the daemon knows the
weights before the bytes come. So a push of x_j^k is not received into a buffer: each chunk, as it
arrives, is checked (finite, |value| within update_max_abs) and added, times w_j, into a running
sum for k (a `Sink` of the data plane; the additions run in the run's pass thread, in order). The
sum lives in the slot the trainer's Mix(k) will read, once our own Publish(k) freed it (the other
slot). An update of an iteration we have not published yet waits for that slot (its stream is
held: gRPC's flow control holds the sender) for up to train_sum_wait seconds, then goes to a
scratch sum. Memory is then O(model), not O(degree x model): the two slots, one snapshot, rarely a
scratch sum.

What it cannot undo: once a chunk is in the sum it cannot be taken out (its bytes are gone). An
update that fails afterwards (a stream cut, a bad checksum, a later chunk with NaN, a norm past
update_max_norm_ratio x ours) taints that iteration's sum: the mix of k is then our own parameters
and the updates still held whole (a partial mix, counted as "lost"), and later updates of k are
received into buffers. An update summed and then dropped by the policy (its sender died before our
mix) stays in the sum with its weight. Weights that change between the sum and the mix (the graph
was repaired) are applied as one common factor when they changed alike, else the sum is not used.
"""
from __future__ import annotations

import asyncio
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch

from peerd.net import tensorwire as tw
from peerd.net.dataplane import Sink
from peerd.node.run.context import RunContext
from peerd.node.run.passes import Passes
from peerd.sync import events as ev
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")

MAX_SCRATCH = 2          # sums of iterations not yet published here (neighbours ahead by one or two)
SPARE = 1                # scratch buffers kept for reuse
BATCH_BYTES = 4 << 20    # chunks handed to the pass thread together (fewer wake-ups of the loop)
BACKLOG_BYTES = 8 << 20  # chunk bytes handed to the pass thread, not yet added, per transfer: the
                         # stream is read no faster (gRPC's flow control then holds the sender)
FLOATS = {"float32": 4, "float64": 8}


@dataclass
class Target:
    """The running sum of iteration k; `buffer` is None until our publish of k frees the slot (or
    the wait for it ends in a scratch buffer), and `ready` is set then."""
    k: int
    buffer: torch.Tensor | None = None
    scratch: bool = False                          # a buffer of its own (not the trainer's free slot)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    summed: dict[int, float] = field(default_factory=dict)    # source rank -> weight, complete and checked
    inflight: set[int] = field(default_factory=set)           # sources whose chunks are being added
    tainted: str = ""                              # why the sum cannot be used ("" when it can)


class _ChunkState:
    """One transfer's progress in the pass thread: its checks, and the bytes of elements cut in
    two by a chunk boundary (at most one per float run per boundary)."""

    def __init__(self) -> None:
        self.bad = ""
        self.top = 0.0
        self.sq = 0.0
        self.edges: dict[int, bytearray] = {}      # element start offset -> its bytes so far


def _float_runs(wire: tw.Layout) -> list[tuple[int, int, torch.dtype, int]]:
    """(start, end, dtype, element size) of every float32/float64 tensor in the wire layout."""
    runs, pos = [], 0
    for spec in wire.specs:
        dtype = getattr(torch, spec.dtype)
        n = math.prod(spec.shape) * torch.empty((), dtype=dtype).element_size()
        if spec.dtype in FLOATS:
            runs.append((pos, pos + n, dtype, FLOATS[spec.dtype]))
        pos += n
    return runs


def _chunk_values(runs, offset: int, data: memoryview, st: _ChunkState) -> list[tuple[int, torch.Tensor]]:
    """The float values a chunk completes, as (byte offset, values) pieces: the whole elements
    inside it, and each element cut by a chunk boundary once its last byte is here (its first
    bytes wait in st.edges; chunks come in order, without gaps)."""
    end = offset + len(data)
    with warnings.catch_warnings():    # read only: the frame's bytes are immutable, nothing writes them
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8)
    out = []
    for s, e, dtype, es in runs:
        lo, hi = max(offset, s), min(end, e)
        if lo >= hi:
            continue
        a = s + -(-(lo - s) // es) * es            # the first element boundary at or after lo
        b = s + (hi - s) // es * es                # the last element boundary at or before hi
        if lo < a:                                 # the rest of an element begun in an earlier chunk
            first = a - es
            buf = st.edges.setdefault(first, bytearray(es))
            stop = min(a, hi)
            buf[lo - first:stop - first] = data[lo - offset:stop - offset]
            if stop == a:
                out.append((first, torch.frombuffer(bytes(st.edges.pop(first)), dtype=dtype)))
        if a < b:
            body = raw[a - offset:b - offset]
            if (body.data_ptr() % es) or body.storage_offset() % es:
                body = body.clone()                # a frame prefix left it unaligned: one copy
            out.append((a, body.view(dtype)))
        if a <= b < hi:                            # the start of an element that ends in a later chunk
            st.edges[b] = bytearray(es)
            st.edges[b][:hi - b] = data[b - offset:hi - offset]
    return out


def _add_chunks(target: torch.Tensor, runs, weight: float, max_abs: float,
                chunks: list[tuple[int, memoryview]], st: _ChunkState) -> None:
    """Pass thread: check and add a batch of consecutive chunks (see _add_chunk)."""
    for offset, data in chunks:
        _add_chunk(target, runs, weight, max_abs, offset, data, st)


def _add_chunk(target: torch.Tensor, runs, weight: float, max_abs: float, offset: int, data: memoryview,
               st: _ChunkState) -> None:
    """Pass thread: check the float values a chunk completes, then add weight x them into the sum.
    After a failed check nothing more of this transfer is added."""
    if st.bad:
        return
    pieces = _chunk_values(runs, offset, data, st)
    for _, values in pieces:
        lo_v, hi_v = (float(v) for v in torch.aminmax(values))
        if not (math.isfinite(lo_v) and math.isfinite(hi_v)):
            st.bad = "NaN/Inf in the parameters"
            return
        st.top = max(st.top, -lo_v, hi_v)
        st.sq += float(torch.dot(values, values))
    if max_abs > 0 and st.top > max_abs:
        st.bad = f"|value| {st.top:.3g} beyond update_max_abs {max_abs:g}"
        return
    for at, values in pieces:
        target[at:at + values.numel() * values.element_size()].view(values.dtype).add_(values, alpha=weight)


class _SumSink(Sink):
    """One push of x_j^k summed into Target k as it arrives (peerd.net.dataplane.Sink)."""

    def __init__(self, owner: "EagerSum", target: Target, src: int, weight: float) -> None:
        self.owner, self.target, self.src, self.weight = owner, target, src, weight
        self.state = _ChunkState()
        self.backlog = 0
        self.batch: list[tuple[int, memoryview]] = []
        self.batch_bytes = 0
        self.room = asyncio.Event()
        self.room.set()
        target.inflight.add(src)

    async def chunk(self, offset: int, data: memoryview) -> None:
        if not self.target.ready.is_set():
            await self.target.ready.wait()         # the slot frees at our publish (bounded: train_sum_wait)
        if self.target.tainted or self.target.buffer is None:
            return                                 # the sum is spoilt or gone: the bytes are only checksummed
        await self.room.wait()
        self.batch.append((offset, data))
        self.batch_bytes += len(data)
        if self.batch_bytes >= BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.batch or self.target.buffer is None or self.target.tainted:
            self.batch, self.batch_bytes = [], 0
            return
        o, n = self.owner, self.batch_bytes
        self.backlog += n
        if self.backlog > BACKLOG_BYTES:
            self.room.clear()
        o.passes.submit(_add_chunks, self.target.buffer, o.runs, self.weight, o.ctx.cfg.train.update_max_abs,
                        self.batch, self.state).add_done_callback(lambda _f: self._added(n))
        self.batch, self.batch_bytes = [], 0

    def _added(self, n: int) -> None:
        self.backlog -= n
        if self.backlog <= BACKLOG_BYTES // 2:
            self.room.set()

    async def finish(self) -> tw.ParamStats:
        self._flush()
        await self.owner.passes.submit(lambda: None)     # every chunk's pass is done
        st, t = self.state, self.target
        t.inflight.discard(self.src)
        if st.edges and not st.bad:
            st.bad = "the stream ended inside a value"
        stats = tw.ParamStats(not st.bad.startswith("NaN"), st.top, math.sqrt(st.sq))
        ratio, own = self.owner.ctx.cfg.train.update_max_norm_ratio, self.owner.snapshots_norm()
        if not st.bad and ratio > 0 and own is not None and stats.norm > ratio * max(own, 1.0):
            st.bad = "norm"      # the check of record is the run's (UpdateCheck): it sees the stats
        if st.bad:
            self.owner.taint(t, f"a bad update from rank {self.src} was partly summed ({st.bad})")
        else:
            t.summed[self.src] = self.weight
        return stats

    def abort(self, why: str) -> None:
        self.target.inflight.discard(self.src)
        self.owner.taint(self.target, f"the update from rank {self.src} failed mid-stream ({why})")


class EagerSum:
    """Running sums of the eager mix, one per iteration (see the module docstring)."""

    def __init__(self, ctx: RunContext, passes: Passes, wire: tw.Layout, nbytes: int,
                 own_norm, held) -> None:
        self.ctx = ctx
        self.passes = passes
        self.runs = _float_runs(wire)
        self.nbytes = nbytes
        self.snapshots_norm = own_norm           # () -> our newest snapshot's norm, or None
        self.held = held                         # (src, k) -> True when held whole (a buffer)
        self.targets: dict[int, Target] = {}
        self.open_k = -1                         # the iteration whose sum may use the trainer's free slot
        self.open_slot: torch.Tensor | None = None
        self.spare: list[torch.Tensor] = []
        self.used = 0                            # mixes answered from a sum
        self.lost = 0                            # sums that could not be used
        self.lost_at: dict[int, set[int]] = {}   # k -> sources whose updates were in a sum not used
        self.scratch_made = 0                    # scratch buffers allocated

    # --- the data plane asks, at each header ---------------------------------------------------------
    def sink_for(self, h: pb.TensorHeader) -> Sink | None:
        ctx = self.ctx
        src, k = ctx.rank_of(h.sender), h.iteration
        policy = ctx.policy
        if src < 0 or src == ctx.rank or h.kind != ctx.kind("model") or k < max(self.open_k, policy.k, 0):
            return None
        if src in policy.dead or self.held((src, k)):
            return None
        weight = policy.mix_weight(src, k)
        if not weight:
            return None
        weight *= h.mass or 1.0       # as the mix weighs it (peerd.node.run.mixer.Mixer._massed)
        target = self.targets.get(k) or self._new_target(k)
        if target is None or target.tainted or src in target.summed or src in target.inflight:
            return None
        return _SumSink(self, target, src, weight)

    def _new_target(self, k: int) -> Target | None:
        if k < self.open_k or k > self.open_k + MAX_SCRATCH:
            return None
        target = self.targets[k] = Target(k)
        if k == self.open_k and self.open_slot is not None:
            self._place(target, self.open_slot, scratch=False)
        else:   # not published here yet: wait for the slot, a bounded time, then take a scratch sum
            target.timer = asyncio.get_running_loop().call_later(self.ctx.cfg.train.sum_wait, self._scratch, target)
        return target

    def _place(self, target: Target, buffer: torch.Tensor, scratch: bool) -> None:
        if target.timer is not None:
            target.timer.cancel()
            target.timer = None
        target.buffer, target.scratch = buffer, scratch
        self.passes.submit(buffer.zero_)
        target.ready.set()

    def _scratch(self, target: Target) -> None:
        target.timer = None
        if target.ready.is_set() or self.targets.get(target.k) is not target:
            return
        if sum(t.scratch for t in self.targets.values()) >= MAX_SCRATCH:
            self.taint(target, "no room for another scratch sum")
            target.ready.set()                     # its sinks see the taint and add nothing
            return
        if not self.spare:
            self.scratch_made += 1
        self._place(target, self.spare.pop() if self.spare else torch.empty(self.nbytes, dtype=torch.uint8),
                    scratch=True)

    def summed(self, src: int, k: int) -> bool:
        t = self.targets.get(k)
        return t is not None and not t.tainted and src in t.summed

    # --- our own publish ---------------------------------------------------------------------------------
    def open(self, k: int, free_slot: torch.Tensor) -> None:
        """We published k: the other slot is free until Mix(k) is answered (a sum of k waiting for
        it goes there); sums of older iterations will never be mixed."""
        for old in [x for x in self.targets if x < k]:
            self._retire(self.targets.pop(old))
        self.open_k, self.open_slot = k, free_slot
        waiting = self.targets.get(k)
        if waiting is not None and not waiting.ready.is_set():
            self._place(waiting, free_slot, scratch=False)

    def taint(self, t: Target, why: str) -> None:
        if not t.tainted:
            t.tainted = why
            log.warning("iteration %d: the running sum is not used: %s", t.k, why)

    def _retire(self, t: Target) -> None:
        if t.timer is not None:
            t.timer.cancel()
        t.ready.set()                              # a sink still waiting sees the target gone: taint
        # Sinks still streaming into it add nothing more: its buffer is the trainer's slot (which
        # soon holds our next snapshot) or a scratch buffer that goes back to the spares. Passes
        # already submitted run before whatever writes the buffer next (the passes are ordered).
        if not t.tainted:
            t.tainted = "its iteration passed"
        if t.scratch:
            self.passes.after(lambda: self.spare.append(t.buffer) if len(self.spare) < SPARE else None)

    # --- the mix -------------------------------------------------------------------------------------------
    def mix(self, mix: ev.Mix, out: torch.Tensor, part_buffer) -> set[int] | None:
        """Submit the mix of k from its running sum: out = (r x sum + the entries held whole + w x
        own) / total weight. Returns the sources in it, or None when there is no usable sum for k
        (the caller then mixes the buffers it holds)."""
        t = self.targets.pop(mix.k, None)
        if t is None:
            return None
        if t.tainted or t.inflight or not t.summed:
            if t.tainted or t.inflight:
                self._lose(t)
            self._retire(t)
            return None
        weights = {src: w for src, _k, w in mix.entries}
        ratios = {src: weights[src] / w for src, w in t.summed.items() if src in weights}
        r = next(iter(ratios.values()), 1.0)
        if any(not math.isclose(x, r, rel_tol=1e-9) for x in ratios.values()):
            self.taint(t, "the weights changed unevenly since the updates were summed")
            self._lose(t)
            self._retire(t)
            return None
        parts: list[tuple[torch.Tensor, float]] = []
        used = set(t.summed)
        total = r * sum(t.summed.values())
        for src, k, w in mix.entries:
            if src in t.summed or w <= 0:
                continue
            buf = part_buffer(src, k)
            if buf is not None:
                parts.append((buf, w))
                used.add(src)
                total += w
        self.passes.submit(_finish_sum, self.runs, out, t.buffer, r / total, [(b, w / total) for b, w in parts])
        self.used += 1
        self._retire(t)
        return used

    def _lose(self, t: Target) -> None:
        self.lost += 1
        self.lost_at[t.k] = set(t.summed) | set(t.inflight)
        for old in [k for k in self.lost_at if k < t.k - 8]:
            del self.lost_at[old]

    def state(self) -> dict:
        return {"mixes_from_sums": self.used, "sums_lost": self.lost, "scratch_made": self.scratch_made,
                "open": {k: sorted(t.summed) for k, t in self.targets.items()}}


def _finish_sum(runs, out: torch.Tensor, acc: torch.Tensor, scale: float, parts) -> None:
    """out = scale x acc + sum of w x buf, over the float runs (pads untouched)."""
    for s, e, dtype, _ in runs:
        o = out[s:e].view(dtype)
        a = acc[s:e].view(dtype)
        if o.data_ptr() == a.data_ptr():
            if scale != 1.0:
                o.mul_(scale)
        else:
            torch.mul(a, scale, out=o)
        for buf, w in parts:
            o.add_(buf[s:e].view(dtype), alpha=w)
