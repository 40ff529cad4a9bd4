"""DiLoCo: outer rounds of many local steps, exchanged rarely, heterogeneity-aware and decentralized.

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = OuterOptimizer(model.parameters(), exchange, inner, round_seconds=60)
    for batch in batches:
        opt.zero_grad()
        loss(model, batch).backward()
        opt.step()                 # the inner step; at a sync point also the exchange and outer step

Per round (Douillard et al. 2023): H inner steps with the inner optimizer from x_start, then the
outer gradient Delta = x_start - mix(x_local) and x_start <- x_start - outer_lr * Nesterov(Delta),
with outer SGD momentum 0.9 and lr 0.7 by default. The exchange is peerd's, so the mix is the run's
algorithm on the run's graph:

- ``--topology complete`` with D-PSGD is DiLoCo as published (every host's model averaged);
- a sparse graph (ring, exponential) is decentralized DiLoCo: each host averages its neighbours'
  models. Mixing the models rather than only the pseudo-gradients is what keeps the hosts' x_start
  together (the outer step pulls each towards its neighbourhood, as gossip does; with pseudo-
  gradients alone nothing ever would). With every x_start equal (complete graph) the two are the
  same thing. What crosses the wire is still the change: with ``--compress int8`` the data plane
  sends increments of its public copy (peerd.net.copies), so a round costs about what its
  pseudo-gradient does.

Heterogeneity: a round is a wall-clock budget (``round_seconds``), not a fixed H: a host half as
fast takes half the inner steps. Its model is weighted in every mix by the inner steps it took
(the publish's mass): Sum_j w_ij s_j x_j / Sum_j w_ij s_j. Why by steps: each inner step is one
minibatch of gradient information, so weighting by steps counts every minibatch once, as data-
parallel training would; weighting hosts equally would let a slow host's short, noisier walk pull
as hard as a fast host's long one. ``inner_steps`` instead fixes H (every host waits for the
slowest at each sync: the baseline the time budget is measured against).

Streaming (Douillard et al. 2025): ``fragments`` F > 1 splits the flat parameters into F contiguous
byte ranges; fragment p syncs every round at offset p/F of it, so a sync moves 1/F of the model and
the syncs spread over the round. ``overlap`` tau: the mix of a sync is collected tau inner steps
after it is published (the exchange crosses the network meanwhile); the fragment then takes its
outer step and keeps the local progress of those tau steps: x_local <- x_start' + (x_local - y),
y being what was published. tau = 0 waits for the mix at once.

The published buffer y is this host's public model: fragment p of y is refreshed to x_local at
fragment p's sync, the rest stays as last sent. So a host that joins a run under way starts from
a neighbour's y (the exchange's ``initial``), the data plane sends only the fragment that changed
(the publish names its byte range), and a mix of y is meaningful everywhere.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from peerd.train.exchange import Exchange
from peerd.train.flat import FlatParams, all_finite, parse_dtype

DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9   # Douillard et al. 2023, with an inner AdamW
FRAGMENT_ALIGN = 512       # fragment bounds: whole blocks of the int8 codec (128 float32)


@dataclass(frozen=True)
class Piece:
    run: int               # index into the layout's typed runs
    lo: int                # element range within that run
    hi: int


def fragment_bounds(total_bytes: int, fragments: int) -> list[tuple[int, int]]:
    """F contiguous byte ranges covering the buffer, bounds on FRAGMENT_ALIGN (the last may be
    shorter; an empty tail fragment is dropped, so there may be fewer than F)."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    size = -(-total_bytes // fragments)
    size = -(-size // FRAGMENT_ALIGN) * FRAGMENT_ALIGN
    return [(lo, min(lo + size, total_bytes)) for lo in range(0, total_bytes, size)]


class OuterOptimizer:
    """DiLoCo around `inner` (a torch optimizer over the same parameters, or "adamw"/"sgd" with
    `lr`, `betas`, `weight_decay`). `iteration` is the exchange's iteration: one per sync."""

    def __init__(self, params: Iterable[Any], exchange: Exchange,
                 inner: torch.optim.Optimizer | str = "adamw", *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0, momentum: float = 0.0,
                 outer_lr: float = DILOCO_OUTER_LR, outer_momentum: float = DILOCO_OUTER_MOMENTUM, nesterov: bool = True,
                 inner_steps: int = 0, round_seconds: float = 0.0, fragments: int = 1, overlap: int = 0,
                 weigh_by_steps: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        if (inner_steps > 0) == (round_seconds > 0):
            raise ValueError("give exactly one of inner_steps (a fixed H) and round_seconds (a time budget)")
        if not 0 <= outer_momentum < 1 or outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1): {outer_lr}, {outer_momentum}")
        if overlap < 0:
            raise ValueError(f"overlap must be >= 0, got {overlap}")
        params = list(params)
        names = None
        if params and isinstance(params[0], tuple):
            names, params = [[n for n, _ in params]], [p for _, p in params]
        self.flat = FlatParams([params], names)
        self.layout = self.flat.layout
        if isinstance(inner, str):
            if inner in ("adam", "adamw"):
                inner = torch.optim.AdamW(self.flat.params, lr=lr, betas=betas, weight_decay=weight_decay)
            elif inner == "sgd":
                inner = torch.optim.SGD(self.flat.params, lr=lr, momentum=momentum, weight_decay=weight_decay)
            else:
                raise ValueError(f"inner optimizer {inner!r}: adam(w), sgd or a torch.optim.Optimizer")
        self.inner = inner
        self.exchange = exchange
        self.iteration = exchange.attach(self.layout)
        initial = getattr(exchange, "initial", None)
        if initial is not None:        # joining a run under way: a neighbour's public model
            self.flat.buffer.copy_(initial)
        self.joined = initial is not None
        self.x_start = self.flat.buffer.clone()
        self.public = self.flat.buffer.clone()        # y: what was published, fragment by fragment
        self.momentum = torch.zeros_like(self.flat.buffer)
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.inner_steps, self.round_seconds = inner_steps, round_seconds
        self.bounds = fragment_bounds(self.layout.total_bytes, fragments)
        self.pieces = [self._pieces(lo, hi) for lo, hi in self.bounds]
        self.overlap = overlap
        self.weigh_by_steps = weigh_by_steps
        self.clock = clock
        self.steps = 0                                 # inner steps taken, in all
        self.since = [0] * len(self.bounds)            # inner steps since each fragment's last sync
        self.since_sync = 0                            # inner steps since the last sync of any
        self.pending: tuple[int, int, int] | None = None   # (iteration, fragment, steps left) of a sync in flight
        self.period = round_seconds / len(self.bounds)
        self.next_sync = clock() + self.period
        self.stats = dict(syncs=0, mixed=0, unmixed=0, nonfinite_grads=0, nonfinite_mix=0, wait_s=0.0,
                          fewest_steps=0, most_steps=0)   # inner steps between two syncs

    # -- the training loop's calls -----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        self.flat.zero_grad()

    @torch.no_grad()
    def step(self) -> bool:
        """One inner step (skipped when the gradient holds NaN/Inf); then the sync work due now.
        True when a sync's outer step was applied in this call."""
        if not self.flat.grads_in_place():
            self.flat.repair_grads()
        if all(all_finite(g) for g in self.flat.views(self.flat.grad_buffer)):
            self.inner.step()
        else:
            self.stats["nonfinite_grads"] += 1
        self.steps += 1
        self.since_sync += 1
        self.since = [s + 1 for s in self.since]
        applied = False
        if self.pending is not None:
            k, frag, left = self.pending
            self.pending = (k, frag, left - 1)
            if left <= 1:
                self._finish(k, frag)
                applied = True
        if self.pending is None and self._due():
            self._publish()
            if self.overlap == 0:
                k, frag, _ = self.pending
                self._finish(k, frag)
                applied = True
        return applied

    def finish(self) -> None:
        """Collect a sync still in flight (the end of training)."""
        if self.pending is not None:
            k, frag, _ = self.pending
            self._finish(k, frag)

    def summary(self) -> str:
        st = self.stats
        return (f"{st['syncs']} syncs ({st['mixed']} mixed, {st['unmixed']} alone), {self.steps} inner steps "
                f"({st['fewest_steps']}-{st['most_steps']} between two syncs), {st['wait_s']:.1f} s waiting for mixes")

    # -- sync points ---------------------------------------------------------------------------------------
    def _due(self) -> bool:
        if self.inner_steps:
            return self.since_sync >= max(1, self.inner_steps // len(self.bounds))
        return self.clock() >= self.next_sync

    def _publish(self) -> None:
        k = self.iteration
        frag = k % len(self.bounds)
        lo, hi = self.bounds[frag]
        if k == 0 or len(self.bounds) == 1:
            self.public.copy_(self.flat.buffer)      # the first publish is the whole model
        else:
            self.public[lo:hi].copy_(self.flat.buffer[lo:hi])
        mass = float(max(self.since[frag], 1)) if self.weigh_by_steps else 1.0
        # With fragments, the publish names the bytes that changed: the data plane sends only those.
        ranges = None if len(self.bounds) == 1 else ((0, self.layout.total_bytes) if k == 0 else (lo, hi))
        self.exchange.publish(k, self.public, mass=mass, ranges=ranges)
        st = self.stats
        st["fewest_steps"] = min(st["fewest_steps"] or self.since_sync, self.since_sync)
        st["most_steps"] = max(st["most_steps"], self.since_sync)
        self.since[frag] = 0
        self.since_sync = 0
        self.pending = (k, frag, self.overlap)
        self.stats["syncs"] += 1

    def _finish(self, k: int, frag: int) -> None:
        t0 = self.clock()
        res = self.exchange.mix(k)
        waited = self.clock() - t0
        self.stats["wait_s"] += waited
        self.pending = None
        if res.params is None:
            self.stats["unmixed"] += 1
            mix = self.public
        else:
            mix = res.params if res.params.device == self.flat.device else res.params.to(self.flat.device)
        self._outer_step(frag, mix)
        self.iteration = res.skip_to if res.skip_to is not None and res.skip_to > k else k + 1
        if self.round_seconds:
            # The next sync one period after this one was due. A host that waited long for its
            # neighbours was early: its schedule moves by the wait, so the hosts stay aligned.
            self.next_sync += self.period + (waited if waited > 0.1 * self.period else 0.0)
            self.next_sync = max(self.next_sync, self.clock() + 0.25 * self.period)

    def _outer_step(self, frag: int, mix: torch.Tensor) -> None:
        typed = self.layout.typed
        xs, u, x, y, m = (typed(b) for b in (self.x_start, self.momentum, self.flat.buffer, self.public, mix))
        pieces = self.pieces[frag]
        if not all(all_finite(m[p.run][p.lo:p.hi]) for p in pieces):
            self.stats["nonfinite_mix"] += 1      # never applied: this fragment goes on locally
            return
        self.stats["mixed"] += 1
        mu, lr = self.outer_momentum, self.outer_lr
        for p in pieces:
            s = slice(p.lo, p.hi)
            delta = xs[p.run][s] - m[p.run][s]           # the outer gradient
            buf = u[p.run][s]
            buf.mul_(mu).add_(delta)
            step = delta.add_(buf, alpha=mu) if self.nesterov else buf
            xs[p.run][s].sub_(step, alpha=lr)
            # x <- x_start' + (x - y): the local progress since the publish (overlap) is kept
            x[p.run][s].sub_(y[p.run][s]).add_(xs[p.run][s])

    def _pieces(self, lo: int, hi: int) -> list[Piece]:
        out = []
        for i, r in enumerate(self.layout.runs()):
            size = parse_dtype(r.dtype).itemsize
            a, b = max(lo, r.offset), min(hi, r.offset + r.numel * size)
            if a < b:
                out.append(Piece(i, (a - r.offset) // size, (b - r.offset) // size))
        return out

    def seed_moments(self, warm) -> None:
        """Start the inner Adam from a warm start's moments (peerd.train.warmstart)."""
        from peerd.train.warmstart import seed_torch_adam
        seed_torch_adam(self.inner, warm)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "x_start": self.x_start.clone(), "public": self.public.clone(),
                "momentum": self.momentum.clone(), "steps": self.steps, "since": list(self.since),
                "iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state. A host that joined from a neighbour's model (its own checkpoint
        older than the run) keeps the outer state that model gave it: the checkpoint's x_start and
        public copy belong to the checkpoint's parameters, and its momentum to that old round
        (the first outer step would add the distance between the two models once more)."""
        self.inner.load_state_dict(state["inner"])
        for name in () if self.joined else ("x_start", "public", "momentum"):
            getattr(self, name).copy_(state[name])
        self.steps = int(state["steps"])
        since = [int(s) for s in state["since"]]
        if len(since) == len(self.since):
            self.since = since


__all__ = ["OuterOptimizer", "fragment_bounds"]
