"""A training run inside the daemon: the sans-I/O sync policy driven by real events.

One `TrainingRun` per `peerd train` on this host. It
- forms the run's world (this node and the first `world - 1` alive peers by node id, ranked by
  site label then node id, so every host that sees the same swarm ranks it the same way, and a
  ring keeps each site's hosts together);
- spawns the trainer (a built-in task or the user's script) with spawn/exec, never fork, and
  restarts it from its last checkpoint when it crashes, without leaving the swarm;
- serves the trainer's Attach/Publish/Mix over the control socket. Parameters never travel over
  protobuf here: the trainer and the daemon share two memory-mapped slot files. Publish(k, slot)
  copies the slot into a private snapshot (one memcpy) and lets the policy decide whom to send it;
  Mix(k, slot) waits as the policy says, then writes the weighted sum straight into the slot;
- carries out the policy's actions: Send -> a data-plane push (ordered per destination), Pull -> a
  data-plane pull, Grant -> GrantTokens, Mix -> flat-buffer arithmetic with no per-tensor loop,
  Skip -> the trainer's next iteration, Drop -> free a received buffer, Wait(until) -> a timer.

Readings chosen here (the policy docstrings cover the algorithms):
- A received buffer with NaN/Inf is never stored nor shown to the policy: it is dropped and counted.
- AD-PSGD's passive `Average` (replace my working parameters now) is applied at this worker's next
  Mix, on top of the mix result: the trainer owns its working parameters between Publish and Mix.
- Peers that the failure detector marks dead (or that leave) become PeerDown for the policy, so no
  policy waits on a dead peer. A peer that comes back is PeerUp only once its run is back too (its
  first update or pull for this run reaches us, tagged with its iteration): a host whose daemon is
  up but whose trainer is still starting is not waited on.
  Our newest update is pushed to a returning peer (outside the policy), so that two sides of a
  healed partition, each holding the other dead, re-admit each other.
- A live daemon whose trainer does not contribute is "absent" to its neighbours, also PeerDown:
  its daemon announces a crashed trainer (ABSENT) and a finished one (FINISHED) at once, through
  the same ordered queue as its updates (so the notice never overtakes its last update). Without
  a notice (a hung trainer, a lost message) a neighbour waited on for `train_silent_peer_timeout`
  (plus its update's transfer allowance, below) is treated as absent until its next update. So no
  host waits on a silent neighbour longer than that bound.
- A pull (NetMax, AD-PSGD) is answered within `train_pull_timeout` (plus the allowance) or the
  policy hears PullFailed and pulls another peer (or steps locally): a pull a peer cannot answer
  (no parameters yet, not attached, run ended, a failed transfer, a lost reply) is never retried
  forever nor waited on until the trainer's `train_mix_timeout`.
- Transfer allowance: those two bounds are for failures, not for slow links. Each grows by
  `train_transfer_slack` times the model's expected transfer from that peer (bytes over the link
  matrix's bandwidth, or over `dataplane_min_rate` where nobody measured it), up to half of
  `train_mix_timeout`: a 100 MB model takes 8 s over 100 Mbit, and a fixed 5 s pull bound failed
  every pull.
- A restarted trainer resumes at the run's iteration, not its own: its daemon asks the live
  neighbours (RESUMING) for theirs and starts at the lowest of them (never behind itself), then
  resets its token edges as a PeerUp from each; a neighbour re-admits it at its first update.
  Resuming where it crashed would hold the neighbours that ran on at Hop's gap bound.
- Eager mix: where the policy's mix of k is fully determined by the iteration-k updates (D-PSGD,
  Hop's standard mode: every live in-neighbour, exact k), the daemon requests the mix as soon as k
  is published, so it is computed while the trainer runs its forward/backward, straight into the
  slot the trainer's Mix(k) will name (the one it did not publish into; the published one is
  already snapshotted). Mix(k) then only answers. Modes that mix "whatever is in hand" when the
  gradient is ready (backup, staleness, asynchronous) keep requesting at Mix(k).
- Incremental mix: for a policy with a preview (Hop's backup and staleness modes), the daemon sums
  the mix while updates arrive, from Publish(k) on, into that same free slot (peerd.node.mixacc):
  each update is added as it lands (during the trainer's forward/backward), one the policy drops
  is subtracted before it is freed, and Mix(k) then costs nothing when every in-neighbour's update
  was in (one scaling pass when some were not), or the full sum when the decided entries differ.
- Metrics ride on MixRequest (no RPC per iteration); ReportMetrics stays for the last ones.
- A finished run drains (serves pulls and queued pushes with its final parameters) only until
  every other host of the run has finished or is gone, at most `train_drain_timeout`.
- A run may admit new hosts up to `max_world` (peerd/node/joining.py: formation, the member table,
  admission; vacant ranks are dead workers to the policy). `peerd train` asks the live peers for
  their run first, so a restarted host or a late joiner takes its rank in the run under way.
- Joining a running swarm (a restarted daemon or a new host; the run's tag never changes): at attach,
  before the trainer's first publish, the daemon pulls a live neighbour's current parameters (the
  data plane: chunked, checksummed; answered from the neighbour's published snapshot, never behind
  its mixing). When they are more than `train_join_min_lead` iterations ahead of this host's own
  checkpoint (same run, kept in the data dir), the trainer starts from them at the neighbour's
  iteration; otherwise it resumes from its own checkpoint. Either way the reason is logged and
  shown in the progress message.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import torch

from peerd.net import tensorwire as tw
from peerd.net.dataplane import Outgoing, Received, Snapshot, TransferError
from peerd.net.links import Ewma
from peerd.node import joining
from peerd.node.autoplan import Replanner
from peerd.node.identity import slot_dir
from peerd.node.mixacc import MixAccumulator, summable
from peerd.sync import events as ev
from peerd.sync import registry, topology
from peerd.sync.policy import Policy
from peerd.train.flat import Layout, LayoutMismatch, all_finite
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb

if TYPE_CHECKING:
    from peerd.node.daemon import Daemon

log = logging.getLogger("peerd.train")

ALGORITHM_ALIASES = {"dpsgd": "d-psgd", "adpsgd": "ad-psgd"}
STEP_EWMA = 0.1   # weight of one step in the step-time averages
PULL_SAMPLES = 9       # a peer's pull time: the median of its last this many answered pulls
PULL_SAMPLES_MIN = 3   # answered pulls from a peer before they replace the link matrix's time


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why."""


def wire_layout(layout: Layout) -> tw.Layout:
    """The trainer's flat buffer (dtype runs, 64-byte aligned) as the data plane's back-to-back
    layout: one typed tensor per run and uint8 padding between, byte for byte the same buffer."""
    specs, pos = [], 0
    for i, run in enumerate(layout.runs()):
        if run.offset > pos:
            specs.append(tw.Spec(f"pad{i}", "uint8", (run.offset - pos,)))
        specs.append(tw.Spec(f"run{i}", run.dtype, (run.numel,)))
        pos = run.offset + run.numel * torch.empty((), dtype=getattr(torch, run.dtype)).element_size()
    if layout.total_bytes > pos:
        specs.append(tw.Spec("pad", "uint8", (layout.total_bytes - pos,)))
    return tw.Layout(tuple(specs))


def map_slot(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    if create:
        with open(path, "wb") as fh:
            fh.truncate(max(nbytes, 1))
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=max(nbytes, 1))
    return torch.tensor([], dtype=torch.uint8).set_(storage)[:nbytes]


@dataclass
class RunSpec:
    task: str
    algorithm: str
    topology: str
    world: int
    iterations: int
    seed: int
    non_iid: bool
    slowdown: float
    options: dict[str, str]
    script: list[str]
    eval_every: int
    join_timeout: float
    max_world: int = 0          # ranks a run may grow to by late joiners (>= world)

    @classmethod
    def from_request(cls, r: cpb.TrainRequest, default_join: float, default_max_world: int = 0) -> "RunSpec":
        algo = ALGORITHM_ALIASES.get(r.algorithm, r.algorithm or "hop")
        if algo != "auto" and algo not in registry.ALGORITHMS:
            raise RunError(f"algorithm: unknown {r.algorithm!r}; known: {', '.join(registry.ALGORITHMS)}")
        if not r.task and not r.script:
            raise RunError("task: name a built-in task (digits, svm, lm) or a script")
        if r.world < 1:
            raise RunError("world: must be at least 1")
        if r.options.get("budget", "host") not in ("host", "swarm"):
            raise RunError(f"budget: expected host or swarm, got {r.options['budget']!r}")
        max_world = r.max_world or default_max_world or r.world
        if max_world < r.world:
            raise RunError(f"max-world: {max_world} is below world {r.world}")
        return cls(r.task, algo, r.topology or "ring", r.world, r.iterations, r.seed, r.non_iid,
                   r.slowdown or 1.0, dict(r.options), list(r.script), r.eval_every,
                   r.join_timeout_s or default_join, max_world)


@dataclass
class Progress:
    state: str = "waiting"
    message: str = ""
    iteration: int = 0
    loss: float = 0.0
    rate: float = 0.0
    peers_in_last_mix: int = 0
    newest_seen: int = -1
    metric_name: str = ""
    metric: float = 0.0
    restarts: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.monotonic)
    compute_s: Ewma = field(default_factory=Ewma)   # the trainer's gradient time (`peerd plan` reads it)
    step_s: Ewma = field(default_factory=Ewma)      # a whole step, the wait for the mix included


class TrainingRun:
    def __init__(self, daemon: "Daemon", spec: RunSpec, nodes: list[str]) -> None:
        self.d = daemon
        self.spec = spec
        self.nodes = list(nodes)     # by rank; "" for a vacant rank (see peerd.node.joining)
        self.rank = nodes.index(daemon.node_id)
        self.n = len(nodes)
        self.session = uuid.uuid4().hex[:12]
        # Every host of this run derives the same tag; transfers carry it, so a late update of one
        # run never reaches the next. Founders only: a joiner does not change it.
        self.tag = joining.run_tag(spec, self.nodes[:spec.world])
        self.admitting = asyncio.Lock()   # one admission at a time when this host admits joiners
        topo = topology.make(spec.topology, self.n)
        opts = registry.options(daemon.cfg, spec.algorithm)
        for key in ("backup", "staleness", "max_ig", "max_skip"):
            if key in spec.options:
                opts[key] = int(spec.options[key])
        if "skip" in spec.options:
            opts["skip"] = spec.options["skip"].lower() in ("1", "true", "yes")
        self.policy = registry.build(spec.algorithm, self.n, topo, seed=spec.seed, **opts)[self.rank]
        self.coalesce = daemon.cfg.train_coalesce_updates and self.policy.coalesces
        self.layout: Layout | None = None
        self.wire: tw.Layout | None = None
        self.slots: list[torch.Tensor] = []
        self.slot_paths: list[Path] = []
        self.own: dict[int, torch.Tensor] = {}        # my published parameters, by iteration
        self.own_out: dict[int, Outgoing] = {}         # the same, ready to push (checksummed once)
        self.sending: collections.Counter[int] = collections.Counter()  # pushes queued or streaming (carries too)
        self.serving: collections.Counter[int] = collections.Counter()  # pulls being answered, per iteration
        self.live_k = -1
        self.received: dict[tuple[int, int], Received] = {}
        self.unattached: list[Received] = []   # updates that arrived before our trainer attached
        self.deferred_sends: list[ev.Send] = []  # sends asked for before we had parameters
        self.pull_answers: dict[tuple[int, int], asyncio.Event] = {}   # (dst, k): a carried pull's answer
        self.mix_waiters: dict[int, asyncio.Future] = {}
        self.ready_mixes: dict[int, tuple[ev.Mix, int, torch.Tensor | None]] = {}
        self.skip_after: dict[int, int] = {}
        self.pending_average: list[tuple[tuple[int, int, float], ...]] = []
        self.queues: dict[int, asyncio.Queue] = {}
        self.senders: dict[int, asyncio.Task] = {}   # the task draining each queue
        self.unsent: dict[int, list] = {}   # coalescing: dst -> [the newest update queued, not yet taken]
        self.timer: asyncio.TimerHandle | None = None
        self.progress = Progress()
        self.changed = asyncio.Event()
        self.dropped_nonfinite = 0
        self.dropped_bad: collections.Counter[str] = collections.Counter()   # per sender node id
        self.checkpoint_failures = 0            # as the trainer reports them
        self.trainer: subprocess.Popen | None = None
        self.done = asyncio.Event()
        self.draining = False                  # trainer finished; still serving the peers' last pulls
        self.pending_publish: tuple[int, int] | None = None
        self._pool: list[torch.Tensor] = []
        self._tasks: set[asyncio.Task] = set()
        self._last_iter_t: float | None = None
        self.absent: dict[int, str] = {}       # neighbours not contributing: "restarting", "finished", "silent"
        self.resync: dict[int, int] = {}       # after a restart: neighbours' iterations, applied at publish
        self._silent_timer: asyncio.TimerHandle | None = None
        self._silent_since = 0.0               # when the wait the silent timer bounds began (or its last check)
        self._waited_since: dict[int, float] = {}   # per neighbour waited on: since when
        self.eager = (self.policy.name in ("d-psgd", "hop") and getattr(self.policy, "backup", 1) == 0
                      and getattr(self.policy, "staleness", 0) is None and not getattr(self.policy, "skip", True))
        self.eager_k = -1                      # iteration whose mix was requested at publish
        self.eager_slot = 0
        self.acc: MixAccumulator | None = None  # the incremental mix (set at attach where it applies)
        self.subscribers: set[asyncio.Queue] = set()   # the trainer's Directives streams
        self.notices_pending = 0               # our notices queued or in flight (a drain waits for them)
        self.paused = False
        self.stop_requested = False
        self.stop_reason = ""
        self.checkpoint_dir = self._checkpoint_dir()
        self.returning: set[str] = set()   # peers back in membership, not yet back in this run
        self.readmitted: dict[int, int] = {}   # re-admitted at this iteration, until its next update
        self.join_note = ""
        self.replanner: Replanner | None = None     # set for `--algo auto`
        for r, node in enumerate(self.nodes):
            if not node:
                self.apply_all(self.policy.on_event(ev.PeerDown(r), time.monotonic()))   # vacant: as dead
        self.estimates_fed = 0
        self.pull_times: collections.defaultdict[int, list[float]] = collections.defaultdict(list)  # answered pulls
        if registry.ESTIMATES.get(self.policy.name) == "pull":
            self._spawn(self._feed_estimates(), "link estimates")
        self.swarm_budget = spec.options.get("budget", "host") == "swarm"
        if self.swarm_budget:
            self._spawn(self._watch_swarm_budget(), "swarm budget")

    def kind(self, base: str) -> str:
        return f"{base}:{self.tag}"

    # --- events into the policy -----------------------------------------------------------------
    def feed(self, event: ev.Event) -> None:
        try:
            actions = self.policy.on_event(event, time.monotonic())
        except Exception:  # noqa: BLE001 - a policy bug must not take the daemon down
            log.exception("policy %s failed on %r", self.policy.name, event)
            self.fail(f"policy error on {type(event).__name__}")
            return
        self.apply_all(actions)
        if self.acc is not None and self.acc.k >= 0:
            self._accumulate()

    def apply_all(self, actions: list[ev.Action]) -> None:
        for action in actions:
            self.apply(action)
        # A Skip follows its Mix in the same batch: answer the trainer once all are applied.
        for k in list(self.ready_mixes):
            self._answer_mix(k)

    def apply(self, a: ev.Action) -> None:
        match a:
            case ev.Send():
                self._send(a)
            case ev.Pull():
                self._spawn(self._pull(a.dst, a.carry_k, self.policy.k), f"pull {a.dst}")
            case ev.Grant():
                self._queue(a.dst).put_nowait(("grant", a.n))
            case ev.Mix():
                self._compute_mix(a)   # now: a Drop later in the batch may free its inputs
            case ev.Average():
                # Captured now: the policy drops the carried update in the same batch.
                self.pending_average.append(tuple(
                    (None if (src == self.rank and k == ev.CURRENT) else self._entry_buffer(src, k), w)
                    for src, k, w in a.entries))
            case ev.Skip():
                self.skip_after[self.policy.k] = a.to
                self.progress.skipped += max(0, a.to - self.policy.k - 1)
            case ev.Drop():
                rec = self.received.pop((a.src, a.k), None)
                if rec is not None:
                    if self.acc is not None:
                        self.acc.withdraw((a.src, a.k), rec.buffer)
                    rec.release()
            case ev.Wait():
                if a.until is not None:
                    self._arm_timer(a.until)

    def _arm_timer(self, until: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, until - time.monotonic())
        self.timer = loop.call_later(delay, lambda: self.feed(ev.Tick()))

    def peer_down(self, node_id: str) -> None:
        if node_id in self.nodes and node_id != self.d.node_id:
            src = self.nodes.index(node_id)
            if self.absent.get(src) != "finished":
                self.absent.pop(src, None)   # the failure detector's word supersedes a notice
            self._reset_sender(src)
            self.readmitted.pop(src, None)
            self.feed(ev.PeerDown(src))

    def peer_up(self, node_id: str) -> None:
        # Not yet: the peer's daemon is back, its run may not be (see the module docstring). Our
        # newest update goes to it at once: after a healed partition each side holds the other
        # dead and sends it nothing, so this greeting is what re-admits us there (and it there).
        if node_id in self.nodes and node_id != self.d.node_id:
            self.returning.add(node_id)
            if self.live_k >= 0:
                self._send(ev.Send(self.nodes.index(node_id), self.live_k))

    def _set_absent(self, src: int, why: str) -> None:
        if src == self.rank or self.absent.get(src) == why:
            return
        was = src in self.absent or src in self.policy.dead
        self.absent[src] = why
        log.info("neighbour %s is %s: not waited for", self.nodes[src], why)
        if not was:
            self.feed(ev.PeerDown(src))

    def _set_present(self, src: int, k: int) -> None:
        if self.absent.get(src) in ("restarting", "silent"):
            del self.absent[src]
            log.info("neighbour %s contributes again from iteration %d", self.nodes[src], k)
            member = self.d.membership.get(self.nodes[src])
            # A peer also back in membership is re-admitted once, by _back_in_run.
            if (member is not None and member.state.value in ("alive", "suspect")
                    and self.nodes[src] not in self.returning):
                self.feed(ev.PeerUp(src, k))

    def on_notice(self, sender: str, state: int, k: int) -> int:
        """A neighbour's trainer stopped, resumes or finished; returns our iteration."""
        if sender in self.nodes and sender != self.d.node_id:
            src = self.nodes.index(sender)
            if state == pb.TrainerNotice.STATE_ABSENT:
                self._set_absent(src, "restarting")
            elif state == pb.TrainerNotice.STATE_FINISHED:
                self._set_absent(src, "finished")
        return self.policy.k

    def _announce(self, state: int) -> None:
        """Tell every other host of the run, each behind the updates already queued for it."""
        for dst in range(self.n):
            if dst != self.rank and self.nodes[dst]:
                self.notices_pending += 1
                self._queue(dst).put_nowait(("notice", state, self.policy.k))

    def _silent_check(self, k: int) -> None:
        """Mix k has waited `train_silent_peer_timeout`: stop waiting for the peers it waits on whose
        transfer allowance is spent too; check the others again when theirs is."""
        self._silent_timer = None
        fut = self.mix_waiters.get(k)
        if fut is None or fut.done():
            return
        if self.policy.waiting.reason == "pull":
            # A pull's wait has its own, shorter bound (train_pull_timeout -> PullFailed), which
            # does not exclude the peer for good: pull policies get no unasked-for updates that
            # would ever mark a "silent" peer present again.
            self._arm_silent(k)
            return
        now = time.monotonic()
        base = self.d.cfg.train_silent_peer_timeout
        left = []
        for src in list(self.policy.waiting.on):
            # Waited on since this wait began, or since the last check for one the policy took up later.
            waited = now - self._waited_since.setdefault(src, self._silent_since)
            remaining = self.transfer_bound(base, self.nodes[src]) - waited
            if remaining > 1e-3:
                left.append(remaining)       # its update may still be on the way over a slow link
                continue
            log.warning("no update from %s for %.1fs at iteration %d: not waited for until it sends one",
                        self.nodes[src], waited, k)
            self._set_absent(src, "silent")
        self._silent_since = now
        if fut.done():
            return
        if left:
            self._arm_silent(k, after=min(left))
        else:   # still waiting (on someone else now): check again after the bound
            self._arm_silent(k)

    def _arm_silent(self, k: int, after: float | None = None) -> None:
        """Check mix k's waits after `after` seconds; None: a fresh wait, the base bound from now."""
        if self._silent_timer is not None:
            self._silent_timer.cancel()
        if after is None:
            self._silent_since = time.monotonic()
            self._waited_since = {}
            after = self.d.cfg.train_silent_peer_timeout
        self._silent_timer = asyncio.get_running_loop().call_later(after, self._silent_check, k)

    def transfer_allowance(self, node: str) -> float:
        """Extra seconds a wait on one model transfer from `node` gets on top of its fixed bound
        (train_pull_timeout, train_silent_peer_timeout): train_transfer_slack times the expected
        transfer (the model's bytes over the link's measured bandwidth towards us, or over
        dataplane_min_rate where nobody measured it), so a big model on a slow link is not taken
        for a failure. `transfer_bound` caps the sum."""
        cfg = self.d.cfg
        nbytes = self.layout.total_bytes if self.layout is not None else 0
        if not nbytes or not node:
            return 0.0
        matrix = self.d.link_matrix
        bw = matrix.bandwidth(node, self.d.node_id) if matrix is not None else None
        return cfg.train_transfer_slack * nbytes / (bw or cfg.dataplane_min_rate)

    def transfer_bound(self, base: float, node: str) -> float:
        """`base` plus the transfer allowance from `node`, at most half of train_mix_timeout (the
        trainer's Mix must be answered within it, a failed pull and the next one included), never
        below `base`."""
        return max(base, min(base + self.transfer_allowance(node), self.d.cfg.train_mix_timeout / 2))

    # --- directives to the trainer ---------------------------------------------------------------
    async def direct(self, d: cpb.Directive) -> int:
        """Deliver a directive to the subscribed trainer(s); returns how many got it.

        PAUSE announces this host ABSENT (its neighbours go on without it); RESUME asks the
        neighbours for their iteration and resumes there (the directive's iteration), as a restart
        does, so the neighbours that ran on are not held at the gap bound."""
        kind = cpb.Directive
        if d.kind == kind.KIND_PAUSE and not self.paused:
            self.paused = True
            self.progress.state = "paused"
            self._announce(pb.TrainerNotice.STATE_ABSENT)
        elif d.kind == kind.KIND_RESUME and self.paused:
            self.paused = False
            if self.progress.state == "paused":
                self.progress.state = "training"
            d = cpb.Directive(kind=d.kind, reason=d.reason,
                              iteration=max(d.iteration, await self._resume_point(), self.policy.k + 1))
        elif d.kind == kind.KIND_STOP:
            self.stop_requested = True
            self.stop_reason = d.reason
            # The trainer stops at its next iteration boundary; a mix it waits for (on neighbours
            # that are stopping too) must not hold it there: it keeps its own parameters.
            for k in list(self.mix_waiters):
                self._release_mix(k)
        for q in self.subscribers:
            q.put_nowait(d)
        self.progress.message = f"{kind.Kind.Name(d.kind).removeprefix('KIND_').lower()} sent to the trainer"
        self.changed.set()
        return len(self.subscribers)

    async def directives(self, context) -> Any:
        """The trainer's subscription: directives until the run ends or the trainer goes away."""
        q: asyncio.Queue = asyncio.Queue()
        if self.stop_requested:   # a trainer (re)started after the stop was sent gets it too
            q.put_nowait(cpb.Directive(kind=cpb.Directive.KIND_STOP, reason="the run was stopped"))
        self.subscribers.add(q)
        try:
            while not self.done.is_set():
                try:
                    yield await asyncio.wait_for(q.get(), self.d.cfg.train_progress_interval)
                except asyncio.TimeoutError:
                    continue
        finally:
            self.subscribers.discard(q)

    def drained(self) -> bool:
        """Nothing left to serve: every other host finished or gone, no push or notice of ours
        queued (stopping the run cancels the senders: our own FINISHED must be out first)."""
        others = [i for i in range(self.n) if i != self.rank and self.nodes[i]]
        return not self.sending and not self.notices_pending and all(
            self.absent.get(i) == "finished" or
            (m := self.d.membership.get(self.nodes[i])) is None or m.state.value not in ("alive", "suspect")
            for i in others)

    def _back_in_run(self, node_id: str, k: int) -> None:
        """A returning peer's run reached us (an update or a pull): re-admit it at iteration k."""
        if node_id in self.returning:
            self.returning.discard(node_id)
            log.info("peer %s is back in the run at iteration %d", node_id, k)
            self.feed(ev.PeerUp(self.nodes.index(node_id), max(k, 0)))

    def _check_readmission(self, src: int, rec: Received) -> None:
        """Re-admit a returning peer at its update's iteration, and check that iteration against
        the next update: a push cut off by a partition may reach us after the heal (TCP delivers
        what was in flight once the path is back, though its sender gave up on it), so the first
        update of a returning peer can be one from before the cut. Re-admitted at that old
        iteration, Hop's token edge would hold us until the peer "caught up" to where it already
        is; a jump past it in the next update re-admits the peer where it really is."""
        if rec.sender in self.returning:
            self._back_in_run(rec.sender, rec.iteration)
            self.readmitted[src] = rec.iteration
        elif (k0 := self.readmitted.pop(src, None)) is not None and rec.iteration > k0 + 1:
            log.info("peer %s re-admitted at iteration %d by a stale update; it is at %d", rec.sender, k0,
                     rec.iteration)
            self.feed(ev.PeerUp(src, rec.iteration))

    # --- data arriving from peers -------------------------------------------------------------
    def on_received(self, rec: Received) -> None:
        src = self.nodes.index(rec.sender) if rec.sender in self.nodes else -1
        if src < 0:
            rec.release()
            return
        if not rec.kind.startswith("carry"):
            for (dst, _), answered in self.pull_answers.items():
                if dst == src:
                    answered.set()
        if src in self.absent:
            self._set_present(src, rec.iteration)
        if self.layout is None:
            # Our trainer has not attached yet (a slow start): hold the update until it does.
            if len(self.unattached) < self.d.cfg.train_early_updates:
                self.unattached.append(rec)
            else:
                rec.release()
            return
        bad = self._bad_update(rec)
        if bad:
            self.dropped_bad[rec.sender] += 1
            log.warning("dropped update %d from %s: %s (%d from it so far)", rec.iteration, rec.sender, bad,
                        self.dropped_bad[rec.sender])
            self.d.offence(rec.sender, bad)
            rec.release()
            if not rec.kind.startswith("carry") and not self.d.offences.flagged_for(rec.sender):
                # It came, it is just not mixed: the mix renormalises over the buffers present, so
                # a policy that waits for this update does not wait for one that never comes.
                self.feed(ev.UpdateArrived(src, rec.iteration))
            return
        self.progress.newest_seen = max(self.progress.newest_seen, rec.iteration)
        self._check_readmission(src, rec)
        old = self.received.pop((src, rec.iteration), None)
        if old is not None:
            if self.acc is not None:   # out of the running sum with the values that went in
                self.acc.withdraw((src, rec.iteration), old.buffer)
            old.release()  # a duplicate: keep the newest copy
        self.received[(src, rec.iteration)] = rec
        if rec.kind.startswith("carry"):
            self.feed(ev.PullRequested(src, rec.iteration, carried=True))
        else:
            self.feed(ev.UpdateArrived(src, rec.iteration))

    def _bad_update(self, rec: Received) -> str:
        """Why a peer's update must not be mixed ("" when it may): size not the run's layout,
        NaN/Inf, a value beyond update_max_abs, or a norm beyond update_max_norm_ratio times ours."""
        if rec.nbytes != self.layout.total_bytes:
            return f"{rec.nbytes} bytes, this run's layout has {self.layout.total_bytes}"
        parts = [t for t in self.layout.typed(rec.buffer) if t.is_floating_point()]
        if not all(all_finite(t) for t in parts):
            self.dropped_nonfinite += 1
            return "NaN/Inf in the parameters"
        cfg = self.d.cfg
        if cfg.update_max_abs > 0:
            top = max((max(-float(lo), float(hi)) for lo, hi in (t.aminmax() for t in parts if t.numel())),
                      default=0.0)
            if top > cfg.update_max_abs:
                return f"|value| {top:.3g} beyond update_max_abs {cfg.update_max_abs:g}"
        if cfg.update_max_norm_ratio > 0 and self.live_k in self.own:
            theirs, ours = _norm(parts), _norm([t for t in self.layout.typed(self.own[self.live_k])
                                                if t.is_floating_point()])
            if theirs > cfg.update_max_norm_ratio * max(ours, 1.0):
                return (f"parameter norm {theirs:.3g} beyond update_max_norm_ratio {cfg.update_max_norm_ratio:g} "
                        f"x ours {ours:.3g} (floor 1)")
        return ""

    def on_tokens(self, node_id: str, n: int) -> None:
        if node_id in self.nodes:
            self.feed(ev.TokensArrived(self.nodes.index(node_id), n))

    def serve_pull(self, requester: str) -> Snapshot | None:
        """A peer pulls: the policy says what to answer; a Send to the requester is the answer."""
        if requester not in self.nodes or self.layout is None:
            return None
        src = self.nodes.index(requester)
        self._back_in_run(requester, self.policy.k)
        actions = self.policy.on_event(ev.PullRequested(src), time.monotonic())
        answer = next((a for a in actions if isinstance(a, ev.Send) and a.dst == src), None)
        self.apply_all([a for a in actions if a is not answer])
        if answer is None:
            log.debug("pull from %s: the policy answers nothing (%s)", requester, actions)
            return None
        buf = self._buffer_for(answer.k, answer.live)
        if buf is None:
            log.debug("pull from %s: iteration %d no longer held", requester, answer.k)
            return None
        held = self.live_k if (answer.live or answer.k == ev.CURRENT) else answer.k
        # Not recycled while it streams: a pull over a slow link outlasts the iterations after
        # which an own snapshot is retired, and a reused buffer fails the puller's checksum.
        self.serving[held] += 1
        return Snapshot(answer.k if answer.k >= 0 else self.live_k, Outgoing.from_buffer(buf, self.wire),
                        done=lambda: self._served(held))

    def _served(self, k: int) -> None:
        self.serving[k] -= 1
        if self.serving[k] <= 0:
            del self.serving[k]

    # --- actions that do I/O ------------------------------------------------------------------
    def _buffer_for(self, k: int, live: bool) -> torch.Tensor | None:
        if live or k == ev.CURRENT:
            k = self.live_k
        return self.own.get(k)

    def _send(self, a: ev.Send) -> None:
        buf = self._buffer_for(a.k, a.live)
        if buf is None:
            # Asked before our trainer published anything (a peer started first): answer with our
            # first parameters as soon as they exist.
            if a.live or a.k == ev.CURRENT or a.k > self.live_k:
                self.deferred_sends.append(a)
            return
        k = self.live_k if (a.live or a.k == ev.CURRENT) else a.k
        self.sending[k] += 1
        item = (self.kind("model"), k, self.own_out[k])
        if not self.coalesce:
            self._queue(a.dst).put_nowait(item)
            return
        slot = self.unsent.get(a.dst)
        if slot is not None:      # an older update to dst waits in its queue: the newer one goes instead
            self._settle(slot[0])
            slot[0] = item
            return
        slot = self.unsent[a.dst] = [item]
        self._queue(a.dst).put_nowait(("unsent", slot))

    def _queue(self, dst: int) -> asyncio.Queue:
        """One ordered sender per destination: updates arrive in iteration order."""
        q = self.queues.get(dst)
        if q is None:
            q = self.queues[dst] = asyncio.Queue()
            self.senders[dst] = self._spawn(self._sender(dst, q), f"sender {dst}")
        return q

    def _reset_sender(self, dst: int) -> None:
        """The peer is down (dead, left, restarted, flagged): abandon what we were sending it.
        A push in flight over a cut link waits out its whole transfer deadline (tens of seconds)
        and each queued one after it would too; anything sent after the peer's return (the
        greeting of `peer_up` first) must not queue behind them, so the next send starts a fresh
        queue. Nothing queued is owed to a down peer: on its return it gets our newest update."""
        task, q = self.senders.pop(dst, None), self.queues.pop(dst, None)
        if task is not None:
            task.cancel()            # its `finally` settles the item in flight
        while q is not None and not q.empty():
            item = q.get_nowait()
            self._settle(item[1][0] if item[0] == "unsent" else item)
        self.unsent.pop(dst, None)

    def _settle(self, item: tuple) -> None:
        """An item left its queue (sent, failed or abandoned): drop it from the pending counts."""
        if item[0] == "notice":
            self.notices_pending -= 1
        elif item[0] != "grant":
            self.sending[item[1]] -= 1
            if self.sending[item[1]] <= 0:
                del self.sending[item[1]]

    async def _sender(self, dst: int, q: asyncio.Queue) -> None:
        while True:
            item = await q.get()
            if item[0] == "unsent":           # coalescing: whatever update is newest now
                slot = item[1]
                item = slot[0]
                if self.unsent.get(dst) is slot:
                    del self.unsent[dst]
            node = self.nodes[dst]   # read per item: a vacant rank may be taken by a joiner
            try:
                member = self.d.membership.get(node) if node else None
                if member is None:
                    continue
                if item[0] == "grant":
                    await self.d.grant_tokens(member.address, item[1], self.policy.k)
                elif item[0] == "notice":
                    await self.d.notice_trainer(member.address, self.tag, item[1], item[2])
                else:
                    kind, k, outgoing = item
                    await self.d.push_tensor(member.address, node, outgoing, iteration=k, kind=kind)
            except (TransferError, grpc.aio.AioRpcError) as e:
                what = item[0] if item[0] in ("grant", "notice") else f"update {item[1]}"
                log.info("%s to %s failed: %s", what, node, e.code().name if isinstance(e, grpc.aio.AioRpcError) else e)
            finally:
                self._settle(item)

    def pull_estimates(self) -> list[list[float]] | None:
        """NetMax's t[i][m] from the daemon's link matrix: the pull's round trip against this
        host's measured compute (every row: other hosts' compute is not known here)."""
        matrix = self.d.link_matrix
        if matrix is None or self.layout is None or self.progress.compute_s.n == 0:
            return None
        compute = self.progress.compute_s.mean
        times = matrix.pull_times(self.nodes, self.layout.total_bytes, compute)
        if times is not None:
            # Our own row from our answered pulls where we have them (the paper's monitor measures
            # the iteration times): the matrix's RTT + bytes / capacity missed the pull's real cost
            # across a slow cut by ~2x (window growth, several hosts pulling over one link).
            for j, ts in self.pull_times.items():
                if len(ts) >= PULL_SAMPLES_MIN:
                    times[self.rank][j] = max(compute, statistics.median(ts[-PULL_SAMPLES:]))
        return times

    async def _feed_estimates(self) -> None:
        """Every train_estimates_interval: the link matrix's times to the policy (NetMax solves its
        peer probabilities from them). The solve runs in a thread first (the policy then finds it
        cached), so the event loop never waits on it."""
        while True:
            # Every second until the first estimates are in, then every interval: each solve costs
            # tenths of a second of CPU per host, and the links do not change faster than that.
            await asyncio.sleep(self.d.cfg.train_estimates_interval if self.estimates_fed else 1.0)
            times = self.pull_estimates()
            if times is None:
                continue
            work = self.policy.estimates_work(times)
            if work is not None:
                await asyncio.to_thread(work)
            self.feed(ev.LinkEstimates(times))
            self.estimates_fed += 1
            if work is not None:
                row = self.policy.state().get("row")
                log.info("link estimates: pull times %s s; peer probabilities %s",
                         [round(x, 3) for x in times[self.rank]], row)

    async def _pull(self, dst: int, carry_k: int, k: int) -> None:
        """The policy's Pull(dst) issued at iteration k. Its answer (the pulled parameters, or for a
        carried pull the peer's pushed reply) must arrive within `train_pull_timeout` plus the
        transfer's allowance (`transfer_bound`); otherwise
        (failed, refused, NOT_FOUND throughout, or answered with nothing: a peer not attached yet,
        or whose run ended) the policy hears PullFailed and pulls another peer or steps locally."""
        node = self.nodes[dst]
        member = self.d.membership.get(node)
        key = (dst, k)
        t0 = time.monotonic()
        bound = self.transfer_bound(self.d.cfg.train_pull_timeout, node)
        try:
            if member is None:
                raise TransferError("peer_down", f"{node} is not a member")
            async with asyncio.timeout(bound):
                if carry_k != ev.CURRENT and carry_k in self.own_out:
                    answered = self.pull_answers[key] = asyncio.Event()
                    # Counted as a push: over a slow link the carry outlasts the iterations after
                    # which the snapshot is retired, and a recycled buffer fails the checksum.
                    self.sending[carry_k] += 1
                    try:
                        await self.d.push_tensor(member.address, node, self.own_out[carry_k],
                                                 iteration=carry_k, kind=self.kind("carry"))
                    finally:
                        self._settle(("carry", carry_k))
                    await answered.wait()
                else:
                    rec, t0 = await self._pull_until_served(node)
                    log.debug("pull %d from %s: iteration %d, %d bytes in %.3fs", k, node, rec.iteration,
                              rec.wire_bytes, time.monotonic() - t0)
                    self.on_received(rec)
                # From the request that was answered: not the wait for a peer's first parameters.
                self.pull_times[dst].append(time.monotonic() - t0)
            return
        except (TransferError, grpc.aio.AioRpcError) as e:
            log.info("pull from %s failed: %s", node, e)
        except TimeoutError:
            log.info("pull from %s unanswered after %.1fs%s", node, bound,
                     " (the bound's cap, half of train_mix_timeout: raise that for a model this big on "
                     "this link)" if bound < self.d.cfg.train_pull_timeout + self.transfer_allowance(node) else "")
        finally:
            self.pull_answers.pop(key, None)
        self.feed(ev.PullFailed(dst, k))

    async def _pull_until_served(self, node: str) -> tuple[Received, float]:
        """A peer that has no parameters yet (its trainer is starting) answers NOT_FOUND: ask
        again, backing off, while it is alive (the caller bounds the whole, `transfer_bound`).
        Returns the answer and when the answered request started."""
        delay = 0.02
        while True:
            member = self.d.membership.get(node)
            if member is None or member.state.value not in ("alive", "suspect"):
                raise TransferError("peer_down", f"{node} is not alive")
            try:
                t0 = time.monotonic()
                return await self.d.pull_tensor(member.address, node, kind=self.kind("model")), t0
            except TransferError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    # --- joining a running swarm -------------------------------------------------------------
    def _checkpoint_dir(self) -> Path:
        """This run's checkpoint directory: an unfinished one of the same run (same tag) left in the
        data dir by an earlier daemon of this host, else a new one."""
        root = self.d.data.path / "checkpoints"
        for old in sorted(root.glob(f"{self.d.cfg.run_id}-*"), key=lambda p: p.stat().st_mtime, reverse=True):
            if (old / "run-tag").is_file() and (old / "run-tag").read_text().strip() == self.tag:
                if 0 <= checkpoint_iteration(old) < self.spec.iterations:
                    return old
        new = root / f"{self.d.cfg.run_id}-{self.session}"
        new.mkdir(parents=True, exist_ok=True)
        (new / "run-tag").write_text(self.tag + "\n")
        return new

    async def join_swarm(self, reply: cpb.AttachReply) -> cpb.AttachReply:
        """At the first attach: start from a live neighbour's parameters when the swarm is ahead of
        what this host holds (see the module docstring). A calm start costs one pull answered
        NOT_FOUND or near iteration 0."""
        if self.policy.k >= 0 or self.join_note:
            return reply                     # a restarted trainer of a run already under way here
        cfg = self.d.cfg
        own = checkpoint_iteration(self.checkpoint_dir)
        for node in self._join_candidates():
            member = self.d.membership.get(node)
            if member is None:
                continue
            try:
                rec = await asyncio.wait_for(self.d.pull_tensor(member.address, node, kind=self.kind("model")),
                                             cfg.train_join_pull_timeout)
            except (TransferError, grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
                log.info("join: no parameters from %s (%s)", node, getattr(e, "code", type(e).__name__))
                continue
            try:
                k = rec.iteration
                if k <= max(own, 0) + cfg.train_join_min_lead:
                    if own < 0:
                        return reply         # a calm start: everyone is at the beginning
                    note = (f"resumed from own checkpoint of iteration {own}: {node} is at {k}, "
                            f"not more than {cfg.train_join_min_lead} ahead")
                elif rec.nbytes != self.layout.total_bytes or not all(
                        all_finite(t) for t in self.layout.typed(rec.buffer)):
                    log.warning("join: parameters from %s unusable (size or NaN/Inf); trying another", node)
                    continue
                else:
                    self.slots[0].copy_(rec.buffer)
                    reply.start_iteration, reply.start_from_slot = k, True
                    note = (f"started from {node}'s parameters of iteration {k}: "
                            + (f"own checkpoint (iteration {own}) is older" if own >= 0 else "no own checkpoint"))
            finally:
                rec.release()
            break
        else:
            return reply                     # nobody has parameters yet: a calm start
        self.join_note = reply.join_note = note
        # Members with nothing published in this run (their trainer is starting too: several hosts
        # restarted together) are absent until their first update, not waited on for
        # train_silent_peer_timeout at our first mixes. Not under a pull policy: it gets no update
        # it did not ask for, and it would never ask an absent member, so it would leave that
        # member out for the whole run (a pull of a trainer still starting fails within its bound).
        if self.spec.algorithm not in registry.ASYNCHRONOUS:
            for i, k in (await self._member_iterations()).items():
                if k < 0:
                    self._set_absent(i, "restarting")
        self.progress.message = note
        log.info("join: %s", note)
        self.changed.set()
        return reply

    def _join_candidates(self) -> list[str]:
        """Live run members, nearest rank first (a ring neighbour is freshest)."""
        live = [m for m in self.nodes if m and m != self.d.node_id and (mem := self.d.membership.get(m)) is not None
                and mem.state.value == "alive"]
        return sorted(live, key=lambda m: min((self.nodes.index(m) - self.rank) % self.n,
                                              (self.rank - self.nodes.index(m)) % self.n))

    # --- the trainer's side -------------------------------------------------------------------
    async def attach(self, req: cpb.AttachRequest) -> cpb.AttachReply:
        layout = Layout.build((e.name, e.dtype, tuple(e.shape)) for e in req.layout)
        if req.total_bytes and req.total_bytes != layout.total_bytes:
            raise LayoutMismatch(f"total size {req.total_bytes} bytes announced, the layout needs "
                                 f"{layout.total_bytes}")
        if self.layout is not None:
            layout.check(self.layout, here="in this trainer", there="in the run")
        else:
            self.layout = layout
            self.wire = wire_layout(layout)
            self.d.dataplane.set_layout(self.kind("model"), self.wire)
            self.d.dataplane.set_layout(self.kind("carry"), self.wire)
            base = slot_dir(self.d.data.path)
            self.slot_paths = [base / f"peerd-{self.d.node_id}-{self.session}-{i}" for i in range(2)]
            self.slots = [map_slot(p, layout.total_bytes, create=True) for p in self.slot_paths]
            if (not self.eager and type(self.policy).preview is not Policy.preview and summable(layout)
                    and len(self.slots) == 2):
                self.acc = MixAccumulator(layout)
            held, self.unattached = self.unattached, []
            for rec in held:
                self.on_received(rec)
        if self.acc is not None:
            self.acc.stop()   # a restarted trainer: the slots are its own until it publishes
        start = max(self.policy.k + 1, 0)
        if self.progress.restarts and self.policy.k >= 0:
            start = max(start, await self._resume_point())
        rank, world = self.data_shard()
        return cpb.AttachReply(node_id=self.d.node_id, session_id=self.session,
                               slot_paths=[str(p) for p in self.slot_paths], start_iteration=start,
                               rank=rank, world=world)

    def data_shard(self) -> tuple[int, int]:
        """(rank, world) the trainer deals its data by: the data is dealt over the founding world,
        a late joiner trains on the shard of its rank mod world."""
        return self.rank % self.spec.world, self.spec.world

    async def _member_iterations(self, quiet: bool = False, every: bool = False) -> dict[int, int]:
        """Every other member's iteration in this run, asked with a RESUMING notice (bounded by
        rpc_timeout); -1 where its trainer has published nothing in this run, or it did not answer.
        Members the policy holds dead or absent are not asked unless `every`."""
        async def ask(i: int) -> tuple[int, int]:
            m = self.d.membership.get(self.nodes[i])
            if m is None or (i in self.policy.dead and not every):
                return i, -1
            try:
                return i, await self.d.notice_trainer(m.address, self.tag, pb.TrainerNotice.STATE_RESUMING,
                                                      self.policy.k)
            except grpc.aio.AioRpcError as e:
                log.log(logging.DEBUG if quiet else logging.INFO, "%s did not answer: %s", self.nodes[i],
                        e.code().name)
                return i, -1
        return dict(await asyncio.gather(*(ask(i) for i in range(self.n) if i != self.rank and self.nodes[i])))

    async def _resume_point(self) -> int:
        """The lowest iteration of the live neighbours; they are re-synchronised as PeerUp at our
        first publish."""
        self.resync = {i: k for i, k in (await self._member_iterations()).items() if k >= 0}
        start = min(self.resync.values(), default=-1)
        log.info("trainer restarted: resuming at iteration %d (own %d, neighbours %s)", max(start, self.policy.k + 1),
                 self.policy.k, self.resync)
        return start

    async def _watch_swarm_budget(self) -> None:
        """--budget swarm: the run's iterations are a budget for all its hosts together, world x
        iterations, as asynchronous algorithms count them (a fast host does more than a slow one
        instead of stopping early and leaving the slow ones to finish alone). Every
        train_budget_interval the live members are asked their iteration (each member's highest
        answer is kept: a finished or lost host still counts what it did); once the sum reaches
        the budget, our trainer is stopped like `peerd ctl stop` does. The built-in trainer is
        started with world x iterations as its own cap."""
        budget = self.spec.iterations * self.spec.world
        seen: dict[int, int] = {}
        while not self.done.is_set() and not self.stop_requested:
            await asyncio.sleep(self.d.cfg.train_budget_interval)
            if self.policy.k < 0:
                continue
            # Every member, the ones the policy does not wait for included (silent, finished): they count.
            for i, k in (await self._member_iterations(quiet=True, every=True)).items():
                seen[i] = max(seen.get(i, 0), k + 1)
            done = self.policy.k + 1 + sum(seen.values())
            if done >= budget and not self.stop_requested:
                log.info("the swarm's budget is spent: %d iterations done of %d (this host %d); stopping the trainer",
                         done, budget, self.policy.k + 1)
                await self.direct(cpb.Directive(kind=cpb.Directive.KIND_STOP,
                                                reason="the swarm's iteration budget is spent"))
                return

    def publish(self, req: cpb.PublishRequest) -> None:
        if self.layout is None:
            raise RunError("publish before attach")
        if req.slot >= len(self.slots):
            raise RunError(f"slot {req.slot} does not exist")
        k = req.iteration
        if k <= self.live_k or (self.pending_publish and k <= self.pending_publish[0]):
            raise RunError(f"iteration {k} published after {self.live_k}")
        # Answer first, snapshot right after (the next callback of the loop, before any later RPC
        # of this trainer): the trainer goes on computing while the daemon copies the slot. The
        # slot is not written again before publish k+2, which comes after mix k.
        self.pending_publish = (k, req.slot)
        asyncio.get_running_loop().call_soon(self._complete_publish)

    def _complete_publish(self) -> None:
        if self.pending_publish is None:
            return
        (k, slot), self.pending_publish = self.pending_publish, None
        snap = self._pool.pop() if self._pool else torch.empty(self.layout.total_bytes, dtype=torch.uint8)
        snap.copy_(self.slots[slot])
        self.own[k] = snap
        self.own_out[k] = Outgoing.from_buffer(snap, self.wire)
        self.live_k = k
        self._retire_own()
        now = time.monotonic()
        if self._last_iter_t is not None:
            dt = now - self._last_iter_t
            self.progress.rate = 1 / dt if self.progress.rate == 0 else 0.8 * self.progress.rate + 0.2 / dt
        self._last_iter_t = now
        self.progress.iteration = k
        deferred, self.deferred_sends = self.deferred_sends, []
        for send in deferred:
            self._send(send)
        self.feed(ev.Published(k))
        resync, self.resync = self.resync, {}
        for src, kj in resync.items():
            self.feed(ev.PeerUp(src, kj))
        if self.eager and len(self.slots) == 2:
            self.eager_k, self.eager_slot = k, 1 - slot
            self.feed(ev.MixRequested(k))
        elif self.acc is not None:
            self.acc.start(k, self.slots[1 - slot])   # free until Mix(k) names it (see eager)
            self._accumulate()

    def _accumulate(self) -> None:
        """Bring the incremental mix up to what the policy would mix now."""
        acc = self.acc
        if acc.k != self.policy.k:
            acc.stop()
            return
        acc.sync(self.policy.preview(acc.k), self._part_buffer)

    def _retire_own(self) -> None:
        keep = max(8, int(self.d.cfg.hop_max_ig) + 4)
        for k in sorted(self.own)[:-keep]:
            snap = self.own.pop(k)
            del self.own_out[k]
            if not self.sending.get(k) and not self.serving.get(k):
                self._pool.append(snap)  # reused only when no push or pull of it is in flight
        del self._pool[2:]

    async def mix(self, req: cpb.MixRequest) -> cpb.MixReply:
        k = req.iteration
        if self.layout is None:
            raise RunError("mix before attach")
        if k in self.mix_waiters:
            raise RunError(f"mix of iteration {k} already requested")
        self._complete_publish()
        if req.HasField("metric"):
            self.on_metric(req.metric)
        fut = asyncio.get_running_loop().create_future()
        self.mix_waiters[k] = fut
        self.mix_slot = req.slot
        if self.stop_requested:
            self._release_mix(k)
        elif k == self.eager_k:
            self._answer_mix(k)              # requested at publish; answered now if computed
        else:
            self.feed(ev.MixRequested(k))
        if not fut.done():
            self._arm_silent(k)
        try:
            return await asyncio.wait_for(fut, self.d.cfg.train_mix_timeout)
        except asyncio.TimeoutError:
            raise RunError(f"mix of iteration {k} not ready after {self.d.cfg.train_mix_timeout:.0f}s: "
                           f"{self.policy.state().get('waiting', '')}") from None
        finally:
            self.mix_waiters.pop(k, None)
            if self._silent_timer is not None:
                self._silent_timer.cancel()
                self._silent_timer = None

    def _compute_mix(self, mix: ev.Mix) -> None:
        """Write the mix of iteration k into the slot the trainer asked for, or into a staging
        buffer when the policy mixes before the trainer asks."""
        waiting = mix.k in self.mix_waiters and self.layout is not None
        if waiting:
            out, staged = self.slots[self.mix_slot], None
        elif mix.k == self.eager_k:
            out = staged = self.slots[self.eager_slot]   # free: the trainer published into the other one
        else:
            out = staged = torch.empty(self.layout.total_bytes, dtype=torch.uint8)
        used = None
        if self.acc is not None and self.acc.k == mix.k:
            if waiting and self.acc.out.data_ptr() == out.data_ptr():
                used = self.acc.finish(mix.k, mix.entries, self._part_buffer)
            else:
                self.acc.stop()
        if used is None:
            used = self._weighted_sum(out, mix.entries)
        for captured in self.pending_average:
            self._average_into(out, captured)
        self.pending_average.clear()
        self.ready_mixes[mix.k] = (mix, used, staged)

    def _answer_mix(self, k: int) -> None:
        fut = self.mix_waiters.get(k)
        if fut is None or fut.done() or k not in self.ready_mixes:
            return
        mix, used, staged = self.ready_mixes.pop(k)
        if staged is not None and staged.data_ptr() != self.slots[self.mix_slot].data_ptr():
            self.slots[self.mix_slot].copy_(staged)
        self.progress.peers_in_last_mix = max(0, used - 1)
        skip = self.skip_after.pop(k, 0)
        # No entries: nothing could be mixed and the trainer keeps its own x_k.
        entries = [cpb.MixEntry(src=self.nodes[s], iteration=max(i, 0), weight=w) for s, i, w in mix.entries] \
            if used else []
        fut.set_result(cpb.MixReply(iteration=k, skip_to=skip, entries=entries))

    def _release_mix(self, k: int) -> None:
        """Answer mix k with nothing mixed: the trainer keeps its own x_k."""
        fut = self.mix_waiters.get(k)
        if fut is not None and not fut.done():
            fut.set_result(cpb.MixReply(iteration=k))

    def _entry_buffer(self, src: int, k: int) -> torch.Tensor | None:
        if src == self.rank:
            return self._buffer_for(k, False)
        rec = self.received.get((src, k))
        return rec.buffer.clone() if rec is not None else None

    def _average_into(self, out: torch.Tensor, captured) -> None:
        """AD-PSGD's passive average, applied on top of this iteration's mix (None: the mix itself)."""
        parts = [(out.clone() if buf is None else buf, w) for buf, w in captured if w > 0]
        self._combine(out, [(b, w) for b, w in parts if b is not None])

    def _weighted_sum(self, out: torch.Tensor, entries) -> int:
        """out = sum(w * params(src, k)); weights renormalised over the buffers actually present.
        Returns how many buffers were used."""
        parts = []
        for src, k, w in entries:
            buf = self._part_buffer(src, k)
            if buf is not None and w > 0:
                parts.append((buf, w))
            elif buf is None:
                log.debug("mix entry (%d, %d) has no buffer; held: %s", src, k, sorted(self.received))
        self._combine(out, parts)
        return len(parts)

    def _part_buffer(self, src: int, k: int) -> torch.Tensor | None:
        """The parameters of the mix entry (src, k), if held."""
        if src == self.rank:
            return self._buffer_for(k, False)
        rec = self.received.get((src, k))
        return rec.buffer if rec is not None else None

    def _combine(self, out: torch.Tensor, parts: list[tuple[torch.Tensor, float]]) -> None:
        """out = sum of w * buf over parts, per typed run of the layout (a few large ops, no
        per-tensor loop)."""
        if not parts:
            return
        total = sum(w for _, w in parts)
        outs = self.layout.typed(out)
        first = True
        for buf, w in parts:
            for o, t in zip(outs, self.layout.typed(buf)):
                if first:
                    torch.mul(t, w / total, out=o)
                else:
                    o.add_(t, alpha=w / total)
            first = False

    def on_metric(self, m: cpb.Metric) -> None:
        p = self.progress
        p.loss = m.loss
        if m.extra.get("compute_s", 0) > 0:
            p.compute_s.add(m.extra["compute_s"], STEP_EWMA)
        if m.step_time_s > 0:
            p.step_s.add(m.step_time_s, STEP_EWMA)
        failures = int(m.extra.get("checkpoint_failures", 0))
        if failures > self.checkpoint_failures:
            self.checkpoint_failures = failures
            p.message = (f"checkpoint at iteration {m.iteration} FAILED ({failures} so far; disk full?): "
                         f"training goes on, the previous checkpoint is kept; see the trainer log")
            log.error("%s", p.message)
        if "accuracy" in m.extra:
            p.metric_name, p.metric = "accuracy", m.extra["accuracy"]
        elif "eval_loss" in m.extra:
            p.metric_name, p.metric = "loss", m.extra["eval_loss"]
        self.changed.set()

    # --- the trainer process --------------------------------------------------------------------
    def trainer_argv(self) -> list[str]:
        s = self.spec
        if s.script:
            return [sys.executable, *s.script]
        cap = s.iterations * s.world if self.swarm_budget else s.iterations
        argv = [sys.executable, "-m", "peerd.train.worker", "--task", s.task, "--iterations", str(cap),
                "--seed", str(s.seed), "--eval-every", str(s.eval_every)]
        if s.non_iid:
            argv.append("--non-iid")
        for key in ("lr", "momentum", "optimizer", "batch_size", "accum_iter", "step_time", "slow_prob",
                    "slow_factor"):
            if key in s.options:
                argv += [f"--{key.replace('_', '-')}", s.options[key]]
        if s.options.get("trace") == "true":
            argv.append("--trace")
        return argv

    def trainer_env(self) -> dict[str, str]:
        env = dict(os.environ)
        rank, world = self.data_shard()
        env.update(PEERD_CONTROL_SOCKET=str(self.d.cfg.control_socket), PEERD_SESSION=self.session,
                   PEERD_RANK=str(rank), PEERD_WORLD=str(world), PEERD_SLOWDOWN=str(self.spec.slowdown),
                   PEERD_CHECKPOINT_DIR=str(self.checkpoint_dir), PEERD_RUN_ID=self.d.cfg.run_id,
                   PEERD_PAUSE_TIMEOUT=str(self.d.cfg.train_pause_timeout),
                   PEERD_CHECKPOINT_EVERY=str(self.d.cfg.checkpoint_every))
        return env

    async def supervise(self) -> None:
        """Run the trainer to completion, restarting it from its checkpoint when it crashes."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.progress.state = "training"
        self.changed.set()
        while True:
            log_path = self.d.data.path / f"trainer-{self.session}.log"
            with open(log_path, "ab") as logf:
                # subprocess uses vfork+exec: no fork handlers run in a child of a process whose
                # gRPC threads are busy (a plain fork there can crash or hang the child).
                if self.progress.state == "stopping":
                    break  # stop() came while we waited: never start a trainer nobody will stop
                # Its own process group: Ctrl+C at the daemon's terminal reaches the daemon only,
                # which stops the trainer in order (a trainer killed first looked like a crash).
                self.trainer = subprocess.Popen(self.trainer_argv(), env=self.trainer_env(), stdout=logf,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                process_group=0)
                log.info("trainer pid %d started (rank %d of %d, %s, %s); log %s", self.trainer.pid, self.rank,
                         self.n, self.spec.algorithm, self.spec.task or " ".join(self.spec.script), log_path)
                code = await asyncio.to_thread(self.trainer.wait)
            if code == 0:
                self.progress.state = "done"
                self.progress.message = (self.stop_reason or "trainer stopped by a directive") if self.stop_requested \
                    else "trainer finished"
                self._announce(pb.TrainerNotice.STATE_FINISHED)
                break
            if self.progress.state == "stopping":
                break
            if self.stop_requested:   # it was told to stop: a restart would train on, unasked
                self.fail(f"trainer exited {code} after the stop directive (not restarted); see {log_path}")
                self._announce(pb.TrainerNotice.STATE_FINISHED)
                break
            self._announce(pb.TrainerNotice.STATE_ABSENT)
            self.progress.restarts += 1
            if self.progress.restarts > self.d.cfg.train_max_restarts:
                self.fail(f"trainer exited {code} and was restarted {self.progress.restarts - 1} times; "
                          f"see {log_path}")
                break
            self.progress.state = "restarting"
            self.progress.message = f"trainer exited {code}; restarting from its last checkpoint"
            log.warning("trainer exited %d; restarting from checkpoint (%d)", code, self.progress.restarts)
            self.changed.set()
            await asyncio.sleep(self.d.cfg.train_restart_delay)
            if self.progress.state == "stopping":
                break
            self.progress.state = "training"
        self.done.set()
        self.changed.set()

    def fail(self, message: str) -> None:
        self.progress.state, self.progress.message = "failed", message
        log.error("run failed: %s", message)
        self.changed.set()

    async def stop(self) -> None:
        """Stop the trainer (SIGTERM, then SIGKILL after the bound) and free every buffer."""
        if self.progress.state not in ("done", "failed"):
            self.progress.state = "stopping"
        proc = self.trainer
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), self.d.cfg.shutdown_grace + 2)
            except asyncio.TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        for task in list(self._tasks):
            task.cancel()
        if self.timer is not None:
            self.timer.cancel()
        for rec in [*self.received.values(), *self.unattached]:
            rec.release()
        self.received.clear()
        self.unattached.clear()
        for fut in self.mix_waiters.values():
            if not fut.done():
                fut.set_exception(RunError("run stopped"))
        for p in self.slot_paths:
            p.unlink(missing_ok=True)
        if self.pull_times:
            log.info("pulls answered (peer rank: count, median, p90 seconds): %s", "; ".join(
                f"{dst}: {len(ts)}, {statistics.median(ts):.3f}, {sorted(ts)[int(0.9 * len(ts))]:.3f}"
                for dst, ts in sorted(self.pull_times.items())))
        if self.acc is not None:
            log.info("incremental mix: %d mixes from the running sum, %d summed in full, %d passes in the sum",
                     self.acc.hits, self.acc.misses, self.acc.passes)
        if self.wire is not None:
            for base in ("model", "carry"):
                self.d.dataplane.set_layout(self.kind(base), None)
        self.done.set()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def progress_message(self) -> cpb.TrainProgress:
        p = self.progress
        gap = p.newest_seen - p.iteration if p.newest_seen >= 0 else 0
        return cpb.TrainProgress(state=p.state, message=p.message, iteration=p.iteration, loss=p.loss,
                                 iterations_per_s=p.rate, peers_in_last_mix=p.peers_in_last_mix,
                                 gap_to_fastest=gap, elapsed_s=time.monotonic() - p.started,
                                 metric_name=p.metric_name, metric=p.metric, rank=self.rank,
                                 world=sum(map(bool, self.nodes)),
                                 trainer_restarts=p.restarts, skipped=p.skipped, wall_time=time.time())

    def state(self) -> dict[str, Any]:
        p = self.progress
        return {"rank": self.rank, "world": self.n, "algorithm": self.spec.algorithm,
                "topology": self.spec.topology, "nodes": self.nodes,
                "model_bytes": self.layout.total_bytes if self.layout is not None else 0,
                "step_time": {"compute_mean_s": p.compute_s.mean, "compute_std_s": p.compute_s.spread,
                              "step_mean_s": p.step_s.mean, "step_std_s": p.step_s.spread,
                              "samples": p.compute_s.n},
                "recommended": list(self.replanner.recommended) if self.replanner else None,
                "policy": self.policy.state(), "held_updates": len(self.received),
                "absent": {self.nodes[i]: why for i, why in self.absent.items()},
                "dropped_nonfinite": self.dropped_nonfinite, "dropped_bad": dict(self.dropped_bad),
                "incremental_mix": {"hits": self.acc.hits, "misses": self.acc.misses,
                                    "passes": self.acc.passes} if self.acc is not None else None,
                "tag": self.tag, "estimates_fed": self.estimates_fed}


def _norm(parts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in parts))


def checkpoint_iteration(directory: Path) -> int:
    """The iteration of the checkpoint in `directory` (-1: none or unreadable)."""
    path = directory / "latest.pt"
    if not path.is_file():
        return -1
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["iteration"])
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint is as good as none
        log.warning("checkpoint %s unreadable (%s); ignored", path, e)
        return -1


def form_world(daemon: "Daemon", world: int) -> list[str] | None:
    """This node and the first world-1 alive peers by node id, in rank order: by site label, then
    node id (every host that sees the same swarm forms the same world; a ring over these ranks
    keeps each site's hosts together, crossing between two sites twice, not at random). None while
    too few peers are alive. The first of them re-ranks them to keep slow access links apart on
    the ring, for every founder (peerd.node.joining.ranking)."""
    alive = daemon.membership.alive()
    if len(alive) < world - 1:
        return None
    return sorted([daemon.node_id, *sorted(alive)[:world - 1]], key=lambda n: (site_of(daemon, n), n))


def site_of(daemon: "Daemon", node: str) -> str:
    """A node's `--site` label as it advertised it ("" when none or unknown)."""
    if node == daemon.node_id:
        return str(daemon.caps.get("site", ""))
    member = daemon.membership.get(node)
    return str(member.capabilities.get("site", "")) if member is not None else ""


async def serve_train(daemon: "Daemon", request: cpb.TrainRequest, context: grpc.aio.ServicerContext):
    """The Train RPC: form the world, run the trainer, stream progress; the caller leaving stops it."""
    try:
        spec = RunSpec.from_request(request, daemon.cfg.train_join_timeout, daemon.cfg.train_max_world)
    except RunError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {e}")
    if daemon.training is not None:
        if not daemon.training.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "peerd: a training run is already active on this daemon")
        await daemon.training.stop()   # a finished run still serving its peers gives way
        daemon.end_run(daemon.training)
    started = time.monotonic()
    auto = spec.algorithm == "auto"
    while True:
        # The run under way, if a live peer has one (rejoin or late join), else a new one formed.
        try:
            nodes, why = await joining.place(daemon, spec)
        except joining.JoinRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
        if nodes is not None:
            break
        waited = time.monotonic() - started
        if waited > spec.join_timeout:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"peerd: no run to take part in after {spec.join_timeout:.0f}s: {why}")
        yield cpb.TrainProgress(state="waiting", world=spec.world, elapsed_s=waited, message=why)
        await asyncio.sleep(daemon.cfg.train_join_retry)
    inputs = None
    if auto and spec.algorithm != "auto":   # took the choice of the run it found (joining.place)
        msg = (f"auto: took {spec.algorithm} on {spec.topology}, the run's choice "
               f"(its first host plans for every host; see its log for the runner-up)")
        log.info("%s", msg)
        yield cpb.TrainProgress(state="waiting", world=spec.world, message=msg)
    if spec.algorithm == "auto":
        try:
            inputs, msg = await _auto(daemon, spec, nodes)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: --algo auto: {e}")
        yield cpb.TrainProgress(state="waiting", world=spec.world, message=msg)
    try:
        run = TrainingRun(daemon, spec, nodes)
    except (ValueError, RunError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {e}")
    if inputs is not None:
        run.replanner = Replanner(daemon.cfg, (spec.algorithm, spec.topology), inputs)
        run.replanner.last_check = time.monotonic()
    daemon.start_run(run)
    log.info("run %s (tag %s): rank %d, world %d, max %d, %s on %s, members %s", daemon.cfg.run_id, run.tag,
             run.rank, spec.world, run.n, spec.algorithm, spec.topology, ", ".join(n or "-" for n in nodes))
    how = "world formed" if run.rank < spec.world else "joined the run under way"
    yield cpb.TrainProgress(state="waiting", rank=run.rank, world=sum(map(bool, run.nodes)),
                            message=f"{how}: rank {run.rank} of {run.n}; starting the trainer")
    supervisor = asyncio.get_running_loop().create_task(run.supervise())
    try:
        while not run.done.is_set():
            try:
                await asyncio.wait_for(run.changed.wait(), daemon.cfg.train_progress_interval)
            except asyncio.TimeoutError:
                pass
            run.changed.clear()
            if run.replanner is not None and run.replanner.due(time.monotonic()):
                note = await _replan(daemon, run)
                if note:
                    msg = run.progress_message()
                    msg.message = note
                    yield msg
                    continue
            yield run.progress_message()
        yield run.progress_message()
    finally:
        supervisor.cancel()
        if run.progress.state == "done" and daemon.training is run:
            # Our trainer is done, our peers may not be: keep answering their pulls and taking
            # their updates (with our final parameters) for a bounded time.
            run.draining = True
            asyncio.get_running_loop().create_task(_drain(daemon, run))
        else:
            await run.stop()
            daemon.end_run(run)


async def _drain(daemon: "Daemon", run: TrainingRun) -> None:
    deadline = time.monotonic() + daemon.cfg.train_drain_timeout
    while time.monotonic() < deadline and daemon.training is run and not run.drained():
        await asyncio.sleep(0.1)
    log.info("run %s drained after %.1fs", run.tag, daemon.cfg.train_drain_timeout - (deadline - time.monotonic()))
    if daemon.training is run:
        await run.stop()
        daemon.end_run(run)


async def _auto(daemon: "Daemon", spec: RunSpec, nodes: list[str]):
    """Resolve `--algo auto` into an algorithm and topology (see peerd.node.autoplan)."""
    from peerd.node import autoplan

    mean = float(spec.options.get("step_time", 0) or daemon.cfg.plan_default_step_time)
    std = float(spec.options.get("step_time_std", 0) or 0)
    nbytes = autoplan.model_bytes_of(spec.task, spec.options)
    inputs = autoplan.gather(daemon, nodes, nbytes, mean, std)
    best, second = await asyncio.to_thread(autoplan.decide, inputs, daemon.cfg)
    spec.algorithm, spec.topology = best.algorithm, best.topology
    for w in inputs.warnings:
        log.warning("auto plan: %s", w)
    msg = (f"auto: chose {autoplan.describe(best)}; runner-up {autoplan.describe(second)} "
           f"(model {nbytes / 1e6:.2f} MB, step {mean:.3f} s)")
    log.info("%s", msg)
    return inputs, msg


async def _replan(daemon: "Daemon", run: TrainingRun) -> str | None:
    """A progress tick is the safe point: re-plan from current links and the measured step time."""
    from peerd.node import autoplan

    rp = run.replanner
    p = run.progress
    last = rp.last
    mean = p.compute_s.mean if p.compute_s.n >= 5 else float(last.comp.mean[0])
    std = p.compute_s.spread if p.compute_s.n >= 5 else float(last.comp.std[0])
    nbytes = float(run.layout.total_bytes) if run.layout is not None else last.model_bytes
    current = autoplan.gather(daemon, run.nodes, nbytes, mean, std)
    try:
        return await asyncio.to_thread(rp.check, time.monotonic(), current)
    except ValueError as e:
        log.warning("re-plan failed: %s", e)
        return None
