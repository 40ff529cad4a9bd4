"""A run feeds NetMax the link matrix's pull times (peerd.node.run.pulls), in process with a
stand-in daemon: no sockets, no trainer."""
from __future__ import annotations

import asyncio
import time
import types

import grpc
import pytest
import torch

from peerd.config import Config
from peerd.net.dataplane import TransferError
from peerd.net.links import LinkMatrix
from peerd.node.run.bounds import largest_mix_bound, mix_bound, transfer_allowance, transfer_bound
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import RunSpec
from peerd.sync import events as ev
from peerd.sync.events import WaitInfo
from peerd.train.flat import Layout
from peerd.v1 import control_pb2 as cpb
from tests.run_env import cancel_tasks, stand_in_env

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
    return stand_in_env(tmp_path, cfg, "a1", link_matrix=matrix)


def _spec(algorithm, options=None, script=()):
    return RunSpec(task="digits", algorithm=algorithm, topology="ring", world=6, iterations=10, seed=0,
                   non_iid=False, slowdown=1.0, options=dict(options or {}), script=list(script), eval_every=0,
                   join_timeout=1.0)


def test_netmax_run_feeds_link_estimates_and_pulls_its_site_neighbour_most(tmp_path):
    cfg = Config().replace(train_estimates_interval=0.05, run_id="t")

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("netmax"), NODES)
        compute = run.progress.compute_s
        assert run.pulls.estimates(compute) is None           # no layout, no compute yet
        run.mixer.layout = Layout.build([("w", "float32", (250_000,))])   # 1 MB
        for _ in range(5):
            compute.add(0.1, 0.1)
        times = run.pulls.estimates(compute)
        assert times[0][1] == 0.1 and abs(times[0][5] - (0.045 + 1e6 / 5e6)) < 1e-9
        run.pulls.times[5] += [0.5, 0.6, 9.0, 0.55]   # our own pulls from b3: slower than the matrix says
        run.pulls.times[1] += [0.02]                  # one pull from a2: too few to replace the matrix
        times = run.pulls.estimates(compute)
        assert 0.55 <= times[0][5] <= 0.6 and times[0][1] == 0.1   # the median: one outlier does not count
        assert abs(times[1][5] - (0.045 + 1e6 / 5e6)) < 1e-9   # other hosts' rows: the matrix
        for _ in range(100):
            await asyncio.sleep(0.05)
            if run.pulls.estimates_fed:
                break
        row = run.policy.row()
        cancel_tasks(run)
        return run, row
    run, row = asyncio.run(go())
    assert run.pulls.estimates_fed >= 1 and run.policy.t is not None and run.policy.kind == "opt"
    assert row[1] > 0.7 and 0 < row[5] < 0.3     # a1: its site neighbour a2 most, b3 across the cut less (uniform: 0.5)


def test_policies_without_pull_estimates_get_none(tmp_path):
    cfg = Config().replace(train_estimates_interval=0.01, run_id="t")

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), NODES)
        names = {t.get_name() for t in run._tasks}
        cancel_tasks(run)
        return names
    assert "link estimates" not in asyncio.run(go())


def test_transfer_bounds_grow_with_the_model_and_the_link_up_to_their_cap(tmp_path):
    """A pull or a neighbour's update of a big model over a slow link is not a failure: the fixed
    bounds grow by train_transfer_slack times the expected transfer (never slower than the data
    plane's floor, below which a sender cuts a push), and so does the trainer's mix bound, by the
    longest of them. a1 has a 120 MB/s link to a2 and a 5 MB/s one to b3 (test matrix)."""
    cfg = Config().replace(run_id="t", train_pull_timeout=5.0, train_transfer_slack=2.0,
                              train_mix_timeout=60.0, dataplane_min_rate=1_000_000)

    env = _daemon(tmp_path, cfg)
    mb = 10_000_000                                                       # 10 MB
    assert transfer_allowance(env, 0, "b3") == 0.0                        # no layout yet
    assert abs(transfer_allowance(env, mb, "a2") - 2 * 10e6 / 120e6) < 1e-9
    assert abs(transfer_allowance(env, mb, "b3") - 2 * 10e6 / 5e6) < 1e-9  # 4 s over 5 MB/s
    assert abs(transfer_allowance(env, mb, "c1") - 2 * 10e6 / 1e6) < 1e-9  # nobody measured: the data plane's floor
    assert abs(transfer_bound(env, 5.0, mb, "b3", cap=30.0) - 9.0) < 1e-9
    assert abs(transfer_bound(env, 5.0, mb, "c1", cap=30.0) - 25.0) < 1e-9
    assert transfer_bound(env, 15.0, mb, "c1", cap=30.0) == 30.0          # 35 s capped
    assert transfer_bound(env, 40.0, mb, "c1", cap=30.0) == 40.0          # never below the base
    assert abs(mix_bound(env, mb, ["a2", "b3"]) - 64.0) < 1e-9             # 60 s + b3's 4 s
    assert abs(mix_bound(env, mb, ["a2", "b3", "c1"]) - 80.0) < 1e-9       # + c1's 20 s at the floor
    assert mix_bound(env, mb, []) == 60.0
    assert largest_mix_bound(env, mb) == 80.0                             # what the trainer is told
    env.link_matrix.bandwidth = lambda src, dst: 0.25e6                  # measured below the floor
    assert abs(transfer_allowance(env, mb, "b3") - 20.0) < 1e-9            # the floor's, not 80 s
    env.cfg = cfg.replace(train_transfer_slack=0.0)
    assert transfer_bound(env, 5.0, mb, "b3", cap=30.0) == 5.0            # 0: fixed bounds
    assert mix_bound(env, mb, ["b3"]) == largest_mix_bound(env, mb) == 60.0


def test_one_stalled_iteration_does_not_stretch_the_silent_bound(tmp_path):
    """The silent bound allows two of our iterations at the run's pace (the median of the last
    few), not two of the last one, which may have waited out a crashed neighbour."""
    cfg = Config().replace(run_id="t", train_silent_peer_timeout=3.0)

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("hop"), ["a1", "a2", "b3"])
        live = run.liveness
        bounds = [live.silent_bound()]                      # nothing published yet
        for t in (0.0, 0.3, 0.6, 0.9, 1.2, 6.2):            # four iterations of 0.3 s, then a 5 s stall
            live.published(now=t)
        bounds.append(live.silent_bound())
        for t in (11.2, 16.2, 21.2):                        # the run's pace itself slows down: it counts
            live.published(now=t)
        bounds.append(live.silent_bound())
        cancel_tasks(run)
        return bounds
    assert asyncio.run(go()) == pytest.approx([3.0, 3.6, 13.0])


def test_silent_check_waits_out_each_neighbours_transfer_allowance(tmp_path):
    """A D-PSGD mix waiting on a2 (fast link) and b3 (slow link, 10 MB: 4 s allowance) marks a2
    silent at the base bound and b3 only once its allowance is spent too."""
    cfg = Config().replace(run_id="t", train_silent_peer_timeout=0.5, train_transfer_slack=0.25,
                              train_mix_timeout=60.0)
    ring = ["a1", "a2", "b3"]

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ring)
        run.mixer.layout = Layout.build([("w", "float32", (2_500_000,))])   # b3: 0.25 * 10 MB / 5 MB/s = 0.5 s more
        fut = asyncio.get_running_loop().create_future()
        run.api.waiters[0] = fut
        run.policy.waiting = WaitInfo("updates", 0.0, [1, 2])
        t0 = time.monotonic()
        live = run.liveness
        live.arm_silent(0)
        marks = {}
        while len(marks) < 2 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
            for src, why in live.absent.items():
                marks.setdefault(ring[src], time.monotonic() - t0)
            run.policy.waiting = WaitInfo("updates", 0.0, [s for s in (1, 2) if s not in live.absent])
        cancel_tasks(run)
        live.disarm_silent()
        return marks
    marks = asyncio.run(go())
    assert 0.48 <= marks["a2"] < 0.9, marks     # 0.5 s (+ 10 MB over 120 MB/s: 0.02 s)
    assert 0.98 <= marks["b3"] < 1.5, marks     # 0.5 + 0.5 s


def _joiner(tmp_path, algorithm, neighbour_at=20, own_checkpoint=-1, pull_s=0.0, budget=None, theirs=None,
            restarted_at=None, options=None, script=(), **overrides):
    """A run whose host attaches after a neighbour ran ahead (a skewed start looks like a join):
    a2 answers the join pull at iteration `neighbour_at` (NOT_FOUND when asked for a later one, as
    a daemon does), the other members are at `theirs` (rank -> iteration; by default they have
    published nothing yet). With `restarted_at`, a restarted trainer attaches instead, told to
    resume at that iteration (catch_up). Returns the run, the reply and
    the iterations the pulls asked for (`asked`) and were answered with whole models (`moved`)."""
    cfg = Config().replace(run_id="t", **overrides)
    alive = types.SimpleNamespace(address="x:1", state=types.SimpleNamespace(value="alive"))
    layout = Layout.build([("w", "float32", (16,))])
    asked, moved = [], []

    async def pull_tensor(address, node, kind="model", min_iteration=0):
        asked.append((node, min_iteration))
        if node != "a2" or min_iteration > neighbour_at:
            raise TransferError("not_found", "nothing at or after it", grpc.StatusCode.NOT_FOUND)
        await asyncio.sleep(pull_s)                   # the model crossing the link
        moved.append(node)
        return types.SimpleNamespace(iteration=neighbour_at, nbytes=layout.total_bytes,
                                     buffer=torch.zeros(layout.total_bytes, dtype=torch.uint8),
                                     release=lambda: None)
    env = stand_in_env(tmp_path, cfg, "a1", membership=types.SimpleNamespace(get=lambda node: alive),
                       peers=types.SimpleNamespace(pull_tensor=pull_tensor))

    async def go():
        run = TrainingRun(env, _spec(algorithm, options, script), NODES)
        run.mixer.layout = layout
        run.mixer.slots = [torch.zeros(layout.total_bytes, dtype=torch.uint8)]
        if own_checkpoint >= 0:
            torch.save({"iteration": own_checkpoint}, run.resume.checkpoint_dir / "latest.pt")

        async def member_iterations(quiet=False, every=False):
            return {i: (theirs or {}).get(i, -1) for i in range(1, len(NODES))}
        run.resume.member_iterations = member_iterations
        if restarted_at is None:
            reply, note = await run.resume.join_swarm(cpb.AttachReply(), budget)
        else:
            reply, note = await run.resume.catch_up(cpb.AttachReply(start_iteration=restarted_at), budget)
        cancel_tasks(run)
        return run, reply, types.SimpleNamespace(asked=asked, moved=moved, note=note)
    run, reply, pulls = asyncio.run(go())
    return run, reply, pulls


def test_a_joiner_starts_at_its_neighbours_lowest_iteration_not_where_its_pull_began(tmp_path):
    """The swarm trained on while the parameters crossed the link: starting at the pulled
    iteration, every neighbour would wait on the joiner until it had computed its way up."""
    run, reply, pulls = _joiner(tmp_path / "push", "d-psgd", neighbour_at=20, theirs={1: 27, 2: 26})
    assert reply.start_from_slot and reply.start_iteration == 26, reply
    assert pulls.note.endswith("continuing at iteration 26, the lowest of its live neighbours'"), pulls.note
    run, reply, pulls = _joiner(tmp_path / "pull", "netmax", neighbour_at=20, theirs={1: 27, 2: 26})
    assert reply.start_iteration == 20, reply     # a pull policy asks no one (its pull re-admitted it)


def test_a_join_marks_starting_members_absent_only_under_a_policy_that_waits_for_updates(tmp_path):
    run, reply, _ = _joiner(tmp_path, "d-psgd")
    absent = run.liveness.absent
    assert reply.start_iteration == 20 and set(absent.values()) == {"restarting"} and len(absent) == 5
    for algorithm in ("netmax", "ad-psgd"):
        run, reply, _ = _joiner(tmp_path, algorithm)
        assert reply.start_iteration == 20 and run.liveness.absent == {}, (algorithm, run.liveness.absent)


def test_a_calm_start_or_a_restart_not_behind_pulls_no_model(tmp_path):
    """The join pull asks only for parameters more than join_min_lead (4) past this host's own: a
    neighbour at iteration 2 of a fresh run, or 20 against a checkpoint of 18, moves no model (a
    whole model per host at every start, 1 GB over a WAN for a 1 GB model, only to be dropped)."""
    run, reply, pulls = _joiner(tmp_path / "calm", "d-psgd", neighbour_at=2)
    assert not reply.start_from_slot and pulls.moved == [] and pulls.note == ""
    assert {m for _, m in pulls.asked} == {5} and len(pulls.asked) == 5     # every live member, once
    assert run.liveness.absent == {}                                          # nothing decided
    run, reply, pulls = _joiner(tmp_path / "restart", "d-psgd", neighbour_at=20, own_checkpoint=18)
    assert not reply.start_from_slot and pulls.moved == [] and {m for _, m in pulls.asked} == {23}
    assert pulls.note.startswith("resumed from own checkpoint of iteration 18: no live neighbour")
    run, reply, pulls = _joiner(tmp_path / "behind", "d-psgd", neighbour_at=30, own_checkpoint=18)
    assert reply.start_from_slot and reply.start_iteration == 30 and pulls.moved == ["a2"]
    assert pulls.note == "started from a2's parameters of iteration 30: own checkpoint (iteration 18) is older"


def test_a_join_pull_gets_the_models_transfer_time_within_the_trainers_attach_deadline(tmp_path):
    """A big model over a slow link takes longer than join_pull_timeout: the pull's bound grows by
    its transfer allowance (here 2 x 64 bytes at 16 bytes/s unmeasured: 8 s), so a 0.5 s pull
    with a 0.2 s base is waited for; the trainer's Attach deadline still caps it (a 3 s budget
    leaves 1 s after the margin for the reply: a 5 s pull is given up, nothing decided)."""
    slow_link = dict(train_join_pull_timeout=0.2, dataplane_min_rate=16)
    run, reply, pulls = _joiner(tmp_path / "slow", "d-psgd", pull_s=0.5, **slow_link)
    assert reply.start_from_slot and reply.start_iteration == 20 and pulls.moved == ["a2"]
    t0 = time.monotonic()
    run, reply, pulls = _joiner(tmp_path / "late", "d-psgd", pull_s=5.0, budget=3.0, **slow_link)
    took = time.monotonic() - t0
    assert not reply.start_from_slot and pulls.note == "" and took < 3.0, took


def test_an_update_sent_before_a_pause_notice_does_not_readmit_the_paused_neighbour(tmp_path):
    """The notice and the updates travel on different streams: an update of the iteration the
    neighbour paused at, arriving after its ABSENT notice, leaves it absent (re-admitted it would be
    waited on and, paused, marked silent: a partial mix). Its RESUMING notice lifts the floor, since a
    trainer may resume from an older checkpoint."""
    from peerd.v1 import peer_pb2 as pb
    cfg = Config().replace(run_id="t")
    ring = ["a1", "a2", "b3"]

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ring)
        live = run.liveness
        live.on_notice("a2", pb.TrainerNotice.STATE_ABSENT, 92)
        assert live.absent == {1: "restarting"}
        live.heard_from(1, 92)                    # sent before the pause
        assert live.absent == {1: "restarting"}
        live.heard_from(1, 93)                    # sent after it: back
        assert live.absent == {}
        live.on_notice("a2", pb.TrainerNotice.STATE_ABSENT, 120)
        live.on_notice("a2", pb.TrainerNotice.STATE_RESUMING, 120)
        live.heard_from(1, 60)                    # resumed from an older checkpoint
        assert live.absent == {}
        cancel_tasks(run)
    asyncio.run(go())


def test_a_neighbour_whose_update_is_streaming_in_is_not_silent(tmp_path):
    """The silent bound is for a neighbour that sends nothing: while bytes of its update arrive
    (a big model over a slow link, longer than the bound and its allowance), it is waited for;
    once they stop, it is marked silent within the arriving window (the time 4 chunks take at
    the data plane's floor rate: 4 x 1 MiB at 4 MB/s here, 1.05 s)."""
    cfg = Config().replace(run_id="t", train_silent_peer_timeout=0.5, train_transfer_slack=0.0,
                           train_mix_timeout=60.0, dataplane_min_rate=4_000_000)
    ring = ["a1", "a2", "b3"]

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ring)
        run.mixer.layout = Layout.build([("w", "float32", (1000,))])
        window = run.liveness.arriving_window()
        run.api.waiters[0] = asyncio.get_running_loop().create_future()
        run.policy.waiting = WaitInfo("updates", 0.0, [1])
        live = run.liveness
        t0 = time.monotonic()
        live.arm_silent(0)
        while time.monotonic() - t0 < 2.0:          # 4x the bound: bytes keep coming
            live.update_arriving("a2")
            await asyncio.sleep(0.1)
            assert 1 not in live.absent, f"marked silent after {time.monotonic() - t0:.1f}s while sending"
        stopped = time.monotonic()
        while 1 not in live.absent and time.monotonic() - stopped < window + 2:
            await asyncio.sleep(0.05)
        marked = time.monotonic() - stopped
        cancel_tasks(run)
        live.disarm_silent()
        return live.absent, marked, window
    absent, marked, window = asyncio.run(go())
    assert window == 2.0                         # 1.05 s: the base window is longer
    assert absent == {1: "silent"} and marked <= window + 1.0, (absent, marked)


def test_an_update_arriving_a_chunk_every_few_seconds_is_still_arriving(tmp_path):
    """Bytes show up a whole chunk at a time: at the data plane's floor rate (1 MB/s), with a
    10 Mbit link shared by a few streams, one gets a 1 MiB chunk through every 2-4 s. Such an
    update is slow, not silent: the window is the time 4 chunks take at the floor."""
    cfg = Config().replace(run_id="t")

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ["a1", "a2", "b3"])
        live = run.liveness
        window = live.arriving_window()
        live.update_arriving("a2")
        t = time.monotonic()
        cancel_tasks(run)
        return window, live.still_arriving(1, 1.0, t + 3.5), live.still_arriving(1, 1.0, t + window + 0.1)
    window, after_3_5_s, after_window = asyncio.run(go())
    assert abs(window - 4 * 2**20 / 1e6) < 1e-9
    assert after_3_5_s and not after_window


def test_a_neighbours_update_that_failed_mid_stream_is_not_waited_for(tmp_path):
    """Its sender does not push a failed update again (cut by its deadline over a slow link,
    stalled): the mix waiting on it goes on without that neighbour at once, not after the silent
    bound (two of our iterations: minutes when they last minutes; a lab run waited 415 s). A
    failure before the trainer asks for that mix counts when it does; another run's update does
    not count (an older iteration's goes to the policy, which does not wait on it for a later
    mix: tests/test_sync_hop.py). The neighbour is never marked absent: the mix of the next
    iteration waits for it (marked absent until its next update, it was left out of that one too)."""
    cfg = Config().replace(run_id="t", train_silent_peer_timeout=30.0)

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ["a1", "a2", "b3"])
        live, kind, policy = run.liveness, run.ctx.kind("model"), run.policy
        fed = []
        live.feed = lambda e: fed.append(e) or policy.on_event(e, 0.0)
        policy.on_event(ev.Published(1), 0.0)
        live.update_lost("a2", kind, 1)                  # before our mix of 1 is asked for
        live.update_lost("b3", "model:another-run", 1)
        live.update_lost("b3", kind, 0)                  # an older iteration's
        policy.on_event(ev.UpdateArrived(2, 1), 0.0)
        mixed = [a for a in policy.on_event(ev.MixRequested(1), 0.0) if isinstance(a, ev.Mix)]
        reason = live.why_missing(1, 1)
        policy.on_event(ev.Published(2), 0.0)
        policy.on_event(ev.UpdateArrived(2, 2), 0.0)
        waits = policy.on_event(ev.MixRequested(2), 0.0)
        cancel_tasks(run)
        return fed, mixed, reason, waits, list(policy.waiting.on), dict(live.absent), live.why_missing(1, 2)

    fed, mixed, reason, waits, waiting_on, absent, later = asyncio.run(go())
    assert fed == [ev.UpdateLost(1, 1), ev.UpdateLost(2, 0)]
    assert len(mixed) == 1 and {j for j, _, _ in mixed[0].entries} == {0, 2} and reason == "lost"
    assert isinstance(waits[0], ev.Wait) and waiting_on == [1]
    assert absent == {} and later != "lost"


def test_an_update_lost_by_a_host_that_then_went_down_does_not_count_once_it_is_back(tmp_path):
    """A host killed mid-push loses that update; restarted, it joins and sends that iteration
    anew: the loss, remembered for our mix of it, must not leave the host out of that mix."""
    cfg = Config().replace(run_id="t", train_silent_peer_timeout=30.0)

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ["a1", "a2", "b3"])
        live, policy = run.liveness, run.policy
        live.feed = lambda e: policy.on_event(e, 0.0)
        policy.on_event(ev.Published(0), 0.0)
        live.update_lost("a2", run.ctx.kind("model"), 1)   # the kill cut its push of 1
        lost = dict(policy.lost)
        live.peer_down("a2")
        live.peer_up("a2", restarted=True)
        live.back_in_run("a2", 1)                          # rejoined at iteration 1
        cancel_tasks(run)
        return lost, dict(policy.lost), live.why_missing(1, 1)

    lost, after, reason = asyncio.run(go())
    assert lost == {1: 1} and after == {} and reason != "lost"


def test_a_pause_notice_covers_the_one_update_the_trainer_may_still_publish(tmp_path):
    """PAUSE reaches the trainer at its next iteration boundary: it may publish iteration k + 1
    after the daemon sent its ABSENT notice at k (CI saw exactly this: the neighbour re-admitted
    the paused host by that update, then waited for it as silent and ended degraded). The notice
    carries k + 1."""
    from peerd.node.run.outbound import Notice
    from peerd.v1 import peer_pb2 as pb
    cfg = Config().replace(run_id="t")

    async def go():
        run = TrainingRun(_daemon(tmp_path, cfg), _spec("d-psgd"), ["a1", "a2", "b3"])
        run.policy.k = 41
        sent = []
        run.outbound._queue = lambda dst: types.SimpleNamespace(put_nowait=lambda item: sent.append((dst, item)))
        await run.api.direct(cpb.Directive(kind=cpb.Directive.KIND_PAUSE))
        cancel_tasks(run)
        return sent
    sent = asyncio.run(go())
    assert sorted(sent) == [(1, Notice(pb.TrainerNotice.STATE_ABSENT, 42)), (2, Notice(pb.TrainerNotice.STATE_ABSENT, 42))]


def test_a_restarted_trainer_far_behind_starts_from_a_neighbours_parameters(tmp_path):
    """A trainer restarted at the run's iteration (40) with a checkpoint of iteration 10 (they come
    every train_checkpoint_every iterations) resumed with parameters 30 iterations stale: it starts
    from a neighbour's instead, at its own resume point. A recent checkpoint moves no model."""
    run, reply, pulls = _joiner(tmp_path / "old", "d-psgd", neighbour_at=41, own_checkpoint=10, restarted_at=40)
    assert reply.start_from_slot and reply.start_iteration == 41 and pulls.moved == ["a2"]
    assert {m for _, m in pulls.asked} == {15}
    assert pulls.note.startswith("trainer restarted from a2's parameters of iteration 41 at iteration 41")
    run, reply, pulls = _joiner(tmp_path / "lower", "d-psgd", neighbour_at=38, own_checkpoint=10, restarted_at=40)
    assert reply.start_from_slot and reply.start_iteration == 40, reply   # never behind the resume point
    run, reply, pulls = _joiner(tmp_path / "recent", "d-psgd", neighbour_at=41, own_checkpoint=37, restarted_at=40)
    assert not reply.start_from_slot and reply.start_iteration == 40 and pulls.asked == [] and pulls.note == ""
    # a built-in trainer that crashed before its first checkpoint: the neighbour's, not its initial ones
    run, reply, pulls = _joiner(tmp_path / "none", "d-psgd", neighbour_at=41, restarted_at=40)
    assert reply.start_from_slot and pulls.moved == ["a2"]
    # not where the parameters are tied to state peerd cannot move with them
    for name, kw in (("outer", dict(options={"outer": "diloco"})), ("script", dict(script=["my.py"]))):
        run, reply, pulls = _joiner(tmp_path / name, "d-psgd", neighbour_at=41, restarted_at=40, **kw)
        assert not reply.start_from_slot and pulls.asked == [], name
