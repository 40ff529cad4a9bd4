"""Tensor wire format of the data plane: layouts, hand-coded TensorFrame, checksum, compression.

Design choices (measured, see shared/research/engineering.md §2c):

- A transfer moves one flat byte buffer: one or more tensors laid out back to back (a `Layout`).
  The header (protobuf `TensorHeader`, small) is serialized by protobuf; chunks are encoded and
  decoded by hand, because the upb runtime copies a `bytes` field on every set and every read.
  A hand-encoded chunk costs one copy (`b"".join([prefix, memoryview])`) and decoding costs none
  (a memoryview into the received message). The bytes are exactly what `TensorFrame` would
  serialize to (field order aside, which protobuf parsers ignore), so generated classes parse
  our frames and we parse theirs; tests/test_tensorwire.py proves both directions.
- The decoder is strict: one frame field per message, known fields only, no trailing garbage.
  Protobuf would tolerate more (merging, unknown fields), but no conforming sender emits those and
  every extra path is attack surface on a port facing other hosts.
- Checksum: zlib CRC-32 over the wire bytes in order (about 5 GB/s here, so it costs ~20 ms per
  100 MB on each side); "none" is accepted for senders that opt out.
- Compression: only float32 tensors are cast (to float16 or bfloat16); other dtypes travel as
  they are. The receiver cannot know the original values, so the sender measures the error it
  introduced (`CastError`); the receiver reports the format's rounding bound.
"""
from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from peerd.v1 import peer_pb2 as pb


class WireError(ValueError):
    """A frame or header that breaks the wire contract; the message names the bad field."""


# ---- dtypes ----------------------------------------------------------------------------------

_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}  # need scale/zero point: not a layout


def _supported_dtypes() -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for value in vars(torch).values():
            if not isinstance(value, torch.dtype):
                continue
            name = str(value).removeprefix("torch.")
            if name in _QUANTIZED:
                continue
            try:  # both directions of the byte view must work for the dtype to travel
                torch.empty(2, dtype=value).reshape(-1).view(torch.uint8)
                torch.empty(value.itemsize * 2, dtype=torch.uint8).view(value)
            except (RuntimeError, TypeError):
                continue
            out[name] = value
    return dict(sorted(out.items()))


DTYPES: dict[str, torch.dtype] = _supported_dtypes()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise WireError(f"dtype {name!r} cannot travel on the data plane")
    return name


# ---- layout ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Layout:
    """Tensors laid out back to back in one flat byte buffer, in order, no padding."""
    specs: tuple[Spec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> "Layout":
        names = names if names is not None else [str(i) for i in range(len(tensors))]
        if len(names) != len(tensors):
            raise WireError(f"{len(names)} names for {len(tensors)} tensors")
        return cls(tuple(Spec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in zip(names, tensors)))

    @classmethod
    def flat(cls, nbytes: int, name: str = "flat") -> "Layout":
        return cls((Spec(name, "uint8", (nbytes,)),))

    def to_proto(self) -> list[pb.TensorSpec]:
        return [pb.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape) for s in self.specs]

    @classmethod
    def from_proto(cls, specs: Iterable[pb.TensorSpec], max_tensors: int, max_bytes: int) -> "Layout":
        out = []
        total = 0
        for i, s in enumerate(specs):
            if i >= max_tensors:
                raise WireError(f"header.tensors: more than {max_tensors} tensors")
            if s.dtype not in DTYPES:
                raise WireError(f"header.tensors[{i}].dtype: unknown dtype {s.dtype!r}")
            if len(s.shape) > 64:
                raise WireError(f"header.tensors[{i}].shape: {len(s.shape)} dimensions")
            spec = Spec(s.name, s.dtype, tuple(int(d) for d in s.shape))
            total += spec.nbytes  # exact Python ints: no overflow from hostile shapes
            if total > max_bytes:
                raise WireError(f"header.tensors: layout needs more than {max_bytes} bytes")
            out.append(spec)
        return cls(tuple(out))

    def same_shapes(self, other: "Layout") -> bool:
        """Same dtypes and shapes in the same order (names are labels only)."""
        return [(s.dtype, s.shape) for s in self.specs] == [(s.dtype, s.shape) for s in other.specs]

    def wire(self, compression: int) -> "Layout":
        """The layout as it travels: float32 tensors cast when compressed."""
        to = _CAST_TO.get(compression)
        if to is None:
            return self
        return Layout(tuple(Spec(s.name, to if s.dtype == "float32" else s.dtype, s.shape)
                            for s in self.specs))

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed tensors sharing memory with the flat uint8 `buf`."""
        out, off = [], 0
        for s in self.specs:
            n = s.nbytes
            out.append(typed_view(buf, off, n, DTYPES[s.dtype]).view(s.shape))
            off += n
        return out

    def runs(self) -> Iterator[tuple[int, int, str]]:
        """(offset, nbytes, dtype) of maximal runs of same-dtype tensors, for bulk casts."""
        off = 0
        cur: list = []
        for s in self.specs:
            if cur and cur[2] == s.dtype:
                cur[1] += s.nbytes
            else:
                if cur:
                    yield tuple(cur)  # type: ignore[misc]
                cur = [off, s.nbytes, s.dtype]
            off += s.nbytes
        if cur:
            yield tuple(cur)  # type: ignore[misc]


def typed_view(buf: torch.Tensor, off: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [off, off+n) of flat uint8 `buf` as a 1-d `dtype` tensor sharing its memory.

    Layouts have no padding, so a tensor may start at an offset its dtype's size does not divide;
    torch refuses `.view(dtype)` there, but a tensor made over the raw bytes works (x86 and ARM
    load unaligned data)."""
    if n == 0:
        return torch.empty(0, dtype=dtype)
    if (buf.storage_offset() + off) % dtype.itemsize == 0:
        return buf[off:off + n].view(dtype)
    return torch.frombuffer(flat_view(buf)[off:off + n], dtype=torch.uint8).view(dtype)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor as a flat memoryview, without a copy when it is contiguous."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class Movable:
    """A stand-in for a memoryview whose bytes can move mid-stream: every slice is taken from
    `view` as it is now. A sender streaming from a buffer its owner is about to overwrite gets
    an identical copy swapped in (`view = ...`), and the chunks it has not sent yet come from it."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, key: slice) -> memoryview:
        return self.view[key]


def flat_view(buf: torch.Tensor) -> memoryview:
    """Writable memoryview of a flat uint8 CPU tensor (receive buffers)."""
    if buf.numel() == 0:
        return memoryview(bytearray())
    return memoryview(buf.numpy()).cast("B")


# ---- compression -----------------------------------------------------------------------------

_CAST_TO = {pb.COMPRESSION_FP16: "float16", pb.COMPRESSION_BF16: "bfloat16"}
# A cast changes a finite value x (within the target's range) by at most
# ROUNDING_BOUND * |x| + ROUNDING_FLOOR: relative for normal values, absolute near zero (subnormals).
# int8/int4 (peerd.net.quant, sent by peerd.net.copies): the bound is relative to the largest |x| of
# x's block of 128 values, not to |x|.
ROUNDING_BOUND = {pb.COMPRESSION_NONE: 0.0, pb.COMPRESSION_FP16: 2.0 ** -11, pb.COMPRESSION_BF16: 2.0 ** -8,
                  pb.COMPRESSION_INT8: 0.5 / 127, pb.COMPRESSION_INT4: 0.5 / 7}
ROUNDING_FLOOR = {pb.COMPRESSION_NONE: 0.0, pb.COMPRESSION_FP16: 2.0 ** -25, pb.COMPRESSION_BF16: 2.0 ** -134,
                  pb.COMPRESSION_INT8: 0.0, pb.COMPRESSION_INT4: 0.0}
COMPRESSION_NAMES = {"none": pb.COMPRESSION_NONE, "fp16": pb.COMPRESSION_FP16, "bf16": pb.COMPRESSION_BF16,
                     "int8": pb.COMPRESSION_INT8, "int4": pb.COMPRESSION_INT4}


@dataclass(frozen=True)
class CastError:
    """Error a compressed transfer introduced, measured by the sender over the float32 values."""
    max_abs: float       # largest |x - cast(x)| among the sampled values
    rel_l2: float        # ||x - cast(x)|| / ||x|| over the sampled values
    overflow: int        # finite values that became inf (fp16 tops out at 65504), all values
    sampled: int         # float32 values compared (all of them up to ~1M per tensor run)


def compress(layout: Layout, src: Sequence[memoryview], dst: torch.Tensor, compression: int,
             measure: bool = True) -> CastError | None:
    """Write the wire form of the buffer whose bytes are the pieces `src` into flat uint8 `dst`."""
    wire = layout.wire(compression)
    srcbuf = _Pieces(src)
    woff = 0
    acc = [0.0, 0.0, 0.0, 0, 0]  # max_abs, sum sq err, sum sq ref, overflow, sampled
    for off, n, dtype in layout.runs():
        if dtype == "float32" and compression in _CAST_TO:
            x = srcbuf.tensor(off, n).view(torch.float32)
            wn = n // 2
            y = typed_view(dst, woff, wn, DTYPES[_CAST_TO[compression]])
            y.copy_(x)
            if measure:
                _measure(x, y, acc)
            woff += wn
        else:
            dst[woff:woff + n].copy_(srcbuf.tensor(off, n))
            woff += n
    assert woff == wire.nbytes
    if not measure:
        return None
    max_abs, sq_err, sq_ref, overflow, sampled = acc
    return CastError(max_abs, math.sqrt(sq_err / sq_ref) if sq_ref else 0.0, overflow, sampled)


def _measure(x: torch.Tensor, y: torch.Tensor, acc: list, sample: int = 1 << 20) -> None:
    """Accumulate the cast error of y = cast(x): overflows exactly, the error on an even sample.

    Cheap on purpose: measuring every element cost 15x the cast itself, and on a busy host each
    torch op also waits for its intra-op threads, so this runs one pass over the whole buffer
    and a handful of ops over at most `sample` evenly spaced values (all of them when fewer)."""
    n = x.numel()
    if not n:
        return
    if not math.isfinite(float(y.sum())):       # an inf or nan somewhere (or a huge sum): count
        acc[3] += int(torch.isinf(y).sum()) - int(torch.isinf(x).sum())
    step = max(1, n // sample)
    xs = x[::step]
    d = y[::step].float().sub_(xs)
    err = float(torch.linalg.vector_norm(d))
    if not math.isfinite(err):                  # rare: inf/nan inputs or fp16 overflow
        keep = torch.isfinite(xs) & torch.isfinite(d)
        d, xs = d[keep], xs[keep]
        err = float(torch.linalg.vector_norm(d)) if d.numel() else 0.0
    acc[4] += xs.numel()
    if d.numel():
        acc[0] = max(acc[0], float(torch.linalg.vector_norm(d, ord=math.inf)))
        acc[1] += err ** 2
        acc[2] += float(torch.linalg.vector_norm(xs)) ** 2


def decompress(layout: Layout, wire_buf: torch.Tensor, dst: torch.Tensor, compression: int) -> None:
    """Inverse of `compress`: widen the wire buffer into the flat uint8 `dst` of `layout`."""
    woff = 0
    for off, n, dtype in layout.runs():
        if dtype == "float32" and compression in _CAST_TO:
            wn = n // 2
            typed_view(dst, off, n, torch.float32).copy_(
                typed_view(wire_buf, woff, wn, DTYPES[_CAST_TO[compression]]))
            woff += wn
        else:
            dst[off:off + n].copy_(wire_buf[woff:woff + n])
            woff += n


class _Pieces:
    """A byte range over a list of memoryviews, as one uint8 tensor (copies only across pieces)."""

    def __init__(self, pieces: Sequence[memoryview]):
        self.pieces = [p for p in pieces if len(p)]
        self.starts = []
        off = 0
        for p in self.pieces:
            self.starts.append(off)
            off += len(p)

    def tensor(self, off: int, n: int) -> torch.Tensor:
        parts = []
        for start, p in zip(self.starts, self.pieces):
            lo, hi = max(off, start), min(off + n, start + len(p))
            if lo < hi:
                parts.append(torch.frombuffer(p[lo - start:hi - start], dtype=torch.uint8))
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# ---- checksum --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamStats:
    """What the update checks need of a buffer of parameters, from one pass over its floats."""
    finite: bool          # no NaN or Inf in any floating tensor
    max_abs: float        # the largest |value| (inf or nan when not finite)
    norm: float           # the L2 norm over all floating tensors


def param_stats(layout: Layout, buf: torch.Tensor) -> ParamStats:
    """Stats of the floating tensors of `layout` in `buf`: two passes each (aminmax, which turns
    NaN into NaN and Inf into an infinite bound, and a dot product in float32 or float64; both an
    order of magnitude faster on CPU than vector_norm's inf-norm). Whole-buffer work: call it off
    the event loop. A sum of squares beyond float32's range is an infinite norm, not a NaN."""
    top, sq = 0.0, 0.0
    for t in layout.views(buf):
        if not t.is_floating_point() or not t.numel():
            continue
        flat = t.reshape(-1)
        lo, hi = (float(v) for v in torch.aminmax(flat))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return ParamStats(False, math.nan, math.inf)
        top = max(top, -lo, hi)
        wide = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
        sq += float(torch.dot(wide, wide))
    return ParamStats(True, top, math.sqrt(sq))


try:                                     # CRC-32C with the CPU's instruction (SSE4.2, ARMv8): ~10 GB/s
    import crc32c as _crc32c
except ImportError:                      # pragma: no cover - a wheel exists for the usual platforms
    _crc32c = None

HAVE_CRC32C = _crc32c is not None


def crc32c(pieces: Iterable[memoryview], value: int = 0) -> int:
    """CRC-32C (Castagnoli) of the concatenated pieces, continuing `value`."""
    for p in pieces:
        value = _crc32c.crc32c(p[0:len(p)], value)
    return value


def crc32(pieces: Iterable[memoryview], step: int = 1 << 22) -> int:
    """CRC-32 over the concatenation of `pieces` (zlib releases the GIL, so run it in a thread)."""
    c = 0
    for p in pieces:
        for i in range(0, len(p), step):
            c = zlib.crc32(p[i:i + step], c)
    return c


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


CRC32_POLY, CRC32C_POLY = 0xEDB88320, 0x82F63B78     # reflected: zlib's CRC-32, Castagnoli's CRC-32C


def _zero_operators(poly: int) -> list[list[int]]:
    """ops[k]: the GF(2) matrix that appends 2**k zero bytes to a CRC state (zlib's method)."""
    m = [poly] + [1 << (n - 1) for n in range(1, 32)]         # one zero bit
    for _ in range(3):                                          # -> one zero byte
        m = [_gf2_times(m, m[n]) for n in range(32)]
    ops = [m]
    for _ in range(63):
        m = [_gf2_times(m, m[n]) for n in range(32)]
        ops.append(m)
    return ops


_ZERO_OPS: dict[int, list[list[int]]] = {}


def crc32_combine(crc1: int, crc2: int, len2: int, poly: int = CRC32_POLY) -> int:
    """The CRC of A+B from crc(A), crc(B) and len(B) (CRC-32 by default, CRC-32C with its
    polynomial): lets chunks be checksummed in parallel, or out of the loop's order."""
    ops = _ZERO_OPS.get(poly)
    if ops is None:
        ops = _ZERO_OPS[poly] = _zero_operators(poly)
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def split(pieces: Sequence[memoryview], part: int) -> list[memoryview]:
    """The bytes of `pieces` as slices of at most `part` bytes, in order (no copy)."""
    return [p[i:i + part] for p in pieces for i in range(0, len(p), part)]


# ---- frames ----------------------------------------------------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, i: int, end: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= end:
            raise WireError("frame: truncated varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
        if shift >= 64:
            raise WireError("frame: varint longer than 10 bytes")


def encode_header(header: pb.TensorHeader) -> bytes:
    """TensorFrame{header}: field 1, length-delimited."""
    body = header.SerializeToString()
    return b"\x0a" + varint(len(body)) + body


def _varint_padded(n: int, length: int) -> bytes:
    """`n` as a varint of exactly `length` bytes (continuation bytes of zero: an over-long but valid
    encoding, which protobuf parsers read as n)."""
    out = bytearray(varint(n))
    if length < len(out) or length > 10:
        raise ValueError(f"varint of {n} cannot take {length} bytes")
    if length > len(out):
        out[-1] |= 0x80
        out += b"\x80" * (length - len(out) - 1) + b"\x00"
    return bytes(out)


def chunk_prefix(offset: int, n: int, align: int = 16) -> bytes:
    """Everything of TensorFrame{chunk{data, offset}} before the data bytes.

    Inner message: field 2 (offset, varint) then field 1 (data, length-delimited), so the data
    ends the frame and the frame is `prefix + data` with no copy beyond the final join. The offset
    varint is stretched so that the prefix is a multiple of `align` bytes: the data then starts
    aligned in the frame (and in the bytes object a receiver gets), so it is read as floats in place.
    """
    lo, ln = len(varint(offset)), len(varint(n))
    for a in range(lo, 11):                          # stretch the varints (offset up to 10 bytes; a
        for b in range(ln, 6):                       # length, a 32-bit varint, up to 5) until the
            inner = b"\x10" + _varint_padded(offset, a) + b"\x0a" + _varint_padded(n, b)   # prefix is aligned
            size = len(inner) + n
            lf = len(varint(size))
            for c in range(lf, 6):
                if (1 + c + len(inner)) % align == 0:
                    return b"\x12" + _varint_padded(size, c) + inner
    inner = b"\x10" + varint(offset) + b"\x0a" + varint(n)
    return b"\x12" + varint(len(inner) + n) + inner


def encode_chunk(data: memoryview | bytes, offset: int) -> bytes:
    return b"".join((chunk_prefix(offset, len(data)), data))


def encode_chunks(pieces: Sequence[memoryview], chunk_bytes: int, start: int = 0) -> Iterator[bytes]:
    """Frames of `chunk_bytes` data over the concatenation of `pieces`; chunks span piece borders."""
    offset = start
    parts: list[memoryview] = []
    have = 0
    for p in pieces:
        i = 0
        while i < len(p):
            take = min(chunk_bytes - have, len(p) - i)
            parts.append(p[i:i + take])
            have += take
            i += take
            if have == chunk_bytes:
                yield b"".join((chunk_prefix(offset, have), *parts))
                offset += have
                parts, have = [], 0
    if have:
        yield b"".join((chunk_prefix(offset, have), *parts))


HEADER = 1
CHUNK = 2


def decode_frame(raw: bytes, max_header_bytes: int) -> tuple[int, object]:
    """Parse one TensorFrame. Returns (HEADER, TensorHeader) or (CHUNK, (offset, memoryview)).

    Raises WireError for anything a conforming TensorFrame serializer would not produce
    (an empty frame, both or repeated oneof fields, unknown fields, bad lengths)."""
    mv = memoryview(raw)
    end = len(mv)
    if end == 0:
        raise WireError("frame: empty message (neither header nor chunk)")
    tag = mv[0]
    if tag not in (0x0A, 0x12):
        raise WireError(f"frame: unexpected tag 0x{tag:02x} (want header=0x0a or chunk=0x12)")
    ln, i = _read_varint(mv, 1, end)
    if i + ln != end:
        raise WireError(f"frame: field length {ln} does not match message size {end - i}")
    if tag == 0x0A:
        if ln > max_header_bytes:
            raise WireError(f"header: {ln} bytes exceeds the {max_header_bytes}-byte limit")
        try:
            return HEADER, pb.TensorHeader.FromString(mv[i:end].tobytes())
        except Exception as e:  # protobuf's DecodeError and friends
            raise WireError(f"header: does not parse ({e})") from None
    offset = 0
    data = None
    while i < end:
        t = mv[i]
        i += 1
        if t == 0x10:
            offset, i = _read_varint(mv, i, end)
        elif t == 0x0A:
            if data is not None:
                raise WireError("chunk: data field repeated")
            n, i = _read_varint(mv, i, end)
            if i + n > end:
                raise WireError(f"chunk.data: length {n} runs past the frame")
            data = mv[i:i + n]
            i += n
        else:
            raise WireError(f"chunk: unexpected tag 0x{t:02x}")
    return CHUNK, (offset, data if data is not None else mv[0:0])
