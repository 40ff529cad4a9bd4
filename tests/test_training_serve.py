"""What a run serves to pullers stays intact while it streams (in process, a stand-in daemon: no
sockets, no trainer). A pull over a slow link can outlast the iterations after which an own
snapshot is retired and its buffer reused for a later publish; reusing it mid-stream changed the
bytes under the stream and the puller refused them (checksum mismatch)."""
from __future__ import annotations

import asyncio
import dataclasses
import types

import torch

from peerd.config import Config
from peerd.node.training import RunSpec, TrainingRun, wire_layout
from peerd.train.flat import Layout

NODES = ["a", "b", "c"]


def _run(tmp_path) -> TrainingRun:
    cfg = dataclasses.replace(Config(), run_id="t")
    daemon = types.SimpleNamespace(cfg=cfg, node_id="a", data=types.SimpleNamespace(path=tmp_path))
    spec = RunSpec(task="digits", algorithm="netmax", topology="ring", world=3, iterations=100, seed=0,
                   non_iid=False, slowdown=1.0, options={}, script=[], eval_every=0, join_timeout=1.0)
    run = TrainingRun(daemon, spec, NODES)
    run.layout = Layout.build([("w", "float32", (1024,))])
    run.wire = wire_layout(run.layout)
    return run


def _publish(run: TrainingRun, k: int) -> None:
    """What _complete_publish does to the own snapshots, without the policy's sends and pulls."""
    snap = run._pool.pop() if run._pool else torch.empty(run.layout.total_bytes, dtype=torch.uint8)
    snap.fill_(k % 256)
    run.own[k] = snap
    run.own_out[k] = None
    run.live_k = run.policy.k = k
    run._retire_own()


def test_a_snapshot_being_served_is_not_reused_until_its_stream_is_done(tmp_path):
    async def go():
        run = _run(tmp_path)
        _publish(run, 0)
        served = run.serve_pull("b")
        assert served is not None and served.iteration == 0
        before = bytes(served.data.pieces[0])
        for k in range(1, 40):                  # the puller is slow: 39 iterations go by
            _publish(run, k)
        assert bytes(served.data.pieces[0]) == before, "the snapshot changed while it was served"
        served.done()                           # the stream ended: nothing is held for it any more
        assert not run.serving
        ptr = run.own[39].data_ptr()
        for k in range(40, 60):                 # a snapshot nobody pulls is recycled as before
            _publish(run, k)
        assert any(b.data_ptr() == ptr for b in [*run._pool, *run.own.values()])

    asyncio.run(go())
