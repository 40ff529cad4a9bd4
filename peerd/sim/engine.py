"""Discrete-event simulator: N workers, each driven by its own sync policy object (the very classes
the daemon drives), over simulated compute and links.

Model:
- Worker i's iteration k: publish x_k (snapshot), compute the gradient at x_k for compute_time(i, k)
  seconds, deliver MixRequested(k); when the policy emits Mix(k), x_{k+1} = mix - lr * g, and the
  worker publishes k+1 (or Skip's target) at once.
- compute_time = base * factor_i * (slow_factor with probability p_slow, drawn per iteration).
- Links are directed FIFO pipes: a message of B bytes on link a->b starts when the link is free,
  occupies it B / bandwidth[a, b] seconds, and arrives latency[a, b] later. Control messages (pull
  requests without data) take the latency only.
- Sender (`sender="daemon"`, the default: what peerd.node.run.outbound does): a worker's pushes (Send)
  and token grants (Grant) to one destination go through one ordered queue, and each is an RPC whose
  reply is awaited before the next starts. An update starts when the queue's previous item was
  answered (and the link is free), arrives bytes / bandwidth + latency[a, b] later, and the next
  item starts latency[b, a] after that (the reply); a grant arrives latency[a, b] after it starts
  and holds the queue one round trip. So a grant never overtakes an update queued before it. Pull
  answers and a Pull's carried model are RPCs of their own (not queued). `sender="pipe"`: the
  older abstraction, updates back to back on the pipe, grants after the latency only.
  `coalesce` (the daemon's `train_coalesce_updates`, for a policy that allows it: Hop's backup and
  staleness modes): an update queued while an older one to the same neighbour has not started
  takes its place (same start and arrival), and the older one is never delivered.
- `lose`: each pushed update fails on its way with that probability (a push cut by its deadline
  on a slow link): it holds the link as if sent, and its receiver gets UpdateLost instead of the
  update when it would have arrived (what the daemon's data plane reports).
- A crashed worker stops at its crash time; messages to it are lost; every other worker gets
  PeerDown after `detect` seconds.
- A late joiner (`join`: worker -> time) is absent from the start: every policy hears PeerDown for
  it before the first publish (the daemon's not-yet-filled ranks). At its time it copies the
  parameters of the lowest-ranked live worker and starts at that worker's iteration; its (fresh)
  policy hears PeerDown for every absent worker; every live worker hears PeerUp(joiner, k) at once
  (the daemon: at the joiner's RESUMING notice after its pull, or under a pull policy its pull).
- Parameters live in one (N, P) array; a message carries a reference to the immutable snapshot it
  sent (or a copy of the working buffer for live sends), freed when the receiver Drops it.
- Timing-only mode keeps no parameters at all (protocol only), for very large N.
- The event heap is ordered by (time, sequence), so a run is deterministic given its seed.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from peerd.sim.objective import Quadratic
from peerd.sim.outer import Outer, OuterSpec, Wire
from peerd.sync.events import (CURRENT, Average, Drop, Grant, LinkEstimates, Mix, MixRequested,
                               PeerDown, PeerUp, Published, Pull, PullRequested, Send, Skip, Tick, TokensArrived,
                               UpdateArrived, UpdateLost, Wait)
from peerd.sync.policy import Policy


class SimError(RuntimeError):
    pass


@dataclass
class SimSpec:
    n: int = 8
    params: int = 1000
    iterations: int = 200              # per worker; a worker stops publishing past this
    compute: float = 0.1               # base seconds per gradient
    factors: dict[int, float] = field(default_factory=dict)  # deterministic slowdown per worker
    p_slow: float = 0.0                # random slowdown: probability per iteration...
    slow_factor: float = 1.0           # ...and factor
    bandwidth: Any = 1e9               # bytes/s: scalar or (N, N)
    latency: Any = 1e-4                # seconds: scalar or (N, N)
    bytes_per_param: int = 4
    lr: float = 0.2
    seed: int = 0
    target: float = 0.01               # relative suboptimality of the average model
    stop_at_target: bool = True
    max_time: float = math.inf
    eval_every: float = 0.0            # simulated seconds between evaluations (0: compute / 2)
    crash: dict[int, float] = field(default_factory=dict)
    lose: float = 0.0                  # probability that a pushed update fails on its way
    join: dict[int, float] = field(default_factory=dict)   # late joiners: worker -> time it joins
    detect: float = 0.5                # seconds until PeerDown reaches the others
    timing_only: bool = False
    hetero: float = 1.0
    noise: float = 0.01
    cond: float = 4.0
    estimates: str = "none"            # none | arrival | pull: which matrix LinkEstimates carries
    bandwidth_changes: dict[float, Any] = field(default_factory=dict)  # time -> new bandwidth
    sender: str = "daemon"             # daemon | pipe: see the module docstring
    coalesce: bool = False             # sender="daemon": the daemon's train_coalesce_updates
    compress: str = "none"             # the wire codec: none | fp16 | bf16 | int8 | int4 (bytes only)
    outer: OuterSpec | None = None     # DiLoCo (peerd.sim.outer): iterations then count syncs


@dataclass
class SimResult:
    algorithm: str
    n: int
    time_to_target: float | None
    iterations_at_target: float | None
    bytes_at_target: int | None
    sim_time: float
    iterations: list[int]
    computed: list[int]
    idle_fraction: list[float]
    bytes_sent: int
    loss: float | None
    consensus: float | None
    history: list[tuple[float, float, float | None]]
    events: int
    stalled: bool = False              # live workers left unfinished with nothing pending (deadlock)
    wall_s: float = 0.0
    label: str = ""                    # the row's name in tables (default: the algorithm)
    keyframes: int = 0                 # pushes sent as whole raw copies (peerd.sim.outer.Wire)
    outer: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        f = lambda x: None if x is None else float(x)  # noqa: E731 (numpy scalars -> JSON)
        return {"algorithm": self.algorithm, "workers": self.n,
                "time_to_target": f(self.time_to_target),
                "iterations_at_target": f(self.iterations_at_target),
                "bytes_at_target": self.bytes_at_target, "sim_time": float(self.sim_time),
                "mean_iterations": float(np.mean(self.iterations)),
                "mean_computed": float(np.mean(self.computed)),
                "idle_fraction": [round(float(x), 4) for x in self.idle_fraction],
                "mean_idle_fraction": float(np.mean(self.idle_fraction)),
                "bytes_sent": int(self.bytes_sent), "final_loss": f(self.loss),
                "consensus_distance": f(self.consensus), "events": self.events, "stalled": bool(self.stalled),
                "wall_s": round(self.wall_s, 3), "label": self.label or self.algorithm,
                "bytes_per_worker_step": f(self.bytes_sent / max(1, self.n) / max(1.0, float(np.mean(self.computed)))),
                "keyframes": self.keyframes, "outer": self.outer}


class _Uniform:
    """A constant N x N matrix without the N^2 memory (10,000 workers would need 800 MB each)."""

    def __init__(self, v: float, n: int) -> None:
        self.v, self.n = v, n

    def __getitem__(self, ij: tuple[int, int]) -> float:
        return self.v

    def full(self) -> np.ndarray:
        return np.full((self.n, self.n), self.v)


def _matrix(v: Any, n: int, name: str) -> Any:
    a = np.asarray(v, dtype=float)
    if a.ndim == 0:
        if float(a) <= 0 and name == "bandwidth":
            raise ValueError(f"bandwidth: must be > 0, got {float(a)}")
        return _Uniform(float(a), n)
    if a.shape != (n, n):
        raise ValueError(f"{name}: expected a scalar or an {n}x{n} matrix, got shape {a.shape}")
    return a


# Heap entry kinds.
_DELIVER, _COMPUTED, _EVAL, _CRASH, _LINKS, _JOIN, _STEP = 0, 1, 2, 3, 4, 5, 6


class Simulator:
    def __init__(self, spec: SimSpec, policies: list[Policy], name: str = "",
                 on_publish: Callable[["Simulator", int, int], None] | None = None,
                 on_mix: Callable[["Simulator", int, Mix], None] | None = None) -> None:
        n = spec.n
        if len(policies) != n:
            raise ValueError(f"policies: expected {n}, got {len(policies)}")
        self.spec, self.pol, self.name = spec, policies, name or policies[0].name
        self.on_publish, self.on_mix = on_publish, on_mix
        self.bw = _matrix(spec.bandwidth, n, "bandwidth")
        self.lat = _matrix(spec.latency, n, "latency")
        self.wire = Wire(n, spec.params, spec.bytes_per_param, spec.compress)
        self.msg_bytes = self.wire.full
        self.rng = np.random.default_rng(spec.seed + 7919)
        self.loss_rng = np.random.default_rng(spec.seed + 104729)   # its own: lose=0 runs stay as they were
        if not 0.0 <= spec.lose < 1.0:
            raise ValueError(f"lose: a probability in [0, 1), got {spec.lose}")
        self.now = 0.0
        self.heap: list[tuple[float, int, int, int, Any]] = []
        self.seq = 0
        if spec.sender not in ("daemon", "pipe"):
            raise ValueError(f"sender: expected daemon or pipe, got {spec.sender!r}")
        self.link_free: dict[tuple[int, int], float] = {}
        self.queue_free: dict[tuple[int, int], float] = {}   # sender="daemon": next queued item may start
        self.last_start = 0.0             # when _transmit's item starts
        # Coalescing (spec.coalesce, for policies that allow it): (a, b) -> (start, arrival, event seq)
        # of the last update queued on a -> b; a newer update before its start takes its place.
        self.coalescing = [spec.coalesce and spec.sender == "daemon" and p.coalesces for p in policies]
        self.unsent: dict[tuple[int, int], tuple[float, float, int]] = {}
        self.cancelled: set[int] = set()  # event seqs of updates replaced before they started
        self.serving = False              # handling a PullRequested: a Send is the pull's answer
        self.k = [-1] * n                 # published iteration
        self.computed = [0] * n
        self.alive = [True] * n
        self.done = [False] * n
        self.asked: list[float | None] = [None] * n   # when MixRequested was delivered
        self.idle = [0.0] * n
        self.finish = [0.0] * n
        self.bytes = 0
        self.events = 0
        self.last_progress = 0.0
        self.own: list[tuple[int, Any]] = [(-1, None)] * n
        self.recv: list[dict[tuple[int, int], Any]] = [dict() for _ in range(n)]
        self.history: list[tuple[float, float, float | None]] = []
        self.hit: tuple[float, float, int] | None = None
        if spec.timing_only:
            self.obj = None
            self.X = self.G = None
        else:
            self.obj = Quadratic(n, spec.params, seed=spec.seed, cond=spec.cond, hetero=spec.hetero,
                                 noise=spec.noise)
            self.X = np.tile(self.obj.x0, (n, 1))
            self.G = np.zeros_like(self.X)
        self.outer = None
        if spec.outer is not None:
            if any(p.asynchronous for p in policies):
                raise ValueError(f"outer: DiLoCo runs on the synchronous algorithms, not {self.name}")
            self.outer = Outer(self, spec.outer)
            self.wire = Wire(n, spec.params, spec.bytes_per_param, spec.compress, self.outer.bounds)

    # --- scheduling ---------------------------------------------------------------------------
    def _push(self, t: float, kind: int, i: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, i, payload))

    def _transmit(self, a: int, b: int, nbytes: int, queued: bool = False) -> float:
        """Arrival time at b of nbytes sent now on link a->b. `queued` (sender="daemon"): an item of
        a's ordered queue to b, which starts once the previous item's reply is back and holds the
        queue until its own reply is (see the module docstring)."""
        queued = queued and self.spec.sender == "daemon"
        if nbytes == 0 and not queued:
            return self.now + self.lat[a, b]
        start = max(self.now, self.link_free.get((a, b), 0.0))
        if queued:
            start = max(start, self.queue_free.get((a, b), 0.0))
        self.last_start = start
        end = start + nbytes / self.bw[a, b]
        if nbytes:
            self.link_free[(a, b)] = end
        if queued:
            self.queue_free[(a, b)] = end + self.lat[a, b] + self.lat[b, a]
        self.bytes += nbytes
        return end + self.lat[a, b]

    def compute_time(self, i: int) -> float:
        s = self.spec
        t = s.compute * s.factors.get(i, 1.0)
        if s.p_slow > 0 and self.rng.random() < s.p_slow:
            t *= s.slow_factor
        return t

    # --- worker steps -------------------------------------------------------------------------
    def start_step(self, i: int) -> None:
        """DiLoCo: worker i starts an inner step."""
        self._push(self.now + self.compute_time(i), _STEP, i, None)

    def request_mix(self, i: int, k: int) -> None:
        """DiLoCo: worker i asks for the mix of k now (after the publish's own actions)."""
        self._push(self.now, _COMPUTED, i, k)

    def _next(self, i: int, k: int) -> None:
        """After a mix: publish k at once, or (DiLoCo) go on with inner steps until it is due."""
        if self.outer is not None:
            self.outer.begin(i, k)
        else:
            self._publish(i, k)

    def _publish(self, i: int, k: int) -> None:
        if k >= self.spec.iterations:
            self.done[i] = True
            self.finish[i] = self.now
            self.k[i] = k
            if self.on_publish:
                self.on_publish(self, i, k)
            self.last_progress = self.now
            self.own[i] = (k, self.outer.snapshot(i, k) if self.outer else
                              self.X[i].copy() if self.X is not None else None)
            # A finished worker keeps serving pulls with its final parameters and pushes them (a
            # neighbour it skipped past may need a newer tag), but starts no exchange.
            acts = self.pol[i].on_event(Published(k), self.now)
            self._act(i, [a for a in acts if type(a) is not Pull], publish_ok=False)
            return
        self.k[i] = k
        self.last_progress = self.now
        if self.outer is not None:          # DiLoCo: y with its mass; the steps go on (peerd.sim.outer)
            self.own[i] = (k, self.outer.snapshot(i, k))
            if self.on_publish:
                self.on_publish(self, i, k)
            self._act(i, self.pol[i].on_event(Published(k), self.now))
            self.outer.published(i, k)
            return
        if self.X is not None:
            snap = self.X[i].copy()
            snap.flags.writeable = False
            self.own[i] = (k, snap)
            self.G[i] = self.obj.grad(i, snap, int(self.rng.integers(1 << 30)))
        else:
            self.own[i] = (k, None)
        if self.on_publish:
            self.on_publish(self, i, k)
        self._push(self.now + self.compute_time(i), _COMPUTED, i, k)
        self._act(i, self.pol[i].on_event(Published(k), self.now))

    def _value(self, i: int, src: int, k: int) -> np.ndarray:
        if src == i:
            if k == CURRENT:
                return self.X[i]
            ok, arr = self.own[i]
            if ok != k:
                raise SimError(f"worker {i}: mix refers to own iteration {k}, published is {ok}")
            return arr
        try:
            return self.recv[i][(src, k)]
        except KeyError:
            raise SimError(f"worker {i}: mix refers to ({src}, {k}) which is not in hand") from None

    def _combine(self, i: int, entries: tuple[tuple[int, int, float], ...]) -> np.ndarray:
        total = sum(w for _, _, w in entries)
        if abs(total - 1.0) > 1e-9:
            raise SimError(f"worker {i}: mix weights sum to {total}")
        out = None
        for src, k, w in entries:
            v = self._value(i, src, k)
            out = v * w if out is None else out + v * w
        return out

    def _act(self, i: int, actions: list, publish_ok: bool = True) -> None:
        nxt = None
        for a in actions:
            t = type(a)
            if t is Send:
                if a.live:
                    data = self.X[i].copy() if self.X is not None else None
                else:
                    ok, data = self.own[i]
                    if ok != a.k:
                        raise SimError(f"worker {i}: Send of iteration {a.k}, published is {ok}")
                if self.alive[a.dst]:
                    coalesce = self.coalescing[i] and not self.serving
                    held = self.unsent.get((i, a.dst)) if coalesce else None
                    if held is not None and held[0] > self.now:   # takes the unstarted one's place
                        self.cancelled.add(held[2])
                        start, at = held[0], held[1]
                    else:
                        at = self._transmit(i, a.dst, self.wire.message(i, a.dst, a.k), queued=not self.serving)
                        start = self.last_start
                    lose = self.spec.lose
                    if lose and not self.serving and self.loss_rng.random() < lose:
                        self._push(at, _DELIVER, a.dst, (UpdateLost(i, a.k), None))
                    else:
                        self._push(at, _DELIVER, a.dst, (UpdateArrived(i, a.k), data))
                    if coalesce:
                        self.unsent[(i, a.dst)] = (start, at, self.seq)
            elif t is Mix:
                self._mixed(i, a)
                nxt = a.k + 1
            elif t is Skip:
                nxt = a.to
            elif t is Grant:
                if self.alive[a.dst]:
                    at = self._transmit(i, a.dst, 0, queued=True)
                    self._push(at, _DELIVER, a.dst, (TokensArrived(i, a.n), None))
            elif t is Pull:
                carried = a.carry_k >= 0
                data = None
                if carried:
                    ok, data = self.own[i]
                    if ok != a.carry_k:
                        raise SimError(f"worker {i}: Pull carries iteration {a.carry_k}, published is {ok}")
                if self.alive[a.dst]:
                    at = self._transmit(i, a.dst, self.wire.message(i, a.dst, a.carry_k) if carried else 0)
                    self._push(at, _DELIVER, a.dst, (PullRequested(i, a.carry_k, carried), data))
            elif t is Drop:
                self.recv[i].pop((a.src, a.k), None)
            elif t is Average:
                if self.X is not None:
                    self.X[i] = self._combine(i, a.entries)
            elif t is Wait:
                if a.until is not None:
                    self._push(a.until, _DELIVER, i, (Tick(), None))
            else:
                raise SimError(f"worker {i}: unknown action {a!r}")
        if nxt is not None and publish_ok and not self.done[i]:
            self._next(i, nxt)

    def _mixed(self, i: int, a: Mix) -> None:
        waited = self.now - self.asked[i] if self.asked[i] is not None else 0.0
        if self.outer is not None:
            self.outer.mixed(i, a.entries, a.k, waited)
        else:
            if self.X is not None:
                self.X[i] = self._combine(i, a.entries) - self.spec.lr * self.G[i]
            self.computed[i] += 1
        self.idle[i] += waited
        self.asked[i] = None
        if self.on_mix:
            self.on_mix(self, i, a)

    def _join(self, i: int) -> None:
        live = [j for j in range(self.spec.n) if self.alive[j] and j != i]
        if not live:
            raise SimError(f"worker {i}: joins with no live worker to copy")
        src = live[0]
        if self.outer is not None:
            self.outer.join(i, src)
        elif self.X is not None:
            self.X[i] = self.X[src]
        self.alive[i] = True
        for j in range(self.spec.n):
            if j != i and not self.alive[j]:
                self._act(i, self.pol[i].on_event(PeerDown(j), self.now))
        if self.spec.estimates != "none":
            m = self.estimates(self.spec.estimates)
            m.flags.writeable = False
            self._act(i, self.pol[i].on_event(LinkEstimates(m, effective_k=0), self.now))
        k0 = max(self.k[src], 0)
        for j in live:
            self._act(j, self.pol[j].on_event(PeerUp(i, k0), self.now))
        self._next(i, k0)

    # --- evaluation ---------------------------------------------------------------------------
    def _eval(self, full: bool = False) -> None:
        """Loss of the average model; the consensus distance (a full pass over (N, P)) only every
        10th evaluation, at the target and at the end (None in between), to keep big runs fast."""
        alive = self.alive
        X = self.X if self.outer is None else self.outer.models()
        X = X if all(alive) else X[[i for i in range(self.spec.n) if alive[i]]]
        xbar = X.mean(0)
        loss = self.obj.loss(xbar)
        hit = self.hit is None and loss <= self.spec.target
        cons = None
        if full or hit or len(self.history) % 10 == 0:
            d = X - xbar
            cons = float(np.mean(np.sqrt(np.einsum("ij,ij->i", d, d))))
        self.history.append((self.now, loss, cons))
        if hit:
            self.hit = (self.now, float(np.mean([self.computed[i] for i in range(self.spec.n) if alive[i]])),
                        self.bytes)

    # --- main loop ----------------------------------------------------------------------------
    def estimates(self, kind: str) -> np.ndarray:
        """Ground-truth expected times a perfect monitor would measure. arrival: t[i][j] = mean
        compute of j + transfer of j's model to i. pull: t[i][j] = i's iteration time when it pulls
        from j, compute overlapped with the round trip."""
        s = self.spec
        c = np.array([s.compute * s.factors.get(i, 1.0) * (1 + s.p_slow * (s.slow_factor - 1))
                      for i in range(s.n)])
        msg = self.msg_bytes
        if self.outer is not None:           # DiLoCo: an iteration is a sync
            c, msg = self.outer.sync_terms(c, self.wire)
        bw = self.bw.full() if isinstance(self.bw, _Uniform) else self.bw
        lat = self.lat.full() if isinstance(self.lat, _Uniform) else self.lat
        xfer = msg / bw.T + lat.T   # [i, j]: j -> i
        if kind == "arrival":
            return c[None, :] + xfer
        return np.maximum(c[:, None], xfer + lat)

    def _announce(self, effective_k: int) -> None:
        """Give every live worker the current link estimates at the same instant."""
        if self.spec.estimates == "none":
            return
        m = self.estimates(self.spec.estimates)
        m.flags.writeable = False
        ev = LinkEstimates(m, effective_k=effective_k)
        for i in range(self.spec.n):
            if self.alive[i]:
                self._act(i, self.pol[i].on_event(ev, self.now))

    def run(self) -> SimResult:
        import time as _time
        wall = _time.perf_counter()
        s = self.spec
        self._announce(0)
        for i, t in s.crash.items():
            self._push(t, _CRASH, i, None)
        for i, t in s.join.items():
            self.alive[i] = False
            self._push(t, _JOIN, i, None)
        for i in s.join:
            for j in range(s.n):
                if j != i and self.alive[j]:
                    self._act(j, self.pol[j].on_event(PeerDown(i), 0.0))
        for t, bw in s.bandwidth_changes.items():
            self._push(t, _LINKS, -1, _matrix(bw, s.n, "bandwidth_changes"))
        every = s.eval_every or s.compute / 2
        if self.X is not None:
            self._eval()
            self._push(every, _EVAL, -1, None)
        for i in range(s.n):
            if self.alive[i]:
                self._next(i, 0)
        while self.heap:
            t, seq, kind, i, payload = heapq.heappop(self.heap)
            if t > s.max_time:
                break
            if seq in self.cancelled:
                self.cancelled.discard(seq)
                continue
            self.now = t
            self.events += 1
            if self._handle(kind, t, i, payload, every):
                break
            if all(self.done[j] or not self.alive[j] for j in range(s.n)):
                break
        return _result(self, every, _time.perf_counter() - wall)

    def _handle(self, kind: int, t: float, i: int, payload: Any, every: float) -> bool:
        """One event; True ends the run (the target reached)."""
        s = self.spec
        if kind == _DELIVER:
            if not self.alive[i]:
                return False
            ev, data = payload
            if type(ev) is UpdateArrived or (type(ev) is PullRequested and ev.carried):
                self.recv[i][(ev.src, ev.k)] = data
            self.serving = type(ev) is PullRequested
            try:
                self._act(i, self.pol[i].on_event(ev, t))
            finally:
                self.serving = False
        elif kind == _STEP:
            if self.alive[i] and not self.done[i]:
                self.outer.stepped(i)
        elif kind == _COMPUTED:
            if not self.alive[i] or self.k[i] != payload:
                return False
            self.asked[i] = t
            self._act(i, self.pol[i].on_event(MixRequested(payload), t))
        elif kind == _EVAL:
            self._eval()
            if self.hit is not None and s.stop_at_target:
                return True
            # Nothing else pending means finished or stalled: stop evaluating, end the run.
            # After 10 intervals without progress, jump to the next pending event.
            if self.heap and not all(self.done[j] or not self.alive[j] for j in range(s.n)):
                nxt = t + every
                if t - self.last_progress > 10 * every:
                    nxt = max(nxt, self.heap[0][0])
                self._push(nxt, _EVAL, -1, None)
        elif kind == _LINKS:
            self.bw = payload
            # Takes effect one iteration past the most advanced worker: nobody has mixed it yet,
            # so every worker switches at the same iteration (what AAU's agreement needs).
            self._announce(max(self.k) + 1)
        elif kind == _JOIN:
            self._join(i)
        elif kind == _CRASH:
            self.alive[i] = False
            self.finish[i] = t
            self.recv[i].clear()
            for j in range(s.n):
                if j != i and self.alive[j]:
                    self._push(t + s.detect, _DELIVER, j, (PeerDown(i), None))
        return False


def _result(self: Simulator, every: float, wall_s: float) -> SimResult:
    """The run's SimResult, once its event loop ended."""
    s = self.spec
    end = self.now
    unfinished = not all(self.done[j] or not self.alive[j] for j in range(s.n))
    stalled = unfinished and (not self.heap or end - self.last_progress > 10 * every)
    if self.X is not None and (self.history[-1][0] != end or self.history[-1][2] is None):
        self._eval(full=True)
    idle = []
    for i in range(s.n):
        span = (self.finish[i] if (self.done[i] or not self.alive[i]) else end) or 1e-12
        extra = (end - self.asked[i]) if (self.asked[i] is not None and self.alive[i]) else 0.0
        idle.append(min(1.0, (self.idle[i] + extra) / span))
    last = self.history[-1] if self.history else (end, None, None)
    o = s.outer
    return SimResult(
        algorithm=self.name, n=s.n,
        time_to_target=self.hit[0] if self.hit else None,
        iterations_at_target=self.hit[1] if self.hit else None,
        bytes_at_target=self.hit[2] if self.hit else None,
        sim_time=end, iterations=list(self.k), computed=list(self.computed),
        idle_fraction=idle, bytes_sent=self.bytes, loss=last[1], consensus=last[2],
        history=self.history, events=self.events, stalled=stalled, wall_s=wall_s,
        keyframes=self.wire.keyframes,
        outer=None if o is None else dict(vars(o), compress=s.compress, fragments=self.outer.F))
