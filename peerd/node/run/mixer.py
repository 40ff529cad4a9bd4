"""The mix: the trainer's shared-memory slots, and the weighted sums written into them.

The trainer and the daemon share two memory-mapped slot files. Publish(k, slot) is snapshotted
(peerd.node.run.snapshots); Mix(k, slot) is answered by writing sum(w * params) straight into the
slot the trainer names, with one pass per entry over the flat buffer, per typed run of the layout
(no per-tensor loop).

Two ways the work moves off the trainer's critical path:
- eager mix: a policy whose mix of k is fully determined by the iteration-k updates
  (`Policy.eager_mix`: D-PSGD, Hop's standard mode) is asked for it at Published(k); the mix is
  computed into the slot the trainer did not publish into, while it runs forward/backward, and
  Mix(k) only answers;
- incremental mix: for a policy with a preview (Hop's backup and staleness modes) the sum is kept
  up to date while updates arrive, from Publish(k) on, into that same free slot
  (peerd.node.run.mixacc).
AD-PSGD's passive `Average` (replace my working parameters now) is applied at the next Mix, on top
of the mix result: the trainer owns its working parameters between Publish and Mix.

The arithmetic runs in the run's pass thread (peerd.node.run.passes), never on the event loop:
`compute` decides what to sum and submits it; `deliver` resolves once the mix is in the slot.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from peerd.net import tensorwire as tw
from peerd.node.run.context import RunContext
from peerd.node.run.eagersum import EagerSum
from peerd.node.run.inbound import HeldUpdates
from peerd.node.run.mixacc import MixAccumulator, summable
from peerd.node.run.passes import Passes
from peerd.node.run.snapshots import Snapshots
from peerd.sync import events as ev
from peerd.train.flat import Layout

log = logging.getLogger("peerd.train")


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


class Slot:
    """One shared-memory slot: an anonymous memory file (memfd) that no crash can leave behind,
    which the trainer maps through /proc/<daemon pid>/fd/<fd>; a named file in /dev/shm where
    memfd_create is missing (removed when the run ends, or at the daemon's next start)."""

    def __init__(self, nbytes: int, fallback: Path) -> None:
        self.fd: int | None = None
        if hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir():
            self.fd = os.memfd_create(fallback.name, 0)
            os.ftruncate(self.fd, max(nbytes, 1))
            self.path = Path(f"/proc/{os.getpid()}/fd/{self.fd}")
            self.tensor = map_slot(Path(f"/proc/self/fd/{self.fd}"), nbytes, create=False)
        else:
            self.path = fallback
            fd = os.open(fallback, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
            self.tensor = map_slot(fallback, nbytes, create=True)

    def close(self) -> None:
        """The daemon's side is done with it; the memory goes once the trainer unmaps it too."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        else:
            self.path.unlink(missing_ok=True)


Entry = tuple[int, int, float]                 # (source rank, iteration, weight)


@dataclass
class MixJob:
    mix: ev.Mix
    sources: set[int]                          # the ranks whose parameters are in it
    staged: torch.Tensor | None                # computed before the trainer asked: copied at delivery
    done: asyncio.Future                       # the passes that compute it


def _combine(layout: Layout, out: torch.Tensor, parts: list[tuple[torch.Tensor, float]]) -> None:
    """out = sum of w * buf over parts (weights renormalised), per typed run of the layout (a few
    large ops, no per-tensor loop). A part may be a holder list filled by an earlier pass."""
    if not parts:
        return
    total = sum(w for _, w in parts)
    outs = layout.typed(out)
    first = True
    for buf, w in parts:
        if isinstance(buf, list):
            buf = buf[0]
        for o, t in zip(outs, layout.typed(buf)):
            if first:
                torch.mul(t, w / total, out=o)
            else:
                o.add_(t, alpha=w / total)
        first = False


def _average_into(layout: Layout, out: torch.Tensor, captured) -> None:
    """AD-PSGD's passive average, applied on top of this iteration's mix (None: the mix itself)."""
    parts = [(out.clone() if buf is None else buf, w) for buf, w in captured if w > 0]
    _combine(layout, out, [(b, w) for b, w in parts if b is not None])


class Mixer:
    def __init__(self, ctx: RunContext, snapshots: Snapshots, updates: HeldUpdates, passes: Passes) -> None:
        self.ctx = ctx
        self.snapshots = snapshots
        self.updates = updates
        self.passes = passes
        self.layout: Layout | None = None
        self.wire: tw.Layout | None = None
        self.slots: list[torch.Tensor] = []
        self.slot_files: list[Slot] = []
        self.mix_slot = 0                      # the slot the trainer's pending Mix names
        self.eager = ctx.policy.eager_mix
        self.eager_k = -1                      # iteration whose mix was requested at publish
        self.eager_slot = 0
        self.acc: MixAccumulator | None = None  # the incremental mix (set at attach where it applies)
        self.sums: EagerSum | None = None       # the eager mix summed as bytes arrive (where it applies)
        self.attached = asyncio.Event()         # set_layout ran (the first trainer attached)
        self.ready: dict[int, MixJob] = {}     # k -> its mix, submitted
        self.pending_average: list[tuple[tuple[list | None, float], ...]] = []

    # --- set-up -----------------------------------------------------------------------------------
    def set_layout(self, layout: Layout, slot_dir: Path) -> None:
        """The run's layout, from the first trainer that attached: map the two slots."""
        self.layout = layout
        self.wire = wire_layout(layout)
        for base in ("model", "carry"):
            self.ctx.env.set_layout(self.ctx.kind(base), self.wire)
        self.slot_files = [Slot(layout.total_bytes, slot_dir / f"peerd-{self.ctx.env.node_id}-{self.ctx.session}-{i}")
                           for i in range(2)]
        self.slots = [s.tensor for s in self.slot_files]
        if not self.eager and self.ctx.policy.has_preview and summable(layout):
            self.acc = MixAccumulator(layout, run=self.passes.submit)
        if self.eager and summable(layout) and self.ctx.cfg.train.sum_on_arrival:
            self.sums = EagerSum(self.ctx, self.passes, self.wire, layout.total_bytes,
                                 own_norm=lambda: (st := self.snapshots.live_stats()) and st.norm,
                                 held=lambda key: key in self.updates.received)
        self.attached.set()

    def withdraw(self, key: tuple[int, int], buffer: torch.Tensor) -> None:
        """A held update is about to be freed: out of the running sum with the values that went in."""
        if self.acc is not None:
            self.acc.withdraw(key, buffer)

    # --- publish ----------------------------------------------------------------------------------
    def published(self, k: int, slot: int, request_mix: Callable[[int], None]) -> None:
        """Iteration k was published from `slot`: the other slot is free until Mix(k) names it."""
        if self.eager:
            self.eager_k, self.eager_slot = k, 1 - slot
            if self.sums is not None:
                self.sums.open(k, self.slots[self.eager_slot])
            request_mix(k)
        elif self.acc is not None:
            self.acc.start(k, self.slots[1 - slot])
            self.accumulate()

    def accumulate(self) -> None:
        """Bring the incremental mix up to what the policy would mix now."""
        acc = self.acc
        if acc is None or acc.k < 0:
            return
        if acc.k != self.ctx.policy.k:
            acc.stop()
            return
        acc.sync(self.ctx.policy.preview(acc.k), self.part_buffer)

    # --- the mix --------------------------------------------------------------------------------
    def compute(self, mix: ev.Mix, waiting: bool) -> None:
        """Write the mix of iteration k into the slot the trainer asked for (`waiting`), or into a
        staging buffer when the policy mixes before the trainer asks."""
        waiting = waiting and self.layout is not None
        mix = self._massed(mix)
        sources = {s for s, k, w in mix.entries if w > 0 and self.part_buffer(s, k) is not None}
        if waiting:
            out, staged = self.slots[self.mix_slot], None
        elif mix.k == self.eager_k:
            out = staged = self.slots[self.eager_slot]   # free: the trainer published into the other one
        else:
            out = staged = torch.empty(self.layout.total_bytes, dtype=torch.uint8)
        used = None
        if self.sums is not None and (summed := self.sums.mix(mix, out, self.part_buffer)) is not None:
            sources, used = summed, len(summed)
        elif self.acc is not None and self.acc.k == mix.k:
            if waiting and self.acc.out.data_ptr() == out.data_ptr():
                used = self.acc.finish(mix.k, mix.entries, self.part_buffer)
            else:
                self.acc.stop()
        if used is None:
            used = self.weighted_sum(out, mix.entries)
        for captured in self.pending_average:
            self.passes.submit(_average_into, self.layout, out, captured)
        self.pending_average.clear()
        done = self.passes.submit(lambda: None)     # every pass above, in order
        self.ready[mix.k] = MixJob(mix, sources if used else set(), staged, done)

    def _massed(self, mix: ev.Mix) -> ev.Mix:
        """The policy's weights times each update's mass (what its trainer published with it, e.g.
        DiLoCo's inner steps; 1 when none was given), renormalised with them over what is mixed."""
        masses = [self.part_mass(s, k) for s, k, _w in mix.entries]
        if all(m == 1.0 for m in masses):
            return mix
        return dataclasses.replace(mix, entries=tuple((s, k, w * m) for (s, k, w), m in zip(mix.entries, masses)))

    def part_mass(self, src: int, k: int) -> float:
        if src == self.ctx.rank:
            return self.snapshots.mass.get(self.snapshots.resolve(k), 1.0)
        rec = self.updates.received.get((src, k))
        return rec.mass if rec is not None else 1.0

    def deliver(self, k: int) -> asyncio.Future | None:
        """Once the computed mix of k is in the trainer's mix slot: (the mix, the sources used)."""
        job = self.ready.pop(k, None)
        if job is None:
            return None
        slot = self.slots[self.mix_slot]
        if job.staged is not None and job.staged.data_ptr() != slot.data_ptr():
            done = self.passes.submit(slot.copy_, job.staged)
        else:
            done = job.done
        out = asyncio.get_running_loop().create_future()

        def finished(f: asyncio.Future) -> None:
            if out.done():
                return
            if f.cancelled() or f.exception() is not None:
                out.set_exception(f.exception() or RuntimeError("mix cancelled"))
            else:
                out.set_result((job.mix, job.sources))
        done.add_done_callback(finished)
        return out

    def capture_average(self, a: ev.Average) -> None:
        """AD-PSGD's passive average, applied on top of this worker's next mix. The buffers are
        copied now (a pass): the policy drops the carried update in the same batch."""
        self.pending_average.append(tuple(
            (None if (src == self.ctx.rank and k == ev.CURRENT) else self._entry_copy(src, k), w)
            for src, k, w in a.entries))

    def _entry_copy(self, src: int, k: int) -> list | None:
        """A holder the pass thread fills with a copy of entry (src, k) (None: not held)."""
        buf = self.snapshots.buffer(k) if src == self.ctx.rank else self.updates.buffer(src, k)
        if buf is None:
            return None
        holder: list = []
        self.passes.submit(lambda: holder.append(buf.clone()))
        return holder

    def weighted_sum(self, out: torch.Tensor, entries: tuple[Entry, ...]) -> int:
        """out = sum(w * params(src, k)); weights renormalised over the buffers actually present.
        Submits the pass; returns how many buffers it uses."""
        parts = []
        for src, k, w in entries:
            buf = self.part_buffer(src, k)
            if buf is not None and w > 0:
                parts.append((buf, w))
            elif buf is None:
                log.debug("mix entry (%d, %d) has no buffer; held: %s", src, k, sorted(self.updates.received))
        self.passes.submit(_combine, self.layout, out, parts)
        return len(parts)

    def part_buffer(self, src: int, k: int) -> torch.Tensor | None:
        """The parameters of the mix entry (src, k), if held."""
        if src == self.ctx.rank:
            return self.snapshots.buffer(k)
        return self.updates.buffer(src, k)

    # --- the end ----------------------------------------------------------------------------------
    @property
    def slot_paths(self) -> list[Path]:
        """What the trainer maps."""
        return [s.path for s in self.slot_files]

    def close(self) -> None:
        for s in self.slot_files:
            s.close()
        if self.acc is not None:
            log.info("incremental mix: %d mixes from the running sum, %d summed in full, %d passes in the sum",
                     self.acc.hits, self.acc.misses, self.acc.passes)
        if self.wire is not None:
            for base in ("model", "carry"):
                self.ctx.env.set_layout(self.ctx.kind(base), None)

    def state(self) -> dict | None:
        if self.acc is None:
            return None
        return {"hits": self.acc.hits, "misses": self.acc.misses, "passes": self.acc.passes}
