"""What a run serves to pullers, or carries in its own pulls, stays intact while it streams (in
process, a stand-in daemon: no sockets, no trainer). A pull over a slow link can outlast the
iterations after which an own snapshot is retired and its buffer reused for a later publish;
reusing it mid-stream changed the bytes under the stream and the peer refused them (checksum
mismatch)."""
from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest
import torch

from peerd.config import Config
from peerd.node.run.mixer import wire_layout
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import RunSpec
from peerd.sync import events as ev
from peerd.train.flat import Layout
from tests.run_env import stand_in_env

NODES = ["a", "b", "c"]


SPEC = RunSpec(task="digits", algorithm="netmax", topology="ring", world=3, iterations=100, seed=0,
               non_iid=False, slowdown=1.0, options={}, script=[], eval_every=0, join_timeout=1.0)


def _run(tmp_path, cfg: Config | None = None, algorithm: str = "netmax", **env) -> TrainingRun:
    run = TrainingRun(stand_in_env(tmp_path, cfg, **env), dataclasses.replace(SPEC, algorithm=algorithm), NODES)
    run.mixer.layout = Layout.build([("w", "float32", (1024,))])
    run.mixer.wire = wire_layout(run.mixer.layout)
    return run


async def _publish(run: TrainingRun, k: int) -> None:
    """What a publish does to the own snapshots, without the policy's sends and pulls."""
    slot = torch.full((run.mixer.layout.total_bytes,), k % 256, dtype=torch.uint8)
    await run.snapshots.take(k, slot, run.mixer.wire)
    run.policy.k = k


def test_a_snapshot_being_served_is_not_reused_until_its_stream_is_done(tmp_path):
    async def go():
        run = _run(tmp_path)
        await _publish(run, 0)
        served = run.serve_pull("b")
        assert served is not None and served.iteration == 0
        before = bytes(served.data.pieces[0])
        for k in range(1, 40):                  # the puller is slow: 39 iterations go by
            await _publish(run, k)
        assert bytes(served.data.pieces[0]) == before, "the snapshot changed while it was served"
        served.done()                           # the stream ended: nothing is held for it any more
        snaps = run.snapshots
        assert not snaps.serving
        ptr = snaps.own[39].data_ptr()
        for k in range(40, 60):                 # a snapshot nobody pulls is recycled as before
            await _publish(run, k)
        assert any(b.data_ptr() == ptr for b in [*snaps.pool, *snaps.own.values()])

    asyncio.run(go())


def test_a_pull_answered_from_the_trainers_slot_moves_to_a_copy_before_the_trainer_writes_it(tmp_path):
    """D-PSGD keeps its snapshot in the trainer's slot. A pull of it (a host joining the swarm)
    over a slow link outlasts the iteration: when the Mix is answered the stream must go on from a
    copy, as a push does, or the trainer's next step changes the bytes under it and the puller
    refuses them (checksum; seen in the lab: a 20 MB join pull over 10 Mbit)."""
    async def go():
        run = _run(tmp_path, algorithm="d-psgd")
        assert run.snapshots.in_slot
        slot = torch.full((run.mixer.layout.total_bytes,), 7, dtype=torch.uint8)
        await run.snapshots.take(3, slot, run.mixer.wire)
        run.policy.k = 3
        served = run.serve_pull("b")
        assert served is not None and served.iteration == 3
        await run.snapshots.release_slot(3, wait=0.0)   # Mix(3) answered: the trainer may write
        slot.fill_(9)                                   # ... and does
        assert all(bytes(p) == bytes([7]) * len(p) for p in served.data.pieces), "the pull's bytes changed"
        served.done()

    asyncio.run(go())


def test_a_neighbour_back_gets_our_newest_at_once_unless_it_restarted(tmp_path):
    """Back after a partition (same incarnation) it holds us dead and would send us nothing: our
    newest goes to it at once. Restarted, its run reaches us with its join pull or first update,
    and a push now would share its link with that pull."""
    import types as _types

    from peerd.net.membership import State, Transition
    from peerd.node.run_host import RunHost

    async def go():
        members = {"b": _types.SimpleNamespace(incarnation=1)}
        run = _run(tmp_path, algorithm="d-psgd",
                   membership=_types.SimpleNamespace(get=members.get, alive=lambda: list(members)))
        slot = torch.zeros(run.mixer.layout.total_bytes, dtype=torch.uint8)
        await run.snapshots.take(0, slot, run.mixer.wire)
        sent = []
        run.liveness.outbound = _types.SimpleNamespace(send=lambda a, once=False: sent.append(a), reset=lambda src: None,
                                                 tell_finished=lambda dst: None)
        host = RunHost(run.ctx.env, offences=None, event=lambda *a, **k: None)
        host.training = run
        host.on_transition(Transition("b", State.ALIVE, State.DEAD))
        host.on_transition(Transition("b", State.DEAD, State.ALIVE))        # a healed partition
        assert [a.dst for a in sent] == [1] and "b" in run.liveness.returning
        host.on_transition(Transition("b", State.ALIVE, State.DEAD))
        members["b"].incarnation = 2                                        # it restarted
        host.on_transition(Transition("b", State.DEAD, State.ALIVE))
        assert len(sent) == 1 and "b" in run.liveness.returning
        host.on_restart("b", 2, 3)                                          # restarted, never seen dead
        assert len(sent) == 1 and "b" in run.liveness.returning

    asyncio.run(go())


def test_a_joiners_pull_readmits_it_only_under_a_pull_policy(tmp_path):
    """Under a push policy the only pull is a joiner's, before its trainer starts: re-admitted
    then, we would wait on it for the whole pull (the silent bound: the swarm held behind us) and
    push it our update over the link the pull needs. Its first update re-admits it. Under a pull
    policy a pull is its run back (a passive worker sends nothing else)."""
    async def go(algorithm: str) -> tuple[bool, set[int], list]:
        run = _run(tmp_path / algorithm, algorithm=algorithm)
        await _publish(run, 5)
        sent = []
        run.liveness.outbound = types.SimpleNamespace(send=lambda a, once=False: sent.append(a), reset=lambda src: None,
                                                 tell_finished=lambda dst: None)
        run.driver.apply_all = lambda actions: sent.extend(a for a in actions if type(a).__name__ == "Send")
        run.liveness.peer_down("b")
        run.liveness.peer_up("b", restarted=True)
        served = run.serve_pull("b", min_iteration=2)
        assert served is not None and served.iteration == 5
        served.done()
        return "b" in run.liveness.returning, set(run.policy.dead), sent

    returning, dead, sent = asyncio.run(go("d-psgd"))
    assert returning and dead == {1} and not sent, "a push policy re-admitted the joiner at its pull"
    returning, dead, sent = asyncio.run(go("ad-psgd"))
    assert not returning and dead == set()


def test_a_joiners_resuming_notice_readmits_it_and_sends_it_our_newest(tmp_path):
    """Its join pull done, the joiner's RESUMING notice says its run is back: re-admitted at our
    iteration, it gets our newest update now (over a link its pull no longer needs). A peer not
    returning (a restarted trainer behind a live daemon) is re-admitted by its next update."""
    from peerd.v1 import peer_pb2 as pb

    async def go():
        run = _run(tmp_path, algorithm="d-psgd")
        await _publish(run, 7)
        sent = []
        run.driver.apply_all = lambda actions: sent.extend(a for a in actions if type(a).__name__ == "Send")
        run.liveness.outbound = types.SimpleNamespace(send=lambda a, once=False: sent.append(a), reset=lambda src: None,
                                                 tell_finished=lambda dst: None)
        run.liveness.peer_down("b")
        run.liveness.peer_up("b", restarted=True)
        run.on_notice("c", pb.TrainerNotice.STATE_RESUMING, 3)
        assert 1 in run.policy.dead and not sent
        run.on_notice("b", pb.TrainerNotice.STATE_RESUMING, -1)
        return run, sent

    run, sent = asyncio.run(go())
    assert "b" not in run.liveness.returning and 1 not in run.policy.dead
    assert [(a.dst, a.k) for a in sent] == [(1, 7)], sent


@pytest.mark.parametrize("algorithm", ["d-psgd", "hop"])
def test_a_peer_back_from_a_partition_gets_our_newest_update_once(tmp_path, algorithm):
    """After a healed partition our newest goes to the returning peer at once (it holds us dead
    too and sends us nothing); when its first update re-admits it, the policy's own Send of that
    same iteration is not pushed again: a whole model, twice, over the link that just healed."""
    async def go():
        run = _run(tmp_path, algorithm=algorithm)
        await _publish(run, 7)
        queued = []
        run.outbound._queue = lambda dst: types.SimpleNamespace(put_nowait=lambda u: queued.append((dst, u.k)))
        run.liveness.peer_down("b")
        run.liveness.peer_up("b")
        assert queued == [(1, 7)]
        run.liveness.back_in_run("b", 7)          # its first update since the heal reached us
        assert 1 not in run.policy.dead
        await _publish(run, 8)
        run.outbound.send(ev.Send(1, 8))          # the next publish goes as usual
        return queued

    assert asyncio.run(go()) == [(1, 7), (1, 8)]


def test_a_pull_for_a_later_iteration_than_ours_is_answered_with_nothing(tmp_path):
    """A joiner asks only for parameters ahead of its own checkpoint (PullRequest.min_iteration):
    a host not that far along answers NOT_FOUND (None here) and holds no snapshot for it."""
    async def go():
        run = _run(tmp_path)
        await _publish(run, 3)
        assert run.serve_pull("b", min_iteration=4) is None and not run.snapshots.serving
        served = run.serve_pull("b", min_iteration=3)
        assert served is not None and served.iteration == 3
        served.done()

    asyncio.run(go())


def test_stop_answers_the_mix_a_trainer_waits_for_so_it_reaches_its_boundary(tmp_path):
    """A trainer told to stop while its mix waits on neighbours (that are stopping too) gets that
    mix at once, with nothing mixed (it keeps its own parameters), and so does any later one: it
    stops within one local step, not after the silent-peer or mix timeouts (a stop of a 5-host run
    once outlasted 120 s). A trainer that subscribes after the stop was sent gets the stop too."""
    from peerd.v1 import control_pb2 as cpb

    async def go():
        run = _run(tmp_path, Config().replace(run_id="t", train_silent_peer_timeout=30.0, train_mix_timeout=30.0))
        run.mixer.slots = [torch.zeros(run.mixer.layout.total_bytes, dtype=torch.uint8)] * 2
        api = run.api
        waiting = asyncio.get_running_loop().create_future()
        api.waiters[7] = waiting                           # what mix(7) holds while the policy waits
        delivered = await api.direct(cpb.Directive(kind=cpb.Directive.KIND_STOP, reason="test"))
        assert delivered == 0 and api.stop_requested
        assert waiting.done() and list(waiting.result().entries) == [] and waiting.result().iteration == 7
        api.waiters.clear()
        reply = await asyncio.wait_for(api.mix(cpb.MixRequest(iteration=8, slot=0)), 2.0)
        assert reply.iteration == 8 and list(reply.entries) == []
        stream = api.directives(None)
        first = await asyncio.wait_for(stream.__anext__(), 2.0)
        assert first.kind == cpb.Directive.KIND_STOP
        await stream.aclose()

    asyncio.run(go())


def test_a_carried_pull_keeps_its_snapshot_until_its_push_is_done(tmp_path):
    """AD-PSGD's active pull pushes its own x_k to the passive (a carry). On a 10 Mbit link that
    push outlasted the snapshot's retirement once the active moved on (its pull timed out or the
    passive finished), the buffer was reused for a later publish, and the passive refused the
    stream: "checksum: crc32 ... does not match" (seen in the star-6 lab)."""
    async def go():
        release, started, streamed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        seen = {}

        async def push_tensor(address, node, out, iteration, kind, compression=None, allowance=0.0):
            seen["buf"] = run.snapshots.own[iteration]
            seen["before"] = bytes(run.snapshots.own[iteration])
            started.set()
            await release.wait()                # the slow link: still streaming
            seen["after"] = bytes(seen["buf"])
            streamed.set()

        run = _run(tmp_path, membership={"b": types.SimpleNamespace(address="b:1")},
                   peers=types.SimpleNamespace(push_tensor=push_tensor))
        await _publish(run, 0)
        run.pulls.feed = lambda event: None     # the policy's answer to PullFailed is not under test
        pull = asyncio.create_task(run.pulls._pull(1, 0, 0))
        await started.wait()
        assert run.snapshots.sending[0] == 1, "a carry in flight counts as a push of its iteration"
        for k in range(1, 40):                  # the active moves on while the carry streams
            await _publish(run, k)
        release.set()
        await streamed.wait()
        pull.cancel()                           # the passive's answer never comes: not under test
        await asyncio.gather(pull, return_exceptions=True)
        assert seen["after"] == seen["before"], "the carried snapshot changed while it streamed"
        assert not run.snapshots.sending, "the push is settled once its stream ended"

    asyncio.run(go())


def test_coalescing_replaces_an_unsent_update_with_the_newest_and_loses_no_count(tmp_path):
    """Hop backup+skip with train_coalesce_updates: while update 0 streams to b over a slow link,
    updates 1-3 for b wait in its queue as one entry that always holds the newest, so 3 follows 0
    and 1-2 are never sent; nothing stays counted as sending. Off, all four go in order."""
    from peerd.sync import events as ev

    async def go(coalesce: bool) -> list[int]:
        gate, pushed = asyncio.Event(), []

        async def push_tensor(address, node, outgoing, iteration, kind, compression=None, allowance=0.0):
            # nobody measured the link to b: the allowance of its update at the floor rate
            assert allowance == pytest.approx(2.0 * outgoing.layout.nbytes / 1e6)
            pushed.append((node, iteration))
            await gate.wait()                   # a slow link: the push lasts until the gate opens
        run = _run(tmp_path, Config().replace(run_id="t", train_coalesce_updates=coalesce), "hop-backup-skip",
                   membership=types.SimpleNamespace(get=lambda node: types.SimpleNamespace(address=node)),
                   peers=types.SimpleNamespace(push_tensor=push_tensor))
        out = run.outbound
        for k in range(4):
            await _publish(run, k)
            out.send(ev.Send(1, k))
            await asyncio.sleep(0.01)           # the sender takes update 0 and streams it
        gate.set()
        for _ in range(100):
            if not run.snapshots.sending:
                break
            await asyncio.sleep(0.01)
        assert not run.snapshots.sending and not out.newest
        for task in out.senders.values():
            task.cancel()
        assert {node for node, _ in pushed} == {"b"}
        return [k for _, k in pushed]

    assert asyncio.run(go(True)) == [0, 3]
    assert asyncio.run(go(False)) == [0, 1, 2, 3]


def _deciding_run(tmp_path, algorithm: str) -> tuple[TrainingRun, list]:
    """A stand-in run whose policy decides as usual: its Mix actions collected, not computed, and
    nothing sent."""
    alive = types.SimpleNamespace(incarnation=1, state=types.SimpleNamespace(value="alive"))
    membership = types.SimpleNamespace(get=lambda node: alive, alive=lambda: list(NODES))
    run = _run(tmp_path, algorithm=algorithm, membership=membership)
    mixes = []
    run.mix = mixes.append
    run.outbound.send = lambda a, once=False: None
    run.outbound.grant = lambda dst, n: None          # Hop's tokens
    return run, mixes


@pytest.mark.parametrize("algorithm", ["d-psgd", "hop"])
def test_a_finished_neighbours_last_update_is_still_mixed(tmp_path, algorithm):
    """A neighbour's FINISHED notice comes after its last update (one ordered queue per receiver),
    but the mix of that iteration may still wait on a slower neighbour. Dropped at the notice, the
    update was left out of the mix (a lab run: every host's last mix lacked one neighbour); it is
    mixed, and the neighbour counts as finished once it has been. A neighbour waited on when its
    notice comes will not send what is waited for: finished at once."""
    from peerd.v1 import peer_pb2 as pb

    async def go():
        run, mixes = _deciding_run(tmp_path, algorithm)
        run.driver.feed(ev.Published(4))
        run.driver.feed(ev.MixRequested(4))
        run.driver.feed(ev.UpdateArrived(1, 4))           # b's last update ...
        run.on_notice("b", pb.TrainerNotice.STATE_FINISHED, 4)   # ... then its notice; c is slow
        assert 1 not in run.policy.dead and not mixes
        run.driver.feed(ev.UpdateArrived(2, 4))
        assert [sorted(j for j, _, _ in m.entries) for m in mixes] == [[0, 1, 2]]
        assert 1 in run.policy.dead and run.liveness.absent[1] == "finished"
        run.driver.feed(ev.Published(5))
        run.driver.feed(ev.MixRequested(5))
        assert run.policy.waiting.on == [2]
        run.on_notice("c", pb.TrainerNotice.STATE_FINISHED, 4)   # waited on: its 5 will not come
        assert 2 in run.policy.dead and run.liveness.all_gone()
        assert [sorted(j for j, _, _ in m.entries) for m in mixes][1:] == [[0]]

    asyncio.run(go())


def test_two_neighbours_that_finished_together_are_settled_after_the_mix(tmp_path):
    """Both neighbours finished, their last updates in hand before our trainer asks for the mix:
    the mix has them both, and settling the first (a PeerDown, whose own batch settles the other)
    does not trip over the second (a KeyError failed the trainer's Mix call)."""
    from peerd.v1 import peer_pb2 as pb

    async def go():
        run, mixes = _deciding_run(tmp_path, "d-psgd")
        run.driver.feed(ev.Published(4))
        run.driver.feed(ev.UpdateArrived(1, 4))
        run.driver.feed(ev.UpdateArrived(2, 4))
        run.on_notice("b", pb.TrainerNotice.STATE_FINISHED, 4)
        run.on_notice("c", pb.TrainerNotice.STATE_FINISHED, 4)
        run.driver.feed(ev.MixRequested(4))
        assert [sorted(j for j, _, _ in m.entries) for m in mixes] == [[0, 1, 2]]
        assert run.liveness.absent == {1: "finished", 2: "finished"} and not run.liveness.leaving

    asyncio.run(go())


def test_a_crashed_trainers_last_update_is_still_mixed_and_its_next_readmits_it(tmp_path):
    """The same for a trainer that crashed (its daemon's ABSENT notice): the update it sent just
    before is mixed, then it is absent ("restarting"), and its first update after the notice
    brings it back."""
    from peerd.v1 import peer_pb2 as pb

    async def go():
        run, mixes = _deciding_run(tmp_path, "d-psgd")
        run.driver.feed(ev.Published(4))
        run.driver.feed(ev.MixRequested(4))
        run.driver.feed(ev.UpdateArrived(1, 4))
        run.on_notice("b", pb.TrainerNotice.STATE_ABSENT, 4)
        assert 1 not in run.policy.dead and not mixes
        run.driver.feed(ev.UpdateArrived(2, 4))
        assert [sorted(j for j, _, _ in m.entries) for m in mixes] == [[0, 1, 2]]
        assert 1 in run.policy.dead and run.liveness.absent[1] == "restarting"
        run.driver.feed(ev.Published(5))
        run.liveness.heard_from(1, 5)                 # its restarted trainer's first update
        run.driver.feed(ev.UpdateArrived(1, 5))
        assert 1 not in run.policy.dead and 1 not in run.liveness.absent

    asyncio.run(go())


def test_a_bug_in_the_run_layer_fails_the_run_loudly_and_the_daemon_serves_on(tmp_path):
    """An exception while the run applies its policy's actions (a KeyError of this kind once
    failed a trainer's Mix call: the trainer was restarted and the run ended "done") is a bug: the
    run fails at once with a message that says so, the trainer's pending Mix gets an error instead
    of a wait, and the run takes no more events. Nothing escapes to the caller (a peer's push, a
    timer, the trainer's call)."""
    from peerd.node.run.spec import RunError

    async def go():
        run, mixes = _deciding_run(tmp_path, "d-psgd")
        stopped = []
        run.supervisor.stop = lambda grace: asyncio.sleep(0, stopped.append(grace))

        def broken() -> None:
            raise KeyError(1)

        run.liveness.leaving[1] = "finished"     # applied() settles leaving neighbours: it raises
        run.liveness.settle_leaving = broken
        waiting = asyncio.get_running_loop().create_future()
        run.api.waiters[4] = waiting
        run.driver.feed(ev.Published(4))          # raises inside applied(), caught by the driver
        assert run.progress.state == "failed"
        assert "INTERNAL ERROR" in run.progress.message and "KeyError" in run.progress.message
        assert isinstance(waiting.exception(), RunError)
        run.driver.feed(ev.UpdateArrived(1, 4))   # no more events in
        run.driver.feed(ev.UpdateArrived(2, 4))
        assert not mixes and run.policy.k == 4
        assert run.driver.decide(ev.PullRequested(1)) == []
        await asyncio.sleep(0.01)
        assert stopped, "the trainer was not stopped"
        await asyncio.wait_for(run.supervisor.supervise(), 2)   # failed before it started: no trainer
        assert run.done.is_set() and run.progress.state == "failed"

    asyncio.run(go())


def test_mixes_alone_after_every_neighbour_finished_are_counted_and_said_at_the_end(tmp_path):
    """With a per-host budget the slow host of an asynchronous algorithm trains on alone once the
    others are done: not a partial mix (they finished), but the end of its run says how many, and
    for NetMax and AD-PSGD how to keep the swarm together."""
    from peerd.v1 import peer_pb2 as pb

    async def go(algorithm: str) -> str:
        run, _ = _deciding_run(tmp_path / algorithm, algorithm)
        run.outbound.announce = lambda state, k=None: None   # our FINISHED, at the end
        for node in ("b", "c"):
            run.on_notice(node, pb.TrainerNotice.STATE_FINISHED, 3)
        run._account_mix(4, {run.rank})                  # alone: both neighbours finished
        run._account_mix(5, {run.rank})
        run.liveness.absent.pop(2)                       # c is back: an alone mix is not "after all"
        run._account_mix(6, {run.rank, 1})
        assert run.ledger.after_all_finished == 2 and run.ledger.partial == 0, run.ledger.state()
        run.supervisor._finished()
        return run.progress.message

    message = asyncio.run(go("ad-psgd"))
    assert message.startswith("trainer finished; 2 of 3 mixes had no neighbour: they had all finished"), message
    assert "--budget swarm" in message
    message = asyncio.run(go("d-psgd"))
    assert "2 of 3 mixes had no neighbour" in message and "--budget" not in message, message


def test_a_peer_back_after_it_was_down_gets_our_finished_notice_again(tmp_path):
    """Our trainer finished; a neighbour found down meanwhile had its queue abandoned, our
    FINISHED in it. Back, it gets the notice again (behind our newest update), or it would wait
    on us until its silent bound. A finished run stopped while it drains (a new `peerd train`)
    sends what it has queued before its senders go."""
    from peerd.v1 import peer_pb2 as pb

    async def go():
        told, hold = [], asyncio.Event()

        async def notice_trainer(address, tag, state, k):
            await hold.wait()                         # c's link is cut: nothing gets through
            told.append((address, state, k))
            return 0
        alive = types.SimpleNamespace(address="c:1", incarnation=1, state=types.SimpleNamespace(value="alive"))
        peers = types.SimpleNamespace(notice_trainer=notice_trainer)
        run = _run(tmp_path, algorithm="d-psgd", peers=peers,
                   membership=types.SimpleNamespace(get=lambda node: alive, alive=lambda: list(NODES)))
        run.policy.k = 9
        run.outbound.announce(pb.TrainerNotice.STATE_FINISHED)
        assert run.outbound.notices_pending == 2
        run.peer_down("c")                           # abandoned: c's queue and the notice in it
        assert run.outbound.notices_pending == 1
        run.peer_up("c")
        assert run.outbound.notices_pending == 2
        run.on_notice("c", pb.TrainerNotice.STATE_RESUMING, 9)   # its run asks: our FINISHED again
        assert run.outbound.notices_pending == 3
        run.progress.state = "done"
        hold.set()
        await asyncio.wait_for(run.stop(), 10)        # stopped while draining: the notices go first
        assert sorted(told) == [("c:1", pb.TrainerNotice.STATE_FINISHED, 9)] * 3, told

    asyncio.run(go())
