"""Wire format: hand-coded frames are TensorFrame on the wire, layouts, checksums, casts."""
from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from peerd.net import tensorwire as tw
from peerd.v1 import peer_pb2 as pb


def _header(**kw) -> pb.TensorHeader:
    base = dict(sender="a", run_id="r", iteration=7, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[2, 3])],
                total_bytes=24, wire_bytes=24, checksum_algo="crc32", checksum=123, kind="model", transfer_id=9)
    base.update(kw)
    return pb.TensorHeader(**base)


# ---- wire compatibility, both directions -------------------------------------------------------

def test_our_header_frame_parses_with_generated_classes():
    h = _header()
    frame = pb.TensorFrame.FromString(tw.encode_header(h))
    assert frame.WhichOneof("frame") == "header"
    assert frame.header == h


@given(data=st.binary(max_size=5000), offset=st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_chunk_frames_round_trip_both_ways(data, offset):
    ours = tw.encode_chunk(memoryview(data), offset)
    parsed = pb.TensorFrame.FromString(ours)
    assert parsed.WhichOneof("frame") == "chunk"
    assert parsed.chunk.data == data and parsed.chunk.offset == offset
    theirs = pb.TensorFrame(chunk=pb.TensorChunk(data=data, offset=offset)).SerializeToString()
    kind, (off, mv) = tw.decode_frame(theirs, 1 << 20)
    assert kind == tw.CHUNK and off == offset and bytes(mv) == data
    kind, (off, mv) = tw.decode_frame(ours, 1 << 20)
    assert off == offset and bytes(mv) == data


def test_generated_header_frame_decodes():
    h = _header(compression=pb.COMPRESSION_BF16)
    kind, got = tw.decode_frame(pb.TensorFrame(header=h).SerializeToString(), 1 << 20)
    assert kind == tw.HEADER and got == h


def test_encode_chunks_spans_pieces_and_matches_concatenation():
    rng = random.Random(1)
    pieces = [os.urandom(rng.randrange(0, 300)) for _ in range(20)]
    whole = b"".join(pieces)
    frames = list(tw.encode_chunks([memoryview(p) for p in pieces], 64))
    got = bytearray()
    for f in frames:
        c = pb.TensorFrame.FromString(f).chunk
        assert c.offset == len(got)
        got += c.data
    assert bytes(got) == whole
    assert all(len(pb.TensorFrame.FromString(f).chunk.data) == 64 for f in frames[:-1])


@pytest.mark.parametrize("raw, why", [
    (b"", "empty"),
    (b"\x1a\x00", "unexpected tag"),
    (b"\x12\x05\x0a\x01", "does not match"),
    (b"\x12\x02\x10\xff", "truncated varint"),
    (b"\x12\x03\x0a\x05a", "runs past"),
    (b"\x12\x06\x0a\x01a\x0a\x01b", "repeated"),
    (b"\x12\x02\x18\x01", "unexpected tag"),
    (b"\x0a\x03\xff\xff\xff", "does not parse"),
    (b"\x12\x0c\x10" + b"\xff" * 11, "longer than 10"),
])
def test_decoder_refuses_malformed_frames(raw, why):
    with pytest.raises(tw.WireError, match=why):
        tw.decode_frame(raw, 1 << 20)


def test_decoder_bounds_header_size():
    big = tw.encode_header(_header(sender="x" * 5000))
    with pytest.raises(tw.WireError, match="exceeds"):
        tw.decode_frame(big, 1000)


# ---- layouts and views ---------------------------------------------------------------------------

def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def test_every_dtype_round_trips_through_a_flat_buffer_at_odd_offsets():
    assert {"float32", "bfloat16", "float16", "int64", "bool", "complex64", "uint8"} <= set(tw.DTYPES)
    ts = []
    for i, d in enumerate(tw.DTYPES.values()):
        ts.append(_random_tensor(torch.uint8, (1,)))     # knock the next tensor off alignment
        ts.append(_random_tensor(d, (i % 3 + 1, 5)))
    layout = tw.Layout.of(ts)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    mv = tw.flat_view(buf)
    off = 0
    for t in ts:
        b = tw.byte_view(t)
        mv[off:off + len(b)] = b
        off += len(b)
    assert off == layout.nbytes
    views = layout.views(buf)
    for t, v in zip(ts, views):
        assert v.dtype == t.dtype and v.shape == t.shape
        assert tw.byte_view(v).tobytes() == tw.byte_view(t).tobytes()
    views[1].view(torch.uint8).reshape(-1)[0] ^= 0xFF   # views share memory with the buffer
    assert buf[1] == (tw.byte_view(ts[1])[0] ^ 0xFF)


def test_layout_from_proto_validates():
    ok = tw.Layout.from_proto([pb.TensorSpec(name="a", dtype="int8", shape=[3])], 10, 100)
    assert ok.nbytes == 3
    with pytest.raises(tw.WireError, match=r"tensors\[0\].dtype"):
        tw.Layout.from_proto([pb.TensorSpec(name="a", dtype="float99", shape=[3])], 10, 100)
    with pytest.raises(tw.WireError, match="more than 1 tensors"):
        tw.Layout.from_proto([pb.TensorSpec(dtype="int8", shape=[1])] * 2, 1, 100)
    with pytest.raises(tw.WireError, match="more than 100 bytes"):
        tw.Layout.from_proto([pb.TensorSpec(dtype="float64", shape=[2**40, 2**40])], 10, 100)


# ---- checksum ------------------------------------------------------------------------------------

@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
@settings(max_examples=100, deadline=None)
def test_crc32_combine_matches_zlib(a, b):
    assert tw.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_over_pieces():
    pieces = [os.urandom(n) for n in (0, 1, 100_000, 7)]
    assert tw.crc32([memoryview(p) for p in pieces], step=4096) == zlib.crc32(b"".join(pieces))


# ---- compression ---------------------------------------------------------------------------------

@pytest.mark.parametrize("comp", [pb.COMPRESSION_FP16, pb.COMPRESSION_BF16])
def test_cast_round_trip_within_bound_and_other_dtypes_exact(comp):
    x = torch.cat([torch.randn(10_001) * 10, torch.tensor([1e-6, -3e-7, 1e-30, 0.0])])
    ints = torch.randint(-5, 5, (13,), dtype=torch.int64)
    y = torch.randn(3, dtype=torch.float64)
    ts = [torch.arange(3, dtype=torch.uint8), x, ints, y, x[:7]]
    layout = tw.Layout.of(ts)
    wire = layout.wire(comp)
    assert wire.nbytes == layout.nbytes - 2 * (x.numel() + 7)
    wbuf = torch.zeros(wire.nbytes, dtype=torch.uint8)
    err = tw.compress(layout, [tw.byte_view(t) for t in ts], wbuf, comp)
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    tw.decompress(layout, wbuf, out, comp)
    got = layout.views(out)
    bound = tw.ROUNDING_BOUND[comp]
    for src, dst in zip(ts, got):
        if src.dtype == torch.float32:
            assert torch.all((dst - src).abs() <= bound * src.abs() + tw.ROUNDING_FLOOR[comp])
        else:
            assert torch.equal(src, dst)
    assert 0 < err.rel_l2 <= bound and err.max_abs > 0 and err.overflow == 0


def test_fp16_overflow_is_counted():
    x = torch.tensor([1.0, 1e6, -1e6, float("inf")])
    layout = tw.Layout.of([x])
    wbuf = torch.zeros(layout.wire(pb.COMPRESSION_FP16).nbytes, dtype=torch.uint8)
    err = tw.compress(layout, [tw.byte_view(x)], wbuf, pb.COMPRESSION_FP16)
    assert err.overflow == 2


def test_overflow_count_is_exact_beyond_the_error_sample():
    x = torch.randn(3_000_001)
    spots = [1, 7, 1_000_003, 2_999_999, 3_000_000]   # not all on the sample's stride
    x[spots] = 1e6
    x[5] = float("inf")                                  # already infinite: not an overflow
    layout = tw.Layout.of([x])
    wbuf = torch.zeros(layout.wire(pb.COMPRESSION_FP16).nbytes, dtype=torch.uint8)
    err = tw.compress(layout, [tw.byte_view(x)], wbuf, pb.COMPRESSION_FP16)
    assert err.overflow == len(spots)
    assert 0 < err.sampled < x.numel() and 0 < err.rel_l2 <= 2 ** -11
