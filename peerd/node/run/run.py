"""A training run inside the daemon: the coordinator of its pieces.

One `TrainingRun` per `peerd train` on this host. It builds the run's policy and wires the pieces,
each with one job (the module docstrings say how each one behaves):

    driver.PolicyDriver       events into the sans-I/O policy, its actions out (to this coordinator)
    snapshots.Snapshots       this host's published parameters, kept while someone reads them
    inbound                   peers' updates held for the mix, and the checks they must pass
    mixer.Mixer               the shared-memory slots and the weighted sums (eager, incremental)
    outbound.Outbound         updates, grants and notices to each neighbour, one ordered queue each
    pulls.Pulls               pulls of and by peers (NetMax, AD-PSGD), and the link estimates fed
    liveness.PeerLiveness     which neighbours are waited for: dead, returning, absent, silent
    resume.Resume             where a (re)started trainer begins: checkpoint, a neighbour, the run
    trainer_api.TrainerApi    the trainer's Attach/Publish/Mix/Directives
    supervisor                the trainer process, restarted when it crashes
    budget                    --budget swarm

Data arriving from the daemon (a peer's update, a pull, tokens, notices, membership changes) comes
in here, and this module decides the order of the steps; the pieces do them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from peerd.net.dataplane import Received, Sink, Snapshot
from peerd.node.run.budget import watch_swarm_budget
from peerd.node.run.context import RunContext
from peerd.node.run.driver import PolicyDriver
from peerd.node.run.env import RunEnv
from peerd.node.run.inbound import HeldUpdates, UpdateCheck
from peerd.node.run.liveness import PeerLiveness
from peerd.node.run.mixer import Mixer
from peerd.node.run.outbound import Outbound
from peerd.node.run.passes import Passes
from peerd.node.run.progress import MixLedger, Progress, Timings
from peerd.node.run.pulls import Pulls
from peerd.node.run.resume import Resume
from peerd.node.run.snapshots import Snapshots
from peerd.node.run.spec import RunError, RunSpec, run_tag
from peerd.node.run.supervisor import TrainerSupervisor
from peerd.node.run.trainer_api import TrainerApi
from peerd.sync import events as ev
from peerd.sync import registry, topology
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")


def build_policy(env: RunEnv, spec: RunSpec, n: int, rank: int):
    """This worker's policy (the algorithm's Config defaults, then the run's own options) and the
    graph it runs on."""
    opts = registry.options(env.cfg, spec.algorithm)
    for key in ("backup", "staleness", "max_ig", "max_skip"):
        if key in spec.options:
            opts[key] = int(spec.options[key])
    if "skip" in spec.options:
        opts["skip"] = spec.options["skip"].lower() in ("1", "true", "yes")
    topo = topology.make(registry.get(spec.algorithm).topology or spec.topology, n)
    return registry.build_one(spec.algorithm, n, topo, rank, seed=spec.seed, **opts), topo


def vacate(policy, nodes: list[str], feed) -> int:
    """Tell a new run's policy that its vacant ranks ("" in `nodes`) are down, as one event: the
    policy's dead set takes them all, then one PeerDown repairs the graph (and re-solves NetMax)
    once for the whole set. A PeerDown per rank repaired it once per rank: O(n) repairs of O(n)
    or more each on the event loop (3,000 ranks wedged a daemon for minutes). For a new policy,
    nothing held, nothing sent, the result is the same (tests/test_security_control.py checks
    it for every algorithm). Returns how many ranks were vacant."""
    vacant = [r for r, node in enumerate(nodes) if not node]
    if vacant:
        policy.dead.update(vacant[:-1])
        feed(ev.PeerDown(vacant[-1]))
    return len(vacant)


class TrainingRun:
    def __init__(self, env: RunEnv, spec: RunSpec, nodes: list[str]) -> None:
        nodes = list(nodes)
        policy, self.topology = build_policy(env, spec, len(nodes), nodes.index(env.node_id))
        # Every host of this run derives the same tag; transfers carry it, so a late update of one
        # run never reaches the next. Founders only: a joiner does not change it.
        self.ctx = ctx = RunContext(env, spec, nodes, run_tag(spec, nodes[:spec.world]), policy)
        self.progress = Progress()
        self.ledger = MixLedger()
        self.timings = Timings()
        self.changed = asyncio.Event()
        self.done = asyncio.Event()
        self.draining = False                  # trainer finished; still serving the peers' last pulls
        self.admitting = asyncio.Lock()        # one admission at a time when this host admits joiners
        self.replanner = None                  # peerd.node.run.autoplan.Replanner, for `--algo auto`
        self._tasks: set[asyncio.Task] = set()
        cfg = env.cfg
        self.driver = PolicyDriver(policy, self, self.internal_error)
        self.passes = Passes()
        # Snapshots stay in the trainer's slot where nobody pulls them at any moment (pull policies
        # answer pulls with our newest parameters whenever they come).
        self.snapshots = Snapshots(policy.own_snapshots, self.passes, in_slot=not policy.pulls)
        self.updates = HeldUpdates(cfg.train.early_updates, on_discard=lambda key, buf: self.mixer.withdraw(key, buf),
                                   release=lambda rec: self.passes.after(rec.release))
        self.check = UpdateCheck(cfg)
        self.mixer = Mixer(ctx, self.snapshots, self.updates, self.passes)
        self.outbound = Outbound(ctx, self.snapshots, cfg.train.coalesce_updates and policy.coalesces, self._spawn)
        self.liveness = PeerLiveness(ctx, self.driver.feed, self.outbound, self.snapshots,
                                     is_waiting=lambda k: self.api.waiting(k), model_bytes=self.model_bytes)
        self.pulls = Pulls(ctx, self.snapshots, self.driver.feed, self.on_received, self.model_bytes, self._spawn)
        self.resume = Resume(ctx, self.mixer, self.liveness)
        self.api = TrainerApi(ctx, mixer=self.mixer, snapshots=self.snapshots, outbound=self.outbound,
                              liveness=self.liveness, resume=self.resume, progress=self.progress,
                              changed=self.changed, done=self.done, feed=self.driver.feed,
                              replay_early=self._replay_early, mixed=self._account_mix, timings=self.timings)
        self.supervisor = TrainerSupervisor(ctx, self.api, self.outbound, self.progress, self.changed, self.done,
                                            self.resume.checkpoint_dir, self.fail, self.ledger)
        vacate(policy, nodes, self.driver.feed)   # a vacant rank: a dead worker to the policy
        if policy.estimates == "pull":
            self._spawn(self.pulls.feed_estimates(self.progress.compute_s), "link estimates")
        if spec.swarm_budget:
            self._spawn(watch_swarm_budget(ctx, self.resume, self.api, self.done), "swarm budget")

    # --- identity ---------------------------------------------------------------------------------
    @property
    def spec(self) -> RunSpec:
        return self.ctx.spec

    @property
    def nodes(self) -> list[str]:
        return self.ctx.nodes

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def n(self) -> int:
        return self.ctx.n

    @property
    def tag(self) -> str:
        return self.ctx.tag

    @property
    def session(self) -> str:
        return self.ctx.session

    @property
    def policy(self):
        return self.ctx.policy

    def kind(self, base: str) -> str:
        return self.ctx.kind(base)

    def model_bytes(self) -> int:
        return self.mixer.layout.total_bytes if self.mixer.layout is not None else 0

    # --- the policy's actions (ActionSink) ----------------------------------------------------------
    def send(self, a: ev.Send) -> None:
        if a.dst not in self.liveness.leaving:    # its trainer stopped: nothing of ours is read there
            self.outbound.send(a)

    def pull(self, a: ev.Pull) -> None:
        self.pulls.start(a)

    def grant(self, a: ev.Grant) -> None:
        if a.dst not in self.liveness.leaving:
            self.outbound.grant(a.dst, a.n)

    def mix(self, a: ev.Mix) -> None:
        t0 = time.perf_counter()
        self.mixer.compute(a, waiting=self.api.waiting(a.k))
        self.timings.add("mix", time.perf_counter() - t0)

    def average(self, a: ev.Average) -> None:
        self.mixer.capture_average(a)

    def skip(self, a: ev.Skip) -> None:
        self.api.skip(a)

    def drop(self, a: ev.Drop) -> None:
        self.updates.drop(a.src, a.k)

    def applied(self) -> None:
        self.api.answer_ready()
        if self.liveness.leaving:
            self.liveness.settle_leaving()

    def fed(self) -> None:
        self.mixer.accumulate()

    # --- from the daemon ----------------------------------------------------------------------------
    def on_received(self, rec: Received) -> None:
        """A peer's update (pushed, pulled, or a carried pull)."""
        ctx = self.ctx
        src = ctx.rank_of(rec.sender)
        if src < 0:
            rec.release()
            return
        carried = rec.kind.startswith("carry")
        if not carried:
            self.pulls.answered_by(src)
        self.liveness.heard_from(src, rec.iteration)
        layout = self.mixer.layout
        if layout is None:
            self.updates.hold_early(rec)   # our trainer has not attached yet (a slow start)
            return
        bad = self.check(rec, self.mixer.wire, self.snapshots.live_stats())
        if bad:
            self._refuse(src, rec, bad, carried)
            return
        self.progress.newest_seen = max(self.progress.newest_seen, rec.iteration)
        self.liveness.check_readmission(src, rec)
        self.updates.put(src, rec)
        self.driver.feed(ev.PullRequested(src, rec.iteration, carried=True) if carried
                         else ev.UpdateArrived(src, rec.iteration))

    def _refuse(self, src: int, rec: Received, why: str, carried: bool) -> None:
        env = self.ctx.env
        self.check.dropped_bad[rec.sender] += 1
        log.warning("dropped update %d from %s: %s (%d from it so far)", rec.iteration, rec.sender, why,
                    self.check.dropped_bad[rec.sender])
        env.report_offence(rec.sender, why)
        rec.release()
        if not carried and not env.offences.flagged_for(rec.sender):
            # It came, it is just not mixed: the mix renormalises over the buffers present, so a
            # policy that waits for this update does not wait for one that never comes.
            self.driver.feed(ev.UpdateArrived(src, rec.iteration))

    def _account_mix(self, k: int, sources: set[int]) -> None:
        """The mix of k was answered with `sources`: which in-neighbours it left out, and why."""
        ctx = self.ctx
        lost = self.mixer.sums.lost_at.get(k, set()) if self.mixer.sums is not None else set()
        left_out = {ctx.nodes[j]: "lost" if j in lost else self.liveness.why_missing(j, k)
                    for j in self.topology.in_neighbors(ctx.rank, max(k, 0))
                    if j != ctx.rank and ctx.nodes[j] and j not in sources}
        self.ledger.record(left_out, alone=sources <= {ctx.rank})

    def _replay_early(self) -> None:
        for rec in self.updates.take_early():
            self.on_received(rec)

    async def sink_for(self, header, wait: float | None = None) -> Sink | None:
        """The data plane asks at a push's header: sum it as it arrives (peerd.node.run.eagersum)?
        Before our trainer attached the layout is unknown: the push waits for it (its stream held,
        up to `wait`, default train_attach_wait) rather than be held whole, one model per early
        neighbour."""
        mixer = self.mixer
        if mixer.layout is None and mixer.eager and self.ctx.cfg.train.sum_on_arrival:
            try:
                await asyncio.wait_for(mixer.attached.wait(),
                                       self.ctx.cfg.train.attach_wait if wait is None else wait)
            except TimeoutError:
                return None
        return mixer.sums.sink_for(header) if mixer.sums is not None else None

    def serve_pull(self, requester: str, min_iteration: int = 0) -> Snapshot | None:
        """A peer pulls: the policy says what to answer; a Send to the requester is the answer.
        Nothing (NOT_FOUND) when we are not yet at `min_iteration` (a joiner asks only for
        parameters ahead of its own).

        Under a pull policy a returning peer's pull is its run back (a passive worker sends
        nothing else). Under a push policy the only pull is a joiner's, made before its trainer
        starts: re-admitted then, we would wait on it for the whole pull (the silent bound, 30 s
        in the lab over 10 Mbit, with the swarm held behind us) and push it our update over the
        link the pull needs. Its RESUMING notice, once the pull is done, re-admits it (or its first
        update: PeerLiveness)."""
        src = self.ctx.rank_of(requester)
        if src < 0 or self.mixer.layout is None:
            return None
        if self.policy.pulls:
            self.liveness.back_in_run(requester, self.policy.k)
        if self.policy.k < min_iteration:
            return None
        actions = self.driver.decide(ev.PullRequested(src))
        answer = next((a for a in actions if isinstance(a, ev.Send) and a.dst == src), None)
        self.driver.apply_all([a for a in actions if a is not answer])
        if answer is None or self.driver.broken:
            log.debug("pull from %s: the policy answers nothing (%s)", requester, actions)
            return None
        return self.pulls.serve(answer)

    def on_tokens(self, node_id: str, n: int) -> None:
        src = self.ctx.rank_of(node_id)
        if src >= 0:
            self.driver.feed(ev.TokensArrived(src, n))

    def on_notice(self, sender: str, state: int, k: int) -> int:
        """A neighbour's trainer stopped (at its iteration k), resumes or finished; returns our iteration."""
        self.liveness.on_notice(sender, state, k)
        return self.policy.k

    def peer_down(self, node_id: str) -> None:
        self.liveness.peer_down(node_id)

    def peer_up(self, node_id: str, restarted: bool = False) -> None:
        self.liveness.peer_up(node_id, restarted)

    # --- the trainer ----------------------------------------------------------------------------------
    async def attach(self, req: cpb.AttachRequest, budget: float | None = None) -> cpb.AttachReply:
        """The trainer attaches; at the first attach a host joining a running swarm, and a
        restarted trainer whose checkpoint is old, may start from a neighbour's parameters
        (peerd.node.run.resume), within `budget` seconds (the Attach call's deadline; None:
        train_attach_timeout)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply = await self.api.attach(req)
        if budget is not None:
            budget -= loop.time() - t0       # a restart asked the neighbours' iterations meanwhile
        if self.progress.restarts and self.policy.k >= 0:
            reply, note = await self.resume.catch_up(reply, budget)
        else:
            reply, note = await self.resume.join_swarm(reply, budget)
        if note:
            self.progress.message = note
            self.changed.set()
        return reply

    async def supervise(self) -> None:
        await self.supervisor.supervise()

    # --- the end --------------------------------------------------------------------------------------
    def drained(self) -> bool:
        """Nothing left to serve: every other host finished or gone, no push or notice of ours
        queued (stopping the run cancels the senders: our own FINISHED must be out first)."""
        return self.outbound.idle() and self.liveness.all_gone()

    def fail(self, message: str) -> None:
        self.progress.state, self.progress.message = "failed", message
        log.error("run failed: %s", message)
        self.changed.set()

    def internal_error(self, what: str) -> None:
        """A bug in the daemon's run layer (the policy, or the code applying its actions): what it
        holds can no longer be trusted, so the run fails now, loudly, and its trainer is stopped.
        Left to propagate, the error failed the trainer's Mix call, the trainer was restarted and
        the run could end "done" with the bug in no line the user reads."""
        if self.progress.state == "failed":
            return
        self.fail(f"INTERNAL ERROR in this daemon, a peerd bug (not your trainer's): {what}. The run is "
                  f"stopped; the daemon log has the traceback: please report it")
        self.api.fail_waiters(RunError("the run failed: an internal error in the daemon (see its log)"))
        self._spawn(self.supervisor.stop(self.ctx.cfg.node.shutdown_grace + 2), "stop the trainer")

    async def stop(self) -> None:
        """Stop the trainer (SIGTERM, then SIGKILL after the bound) and free every buffer. A run
        stopped before it finished (Ctrl+C in `peerd train`, a failed trainer) tells the other
        hosts first, as a finished one does: they stop waiting for us now, not after the silent
        bound. The notice goes behind a push in flight: waited for up to half of rpc_timeout
        (a finished run's own notice too, when it is stopped while it drains)."""
        if self.progress.state not in ("done", "degraded"):
            if self.progress.state != "failed":
                self.progress.state = "stopping"
            self.outbound.announce(pb.TrainerNotice.STATE_FINISHED)
        # A finished run stopped while it drains (a new `peerd train` replaces it) may still
        # have its FINISHED queued: cancelled, a neighbour would wait out its silent bound.
        deadline = time.monotonic() + self.ctx.cfg.node.rpc_timeout / 2
        while self.outbound.notices_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.supervisor.stop(self.ctx.cfg.node.shutdown_grace + 2)
        for task in list(self._tasks):
            task.cancel()
        self.driver.stop()
        await self.passes.close()        # nothing may still read a buffer freed below
        self.updates.release_all()
        self.api.fail_waiters(RunError("run stopped"))
        if self.pulls.times:
            log.info("pulls answered (peer rank: count, median, p90 seconds): %s", self.pulls.summary())
        self.mixer.close()
        self.done.set()

    def force_stop(self) -> None:
        """What must not outlive a daemon whose orderly shutdown ran out of time."""
        self.supervisor.kill()
        for slot in self.mixer.slot_files:
            slot.close()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- observability --------------------------------------------------------------------------------
    def progress_message(self) -> cpb.TrainProgress:
        return self.progress.to_message(self.rank, sum(map(bool, self.nodes)), self.ledger)

    def state(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.n, "algorithm": self.spec.algorithm,
                "topology": self.spec.topology, "nodes": self.nodes, "model_bytes": self.model_bytes(),
                "step_time": self.progress.step_time(),
                "recommended": list(self.replanner.recommended) if self.replanner else None,
                "policy": self.policy.state(), "held_updates": len(self.updates.received),
                "absent": {self.nodes[i]: why for i, why in self.liveness.absent.items()},
                "dropped_nonfinite": self.check.dropped_nonfinite, "dropped_bad": dict(self.check.dropped_bad),
                "incremental_mix": self.mixer.state(), "tag": self.tag, "estimates_fed": self.pulls.estimates_fed,
                "mixes": self.ledger.state(), "timings": self.timings.state(),
                "sums": self.mixer.sums.state() if self.mixer.sums is not None else None,
                "snapshot_buffers": self.snapshots.allocated}
