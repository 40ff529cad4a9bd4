"""Where a trainer starts: its own checkpoint, a live neighbour's parameters, or the run's iteration.

- Joining a running swarm (a restarted daemon or a new host; the run's tag never changes): at the
  first attach, before the trainer's first publish, the daemon pulls a live neighbour's current
  parameters (answered from its published snapshot, never behind its mixing). When they are more
  than `train_join_min_lead` iterations ahead of this host's own checkpoint (same run, kept in the
  data dir), the trainer starts from them at the neighbour's iteration; otherwise it resumes from
  its own checkpoint. Either way the reason is logged and shown in the progress message.
- A restarted trainer resumes at the run's iteration, not its own: the daemon asks the live
  neighbours (RESUMING) for theirs and starts at the lowest of them (never behind itself), then
  resets its token edges as a PeerUp from each at its first publish (PeerLiveness.resync).
  Resuming where it crashed would hold the neighbours that ran on at Hop's gap bound. When its own
  checkpoint is more than `train_join_min_lead` iterations behind that point, it starts from a
  live neighbour's parameters, as a joiner does.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import torch

from peerd.net.dataplane import TransferError
from peerd.node.run.bounds import transfer_allowance
from peerd.node.run.context import RunContext
from peerd.node.run.liveness import PeerLiveness
from peerd.node.run.mixer import Mixer
from peerd.train.flat import all_finite
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import peer_pb2 as pb

log = logging.getLogger("peerd.train")
JOIN_REPLY_MARGIN = 2.0   # seconds of the Attach deadline kept for the reply after the join pulls


def checkpoint_iteration(directory: Path) -> int:
    """The iteration of the checkpoint in `directory` (-1: none or unreadable)."""
    path = directory / "latest.pt"
    if not path.is_file():
        return -1
    try:
        # mmap: the tensors stay on disk (a 1 GB model's checkpoint is not read to get one int)
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["iteration"])
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint is as good as none
        log.warning("checkpoint %s unreadable (%s); ignored", path, e)
        return -1


def checkpoint_dir(ctx: RunContext) -> Path:
    """This run's checkpoint directory: an unfinished one of the same run (same tag) left in the
    data dir by an earlier daemon of this host, else a new one."""
    root = ctx.env.data_dir / "checkpoints"
    run_id = ctx.cfg.node.run_id
    for old in sorted(root.glob(f"{run_id}-*"), key=lambda p: p.stat().st_mtime, reverse=True):
        if (old / "run-tag").is_file() and (old / "run-tag").read_text().strip() == ctx.tag:
            if 0 <= checkpoint_iteration(old) < ctx.spec.iterations:
                return old
    new = root / f"{run_id}-{ctx.session}"
    new.mkdir(parents=True, exist_ok=True)
    (new / "run-tag").write_text(ctx.tag + "\n")
    return new


class Resume:
    def __init__(self, ctx: RunContext, mixer: Mixer, liveness: PeerLiveness) -> None:
        self.ctx = ctx
        self.mixer = mixer
        self.liveness = liveness
        self.checkpoint_dir = checkpoint_dir(ctx)
        self.join_note = ""

    async def join_swarm(self, reply: cpb.AttachReply, budget: float | None = None) -> tuple[cpb.AttachReply, str]:
        """At the first attach: start from a live neighbour's parameters when the swarm is ahead of
        what this host holds. The pull asks for an iteration past this host's own checkpoint by more
        than join_min_lead, so a calm start (everyone near the beginning) or a restart that is not
        behind moves no model: each neighbour answers NOT_FOUND. Each pull is bounded by
        join_pull_timeout plus the model's transfer allowance over the measured link (a big model
        over a WAN takes minutes), all within `budget` (the trainer's Attach deadline). Returns the
        reply and the note ("" when nothing was decided)."""
        ctx = self.ctx
        if ctx.policy.k >= 0 or self.join_note:
            return reply, ""                 # a restarted trainer of a run already under way here
        cfg = ctx.cfg.train
        own = checkpoint_iteration(self.checkpoint_dir)
        pulled, not_ahead = await self._pull_ahead(max(own, 0) + cfg.join_min_lead + 1, reply, budget)
        if pulled:
            note = (f"started from {pulled}'s parameters of iteration {reply.start_iteration}: "
                    + (f"own checkpoint (iteration {own}) is older" if own >= 0 else "no own checkpoint"))
        else:
            if own < 0 or not not_ahead:
                return reply, ""             # a calm start, or nobody answered
            note = (f"resumed from own checkpoint of iteration {own}: no live neighbour "
                    f"({', '.join(not_ahead)}) is more than {cfg.join_min_lead} iterations ahead")
        if not ctx.policy.pulls:
            # Our RESUMING notice tells each member that our run is back (they re-admit us and
            # push us their newest now, not during the pull) and asks for its iteration. The
            # swarm went on while the parameters crossed a slow link: we start at the lowest
            # iteration of our live neighbours, as a restarted trainer does, or every neighbour
            # would wait on us until we had computed our way up to it.
            # Members with nothing published in this run (their trainer is starting too: several
            # hosts restarted together) are absent until their first update, not waited on for
            # train_silent_peer_timeout at our first mixes. Not under a pull policy: it gets no
            # update it did not ask for, and it would never ask an absent member, so it would
            # leave that member out for the whole run (a pull of a trainer still starting fails
            # within its bound); there a pull re-admits (TrainingRun.serve_pull).
            theirs = await self.member_iterations()
            for i, k in theirs.items():
                if k < 0:
                    self.liveness.set_absent(i, "restarting")
            lowest = min((k for k in theirs.values() if k >= 0), default=-1)
            if reply.start_from_slot and lowest > reply.start_iteration:
                note += f"; continuing at iteration {lowest}, the lowest of its live neighbours'"
                reply.start_iteration = lowest
        self.join_note = reply.join_note = note
        log.info("join: %s", note)
        return reply, note

    async def catch_up(self, reply: cpb.AttachReply, budget: float | None = None) -> tuple[cpb.AttachReply, str]:
        """A restarted trainer resumes at the run's iteration (resume_point) but from its own
        checkpoint, which may be far older: checkpoints come every train_checkpoint_every
        iterations, and the run went on while it was down. More than join_min_lead behind, it
        starts from a live neighbour's parameters instead (pulled as a joiner's are; nobody waits
        on it meanwhile: its neighbours hold it absent until its next update), keeping its
        iteration. Returns the reply and the note ("" when its own checkpoint is recent).

        Not for the low-communication mode (its outer state, restored from the checkpoint, is
        tied to the checkpoint's parameters), nor for a script without peerd's checkpoint (it may
        restore from its own files, which peerd cannot date)."""
        spec = self.ctx.spec
        if spec.options.get("outer", "none") != "none":
            return reply, ""
        own = checkpoint_iteration(self.checkpoint_dir)
        lead = self.ctx.cfg.train.join_min_lead
        if (own < 0 and spec.script) or reply.start_iteration - max(own, 0) <= lead:
            return reply, ""
        start = reply.start_iteration
        pulled, _ = await self._pull_ahead(max(own, 0) + lead + 1, reply, budget)
        if not pulled:
            return reply, ""
        note = (f"trainer restarted from {pulled}'s parameters of iteration {reply.start_iteration} at iteration "
                f"{max(start, reply.start_iteration)}: " + (f"own checkpoint (iteration {own}) is older" if own >= 0
                                                            else "no own checkpoint"))
        reply.start_iteration = max(start, reply.start_iteration)
        reply.join_note = note
        log.info("%s", note)
        return reply, note

    async def _pull_ahead(self, wanted: int, reply: cpb.AttachReply,
                          budget: float | None) -> tuple[str, list[str]]:
        """Pull the first live neighbour's parameters of iteration `wanted` or later into slot 0
        (reply.start_iteration and start_from_slot set); returns who answered them ("" when
        nobody did) and who had nothing that far ahead."""
        env, cfg = self.ctx.env, self.ctx.cfg.train
        layout = self.mixer.layout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (cfg.attach_timeout if budget is None else budget) - JOIN_REPLY_MARGIN
        not_ahead: list[str] = []
        for node in self._candidates():
            member = env.membership.get(node)
            if member is None:
                continue
            bound = min(cfg.join_pull_timeout + transfer_allowance(env, layout.total_bytes, node),
                        deadline - loop.time())
            if bound <= 0:
                log.warning("join: the trainer's Attach deadline is spent (train_attach_timeout, or the "
                            "trainer's own); starting without the swarm's parameters")
                break
            t0 = loop.time()
            try:
                rec = await asyncio.wait_for(env.peers.pull_tensor(member.address, node, kind=self.ctx.kind("model"),
                                                                   min_iteration=wanted), bound)
            except (TransferError, grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
                if getattr(e, "code", None) == grpc.StatusCode.NOT_FOUND:
                    not_ahead.append(node)   # nothing at or after `wanted` (or nothing yet)
                else:
                    log.info("join: no parameters from %s within %.0f s (%s)", node, bound,
                             getattr(e, "reason", type(e).__name__))
                continue
            try:
                if rec.nbytes != layout.total_bytes or not all(all_finite(t) for t in layout.typed(rec.buffer)):
                    log.warning("join: parameters from %s unusable (size or NaN/Inf); trying another", node)
                    continue
                log.info("join: %.0f MB of parameters from %s in %.1f s", rec.nbytes / 1e6, node, loop.time() - t0)
                await self.mixer.passes.submit(self.mixer.slots[0].copy_, rec.buffer)
                reply.start_iteration, reply.start_from_slot = rec.iteration, True
                return node, not_ahead
            finally:
                rec.release()
        return "", not_ahead

    def _candidates(self) -> list[str]:
        """Live run members, nearest rank first (a ring neighbour is freshest)."""
        ctx = self.ctx
        live = [m for m in ctx.nodes if m and m != ctx.env.node_id and ctx.env.alive(m, suspect=False)]
        return sorted(live, key=lambda m: min((ctx.rank_of(m) - ctx.rank) % ctx.n,
                                              (ctx.rank - ctx.rank_of(m)) % ctx.n))

    async def member_iterations(self, quiet: bool = False, every: bool = False) -> dict[int, int]:
        """Every other member's iteration in this run, asked with a RESUMING notice (bounded by
        rpc_timeout); -1 where its trainer has published nothing in this run, or it did not answer.
        Members the policy holds dead or absent are not asked unless `every`."""
        ctx = self.ctx

        async def ask(i: int) -> tuple[int, int]:
            m = ctx.member(i)
            if m is None or (i in ctx.policy.dead and not every):
                return i, -1
            try:
                return i, await ctx.env.peers.notice_trainer(m.address, ctx.tag, pb.TrainerNotice.STATE_RESUMING,
                                                             ctx.policy.k)
            except grpc.aio.AioRpcError as e:
                log.log(logging.DEBUG if quiet else logging.INFO, "%s did not answer: %s", ctx.nodes[i],
                        e.code().name)
                return i, -1
        return dict(await asyncio.gather(*(ask(i) for i in ctx.others())))

    async def resume_point(self) -> int:
        """The lowest iteration of the live neighbours; they are re-synchronised as PeerUp at our
        first publish."""
        self.liveness.resync = {i: k for i, k in (await self.member_iterations()).items() if k >= 0}
        start = min(self.liveness.resync.values(), default=-1)
        log.info("trainer restarted: resuming at iteration %d (own %d, neighbours %s)",
                 max(start, self.ctx.policy.k + 1), self.ctx.policy.k, self.liveness.resync)
        return start
