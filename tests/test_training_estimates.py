"""A run feeds NetMax the link matrix's pull times (TrainingRun._feed_estimates), in process with a
stand-in daemon: no sockets, no trainer."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import torch

from peerd.config import Config
from peerd.net.links import LinkMatrix
from peerd.node.training import RunSpec, TrainingRun
from peerd.sync.events import WaitInfo
from peerd.train.flat import Layout
from peerd.v1 import control_pb2 as cpb

NODES = ["a1", "a2", "a3", "b1", "b2", "b3"]          # two sites; ring a1-a2-a3-b1-b2-b3-a1


def _entry(m, t, bw, rtt):
    return {"measurer": m, "target": t, "capacity_bytes_s": bw, "capacity_age_s": 1.0,
            "throughput_bytes_s": bw, "throughput_spread_bytes_s": 0.0, "rtt_s": rtt, "rtt_spread_s": 0.0,
            "samples": 3, "age_s": 1.0}


def _daemon(tmp_path, cfg):
    matrix = LinkMatrix("a1", cfg)
    same = lambda x, y: x[0] == y[0]   # noqa: E731
    matrix.merge([_entry(x, y, 120e6 if same(x, y) else 5e6, 0.001 if same(x, y) else 0.045)
                  for x in NODES for y in NODES if x != y], now=10.0)
    return types.SimpleNamespace(cfg=cfg, node_id="a1", link_matrix=matrix,
                                 data=types.SimpleNamespace(path=tmp_path))


def _spec(algorithm):
    return RunSpec(task="digits", algorithm=algorithm, topology="ring", world=6, iterations=10, seed=0,
                   non_iid=False, slowdown=1.0, options={}, script=[], eval_every=0, join_timeout=1.0)


def test_netmax_run_feeds_link_estimates_and_pulls_its_site_neighbour_most(tmp_path):
    cfg = dataclasses.replace(Config(), train_estimates_interval=0.05, run_id="t")

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("netmax"), NODES)
        assert run.pull_estimates() is None                   # no layout, no compute yet
        run.layout = Layout.build([("w", "float32", (250_000,))])   # 1 MB
        for _ in range(5):
            run.progress.compute_s.add(0.1, 0.1)
        times = run.pull_estimates()
        assert times[0][1] == 0.1 and abs(times[0][5] - (0.045 + 1e6 / 5e6)) < 1e-9
        run.pull_times[5] += [0.5, 0.6, 9.0, 0.55]   # our own pulls from b3: slower than the matrix says
        run.pull_times[1] += [0.02]                  # one pull from a2: too few to replace the matrix
        times = run.pull_estimates()
        assert 0.55 <= times[0][5] <= 0.6 and times[0][1] == 0.1   # the median: one outlier does not count
        assert abs(times[1][5] - (0.045 + 1e6 / 5e6)) < 1e-9   # other hosts' rows: the matrix
        for _ in range(100):
            await asyncio.sleep(0.05)
            if run.estimates_fed:
                break
        row = run.policy.row()
        for task in list(run._tasks):
            task.cancel()
        return run, row
    run, row = asyncio.run(go())
    assert run.estimates_fed >= 1 and run.policy.t is not None and run.policy.kind == "opt"
    assert row[1] > 0.7 and 0 < row[5] < 0.3     # a1: its site neighbour a2 most, b3 across the cut less (uniform: 0.5)


def test_policies_without_pull_estimates_get_none(tmp_path):
    cfg = dataclasses.replace(Config(), train_estimates_interval=0.01, run_id="t")

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), NODES)
        names = {t.get_name() for t in run._tasks}
        for task in list(run._tasks):
            task.cancel()
        return names
    assert "link estimates" not in asyncio.run(go())


def test_transfer_bounds_grow_with_the_model_and_the_link_up_to_half_the_mix_timeout(tmp_path):
    """A pull or a neighbour's update of a big model over a slow link is not a failure: the fixed
    bounds grow by train_transfer_slack times the expected transfer, capped at half of
    train_mix_timeout. a1 has a 120 MB/s link to a2 and a 5 MB/s one to b3 (test matrix)."""
    cfg = dataclasses.replace(Config(), run_id="t", train_pull_timeout=5.0, train_transfer_slack=2.0,
                              train_mix_timeout=60.0, dataplane_min_rate=1_000_000)

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("netmax"), NODES + ["c1"])
        for task in list(run._tasks):
            task.cancel()
        return run
    run = asyncio.run(go())
    assert run.transfer_allowance("b3") == 0.0                            # no layout yet
    run.layout = Layout.build([("w", "float32", (2_500_000,))])          # 10 MB
    assert abs(run.transfer_allowance("a2") - 2 * 10e6 / 120e6) < 1e-9
    assert abs(run.transfer_allowance("b3") - 2 * 10e6 / 5e6) < 1e-9     # 4 s over 5 MB/s
    assert abs(run.transfer_allowance("c1") - 2 * 10e6 / 1e6) < 1e-9     # nobody measured: the data plane's floor
    assert abs(run.transfer_bound(5.0, "b3") - 9.0) < 1e-9
    assert abs(run.transfer_bound(5.0, "c1") - 25.0) < 1e-9
    assert run.transfer_bound(15.0, "c1") == 30.0                         # 35 s capped at 60 / 2
    assert run.transfer_bound(40.0, "c1") == 40.0                         # never below the base
    run.d.cfg = dataclasses.replace(cfg, train_transfer_slack=0.0)
    assert run.transfer_bound(5.0, "b3") == 5.0                           # 0: fixed bounds


def test_silent_check_waits_out_each_neighbours_transfer_allowance(tmp_path):
    """A D-PSGD mix waiting on a2 (fast link) and b3 (slow link, 10 MB: 4 s allowance) marks a2
    silent at the base bound and b3 only once its allowance is spent too."""
    cfg = dataclasses.replace(Config(), run_id="t", train_silent_peer_timeout=0.5, train_transfer_slack=0.25,
                              train_mix_timeout=60.0)
    ring = ["a1", "a2", "b3"]

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ring)
        run.layout = Layout.build([("w", "float32", (2_500_000,))])      # b3: 0.25 * 10 MB / 5 MB/s = 0.5 s more
        fut = asyncio.get_running_loop().create_future()
        run.mix_waiters[0] = fut
        run.policy.waiting = WaitInfo("updates", 0.0, [1, 2])
        t0 = time.monotonic()
        run._arm_silent(0)
        marks = {}
        while len(marks) < 2 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
            for src, why in run.absent.items():
                marks.setdefault(ring[src], time.monotonic() - t0)
            run.policy.waiting = WaitInfo("updates", 0.0, [s for s in (1, 2) if s not in run.absent])
        for task in list(run._tasks):
            task.cancel()
        run._silent_timer.cancel()
        return marks
    marks = asyncio.run(go())
    assert 0.48 <= marks["a2"] < 0.9, marks     # 0.5 s (+ 10 MB over 120 MB/s: 0.02 s)
    assert 0.98 <= marks["b3"] < 1.5, marks     # 0.5 + 0.5 s


def _joiner(tmp_path, algorithm):
    """A run whose host attaches after a neighbour ran ahead (a skewed start looks like a join):
    a2 answers the join pull at iteration 20, every other member has published nothing yet."""
    cfg = dataclasses.replace(Config(), run_id="t")
    d = _daemon(tmp_path, cfg)
    alive = types.SimpleNamespace(address="x:1", state=types.SimpleNamespace(value="alive"))
    d.membership = types.SimpleNamespace(get=lambda node: alive)
    layout = Layout.build([("w", "float32", (16,))])

    async def pull_tensor(address, node, kind="model"):
        return types.SimpleNamespace(iteration=20, nbytes=layout.total_bytes,
                                     buffer=torch.zeros(layout.total_bytes, dtype=torch.uint8),
                                     release=lambda: None)
    d.pull_tensor = pull_tensor

    async def go():
        run = TrainingRun(d, _spec(algorithm), NODES)
        run.layout = layout
        run.slots = [torch.zeros(layout.total_bytes, dtype=torch.uint8)]

        async def nothing_published(quiet=False, every=False):
            return {i: -1 for i in range(1, len(NODES))}
        run._member_iterations = nothing_published
        reply = await run.join_swarm(cpb.AttachReply())
        for task in list(run._tasks):
            task.cancel()
        return run, reply
    return asyncio.run(go())


def test_a_join_marks_starting_members_absent_only_under_a_policy_that_waits_for_updates(tmp_path):
    run, reply = _joiner(tmp_path, "d-psgd")
    assert reply.start_iteration == 20 and set(run.absent.values()) == {"restarting"} and len(run.absent) == 5
    for algorithm in ("netmax", "ad-psgd"):
        run, reply = _joiner(tmp_path, algorithm)
        assert reply.start_iteration == 20 and run.absent == {}, (algorithm, run.absent)
