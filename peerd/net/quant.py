"""Blockwise integer quantization of float32 values: the int8 and int4 wire codecs.

A segment of n float32 values travels as ceil(n / BLOCK) float32 scales followed by the integers
(int8: one byte each; int4: two per byte, low nibble first), padded to 16 bytes. A block's scale
is its largest |value| divided by QMAX, so every value is rounded to the nearest of 2*QMAX+1
levels spread over its own block's range: the error of one value is at most scale / 2, i.e.
1/254 (int8) or 1/14 (int4) of the largest |value| in its block of 128.

On their own these codecs are coarse for parameters; peerd sends them as increments of a public
copy (peerd.net.copies), which makes the rounding error of one message part of the next one's
increment (error feedback): what a receiver holds never drifts from the sender's values by more
than one message's rounding.

Pure torch on CPU tensors, in pieces of PIECE values so that scratch memory stays small whatever
the model's size. Functions here never trust a wire buffer: decoding checks the scales.
"""
from __future__ import annotations

import math

import torch

BLOCK = 128
QMAX = {8: 127, 4: 7}
PIECE = BLOCK * 8192                 # values per pass (1M): bounds the scratch tensors
ALIGN = 16


class QuantError(ValueError):
    """Values that cannot be quantized (NaN/Inf), or a wire segment that does not decode."""


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def segment_bytes(n: int, bits: int) -> int:
    """Wire bytes of n float32 values at `bits` (8 or 4)."""
    blocks = -(-n // BLOCK)
    data = n if bits == 8 else (n + 1) // 2
    return _pad(4 * blocks + data)


def encode(x: torch.Tensor, out: torch.Tensor, bits: int, minus: torch.Tensor | None = None) -> None:
    """Write float32 `x` (1-d, n values), or x - `minus` when given, into uint8 `out`
    (segment_bytes(n, bits) long). Raises QuantError on NaN/Inf."""
    n = x.numel()
    qmax = QMAX[bits]
    blocks = -(-n // BLOCK)
    if out.numel() != segment_bytes(n, bits):
        raise ValueError(f"out: {out.numel()} bytes for {n} values at {bits} bits")
    scales = _typed(out, 0, blocks, torch.float32)
    data = out[4 * blocks:]
    for lo in range(0, n, PIECE):
        hi = min(lo + PIECE, n)
        piece = x[lo:hi] if minus is None else x[lo:hi] - minus[lo:hi]
        rows = _rows(piece)
        s = scales[lo // BLOCK:lo // BLOCK + rows.shape[0]]
        torch.amax(rows.abs(), dim=1, out=s)
        if not bool(torch.isfinite(s).all()):
            raise QuantError("NaN or Inf among the values")
        s.div_(qmax)
        div = torch.where(s > 0, s, 1.0).unsqueeze(1)
        fresh = minus is not None or (hi - lo) % BLOCK     # rows is scratch, not x itself
        q = rows.div_(div) if fresh else rows / div
        q.round_().clamp_(-qmax, qmax)
        flat = q.reshape(-1)[:hi - lo]
        if bits == 8:
            data[lo:hi].view(torch.int8).copy_(flat)
        else:
            _pack4(flat, data, lo)
    data[_data_bytes(n, bits):].zero_()


def check(seg: torch.Tensor, n: int, bits: int) -> None:
    """Raise QuantError unless `seg` is a well-formed segment of n values (size, scales finite and
    not negative)."""
    blocks = -(-n // BLOCK)
    if seg.numel() != segment_bytes(n, bits):
        raise QuantError(f"segment of {seg.numel()} bytes for {n} values at {bits} bits")
    scales = _typed(seg, 0, blocks, torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise QuantError("a block scale is NaN, Inf or negative")


def decode(seg: torch.Tensor, n: int, bits: int, dst: torch.Tensor, add: bool) -> None:
    """Decode a wire segment of n values into float32 `dst` (1-d, n): dst = values, or dst += values
    when `add`. Raises QuantError when a scale is NaN, Inf or negative, before writing."""
    qmax = QMAX[bits]
    blocks = -(-n // BLOCK)
    check(seg, n, bits)
    if dst.numel() != n:
        raise ValueError(f"dst: {dst.numel()} values, the segment has {n}")
    scales = _typed(seg, 0, blocks, torch.float32)
    data = seg[4 * blocks:]
    for lo in range(0, n, PIECE):
        hi = min(lo + PIECE, n)
        if bits == 8:
            q = data[lo:hi].view(torch.int8).float()
        else:
            q = _unpack4(data, lo, hi)
        q.clamp_(-qmax, qmax)
        b0, b1 = lo // BLOCK, -(-hi // BLOCK)
        per = scales[b0:b1].repeat_interleave(BLOCK)[:hi - lo]
        if add:
            dst[lo:hi].addcmul_(q, per)
        else:
            torch.mul(q, per, out=dst[lo:hi])


def rounding_bound(bits: int) -> float:
    """Largest error of one value relative to the largest |value| of its block."""
    return 0.5 / QMAX[bits]


# ---- internals ---------------------------------------------------------------------------------

def _data_bytes(n: int, bits: int) -> int:
    return n if bits == 8 else (n + 1) // 2


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows of BLOCK, the last one zero-padded (a copy only for a partial block)."""
    n = x.numel()
    if n % BLOCK == 0:
        return x.view(-1, BLOCK)
    padded = torch.zeros(math.ceil(n / BLOCK) * BLOCK, dtype=x.dtype)
    padded[:n] = x
    return padded.view(-1, BLOCK)


def _typed(buf: torch.Tensor, off: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    n = count * dtype.itemsize
    if (buf.storage_offset() + off) % dtype.itemsize == 0:
        return buf[off:off + n].view(dtype)
    raise ValueError("a wire segment must start 4-byte aligned")


def _pack4(q: torch.Tensor, data: torch.Tensor, lo: int) -> None:
    """Values in [-7, 7] at element offset `lo` (even) as nibbles q + 8, two per byte."""
    u = (q + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
    b0 = lo // 2
    data[b0:b0 + u.numel() // 2] = u[0::2] | (u[1::2] << 4)


def _unpack4(data: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    b = data[lo // 2:(hi + 1) // 2]
    out = torch.empty(2 * b.numel(), dtype=torch.float32)
    out[0::2] = (b & 0x0F).float()
    out[1::2] = (b >> 4).float()
    return out[:hi - lo].sub_(8)
