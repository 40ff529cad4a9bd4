"""The eager mix summed as bytes arrive (peerd/node/run/eagersum.py), in process: the chunks of any
layout split anywhere reassemble exactly; the sum equals the direct weighted sum; what spoils a
sum (NaN in a late chunk, a stream cut) is never mixed; an update of an iteration not yet published
waits for the slot, then falls back to a scratch sum."""
from __future__ import annotations

import asyncio
import random
import time
import types

import pytest
import torch

from peerd.config import Config
from peerd.net import tensorwire as tw
from peerd.node.run.eagersum import _ChunkState, _chunk_values, _float_runs
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import RunSpec
from peerd.sync import events as ev
from peerd.train.flat import Layout
from peerd.v1 import peer_pb2 as pb
from tests.run_env import cancel_tasks, stand_in_env

NODES = ["a", "b", "c"]        # a ring: a's in-neighbours are b and c, weights 1/3 each


@pytest.mark.parametrize("seed", range(40))
def test_chunks_of_any_layout_split_anywhere_reassemble_every_float_once(seed):
    rnd = random.Random(seed)
    specs = [tw.Spec(f"t{i}", rnd.choice(["float32", "float64", "uint8"]), (rnd.randint(1, 40),))
             for i in range(rnd.randint(1, 5))]
    layout = tw.Layout(tuple(specs))
    buf = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)
    runs = _float_runs(layout)
    got = torch.zeros(layout.nbytes, dtype=torch.uint8)
    seen = torch.zeros(layout.nbytes, dtype=torch.int32)
    st, off = _ChunkState(), 0
    frame = b"xyz" + bytes(buf.numpy())          # an unaligned start, as a frame prefix can leave it
    while off < layout.nbytes:
        n = rnd.randint(1, 13)
        for at, values in _chunk_values(runs, off, memoryview(frame)[3 + off:3 + off + n], st):
            size = values.numel() * values.element_size()
            got[at:at + size] = values.reshape(-1).view(torch.uint8)
            seen[at:at + size] += 1
        off += n
    for s, e, _, _ in runs:
        assert torch.equal(got[s:e], buf[s:e]) and bool((seen[s:e] == 1).all())
    assert not st.edges


SPEC = RunSpec(task="digits", algorithm="d-psgd", topology="ring", world=3, iterations=100, seed=0,
               non_iid=False, slowdown=1.0, options={}, script=[], eval_every=0, join_timeout=1.0)
LAYOUT = Layout.build([("w", "float32", (3000,)), ("v", "float64", (17,))])


def _run(tmp_path, **cfg) -> TrainingRun:
    run = TrainingRun(stand_in_env(tmp_path, Config().replace(run_id="t", **cfg)), SPEC, NODES)
    run.mixer.set_layout(LAYOUT, tmp_path)
    assert run.mixer.sums is not None, "D-PSGD on a float layout sums as updates arrive"
    return run


def _params(seed: int) -> torch.Tensor:
    buf = torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)
    for t in LAYOUT.typed(buf):
        t.copy_(torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed), dtype=t.dtype))
    return buf


async def _push(run: TrainingRun, sender: str, k: int, buf: torch.Tensor, chunk: int = 4096,
                cut: bool = False, nan_at: int | None = None) -> pb.TensorHeader:
    """What the data plane does with a push the run sums: chunks into the sink, then finish."""
    data = bytearray(bytes(buf.numpy()))
    if nan_at is not None:
        data[nan_at:nan_at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    h = pb.TensorHeader(sender=sender, run_id="t", iteration=k, kind=run.kind("model"))
    sink = await run.sink_for(h)
    if sink is None:     # no sum to go into (spoilt): the data plane receives the update whole
        whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        run.on_received(types.SimpleNamespace(sender=sender, iteration=k, kind=run.kind("model"),
                                              nbytes=LAYOUT.total_bytes, buffer=whole, stats=None, sunk=False,
                                              release=lambda: None, mass=1.0))
        return h
    for off in range(0, len(data), chunk):
        if cut and off >= len(data) // 2:
            sink.abort("cut")
            return h
        await sink.chunk(off, memoryview(bytes(data[off:off + chunk])))
    stats = await sink.finish()
    run.on_received(types.SimpleNamespace(sender=sender, iteration=k, kind=run.kind("model"), nbytes=LAYOUT.total_bytes,
                                          buffer=torch.empty(0, dtype=torch.uint8), stats=stats, sunk=True,
                                          release=lambda: None, mass=1.0))
    return h


async def _publish_and_mix(run: TrainingRun, k: int, own: torch.Tensor) -> torch.Tensor:
    """Our trainer publishes x_k from slot 0 and asks for the mix in slot 1."""
    from peerd.v1 import control_pb2 as cpb
    run.mixer.slots[0].copy_(own)
    run.api.publish(cpb.PublishRequest(iteration=k, slot=0))
    await run.api.published()
    reply = await asyncio.wait_for(run.api.mix(cpb.MixRequest(iteration=k, slot=1)), 10)
    assert reply.iteration == k
    return run.mixer.slots[1].clone()


def _direct(*bufs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)
    for o, *ts in zip(LAYOUT.typed(out), *(LAYOUT.typed(b) for b in bufs)):
        o.copy_(sum(t.double() for t in ts).div(len(ts)).to(o.dtype))
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(torch.allclose(x.double(), y.double(), rtol=1e-5, atol=1e-6)
               for x, y in zip(LAYOUT.typed(a), LAYOUT.typed(b)))


def test_the_summed_mix_equals_the_weighted_sum_before_and_after_our_publish(tmp_path):
    """b's update arrives before our publish (it waits for the slot, then goes in), c's after."""
    async def go():
        run = _run(tmp_path)
        x_a, x_b, x_c = _params(1), _params(2), _params(3)
        early = asyncio.create_task(_push(run, "b", 0, x_b))
        await asyncio.sleep(0.05)
        mixing = asyncio.create_task(_publish_and_mix(run, 0, x_a))
        await early
        await _push(run, "c", 0, x_c)
        mixed = await mixing
        state = run.mixer.sums.state()
        cancel_tasks(run)
        await run.passes.close()
        return mixed, state, x_a, x_b, x_c
    mixed, state, x_a, x_b, x_c = asyncio.run(go())
    assert _close(mixed, _direct(x_a, x_b, x_c))
    assert state["mixes_from_sums"] == 1 and state["sums_lost"] == 0 and state["scratch_made"] == 0


def test_an_update_with_nan_in_a_late_chunk_is_refused_and_its_partial_sum_never_mixed(tmp_path):
    async def go():
        run = _run(tmp_path, peer_max_offences=100)
        x_a, x_b, x_c = _params(1), _params(2), _params(3)
        mixing = asyncio.create_task(_publish_and_mix(run, 0, x_a))
        await asyncio.sleep(0.05)
        await _push(run, "b", 0, x_b)
        await _push(run, "c", 0, x_c, nan_at=8000)     # chunks before it were already summed
        mixed = await mixing
        state = run.mixer.sums.state()
        cancel_tasks(run)
        await run.passes.close()
        return run, mixed, state, x_a, x_b
    run, mixed, state, x_a, x_b = asyncio.run(go())
    assert run.check.dropped_nonfinite == 1 and state["sums_lost"] == 1
    # the mix is what was held whole: our own parameters (b's update is lost with the spoilt sum)
    assert all(bool(torch.isfinite(t).all()) for t in LAYOUT.typed(mixed) if t.is_floating_point())
    assert _close(mixed, x_a)
    assert run.ledger.partial == 1 and run.ledger.left_out[("b", "lost")] == 1


def test_a_stream_cut_mid_way_spoils_the_sum_and_counts_the_mix_partial(tmp_path):
    async def go():
        run = _run(tmp_path)
        x_a = _params(1)
        mixing = asyncio.create_task(_publish_and_mix(run, 0, x_a))
        await asyncio.sleep(0.05)
        await _push(run, "b", 0, _params(2), cut=True)
        run.driver.feed(ev.PeerDown(1))               # the failure detector finds b dead
        x_c = _params(3)
        await _push(run, "c", 0, x_c)                  # no sum to go into now: received whole
        mixed = await mixing
        cancel_tasks(run)
        await run.passes.close()
        return run, mixed, x_a, x_c
    run, mixed, x_a, x_c = asyncio.run(go())
    assert _close(mixed, _direct(x_a, x_c)) and run.mixer.sums.state()["sums_lost"] == 1


def test_an_update_ahead_of_us_waits_for_the_slot_then_takes_a_scratch_sum(tmp_path):
    """With sum_wait short and our trainer slow to publish, b's update of iteration 0 is summed in a
    scratch buffer; the mix is still right."""
    async def go():
        run = _run(tmp_path, train_sum_wait=0.05)
        x_a, x_b, x_c = _params(1), _params(2), _params(3)
        await _push(run, "b", 0, x_b)
        await _push(run, "c", 0, x_c)
        mixed = await _publish_and_mix(run, 0, x_a)
        state = run.mixer.sums.state()
        cancel_tasks(run)
        await run.passes.close()
        return mixed, state, x_a, x_b, x_c
    mixed, state, x_a, x_b, x_c = asyncio.run(go())
    assert _close(mixed, _direct(x_a, x_b, x_c))
    assert state["scratch_made"] == 1 and state["mixes_from_sums"] == 1


def test_chunks_of_an_iteration_mixed_without_them_never_reach_the_slot_again(tmp_path):
    """b's push of iteration 0 still streams when the mix of 0 is answered without it (b found
    dead, as a neighbour across a slow link is found silent): its later chunks go nowhere. They
    used to keep adding into the trainer's slot, which by then held our next snapshot, and the
    receivers of that snapshot refused it on its checksum."""
    async def go():
        run = _run(tmp_path)
        x_a, x_b, x_c = _params(1), _params(2), _params(3)
        mixing = asyncio.create_task(_publish_and_mix(run, 0, x_a))
        await asyncio.sleep(0.05)
        await _push(run, "c", 0, x_c)
        sink = await run.sink_for(pb.TensorHeader(sender="b", run_id="t", iteration=0, kind=run.kind("model")))
        data, half = bytes(x_b.numpy()), 8192
        for off in range(0, half, 4096):
            await sink.chunk(off, memoryview(data[off:off + 4096]))
        run.driver.feed(ev.PeerDown(1))
        await mixing
        after_mix = run.mixer.slots[1].clone()
        for off in range(half, len(data), 4096):
            await sink.chunk(off, memoryview(data[off:off + 4096]))
        await sink.finish()
        await run.passes.submit(lambda: None)
        slot = run.mixer.slots[1].clone()
        cancel_tasks(run)
        await run.passes.close()
        return after_mix, slot
    after_mix, slot = asyncio.run(go())
    assert torch.equal(slot, after_mix)


HOP4 = RunSpec(task="digits", algorithm="hop", topology="ring", world=4, iterations=100, seed=0,
               non_iid=False, slowdown=1.0, options={}, script=[], eval_every=0, join_timeout=1.0)


def test_a_lost_sum_and_a_killed_neighbour_stall_the_mix_no_longer_than_its_detection(tmp_path):
    """Ring a-b-c-d, d killed (tests/test_churn_daemons.py, in process). b's update of iteration 0
    is summed; d's push fails mid-stream, so that sum is lost (b's update is left out, "lost", never
    waited for again). c, across the hole, finds d dead before we do and, one iteration ahead,
    sends us its newest update (1) when the edge appears on its side: it arrives before our own
    repair. Once we find d dead, c's update stands in and the mix is answered at once. It used to
    be dropped (c was not our neighbour yet): we then waited for c, which waited for our next
    update, until train_silent_peer_timeout (every survivor stalled 10 s instead of dead_after)."""
    async def go():
        run = TrainingRun(stand_in_env(tmp_path, Config().replace(run_id="t", train_silent_peer_timeout=30.0)),
                          HOP4, ["a", "b", "c", "d"])
        run.mixer.set_layout(LAYOUT, tmp_path)
        x_a, x_b, x_c, x_d = _params(1), _params(2), _params(3), _params(4)
        mixing = asyncio.create_task(_publish_and_mix(run, 0, x_a))
        await asyncio.sleep(0.05)
        await _push(run, "b", 0, x_b)                  # summed as it arrives
        await _push(run, "d", 0, x_d, cut=True)        # d is killed mid-push: the sum is lost
        await _push(run, "c", 1, x_c)                  # c is ahead and repaired its graph first
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        run.driver.feed(ev.PeerDown(3))                # the failure detector finds d dead
        done, _ = await asyncio.wait({mixing}, timeout=3.0)
        waited = time.monotonic() - t0
        mixed = mixing.result() if done else None
        mixing.cancel()
        state = run.mixer.sums.state()
        cancel_tasks(run)
        await run.passes.close()
        return run, mixed, waited, state, x_a, x_c
    run, mixed, waited, state, x_a, x_c = asyncio.run(go())
    assert mixed is not None, f"the mix still waited {waited:.1f}s after d was found dead: " \
                              f"{run.policy.state()['waiting']}"
    assert state["sums_lost"] == 1 and not run.liveness.absent       # nobody was marked silent
    assert _close(mixed, _direct(x_a, x_c))        # b's update went with the lost sum
    assert run.ledger.state()["left_out"] == {"b": {"lost": 1}, "d": {"dead": 1}}


def test_an_update_that_comes_before_our_trainer_attached_waits_for_it_then_is_summed(tmp_path):
    """Held whole, an early update costs a model's worth of memory per early neighbour; its stream
    waits for the attach instead (up to train_attach_wait), then it is summed as it arrives."""
    async def go():
        run = TrainingRun(stand_in_env(tmp_path, Config().replace(run_id="t", train_attach_wait=5.0)), SPEC, NODES)
        h = pb.TensorHeader(sender="b", run_id="t", iteration=0, kind=run.kind("model"))
        asking = asyncio.create_task(run.sink_for(h))
        await asyncio.sleep(0.1)
        assert not asking.done()                       # no layout yet: the stream is held
        run.mixer.set_layout(LAYOUT, tmp_path)
        sink = await asyncio.wait_for(asking, 1.0)
        assert sink is not None and run.mixer.sums.targets[0].inflight == {1}
        sink.abort("test over")

        late = TrainingRun(stand_in_env(tmp_path / "late", Config().replace(run_id="t", train_attach_wait=0.2)),
                           SPEC, NODES)
        t0 = time.monotonic()
        assert await late.sink_for(h) is None          # no trainer in time: received whole, as before
        assert 0.15 < time.monotonic() - t0 < 2.0
    asyncio.run(go())


def test_an_update_that_comes_before_our_run_started_waits_for_it(tmp_path):
    """The neighbour's `peerd train` ran first: its update waits (stream held) for our run to
    start and our trainer to attach, within one train_attach_wait, then is summed as it arrives."""
    from peerd.node.offences import PeerOffences
    from peerd.node.run_host import RunHost

    async def go():
        env = stand_in_env(tmp_path, Config().replace(run_id="t", train_attach_wait=5.0))
        host = RunHost(env, PeerOffences(3, 10.0), lambda *a, **k: None)
        run = TrainingRun(env, SPEC, NODES)
        h = pb.TensorHeader(sender="b", run_id="t", iteration=0, kind=run.kind("model"))
        asking = asyncio.create_task(host.sink_for(h, "b"))
        await asyncio.sleep(0.1)
        assert not asking.done()                       # no run yet: the stream is held
        host.start_run(run)
        await asyncio.sleep(0.1)
        assert not asking.done()                       # a run, no trainer yet: still held
        run.mixer.set_layout(LAYOUT, tmp_path)
        sink = await asyncio.wait_for(asking, 1.0)
        assert sink is not None and run.mixer.sums.targets[0].inflight == {1}
        sink.abort("test over")

        env2 = stand_in_env(tmp_path / "late", Config().replace(run_id="t", train_attach_wait=0.3))
        late = RunHost(env2, PeerOffences(3, 10.0), lambda *a, **k: None)
        t0 = time.monotonic()
        asking = asyncio.create_task(late.sink_for(h, "b"))
        await asyncio.sleep(0.2)
        late.start_run(TrainingRun(env2, SPEC, NODES))  # a run, but its trainer never attaches
        assert await asking is None                     # received whole, as before, after one wait
        assert 0.25 < time.monotonic() - t0 < 1.0
        await late.stop()

        stopped = RunHost(env2, PeerOffences(3, 10.0), lambda *a, **k: None)
        await stopped.stop()
        t0 = time.monotonic()
        assert await stopped.sink_for(h, "b") is None   # a stopping daemon: nothing to wait for
        assert time.monotonic() - t0 < 0.2
    asyncio.run(go())


def test_a_pass_asked_for_after_the_run_stopped_is_cancelled_not_an_error():
    """A scratch-sum timer that fired after the run stopped raised "cannot schedule new futures
    after shutdown" on the loop (an ERROR traceback in the daemon log at every Ctrl+C)."""
    from peerd.node.run.passes import Passes

    async def main():
        passes = Passes()
        assert await passes.submit(lambda: 1) == 1
        await passes.close()
        assert passes.submit(lambda: 2).cancelled()
        done = []
        passes.after(lambda: done.append(True))
        assert done == [True]
    asyncio.run(main())
