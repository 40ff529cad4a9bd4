"""Fuzz: thousands of random and mutated frames at a live data plane, then a correct transfer.

Invariants: every call ends (bounded), nothing corrupt is delivered (each delivered buffer equals
one of the payloads we sent intact), no budget leaks, every refusal is counted, and the server
still moves a correct transfer afterwards.
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import zlib

import grpc
import torch

from peerd.config import Config
from peerd.net import tensorwire as tw
from peerd.net.dataplane import AUTH_KEY, PULL_METHOD, PUSH_METHOD, Outgoing, Snapshot
from peerd.v1 import peer_pb2 as pb
from tests.dataplane_harness import nodes, run

CFG = Config(dataplane_chunk_bytes=4096, dataplane_stall_timeout=2.0, dataplane_admit_timeout=0.2,
             dataplane_peer_bytes=1 << 20, dataplane_total_bytes=2 << 20, dataplane_max_tensors=64,
             dataplane_max_header_bytes=4096)
IDS = ("f0", "f1", "f2", "f3")
DTYPE_NAMES = list(tw.DTYPES) + ["float128", "", "x" * 40]


def valid(rng: random.Random, sender: str, algo: str = "crc32") -> tuple[list[bytes], bytes]:
    n = rng.choice([0, 1, 7, 4096, 4097, rng.randrange(1, 30_000)])
    data = rng.randbytes(n)
    h = pb.TensorHeader(sender=sender, run_id="run1", iteration=rng.randrange(100),
                        tensors=tw.Layout.flat(n).to_proto(), total_bytes=n, wire_bytes=n,
                        checksum_algo=algo, checksum=zlib.crc32(data),
                        kind="model", transfer_id=rng.getrandbits(64))
    return [tw.encode_header(h)] + [tw.encode_chunk(data[i:i + 4096], i) for i in range(0, n, 4096)], data


def random_header(rng: random.Random, sender: str) -> bytes:
    specs = [pb.TensorSpec(name=rng.choice(["", "w", "é" * 3]), dtype=rng.choice(DTYPE_NAMES),
                           shape=[rng.choice([0, 1, 3, 2**31, 2**63]) for _ in range(rng.randrange(4))])
             for _ in range(rng.choice([0, 1, 2, 70]))]
    h = pb.TensorHeader(sender=rng.choice([sender, "mallory", ""]), run_id=rng.choice(["run1", "x"]),
                        iteration=rng.getrandbits(64), tensors=specs, total_bytes=rng.choice([0, 5, 2**40]),
                        wire_bytes=rng.choice([0, 5, 2**40]), checksum_algo=rng.choice(["crc32", "none", "sha"]),
                        checksum=rng.getrandbits(32), compression=rng.choice([0, 1, 2, 7]),
                        kind=rng.choice(["model", "state", "probe", "?"]))
    return tw.encode_header(h)


def mutate(rng: random.Random, frames: list[bytes], sender: str) -> list[bytes]:
    frames = list(frames)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(9)
        i = rng.randrange(len(frames)) if frames else 0
        if op == 0 and frames:                                   # flip bytes
            f = bytearray(frames[i])
            for _ in range(rng.randrange(1, 4)):
                f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
            frames[i] = bytes(f)
        elif op == 1 and frames:                                 # truncate a frame
            frames[i] = frames[i][:rng.randrange(len(frames[i]))]
        elif op == 2:                                            # random junk message
            frames.insert(i, rng.randbytes(rng.randrange(0, 64)))
        elif op == 3 and frames:                                 # duplicate
            frames.insert(i, frames[i])
        elif op == 4 and frames:                                 # drop
            frames.pop(i)
        elif op == 5 and len(frames) > 1:                        # swap
            j = rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == 6:                                            # replace the header
            frames[0:1] = [random_header(rng, sender)]
        elif op == 7:                                            # chunk at a wild offset
            frames.insert(i, tw.encode_chunk(rng.randbytes(rng.randrange(1, 100)), rng.getrandbits(rng.choice([3, 20, 64]))))
        else:                                                    # plausible-looking prefix junk
            frames.insert(i, rng.choice([b"\x0a", b"\x12"]) + tw.varint(rng.getrandbits(rng.choice([4, 30, 70])))
                          + rng.randbytes(rng.randrange(10)))
    return frames


async def push_raw(ch, frames: list[bytes], sender: str) -> grpc.StatusCode:
    async def gen():
        for f in frames:
            yield f
    try:
        await ch.stream_unary(PUSH_METHOD)(gen(), metadata=((AUTH_KEY, sender),), timeout=15)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


def test_fuzz_live_server_then_correct_transfer():
    rng = random.Random(20261202)

    async def main():
        async with nodes("a", "b", config=CFG) as (a, b):
            ch = a.channel(b)
            intact: set[str] = set()
            sent_messages = 0
            calls = 0
            codes: dict[grpc.StatusCode, int] = {}
            for batch in range(100):
                streams = []
                for sender in IDS:
                    r = rng.random()
                    # "none" opts out of the checksum: only unmutated streams may use it
                    frames, data = valid(rng, sender, "none" if r < 0.05 else "crc32")
                    if r < 0.15:
                        pass
                    elif r < 0.9:
                        frames = mutate(rng, frames, sender)
                    else:
                        frames = [rng.randbytes(rng.randrange(200)) for _ in range(rng.randrange(1, 6))]
                    # a mutation may leave a stream valid; then its payload is intact too
                    intact.add(hashlib.sha256(data).hexdigest())
                    sent_messages += len(frames)
                    streams.append(push_raw(ch, frames, sender))
                for code in await asyncio.gather(*streams):
                    codes[code] = codes.get(code, 0) + 1
                    calls += 1
                while not b.inbox.empty():
                    with b.inbox.get_nowait() as rec:
                        assert hashlib.sha256(rec.buffer.numpy().tobytes()).hexdigest() in intact
            # random PullRequests too
            b.snapshots["model"] = Snapshot(1, Outgoing.of([torch.arange(100)]))
            for _ in range(200):
                req = rng.randbytes(rng.randrange(40)) if rng.random() < 0.5 else pb.PullRequest(
                    requester=rng.choice(["a", "b", "f0"]), run_id=rng.choice(["run1", "z"]),
                    min_iteration=rng.choice([0, 1, 2**63]), compression=rng.choice([0, 1, 9]),
                    kind=rng.choice(["", "model", "state", "?"])).SerializeToString()
                call = ch.unary_stream(PULL_METHOD)(req, metadata=((AUTH_KEY, "a"),), timeout=15)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError:
                    pass
                sent_messages += 1
            print("fuzz:", sent_messages, "messages", calls, "push calls", codes, dict(b.dp.rejected))
            assert sent_messages >= 1000, sent_messages
            ok = codes.get(grpc.StatusCode.OK, 0)
            assert ok > 40 and calls - ok > 200, codes
            assert sum(b.dp.rejected.values()) >= calls - ok
            assert b.dp.budget.used_total == 0 and b.dp.pool.idle_bytes <= CFG.dataplane.pool_bytes
            assert not b.dp._server_active
            x = torch.randn(100_000)
            await a.push(b, [x], iteration=99)
            with await asyncio.wait_for(b.inbox.get(), 10) as rec:
                assert rec.iteration == 99 and torch.equal(rec.tensors()[0], x)
    run(main(), timeout=120)
