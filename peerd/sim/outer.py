"""DiLoCo in the simulator: outer rounds of inner steps driven through the very sync policies.

The trainer's side is peerd.train.outer.OuterOptimizer; this module plays it for every simulated
worker, on its quadratic shard (peerd.sim.objective), with the same rules:

- Inner steps: plain SGD x <- x - lr * g_i(x) on the worker's shard, one event per step; a step
  takes compute_time(i) simulated seconds (stragglers' factors and random slowdowns apply per step),
  so a sync's compute is the sum of its steps.
- A sync is one iteration k of the policy. Fragment p = k mod F (the flat parameters cut into F
  contiguous ranges on peerd.train.outer.fragment_bounds' bounds). When the sync is due the worker
  refreshes fragment p of its public model y from its local x (k = 0, or F = 1: all of y) and
  publishes y with `mass` = the inner steps since fragment p's last sync (1 at least; 1 for every
  publish when weigh_by_steps is off).
- Due: fixed H (`inner_steps`): every H // F inner steps since the previous publish; every worker
  then waits for the policy's mix, so the slowest sets the pace. Time budget (`round_seconds` T):
  when the simulated clock passes the worker's next sync time, first T / F after the start, then
  T / F after the previous one was due, moved by the wait for the mix when that wait exceeded a
  tenth of T / F, and never sooner than a quarter of T / F from the mix (OuterOptimizer's rule).
  A slow worker then takes fewer steps and its publish weighs less.
- Overlap tau: the mix of k is asked for (MixRequested) tau inner steps after k was published; the
  exchange crosses the simulated links meanwhile. tau = 0 asks at once. A sync still pending holds
  the next publish back, as in OuterOptimizer.
- The mix: the policy's Mix entries with weights w_ij * mass_j, renormalised (what the daemon's
  mixer does with masses, peerd.node.run.mixer). Then the outer Nesterov step on fragment p only:
      Delta = x_start - mix,  u <- mu u + Delta,  x_start <- x_start - outer_lr (Delta + mu u)
      x <- x_start + (x - y)       (the local progress of the tau overlap steps is kept)
  (without Nesterov: x_start <- x_start - outer_lr u). A Skip only moves the next iteration.
- The model evaluated (loss, consensus, time to target) is the mean over live workers of their
  x_start: the outer model, DiLoCo's result. A joiner starts from the lowest live worker's y.

Bytes (Wire): the sim models what the data plane puts on the wire, not the codec's rounding: every
worker's values stay exact float64. A message's bytes are those of peerd.net.copies: plain float32
(4 bytes a value; `bytes_per_param`), cast fp16/bf16 (2), or int8/int4 blockwise (128 values per
float32 scale, padded to 16 bytes: peerd.net.quant.segment_bytes, ~1.03 and ~0.53 bytes a value).
In copy mode (int8/int4, or F > 1) a push carries only its sync's fragment (k = 0: all of it) as
the increment of the public copy the receiver holds; a receiver that missed the sender's previous
version (a time-varying graph such as exp, where a sender pushes each iteration to another peer)
gets a keyframe instead: the whole copy, raw (4 bytes a value). So with a static graph a sync moves
about model bytes x codec factor / F per neighbour.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

CODECS = ("none", "fp16", "bf16", "int8", "int4")
FRAGMENT_ALIGN = 512      # peerd.train.outer.FRAGMENT_ALIGN (tests/test_sim_outer.py checks they agree)
QUANT_BLOCK, QUANT_ALIGN = 128, 16     # peerd.net.quant.BLOCK and ALIGN (likewise)


def fragment_bounds(total_bytes: int, fragments: int) -> list[tuple[int, int]]:
    """peerd.train.outer.fragment_bounds: F contiguous byte ranges, bounds on FRAGMENT_ALIGN."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    size = -(-total_bytes // fragments)
    size = -(-size // FRAGMENT_ALIGN) * FRAGMENT_ALIGN
    return [(lo, min(lo + size, total_bytes)) for lo in range(0, total_bytes, size)]


def wire_bytes(values: int, codec: str, bytes_per_param: int = 4) -> int:
    """Bytes of `values` parameters on the wire under `codec` (a float32 model: bytes_per_param 4)."""
    if codec not in CODECS:
        raise ValueError(f"compress: unknown codec {codec!r}; known: {', '.join(CODECS)}")
    if codec == "none" or bytes_per_param < 4:
        return values * bytes_per_param
    if codec in ("fp16", "bf16"):
        return values * 2
    bits = 8 if codec == "int8" else 4
    blocks = -(-values // QUANT_BLOCK)
    data = values if bits == 8 else (values + 1) // 2
    return -(-(4 * blocks + data) // QUANT_ALIGN) * QUANT_ALIGN      # peerd.net.quant.segment_bytes


def codec_factor(codec: str) -> float:
    """Wire bytes per float32 byte of a large model under `codec` (none 1, fp16 0.5, int8 ~0.258)."""
    return wire_bytes(1 << 20, codec) / float(4 << 20)


@dataclass(frozen=True)
class OuterSpec:
    """DiLoCo's settings, as OuterOptimizer takes them (same defaults)."""
    inner_steps: int = 0             # H: a fixed number of inner steps per round...
    round_seconds: float = 0.0       # ...or a wall-clock (simulated) budget T per round
    fragments: int = 1               # F
    overlap: int = 0                 # tau, inner steps
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    weigh_by_steps: bool = True

    def __post_init__(self) -> None:
        if (self.inner_steps > 0) == (self.round_seconds > 0):
            raise ValueError("outer: give exactly one of inner_steps (a fixed H) and round_seconds (a time budget)")
        if not 0 <= self.outer_momentum < 1 or self.outer_lr <= 0:
            raise ValueError(f"outer: outer_lr must be > 0 and outer_momentum in [0, 1), got "
                             f"{self.outer_lr}, {self.outer_momentum}")
        if self.overlap < 0 or self.fragments < 1:
            raise ValueError(f"outer: overlap must be >= 0 and fragments >= 1, got {self.overlap}, {self.fragments}")


class Wire:
    """Bytes of each model message, as peerd.net.copies sends it (see the module docstring)."""

    def __init__(self, n: int, params: int, bytes_per_param: int, codec: str,
                 bounds: list[tuple[int, int]] | None = None) -> None:
        self.params, self.bpp, self.codec = params, bytes_per_param, codec
        self.bounds = bounds or [(0, params)]
        self.full = wire_bytes(params, codec, bytes_per_param)
        self.copy_mode = codec in ("int8", "int4") or len(self.bounds) > 1
        self.version = [0] * n                      # each sender's copy version
        self.base = [0] * n                         # the version its current encoding applies to
        self.encoded: list[int | None] = [None] * n  # iteration of its current encoding
        self.known: dict[tuple[int, int], int] = {}  # (sender, receiver) -> version it holds
        self.keyframes = 0

    def message(self, i: int, dst: int, k: int) -> int:
        """Bytes of i's push of iteration k to dst (the receiver is assumed to take it)."""
        if not self.copy_mode:
            return self.full
        enc = self.encoded[i]
        if enc is not None and k < enc:          # older than the newest encoding: plainly quantized
            return self.full
        if enc != k:                             # the first push of k encodes it: the next version
            self.base[i], self.version[i], self.encoded[i] = self.version[i], self.version[i] + 1, k
        increment = self.base[i] == 0 or self.known.get((i, dst)) == self.base[i]
        self.known[(i, dst)] = self.version[i]
        if not increment:
            self.keyframes += 1
            return self.params * self.bpp            # the whole copy, raw
        if k == 0 or len(self.bounds) == 1:
            return self.full
        lo, hi = self.bounds[k % len(self.bounds)]
        return wire_bytes(hi - lo, self.codec, self.bpp)


class Outer:
    """Every simulated worker's DiLoCo state, driven by the Simulator (duck-typed `sim`: spec, X, obj,
    rng, now, computed, k, own, alive, compute_time, _publish, _value, request_mix, start_step)."""

    def __init__(self, sim: Any, spec: OuterSpec) -> None:
        s = sim.spec
        n = s.n
        self.sim, self.o = sim, spec
        self.bounds = [(lo // s.bytes_per_param, hi // s.bytes_per_param)
                       for lo, hi in fragment_bounds(s.params * s.bytes_per_param, spec.fragments)]
        self.F = len(self.bounds)
        X = sim.X
        self.XS = None if X is None else X.copy()       # x_start, the outer model
        self.Y = None if X is None else X.copy()        # y, the public model
        self.U = None if X is None else np.zeros_like(X)
        self.since = np.zeros((n, self.F), dtype=np.int64)   # inner steps since each fragment's sync
        self.since_sync = [0] * n
        self.pending: list[tuple[int, int, int] | None] = [None] * n   # (k, fragment, steps left)
        self.next_k = [0] * n
        self.period = spec.round_seconds / self.F
        self.per_sync = max(1, spec.inner_steps // self.F)
        self.next_sync = [self.period] * n
        self.mass: dict[tuple[int, int], float] = {}
        self.syncs = [0] * n

    # --- the worker's loop -------------------------------------------------------------------------
    def begin(self, i: int, k: int) -> None:
        """Worker i goes on with inner steps; its next publish is iteration k."""
        self.next_k[i] = k
        self.advance(i)

    def advance(self, i: int) -> None:
        """At a step boundary: ask for a pending sync's mix once its overlap is done, else publish
        when a sync is due, else take the next inner step."""
        p = self.pending[i]
        if p is not None:
            if p[2] <= 0:
                self.sim.request_mix(i, p[0])
                return
        elif self._due(i):
            self.sim._publish(i, self.next_k[i])
            return
        self.sim.start_step(i)

    def _due(self, i: int) -> bool:
        if self.o.inner_steps:
            return self.since_sync[i] >= self.per_sync
        return self.sim.now >= self.next_sync[i]

    def stepped(self, i: int) -> None:
        """Worker i finished an inner step (now): SGD on its shard, then what is due."""
        sim = self.sim
        if sim.X is not None:
            g = sim.obj.grad(i, sim.X[i], int(sim.rng.integers(1 << 30)))
            sim.X[i] -= sim.spec.lr * g
        sim.computed[i] += 1
        sim.last_progress = sim.now
        self.since[i] += 1
        self.since_sync[i] += 1
        p = self.pending[i]
        if p is not None:
            self.pending[i] = (p[0], p[1], p[2] - 1)
        self.advance(i)

    def snapshot(self, i: int, k: int) -> np.ndarray | None:
        """Publish k: refresh y's fragment from x, record the mass; y's read-only copy."""
        frag = k % self.F
        self.mass[(i, k)] = float(max(int(self.since[i, frag]), 1)) if self.o.weigh_by_steps else 1.0
        self.since[i, frag] = 0
        self.since_sync[i] = 0
        self.syncs[i] += 1
        if self.Y is None:
            return None
        lo, hi = (0, self.sim.spec.params) if k == 0 or self.F == 1 else self.bounds[frag]
        self.Y[i, lo:hi] = self.sim.X[i, lo:hi]
        snap = self.Y[i].copy()
        snap.flags.writeable = False
        return snap

    def published(self, i: int, k: int) -> None:
        self.pending[i] = (k, k % self.F, self.o.overlap)
        self.advance(i)

    def mixed(self, i: int, entries: tuple[tuple[int, int, float], ...], k: int, waited: float) -> None:
        """The policy's mix of k: the outer step on k's fragment."""
        p = self.pending[i]
        frag = p[1] if p is not None and p[0] == k else k % self.F
        self.pending[i] = None
        if self.o.round_seconds:
            per = self.period
            self.next_sync[i] += per + (waited if waited > 0.1 * per else 0.0)
            self.next_sync[i] = max(self.next_sync[i], self.sim.now + 0.25 * per)
        if self.XS is None:
            return
        lo, hi = self.bounds[frag]
        mix = self._combine(i, entries, lo, hi)
        xs, u = self.XS[i, lo:hi], self.U[i, lo:hi]
        delta = xs - mix
        mu = self.o.outer_momentum
        u *= mu
        u += delta
        xs -= self.o.outer_lr * (delta + mu * u if self.o.nesterov else u)
        x = self.sim.X[i, lo:hi]
        x += xs - self.Y[i, lo:hi]

    def _combine(self, i: int, entries: tuple[tuple[int, int, float], ...], lo: int, hi: int) -> np.ndarray:
        """sum_j w_ij m_j y_j / sum_j w_ij m_j over the entries, on [lo, hi)."""
        weights = [(src, k, w * self.mass.get((src, k), 1.0)) for src, k, w in entries]
        total = sum(w for _, _, w in weights)
        if not total > 0:
            raise ValueError(f"worker {i}: mix weights times masses sum to {total}")
        out = None
        for src, k, w in weights:
            v = self.sim._value(i, src, k)[lo:hi] * (w / total)
            out = v if out is None else out + v
        return out

    def join(self, i: int, src: int) -> None:
        """A late joiner starts from src's public model y (the exchange's `initial`)."""
        if self.Y is not None:
            self.sim.X[i] = self.XS[i] = self.Y[i] = self.Y[src]
            self.U[i] = 0.0
        self.since[i] = 0
        self.since_sync[i] = 0
        self.pending[i] = None
        self.next_sync[i] = self.sim.now + self.period

    def models(self) -> np.ndarray:
        return self.XS

    def sync_terms(self, step: np.ndarray, wire: Wire) -> tuple[np.ndarray, float]:
        """(expected compute per sync per worker, bytes of a sync's push) for LinkEstimates (AAU):
        H // F steps each, or the budget's T / F; one fragment's bytes."""
        c = step * self.per_sync if self.o.inner_steps else np.full_like(step, self.period)
        lo, hi = self.bounds[0]
        return c, float(wire.full if self.F == 1 else wire_bytes(hi - lo, wire.codec, wire.bpp))


def label(algorithm: str, topology: str, spec: OuterSpec | None, compress: str = "none") -> str:
    """A row's name: the algorithm alone, or e.g. `diloco/ring T=0.8s F=2 tau=4 int8`."""
    if spec is None:
        return algorithm + ("" if compress == "none" else f" {compress}")
    name = "diloco" + ("" if algorithm == "d-psgd" else f"({algorithm})") + f"/{topology} "
    name += f"H={spec.inner_steps}" if spec.inner_steps else f"T={spec.round_seconds:g}s"
    if spec.fragments > 1:
        name += f" F={spec.fragments}"
    if spec.overlap:
        name += f" tau={spec.overlap}"
    if not spec.weigh_by_steps:
        name += " equal"
    return name + ("" if compress == "none" else f" {compress}")
