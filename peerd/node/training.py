"""A training run inside the daemon: the sans-I/O sync policy driven by real events.

One `TrainingRun` per `peerd train` on this host. It
- forms the run's world (this node and the first `world - 1` alive peers, ranked by node id, so
  every host that sees the same swarm ranks it the same way);
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
  policy waits on a dead peer; they come back as PeerUp.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
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
from peerd.sync import events as ev
from peerd.sync import registry, topology
from peerd.train.flat import Layout, LayoutMismatch, all_finite
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb

if TYPE_CHECKING:
    from peerd.node.daemon import Daemon

log = logging.getLogger("peerd.train")

ALGORITHM_ALIASES = {"dpsgd": "d-psgd", "adpsgd": "ad-psgd"}


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


def slot_dir(data_dir: Path) -> Path:
    """/dev/shm where it exists (memory, not disk), else the data dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else data_dir


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

    @classmethod
    def from_request(cls, r: cpb.TrainRequest, default_join: float) -> "RunSpec":
        algo = ALGORITHM_ALIASES.get(r.algorithm, r.algorithm or "hop")
        if algo not in registry.ALGORITHMS:
            raise RunError(f"algorithm: unknown {r.algorithm!r}; known: {', '.join(registry.ALGORITHMS)}")
        if not r.task and not r.script:
            raise RunError("task: name a built-in task (digits, svm, lm) or a script")
        if r.world < 1:
            raise RunError("world: must be at least 1")
        return cls(r.task, algo, r.topology or "ring", r.world, r.iterations, r.seed, r.non_iid,
                   r.slowdown or 1.0, dict(r.options), list(r.script), r.eval_every,
                   r.join_timeout_s or default_join)


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


class TrainingRun:
    def __init__(self, daemon: "Daemon", spec: RunSpec, nodes: list[str]) -> None:
        self.d = daemon
        self.spec = spec
        self.nodes = nodes
        self.rank = nodes.index(daemon.node_id)
        self.n = len(nodes)
        self.session = uuid.uuid4().hex[:12]
        # Every host of this run derives the same tag; transfers carry it, so a late update of one
        # run never reaches the next.
        self.tag = hashlib.sha1(json.dumps([dataclasses.asdict(spec) | {"slowdown": 0}, nodes],
                                           sort_keys=True).encode()).hexdigest()[:12]
        topo = topology.make(spec.topology, self.n)
        opts = registry.options(daemon.cfg, spec.algorithm)
        for key in ("backup", "staleness", "max_ig", "max_skip"):
            if key in spec.options:
                opts[key] = int(spec.options[key])
        if "skip" in spec.options:
            opts["skip"] = spec.options["skip"].lower() in ("1", "true", "yes")
        self.policy = registry.build(spec.algorithm, self.n, topo, seed=spec.seed, **opts)[self.rank]
        self.layout: Layout | None = None
        self.wire: tw.Layout | None = None
        self.slots: list[torch.Tensor] = []
        self.slot_paths: list[Path] = []
        self.own: dict[int, torch.Tensor] = {}        # my published parameters, by iteration
        self.own_out: dict[int, Outgoing] = {}         # the same, ready to push (checksummed once)
        self.sending: collections.Counter[int] = collections.Counter()  # queued pushes per iteration
        self.live_k = -1
        self.received: dict[tuple[int, int], Received] = {}
        self.unattached: list[Received] = []   # updates that arrived before our trainer attached
        self.deferred_sends: list[ev.Send] = []  # sends asked for before we had parameters
        self.mix_waiters: dict[int, asyncio.Future] = {}
        self.ready_mixes: dict[int, tuple[ev.Mix, int, torch.Tensor | None]] = {}
        self.skip_after: dict[int, int] = {}
        self.pending_average: list[tuple[tuple[int, int, float], ...]] = []
        self.queues: dict[int, asyncio.Queue] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.progress = Progress()
        self.changed = asyncio.Event()
        self.dropped_nonfinite = 0
        self.trainer: subprocess.Popen | None = None
        self.done = asyncio.Event()
        self.draining = False                  # trainer finished; still serving the peers' last pulls
        self.pending_publish: tuple[int, int] | None = None
        self._pool: list[torch.Tensor] = []
        self._tasks: set[asyncio.Task] = set()
        self._last_iter_t: float | None = None
        self.checkpoint_dir = daemon.data.path / "checkpoints" / f"{daemon.cfg.run_id}-{self.session}"

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
                self._spawn(self._pull(a.dst, a.carry_k), f"pull {a.dst}")
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
            self.feed(ev.PeerDown(self.nodes.index(node_id)))

    def peer_up(self, node_id: str) -> None:
        if node_id in self.nodes and node_id != self.d.node_id:
            self.feed(ev.PeerUp(self.nodes.index(node_id)))

    # --- data arriving from peers -------------------------------------------------------------
    def on_received(self, rec: Received) -> None:
        src = self.nodes.index(rec.sender) if rec.sender in self.nodes else -1
        if src < 0:
            rec.release()
            return
        if self.layout is None:
            # Our trainer has not attached yet (a slow start): hold the update until it does.
            if len(self.unattached) < self.d.cfg.train_early_updates:
                self.unattached.append(rec)
            else:
                rec.release()
            return
        if rec.nbytes != self.layout.total_bytes:
            log.warning("dropped update %d from %s: %d bytes, this run's layout has %d", rec.iteration,
                        rec.sender, rec.nbytes, self.layout.total_bytes)
            rec.release()
            return
        if not all(all_finite(t) for t in self.layout.typed(rec.buffer)):
            self.dropped_nonfinite += 1
            log.warning("dropped update %d from %s: NaN/Inf in the parameters (%d dropped so far)",
                        rec.iteration, rec.sender, self.dropped_nonfinite)
            rec.release()
            return
        self.progress.newest_seen = max(self.progress.newest_seen, rec.iteration)
        old = self.received.pop((src, rec.iteration), None)
        if old is not None:
            old.release()  # a duplicate: keep the newest copy
        self.received[(src, rec.iteration)] = rec
        if rec.kind.startswith("carry"):
            self.feed(ev.PullRequested(src, rec.iteration, carried=True))
        else:
            self.feed(ev.UpdateArrived(src, rec.iteration))

    def on_tokens(self, node_id: str, n: int) -> None:
        if node_id in self.nodes:
            self.feed(ev.TokensArrived(self.nodes.index(node_id), n))

    def serve_pull(self, requester: str) -> Snapshot | None:
        """A peer pulls: the policy says what to answer; a Send to the requester is the answer."""
        if requester not in self.nodes or self.layout is None:
            return None
        src = self.nodes.index(requester)
        actions = self.policy.on_event(ev.PullRequested(src), time.monotonic())
        answer = next((a for a in actions if isinstance(a, ev.Send) and a.dst == src), None)
        self.apply_all([a for a in actions if a is not answer])
        if answer is None:
            return None
        buf = self._buffer_for(answer.k, answer.live)
        if buf is None:
            return None
        return Snapshot(answer.k if answer.k >= 0 else self.live_k, Outgoing.from_buffer(buf, self.wire))

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
        self._queue(a.dst).put_nowait((self.kind("model"), k, self.own_out[k]))

    def _queue(self, dst: int) -> asyncio.Queue:
        """One ordered sender per destination: updates arrive in iteration order."""
        q = self.queues.get(dst)
        if q is None:
            q = self.queues[dst] = asyncio.Queue()
            self._spawn(self._sender(dst, q), f"sender {dst}")
        return q

    async def _sender(self, dst: int, q: asyncio.Queue) -> None:
        node = self.nodes[dst]
        while True:
            item = await q.get()
            try:
                member = self.d.membership.get(node)
                if member is None:
                    continue
                if item[0] == "grant":
                    await self.d.grant_tokens(member.address, item[1], self.policy.k)
                else:
                    kind, k, outgoing = item
                    await self.d.push_tensor(member.address, node, outgoing, iteration=k, kind=kind)
            except (TransferError, grpc.aio.AioRpcError) as e:
                log.info("send to %s failed: %s", node, e)
            finally:
                if item[0] != "grant":
                    self.sending[item[1]] -= 1
                    if self.sending[item[1]] <= 0:
                        del self.sending[item[1]]

    async def _pull(self, dst: int, carry_k: int) -> None:
        node = self.nodes[dst]
        member = self.d.membership.get(node)
        if member is None:
            return
        try:
            if carry_k != ev.CURRENT and carry_k in self.own_out:
                await self.d.push_tensor(member.address, node, self.own_out[carry_k], iteration=carry_k,
                                         kind=self.kind("carry"))
            else:
                self.on_received(await self._pull_until_served(node))
        except (TransferError, grpc.aio.AioRpcError) as e:
            log.info("pull from %s failed: %s", node, e)

    async def _pull_until_served(self, node: str) -> Received:
        """A peer that has no parameters yet (its trainer is starting) answers NOT_FOUND: ask
        again, backing off, for as long as it is alive. The failure detector, not a failed pull,
        tells the policy that a peer is gone."""
        delay = 0.02
        while True:
            member = self.d.membership.get(node)
            if member is None or member.state.value not in ("alive", "suspect"):
                raise TransferError("peer_down", f"{node} is not alive")
            try:
                return await self.d.pull_tensor(member.address, node, kind=self.kind("model"))
            except TransferError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    # --- the trainer's side -------------------------------------------------------------------
    def attach(self, req: cpb.AttachRequest) -> cpb.AttachReply:
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
            held, self.unattached = self.unattached, []
            for rec in held:
                self.on_received(rec)
        start = max(self.policy.k + 1, 0)
        return cpb.AttachReply(node_id=self.d.node_id, session_id=self.session,
                               slot_paths=[str(p) for p in self.slot_paths], start_iteration=start,
                               rank=self.rank, world=self.n)

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

    def _retire_own(self) -> None:
        keep = max(8, int(self.d.cfg.hop_max_ig) + 4)
        for k in sorted(self.own)[:-keep]:
            snap = self.own.pop(k)
            del self.own_out[k]
            if not self.sending.get(k):
                self._pool.append(snap)  # reused only when no push of it is still queued
        del self._pool[2:]

    async def mix(self, req: cpb.MixRequest) -> cpb.MixReply:
        k = req.iteration
        if self.layout is None:
            raise RunError("mix before attach")
        if k in self.mix_waiters:
            raise RunError(f"mix of iteration {k} already requested")
        self._complete_publish()
        fut = asyncio.get_running_loop().create_future()
        self.mix_waiters[k] = fut
        self.mix_slot = req.slot
        self.feed(ev.MixRequested(k))
        try:
            return await asyncio.wait_for(fut, self.d.cfg.train_mix_timeout)
        except asyncio.TimeoutError:
            raise RunError(f"mix of iteration {k} not ready after {self.d.cfg.train_mix_timeout:.0f}s: "
                           f"{self.policy.state().get('waiting', '')}") from None
        finally:
            self.mix_waiters.pop(k, None)

    def _compute_mix(self, mix: ev.Mix) -> None:
        """Write the mix of iteration k into the slot the trainer asked for, or into a staging
        buffer when the policy mixes before the trainer asks."""
        waiting = mix.k in self.mix_waiters and self.layout is not None
        out = self.slots[self.mix_slot] if waiting else torch.empty(self.layout.total_bytes, dtype=torch.uint8)
        used = self._weighted_sum(out, mix.entries)
        for captured in self.pending_average:
            self._average_into(out, captured)
        self.pending_average.clear()
        self.ready_mixes[mix.k] = (mix, used, None if waiting else out)

    def _answer_mix(self, k: int) -> None:
        fut = self.mix_waiters.get(k)
        if fut is None or fut.done() or k not in self.ready_mixes:
            return
        mix, used, staged = self.ready_mixes.pop(k)
        if staged is not None:
            self.slots[self.mix_slot].copy_(staged)
        self.progress.peers_in_last_mix = max(0, used - 1)
        skip = self.skip_after.pop(k, 0)
        # No entries: nothing could be mixed and the trainer keeps its own x_k.
        entries = [cpb.MixEntry(src=self.nodes[s], iteration=max(i, 0), weight=w) for s, i, w in mix.entries] \
            if used else []
        fut.set_result(cpb.MixReply(iteration=k, skip_to=skip, entries=entries))

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
            if src == self.rank:
                buf = self._buffer_for(k, False)
            else:
                rec = self.received.get((src, k))
                buf = rec.buffer if rec is not None else None
            if buf is not None and w > 0:
                parts.append((buf, w))
            elif buf is None:
                log.debug("mix entry (%d, %d) has no buffer; held: %s", src, k, sorted(self.received))
        self._combine(out, parts)
        return len(parts)

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
        argv = [sys.executable, "-m", "peerd.train.worker", "--task", s.task, "--iterations", str(s.iterations),
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
        env.update(PEERD_CONTROL_SOCKET=str(self.d.cfg.control_socket), PEERD_SESSION=self.session,
                   PEERD_RANK=str(self.rank), PEERD_WORLD=str(self.n), PEERD_SLOWDOWN=str(self.spec.slowdown),
                   PEERD_CHECKPOINT_DIR=str(self.checkpoint_dir), PEERD_RUN_ID=self.d.cfg.run_id)
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
                self.trainer = subprocess.Popen(self.trainer_argv(), env=self.trainer_env(), stdout=logf,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                log.info("trainer pid %d started (rank %d of %d, %s, %s); log %s", self.trainer.pid, self.rank,
                         self.n, self.spec.algorithm, self.spec.task or " ".join(self.spec.script), log_path)
                code = await asyncio.to_thread(self.trainer.wait)
            if code == 0:
                self.progress.state, self.progress.message = "done", "trainer finished"
                break
            if self.progress.state == "stopping":
                break
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
        if self.wire is not None:
            for base in ("model", "carry"):
                self.d.dataplane.set_layout(self.kind(base), None)
        self.done.set()

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def progress_message(self) -> cpb.TrainProgress:
        p = self.progress
        gap = p.newest_seen - p.iteration if p.newest_seen >= 0 else 0
        return cpb.TrainProgress(state=p.state, message=p.message, iteration=p.iteration, loss=p.loss,
                                 iterations_per_s=p.rate, peers_in_last_mix=p.peers_in_last_mix,
                                 gap_to_fastest=gap, elapsed_s=time.monotonic() - p.started,
                                 metric_name=p.metric_name, metric=p.metric, rank=self.rank, world=self.n,
                                 trainer_restarts=p.restarts, skipped=p.skipped, wall_time=time.time())

    def state(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.n, "algorithm": self.spec.algorithm,
                "policy": self.policy.state(), "held_updates": len(self.received),
                "dropped_nonfinite": self.dropped_nonfinite}


def form_world(daemon: "Daemon", world: int) -> list[str] | None:
    """This node and the first world-1 alive peers by node id, sorted: every host that sees the
    same swarm forms the same world. None while too few peers are alive."""
    alive = daemon.membership.alive()
    if len(alive) < world - 1:
        return None
    return sorted([daemon.node_id, *sorted(alive)[:world - 1]])


async def serve_train(daemon: "Daemon", request: cpb.TrainRequest, context: grpc.aio.ServicerContext):
    """The Train RPC: form the world, run the trainer, stream progress; the caller leaving stops it."""
    try:
        spec = RunSpec.from_request(request, daemon.cfg.train_join_timeout)
    except RunError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {e}")
    if daemon.training is not None:
        if not daemon.training.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "peerd: a training run is already active on this daemon")
        await daemon.training.stop()   # a finished run still serving its peers gives way
        daemon.end_run(daemon.training)
    started = time.monotonic()
    nodes = form_world(daemon, spec.world)
    while nodes is None:
        waited = time.monotonic() - started
        if waited > spec.join_timeout:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"peerd: only {len(daemon.membership.alive()) + 1} of {spec.world} hosts present "
                                f"after {spec.join_timeout:.0f}s")
        yield cpb.TrainProgress(state="waiting", world=spec.world, elapsed_s=waited,
                                message=f"{len(daemon.membership.alive()) + 1} of {spec.world} hosts present")
        await asyncio.sleep(0.5)
        nodes = form_world(daemon, spec.world)
    try:
        run = TrainingRun(daemon, spec, nodes)
    except (ValueError, RunError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {e}")
    daemon.start_run(run)
    log.info("run %s: rank %d of %d, %s on %s, world %s", daemon.cfg.run_id, run.rank, run.n, spec.algorithm,
             spec.topology, ", ".join(nodes))
    yield cpb.TrainProgress(state="waiting", rank=run.rank, world=run.n,
                            message=f"world formed: rank {run.rank} of {run.n}; starting the trainer")
    supervisor = asyncio.get_running_loop().create_task(run.supervise())
    try:
        while not run.done.is_set():
            try:
                await asyncio.wait_for(run.changed.wait(), daemon.cfg.train_progress_interval)
            except asyncio.TimeoutError:
                pass
            run.changed.clear()
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
    await asyncio.sleep(daemon.cfg.train_drain_timeout)
    if daemon.training is run:
        await run.stop()
        daemon.end_run(run)
