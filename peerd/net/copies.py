"""Public copies: a sender's parameters as its receivers hold them, updated by small messages.

With `--compress int8|int4`, or when a trainer says which parts of its buffer changed (DiLoCo's
fragments), a push does not carry the whole buffer. Sender and receiver both hold the sender's
*public copy* y^ of its parameters; each push carries what moves y^ towards the new parameters x:

- int8 / int4: the increment Q(x - y^) in blocks of 128 (peerd.net.quant); both sides add the
  decoded increment to y^. The rounding error of one push stays in x - y^ and goes with the
  next (error feedback, as in CHOCO-SGD's compressed gossip): the receiver's y^ is never more
  than one push's rounding away from the sender's x, and the error does not accumulate.
- none / fp16 / bf16 with changed ranges: the new values of those ranges (cast on the wire);
  both sides set y^ there. Ranges nobody changed cost nothing.

A receiver hands its daemon the whole y^ (a full buffer for the mix), so nothing above the data
plane knows about copies. Versions keep both sides equal: every encoding makes the sender's next
version, a push applies to one version (its base) and the receiver refuses any other
(`copy_base`); the sender then sends a *keyframe*, its whole y^ raw, which any receiver can take.
A sender that sent every version to a peer sends it increments only; one that skipped a peer
(a coalesced update, a time-varying graph, a restart on either side) sends it a keyframe. The
epoch (random per sender and run) tells a restarted sender's versions from its predecessor's.

Costs: the sender holds y^ (one model) and one encoded push; a receiver holds one y^ per sender
in copy mode (at most `dataplane_copies_max`, least recently used dropped first: that sender then
gets a refusal and sends a keyframe).
"""
from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from peerd.net import quant
from peerd.net import tensorwire as tw
from peerd.v1 import peer_pb2 as pb

BITS = {pb.COMPRESSION_INT8: 8, pb.COMPRESSION_INT4: 4}
CASTS = {pb.COMPRESSION_FP16: "float16", pb.COMPRESSION_BF16: "bfloat16"}
ALIGN = 16


@dataclass(frozen=True)
class Segment:
    off: int          # byte offset in the buffer
    nbytes: int       # bytes in the buffer
    dtype: str        # the buffer's dtype there
    codec: str        # "q8", "q4" (float32 quantized), "float16"/"bfloat16" (float32 cast), "raw"
    woff: int         # byte offset on the wire (16-byte aligned)
    wbytes: int       # bytes on the wire

    @property
    def count(self) -> int:
        return self.nbytes // tw.DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Plan:
    """Where each part of a buffer goes on the wire, for one (layout, compression, ranges)."""
    segments: tuple[Segment, ...]
    wire_bytes: int


def check_ranges(ranges: Sequence[int], layout: tw.Layout) -> tuple[tuple[int, int], ...]:
    """[start, end) byte pairs: even count, ascending, disjoint, non-empty, inside the buffer, and
    on element boundaries of the dtype they cut. Empty: the whole buffer. Raises WireError."""
    if len(ranges) % 2:
        raise tw.WireError(f"ranges: {len(ranges)} numbers, want [start, end) pairs")
    if len(ranges) > 2 * 4096:
        raise tw.WireError(f"ranges: {len(ranges) // 2} pairs, at most 4096")
    pairs = tuple((int(ranges[i]), int(ranges[i + 1])) for i in range(0, len(ranges), 2))
    total, prev = layout.nbytes, 0
    runs = list(layout.runs())
    for a, b in pairs:
        if not prev <= a < b <= total:
            raise tw.WireError(f"ranges: [{a}, {b}) not ascending, disjoint, non-empty and within "
                               f"the {total} bytes of the buffer")
        for edge in (a, b):
            for off, n, dtype in runs:
                if off < edge < off + n and (edge - off) % tw.DTYPES[dtype].itemsize:
                    raise tw.WireError(f"ranges: {edge} cuts a {dtype} element")
        prev = b
    return pairs


def plan(layout: tw.Layout, compression: int, ranges: Sequence[tuple[int, int]] = ()) -> Plan:
    """The wire plan: every same-dtype run of the layout, cut to `ranges` (all when empty), one
    segment each, each starting 16-byte aligned on the wire."""
    spans = ranges or ((0, layout.nbytes),)
    bits = BITS.get(compression)
    segs, woff = [], 0
    for off, n, dtype in layout.runs():
        for a, b in spans:
            lo, hi = max(a, off), min(b, off + n)
            if lo >= hi:
                continue
            nbytes = hi - lo
            if dtype == "float32" and bits:
                codec, wbytes = f"q{bits}", quant.segment_bytes(nbytes // 4, bits)
            elif dtype == "float32" and compression in CASTS:
                codec, wbytes = CASTS[compression], nbytes // 2
            else:
                codec, wbytes = "raw", nbytes
            segs.append(Segment(lo, nbytes, dtype, codec, woff, wbytes))
            woff += -(-wbytes // ALIGN) * ALIGN
    return Plan(tuple(segs), woff)


def encode(p: Plan, src: torch.Tensor, out: torch.Tensor, copy: torch.Tensor | None) -> None:
    """Write flat uint8 `src` into `out` (p.wire_bytes) by plan `p`. With `copy` (the sender's
    public copy, flat uint8 like src): quantized segments carry src - copy, then the copy takes
    the message exactly as a receiver decodes it (increments added, other segments set). Raises
    quant.QuantError on NaN/Inf, with `copy` unchanged."""
    for s in p.segments:
        w = out[s.woff:s.woff + s.wbytes]
        if s.codec.startswith("q"):
            minus = None if copy is None else tw.typed_view(copy, s.off, s.nbytes, torch.float32)
            quant.encode(tw.typed_view(src, s.off, s.nbytes, torch.float32), w, int(s.codec[1:]), minus)
        elif s.codec == "raw":
            w.copy_(src[s.off:s.off + s.nbytes])
        else:
            tw.typed_view(out, s.woff, s.wbytes, tw.DTYPES[s.codec]).copy_(
                tw.typed_view(src, s.off, s.nbytes, torch.float32))
        pad_end = -(-(s.woff + s.wbytes) // ALIGN) * ALIGN
        out[s.woff + s.wbytes:pad_end].zero_()      # no stale pool bytes on the wire
    if copy is not None:
        decode(p, out, copy, add=True)


def decode(p: Plan, wire: torch.Tensor, dst: torch.Tensor, *, add: bool) -> None:
    """Apply wire buffer `wire` to flat uint8 `dst` by plan `p`: quantized segments add their values
    (when `add`, else set), the others set theirs. Checks every quantized segment before writing
    any (QuantError)."""
    for s in p.segments:
        if s.codec.startswith("q"):
            quant.check(wire[s.woff:s.woff + s.wbytes], s.count, int(s.codec[1:]))
    for s in p.segments:
        _apply(s, wire, dst, add=add and s.codec.startswith("q"))


def _apply(s: Segment, wire: torch.Tensor, dst: torch.Tensor, add: bool) -> None:
    w = wire[s.woff:s.woff + s.wbytes]
    if s.codec.startswith("q"):
        quant.decode(w, s.count, int(s.codec[1:]), tw.typed_view(dst, s.off, s.nbytes, torch.float32), add)
    elif s.codec == "raw":
        dst[s.off:s.off + s.nbytes].copy_(w)
    else:
        tw.typed_view(dst, s.off, s.nbytes, torch.float32).copy_(
            tw.typed_view(wire, s.woff, s.wbytes, tw.DTYPES[s.codec]))


# ---- the two sides' state ------------------------------------------------------------------------

@dataclass
class Encoded:
    """One encoding of the sender's parameters: what every peer at version `base` gets."""
    iteration: int
    compression: int
    ranges: tuple[tuple[int, int], ...]
    plan: Plan
    buf: torch.Tensor | None
    base: int
    version: int
    refs: int = 0
    stale: bool = False     # a newer encoding replaced it: back to the pool once unreferenced


@dataclass
class SenderCopy:
    """The sender's public copy for one kind (a run's parameters), and what each peer holds."""
    layout: tw.Layout
    copy: torch.Tensor
    epoch: int = field(default_factory=lambda: secrets.randbits(63) | 1)
    version: int = 0
    known: dict[str, int] = field(default_factory=dict)   # peer -> the version it holds
    current: Encoded | None = None
    keyframes: int = 0
    increments: int = 0


@dataclass
class HeldCopy:
    epoch: int
    version: int
    buf: torch.Tensor


class ReceiverCopies:
    """Public copies of the senders pushing to this node in copy mode, by (sender, kind), the least
    recently used dropped beyond `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: OrderedDict[tuple[str, str], HeldCopy] = OrderedDict()
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def lock(self, sender: str, kind: str) -> asyncio.Lock:
        """Held while a push from `sender` applies (two of one sender never interleave)."""
        return self._locks.setdefault((sender, kind), asyncio.Lock())

    def get(self, sender: str, kind: str) -> HeldCopy | None:
        c = self.held.get((sender, kind))
        if c is not None:
            self.held.move_to_end((sender, kind))
        return c

    def base_error(self, h: pb.TensorHeader) -> str:
        """Why header `h` cannot apply here ("" when it can)."""
        if h.copy_version <= h.copy_base:
            return f"copy_version {h.copy_version} not after copy_base {h.copy_base}"
        if h.copy_base == 0:
            return ""
        c = self.held.get((h.sender, h.kind))
        if c is None:
            return f"update applies to version {h.copy_base}; no copy of this sender's here"
        if c.epoch != h.copy_epoch or c.version != h.copy_base:
            return (f"update applies to version {h.copy_base} of copy {h.copy_epoch:x}; here is version "
                    f"{c.version} of copy {c.epoch:x}")
        return ""

    def put(self, sender: str, kind: str, copy: HeldCopy) -> None:
        self.held[(sender, kind)] = copy
        self.held.move_to_end((sender, kind))
        while len(self.held) > self.limit:
            self.held.popitem(last=False)

    def drop(self, sender: str, kind: str) -> None:
        self.held.pop((sender, kind), None)

    def keep_kinds(self, kinds: set[str]) -> None:
        """Forget the copies of kinds no longer received (a run ended)."""
        for key in [k for k in self.held if k[1] not in kinds]:
            del self.held[key]
        for key in [k for k in self._locks if k[1] not in kinds and not self._locks[k].locked()]:
            del self._locks[key]


# ---- the data plane's side -------------------------------------------------------------------------

@dataclass
class Message:
    """One push in copy mode (or a plain quantized one: epoch 0), ready to stream."""
    plan: Plan
    buf: torch.Tensor
    compression: int
    epoch: int
    base: int
    version: int
    ranges: tuple[tuple[int, int], ...]
    release: Callable[[], None]


class Senders:
    """This node's public copies as a sender, one per kind (a run's parameters). `pool` gives and
    takes scratch buffers (peerd.net.dataplane.BufferPool)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.by_kind: dict[str, SenderCopy] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.totals = {"copy_keyframes": 0, "copy_increments": 0}   # since start, over every run

    async def message(self, kind: str, layout: tw.Layout, src: torch.Tensor, compression: int,
                      ranges: tuple[tuple[int, int], ...], iteration: int, peer: str,
                      keyframe: bool = False) -> Message:
        """What to push to `peer` for `iteration`: the increment from the version it holds, or a
        keyframe (forced by `keyframe`, or when it does not hold the base). The first push of an
        iteration encodes it (the copy's next version); the others reuse that encoding. A push of
        an iteration older than the newest encoded one travels plainly quantized (epoch 0): the
        copies stay as they are."""
        sc = self.by_kind.get(kind)
        if sc is None or sc.layout != layout:
            sc = self.by_kind[kind] = SenderCopy(layout, torch.zeros(layout.nbytes, dtype=torch.uint8))
        lock = self._locks.setdefault(kind, asyncio.Lock())
        async with lock:
            enc = sc.current
            if enc is not None and iteration < enc.iteration:
                return await self.plain(layout, src, compression)
            if enc is None or enc.iteration != iteration:
                enc = await self._encode(sc, layout, src, compression, ranges, iteration)
            if not keyframe and (enc.base == 0 or sc.known.get(peer) == enc.base):   # base 0: zeros, anyone's
                enc.refs += 1
                sc.increments += 1
                self.totals["copy_increments"] += 1
                return Message(enc.plan, enc.buf, compression, sc.epoch, enc.base, enc.version, enc.ranges,
                               lambda: self._unref(enc))
            p = plan(layout, pb.COMPRESSION_NONE)
            buf = await self.pool.get(p.wire_bytes)
            await asyncio.to_thread(encode, p, sc.copy, buf, None)
            sc.keyframes += 1
            self.totals["copy_keyframes"] += 1
            return Message(p, buf, pb.COMPRESSION_NONE, sc.epoch, 0, enc.version, (), lambda: self.pool.put(buf))

    def delivered(self, kind: str, peer: str, m: Message) -> None:
        """`peer` took `m`: it holds that version now."""
        sc = self.by_kind.get(kind)
        if sc is not None and m.epoch == sc.epoch:
            sc.known[peer] = m.version

    def failed(self, kind: str, peer: str) -> None:
        """A push to `peer` failed: what it holds is unknown (its next push is a keyframe)."""
        sc = self.by_kind.get(kind)
        if sc is not None:
            sc.known.pop(peer, None)

    def keep_kinds(self, kinds: set[str]) -> None:
        for kind in [k for k in self.by_kind if k not in kinds]:
            sc = self.by_kind.pop(kind)
            if sc.current is not None:
                sc.current.stale = True
                self._free(sc.current)

    def counts(self) -> dict[str, int]:
        return dict(self.totals)

    async def _encode(self, sc: SenderCopy, layout: tw.Layout, src: torch.Tensor, compression: int,
                      ranges: tuple[tuple[int, int], ...], iteration: int) -> Encoded:
        p = plan(layout, compression, ranges)
        buf = await self.pool.get(p.wire_bytes)
        try:
            await asyncio.to_thread(encode, p, src, buf, sc.copy)
        except BaseException:
            self.pool.put(buf)
            raise
        if sc.current is not None:
            sc.current.stale = True
            self._free(sc.current)
        sc.version += 1
        sc.current = Encoded(iteration, compression, ranges, p, buf, sc.version - 1, sc.version)
        return sc.current

    async def plain(self, layout: tw.Layout, src: torch.Tensor, compression: int) -> Message:
        """`src` quantized as it is (no copy on either side), or raw when `compression` is not
        int8/int4: a pull's answer, or an update older than the copy."""
        comp = compression if compression in BITS else pb.COMPRESSION_NONE
        p = plan(layout, comp)
        buf = await self.pool.get(p.wire_bytes)
        try:
            await asyncio.to_thread(encode, p, src, buf, None)
        except BaseException:
            self.pool.put(buf)
            raise
        return Message(p, buf, comp, 0, 0, 0, (), lambda: self.pool.put(buf))

    def _unref(self, enc: Encoded) -> None:
        enc.refs -= 1
        self._free(enc)

    def _free(self, enc: Encoded) -> None:
        if enc.stale and enc.refs <= 0 and enc.buf is not None:
            self.pool.put(enc.buf)
            enc.buf = None


class CopyRefused(Exception):
    """A push in copy mode that does not apply to the copy held here (reason `copy_base`)."""


async def receive(copies: ReceiverCopies, h: pb.TensorHeader, p: Plan, wire: torch.Tensor,
                  dst: torch.Tensor) -> None:
    """Decode a received push into `dst` (flat uint8, the whole buffer). Copy mode: apply it to
    the sender's copy held here, then copy that into `dst`; plain (epoch 0): decode into `dst`.
    Raises CopyRefused when it does not apply, quant.QuantError when it does not decode (the
    sender's copy is then dropped here: its next push must be a keyframe)."""
    if h.copy_epoch == 0:
        await asyncio.to_thread(decode, p, wire, dst, add=False)
        return
    async with copies.lock(h.sender, h.kind):
        why = copies.base_error(h)
        if why:
            raise CopyRefused(why)
        held = copies.get(h.sender, h.kind)
        fresh = h.copy_base == 0
        if fresh:
            buf = held.buf if held is not None and held.buf.numel() == dst.numel() else None
        else:
            buf = held.buf

        def apply() -> torch.Tensor:
            out = torch.zeros(dst.numel(), dtype=torch.uint8) if buf is None else buf
            if fresh and buf is not None:
                out.zero_()
            decode(p, wire, out, add=True)
            dst.copy_(out)
            return out

        try:
            out = await asyncio.to_thread(apply)
        except BaseException:
            copies.drop(h.sender, h.kind)
            raise
        copies.put(h.sender, h.kind, HeldCopy(h.copy_epoch, h.copy_version, out))
