"""int8/int4 codecs and public copies: the quantizer's bound, copies that stay equal on both sides
through increments, keyframes, restarts and refusals, changed ranges, mass, hostile headers."""
from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from peerd.config import Config
from peerd.net import copies as cp
from peerd.net import quant
from peerd.net import tensorwire as tw
from peerd.net.dataplane import Outgoing, TransferError, check_header
from peerd.v1 import peer_pb2 as pb
from tests.dataplane_harness import nodes, run

SMALL = Config(dataplane_chunk_bytes=4096, dataplane_stall_timeout=2.0, dataplane_admit_timeout=0.5,
               dataplane_deliver_timeout=1.0)
KIND = "model:t1"


# ---- the quantizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 127, 128, 129, 5000, quant.PIECE + 77])
def test_quantized_values_within_half_a_step_of_their_block(bits, n):
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-3, 2, n)        # blocks of very different scales
    seg = torch.empty(quant.segment_bytes(n, bits), dtype=torch.uint8)
    quant.encode(x, seg, bits)
    y = torch.empty(n)
    quant.decode(seg, n, bits, y, add=False)
    pad = torch.zeros(-(-n // quant.BLOCK) * quant.BLOCK)
    pad[:n] = x.abs()
    block_max = pad.view(-1, quant.BLOCK).amax(1).repeat_interleave(quant.BLOCK)[:n]
    assert torch.all((y - x).abs() <= block_max * quant.rounding_bound(bits) * (1 + 1e-5) + 1e-30)
    z = torch.ones(n)
    quant.decode(seg, n, bits, z, add=True)
    assert torch.all((z - (y + 1)).abs() <= 1e-6 * (1 + y.abs()))


def test_quantizer_refuses_nan_and_bad_scales():
    x = torch.randn(300)
    x[200] = float("nan")
    seg = torch.empty(quant.segment_bytes(300, 8), dtype=torch.uint8)
    with pytest.raises(quant.QuantError):
        quant.encode(x, seg, 8)
    quant.encode(torch.randn(300), seg, 8)
    seg[4:8] = torch.frombuffer(bytearray(struct.pack("<f", float("inf"))), dtype=torch.uint8)
    with pytest.raises(quant.QuantError):
        quant.decode(seg, 300, 8, torch.zeros(300), add=True)


def test_encoding_with_a_copy_is_error_feedback():
    """Sending x repeatedly: the copy converges to x (the residual goes with the next message),
    and a receiver decoding every message holds exactly the sender's copy."""
    layout = tw.Layout.of([torch.zeros(10_000)])
    x = torch.randn(10_000)
    src = x.view(torch.uint8)
    sender = torch.zeros(layout.nbytes, dtype=torch.uint8)
    receiver = torch.zeros(layout.nbytes, dtype=torch.uint8)
    p = cp.plan(layout, pb.COMPRESSION_INT4)
    errs = []
    for _ in range(6):
        out = torch.empty(p.wire_bytes, dtype=torch.uint8)
        cp.encode(p, src, out, sender)
        cp.decode(p, out, receiver, add=True)
        assert torch.equal(sender, receiver)
        errs.append(float((receiver.view(torch.float32) - x).abs().max()))
    assert errs[-1] < errs[0] * 1e-4, errs


def test_plan_cuts_runs_to_ranges_and_checks_them():
    layout = tw.Layout.of([torch.zeros(1000), torch.zeros(10, dtype=torch.int64), torch.zeros(500)])
    assert cp.check_ranges([], layout) == ()
    ranges = cp.check_ranges([400, 4080, 4080, 4400], layout)
    p = cp.plan(layout, pb.COMPRESSION_INT8, ranges)
    assert [(s.off, s.nbytes, s.codec) for s in p.segments] == [(400, 3600, "q8"), (4000, 80, "raw"),
                                                                 (4080, 320, "q8")]
    assert all(s.woff % 16 == 0 for s in p.segments)
    for bad in ([1, 2, 3], [8, 4], [0, 4, 2, 8], [0, 5_000_000], [2, 8]):
        with pytest.raises(tw.WireError):
            cp.check_ranges(bad, layout)


# ---- over the wire ---------------------------------------------------------------------------------

def _setup(*dps):
    layout = tw.Layout.of([torch.zeros(20_000), torch.zeros(3, dtype=torch.int64)])
    for dp in dps:
        dp.set_layout(KIND, layout)
    return layout


def _outgoing(layout, x: torch.Tensor, ints: torch.Tensor, **kw) -> Outgoing:
    buf = torch.cat([x.view(torch.uint8), ints.view(torch.uint8)])
    return Outgoing(layout, [tw.byte_view(buf)], (buf,), **kw)


@pytest.mark.parametrize("comp", ["int8", "int4"])
def test_increments_keep_both_copies_equal_and_close(comp):
    async def main():
        async with nodes("a", "b", config=SMALL) as (a, b):
            layout = _setup(a.dp, b.dp)
            x = torch.randn(20_000)
            ints = torch.tensor([1, 2, 3])
            sizes = []
            for k in range(1, 6):
                x = x + 0.01 * torch.randn(20_000)          # a training step's worth of change
                sc = a.dp.senders.by_kind.get(KIND)
                before = sc.copy[:80_000].view(torch.float32).clone() if sc else torch.zeros(20_000)
                increment = float((x - before).abs().max())
                res = await a.push(b, _outgoing(layout, x, ints), iteration=k, kind=KIND, compression=comp)
                sizes.append(res.wire_bytes)
                with await take(b) as rec:
                    got = rec.tensors()
                    assert torch.equal(got[1], ints)
                    held = b.dp.copies.get("a", KIND)
                    assert torch.equal(held.buf, a.dp.senders.by_kind[KIND].copy)
                    err = float((got[0] - x).abs().max())
                    bits = 8 if comp == "int8" else 4
                    assert err <= increment * quant.rounding_bound(bits) * 1.01
            assert max(sizes) < layout.nbytes / (3.5 if comp == "int8" else 7)
            assert a.dp.senders.counts() == {"copy_keyframes": 0, "copy_increments": 5}
    run(main())


def test_a_receiver_without_the_base_gets_a_keyframe():
    """b forgets a's copy (a restart): the next increment is refused at its header and a resends
    its whole copy raw; b then holds exactly a's copy again. The refused increment is not a lost
    update (a run would mix without a): its keyframe follows."""
    async def main():
        async with nodes("a", "b", config=SMALL) as (a, b):
            layout = _setup(a.dp, b.dp)
            lost = []
            b.dp.on_update_lost = lambda *args: lost.append(args)
            x, ints = torch.randn(20_000), torch.zeros(3, dtype=torch.int64)
            await a.push(b, _outgoing(layout, x, ints), iteration=1, kind=KIND, compression="int8")
            (await take(b)).release()
            b.dp.copies.drop("a", KIND)
            res = await a.push(b, _outgoing(layout, x + 1, ints), iteration=2, kind=KIND, compression="int8")
            assert res.wire_bytes >= layout.nbytes
            with await take(b) as rec:
                assert torch.equal(b.dp.copies.get("a", KIND).buf, a.dp.senders.by_kind[KIND].copy)
                assert float((rec.tensors()[0] - (x + 1)).abs().max()) < 0.1
            assert a.dp.counters["copy_refused"] == 1 and a.dp.senders.counts()["copy_keyframes"] == 1
            assert b.dp.rejected["copy_base"] == 1 and lost == []
    run(main())


def test_changed_ranges_travel_alone_and_mass_arrives():
    async def main():
        async with nodes("a", "b", config=SMALL) as (a, b):
            layout = _setup(a.dp, b.dp)
            x, ints = torch.randn(20_000), torch.zeros(3, dtype=torch.int64)
            whole = ((0, layout.nbytes),)
            await a.push(b, _outgoing(layout, x, ints, mass=3.0, ranges=whole), iteration=1, kind=KIND,
                         compression="none")
            with await take(b) as rec:
                assert rec.mass == 3.0 and torch.equal(rec.tensors()[0], x)
            y = x.clone()
            y[:5000] += 1.0                                     # one fragment changed
            res = await a.push(b, _outgoing(layout, y, ints, ranges=((0, 20_000),)), iteration=2, kind=KIND,
                               compression="none")
            assert res.wire_bytes < 20_100
            with await take(b) as rec:
                assert rec.mass == 1.0 and torch.equal(rec.tensors()[0], y)
    run(main())


def test_plain_int8_pull_and_older_iterations_leave_copies_alone():
    async def main():
        async with nodes("a", "b", config=SMALL) as (a, b):
            layout = _setup(a.dp, b.dp)
            x, ints = torch.randn(20_000), torch.zeros(3, dtype=torch.int64)
            await a.push(b, _outgoing(layout, x, ints), iteration=5, kind=KIND, compression="int8")
            (await take(b)).release()
            version = b.dp.copies.get("a", KIND).version
            await a.push(b, _outgoing(layout, x * 2, ints), iteration=4, kind=KIND, compression="int8")
            with await take(b) as rec:
                assert float((rec.tensors()[0] - 2 * x).abs().max()) < 2 * x.abs().max() / 250
            assert b.dp.copies.get("a", KIND).version == version
    run(main())


def test_hostile_copy_headers_are_refused():
    layout = tw.Layout.of([torch.zeros(1000)])
    base = dict(sender="a", run_id="r", iteration=1, tensors=layout.to_proto(), total_bytes=4000,
                checksum_algo="none", kind=KIND)
    q8 = cp.plan(layout, pb.COMPRESSION_INT8).wire_bytes
    cases = [
        dict(compression=pb.COMPRESSION_INT8, wire_bytes=q8 + 16),                       # size lies
        dict(compression=pb.COMPRESSION_NONE, wire_bytes=4000, copy_base=3),             # no epoch
        dict(compression=pb.COMPRESSION_INT8, wire_bytes=q8, copy_epoch=1, ranges=[0, 6]),   # cuts a float
        dict(compression=pb.COMPRESSION_INT8, wire_bytes=q8, mass=float("nan")),
        dict(compression=pb.COMPRESSION_INT8, wire_bytes=q8, mass=-1.0),
    ]
    for extra in cases:
        with pytest.raises(TransferError):
            check_header(pb.TensorHeader(**base, **extra), 16, 1 << 30)
    layout2, wire_bytes, plan = check_header(pb.TensorHeader(**base, compression=pb.COMPRESSION_INT8,
                                                             wire_bytes=q8), 16, 1 << 30)
    assert wire_bytes == q8 and plan is not None


def test_receiver_refuses_versions_out_of_order():
    copies = cp.ReceiverCopies(limit=2)
    h = pb.TensorHeader(sender="a", kind=KIND, copy_epoch=7, copy_base=0, copy_version=1)
    assert copies.base_error(h) == ""
    copies.put("a", KIND, cp.HeldCopy(7, 1, torch.zeros(4, dtype=torch.uint8)))
    assert "version 2" in copies.base_error(pb.TensorHeader(sender="a", kind=KIND, copy_epoch=7, copy_base=2,
                                                             copy_version=3))
    assert copies.base_error(pb.TensorHeader(sender="a", kind=KIND, copy_epoch=8, copy_base=1, copy_version=2))
    assert copies.base_error(pb.TensorHeader(sender="a", kind=KIND, copy_epoch=7, copy_base=1, copy_version=1))
    for s in ("b", "c"):
        copies.put(s, KIND, cp.HeldCopy(1, 1, torch.zeros(4, dtype=torch.uint8)))
    assert copies.get("a", KIND) is None          # least recently used went first


async def take(node, timeout: float = 10.0):
    return await asyncio.wait_for(node.inbox.get(), timeout)
