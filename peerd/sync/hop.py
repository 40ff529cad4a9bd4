"""Hop (Luo et al., ASPLOS'19): queue-based decentralized synchronisation with update queues and
per-edge token queues, backup workers, bounded staleness and iteration skipping.

Per worker i, iteration k (D-PSGD shape, sends overlap the gradient):
    Published(k)      -> Send(j, k) to every live out-neighbour j
    MixRequested(k)   -> wait for the GATHER rule of the mode, and for one token on every live
                         out-edge; then Mix(k, entries), Grant(j, steps) to every live in-neighbour,
                         and, when skipping, Skip(k + steps)
Modes (GATHER):
    standard          every live in-neighbour's iteration-k update
    backup b          iteration-k updates of at least |N_in| - b live in-neighbours (exact k only;
                      older arrivals are dropped at once, newer ones are kept for later)
    staleness s       newest update of every live in-neighbour, each at iteration >= k - s
    backup+staleness  at least |N_in| - b live in-neighbours with a newest update >= k - s
The mix uses every qualifying update in hand at that moment, with the topology's row renormalised
over the entries used (self included).

Reading choices (the paper's details are reconstructed, see research/papers.md 1.3-1.5):
- Token placement: the counter lives at the sender. Edge i -> j starts with max_ig tokens; i spends
  one per step when it advances its iteration (publishing iteration 0 is free); j grants one per
  step when it advances past a mixed iteration (k -> k+s grants s). Hence tokens granted by j equal
  j's iteration, and iter(i) - iter(j) <= max_ig holds on every edge in every mode, skipping
  included. Mix(k) is held back until the tokens for the step are in hand, so "may I advance" and
  "here is my mix" are one decision and the trainer never runs ahead of its tokens.
- Skip rule: after mixing k, with k_seen the newest iteration tag received from a live in-neighbour,
  if k_seen > k+1 the worker jumps to k + 1 + min(k_seen - k - 1, max_skip), further capped by the
  tokens in hand on every out-edge (each skipped step spends and grants one token, exactly like a
  computed one, so skipping releases the fast neighbours at once). Skipped iterations send nothing.
  Skipping needs backup or staleness (in standard mode receivers would wait forever for a skipped
  update); the constructor refuses it otherwise. In backup mode a neighbour that went past k without
  sending k (it skipped k; links are FIFO, so a newer tag proves it) is represented in the mix of k
  by its next update: without this, two neighbours that both skipped k would starve a slow worker
  that lands on k (found by the random-slowdown scenario: a deadlock).
- Crashes: PeerDown removes the peer from the waited set in every mode (standard mode then waits for
  the live in-neighbours only) and from the token check; its held updates are dropped. Without a
  PeerDown the tokens stop neighbours max_ig iterations past a silent peer, by design.
- PeerUp(p, k_p) re-admits p with its token counter reset as if p had granted up to k_p.
- UpdateLost(p, k): p's update of k will not come; the mix of k goes without it (in backup mode it
  is one of the b updates a mix may miss), p stays a neighbour (no repair, its tokens and our sends
  go on) and the mix of k + 1 waits for it again.
- Catch-up (ours, every mode): a live in-neighbour's tag beyond k + max_ig cannot happen while the
  tokens bind every edge; it means the two were apart (a healed partition: each side trained on
  alone and drifted further apart than the bound) or an edge was rebuilt around a dead worker. The
  worker behind then jumps to that tag after its mix of k (Skip, each jumped step spent and granted
  like a computed one, not capped by its tokens), so the ones ahead, whose tokens the re-admission
  reset to its old iteration, are released at once instead of waiting until it has computed its
  way up (which outlasts the daemon's silent-peer timeout: the leaders then drop it, re-admit it at
  its next update and wait again). Its neighbours on its own side see its new tag beyond their
  bound and jump too, so a whole lagging side catches up hop by hop. Its model is its own mixed
  with the leader's newest update, as a restarted worker resumes at its neighbours' iteration.
- Repair: on PeerDown/PeerUp the graph becomes `topology.repair(base, dead)` (a ring re-links around
  the hole). An out-edge that appears gets my newest published update at once and a fresh token
  counter (as if the new neighbour were at my iteration); an in-edge that disappears has its held
  updates dropped. A new in-neighbour may be past k without ever having sent k to me (it was not my
  neighbour then), so in every mode a neighbour whose newest tag is beyond k is represented by its
  next update held (standard mode included; with a fixed graph FIFO links make this case
  impossible, so it changes nothing there). The new neighbour may repair first: its update, sent
  when the edge appeared on its side, then reaches me before my own repair; the newest such update
  of a live worker is kept (not mixed while it is not my in-neighbour), so it can stand in.
- The gap bound holds for the sender ahead of the receiver; on undirected graphs (every topology
  here but directed link matrices) it therefore bounds |gap| on every edge.
- Queues: held updates per in-edge are bounded: standard/backup keep iterations in (last mixed,
  last mixed + max_ig + 1]; staleness keeps only the newest per sender.
"""
from __future__ import annotations

from typing import Any

from peerd.sync.events import (Action, Drop, Grant, Mix, MixRequested, PeerDown, PeerUp, Published,
                               Skip, Tick, TokensArrived, UpdateArrived, UpdateLost, Wait)
from peerd.sync.policy import Algorithm, Policy
from peerd.sync import topology
from peerd.sync.topology import Topology


class Hop(Policy):
    name = "hop"
    static_graph = True      # token queues and skipping need a static graph

    def __init__(self, me: int, topo: Topology, *, max_ig: int | None = 4, backup: int = 0,
                 staleness: int | None = None, skip: bool = False, max_skip: int = 4) -> None:
        super().__init__(me, topo.n)
        if max_ig is not None and max_ig < 1:
            raise ValueError(f"max_ig: must be >= 1, got {max_ig}")
        if backup < 0:
            raise ValueError(f"backup: must be >= 0, got {backup}")
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness: must be >= 0, got {staleness}")
        if skip and backup == 0 and staleness is None:
            raise ValueError("skip: skipping needs backup >= 1 or a staleness bound")
        if skip and max_skip < 1:
            raise ValueError(f"max_skip: must be >= 1, got {max_skip}")
        if (max_ig is not None or skip) and topo.period != 1:
            raise ValueError("max_ig/skip: token queues and skipping need a static topology")
        self.base = topo                       # the configured graph; self.topo is it repaired
        self.topo = topo
        self.max_ig = max_ig
        self.backup = backup
        self.staleness = staleness
        self.skip = skip
        self.coalesces = backup > 0 or staleness is not None
        # Standard mode mixes every live in-neighbour's exact-k update: known at Published(k).
        self.eager_mix = backup == 0 and staleness is None and not skip
        self.max_skip = max_skip
        self.held: dict[int, set[int]] = {}     # src -> iterations in hand
        self.seen: dict[int, int] = {}          # src -> newest tag ever received
        self.granted: dict[int, int] = {}       # tokens received from j (edge me -> j)
        self.spent: dict[int, int] = {}         # tokens spent on edge me -> j
        self.want = -1                           # iteration whose mix was requested, not yet given
        self.mixed = -1                          # last iteration mixed
        self.skipped = 0

    # --- helpers ----------------------------------------------------------------------------
    def mode(self) -> str:
        if self.staleness is None:
            return "standard" if self.backup == 0 else f"backup{self.backup}"
        return f"staleness{self.staleness}" + (f"+backup{self.backup}" if self.backup else "")

    def live_in(self, k: int) -> list[int]:
        return [j for j in self.topo.in_neighbors(self.me, k) if j not in self.dead]

    def live_out(self, k: int) -> list[int]:
        return [j for j in self.topo.out_neighbors(self.me, k) if j not in self.dead]

    def tokens(self, j: int) -> int:
        by_grant = self.max_ig + self.granted.get(j, 0) - self.spent.get(j, 0)  # type: ignore[operator]
        # j's newest tag is an iteration j has reached: a lower bound that never overstates its
        # progress (tokens granted by j equal j's iteration). It matters on an edge repaired
        # mid-run, whose fresh counter cannot know how far ahead j already was (without it: j
        # waits for my update, I wait for j's token), and when a grant is lost (its RPC timed out
        # on a congested link): j's next update makes up for it instead of a silent-peer timeout.
        s = self.seen.get(j)
        return by_grant if s is None else max(by_grant, self.max_ig + s - self.k)  # type: ignore[operator]

    def _newest(self, j: int) -> int:
        h = self.held.get(j)
        return max(h) if h else -1

    def _drop(self, j: int, ks: list[int], out: list[Action]) -> None:
        h = self.held.get(j)
        for k in ks:
            if h is not None and k in h:
                h.discard(k)
                out.append(Drop(j, k))

    # --- events -----------------------------------------------------------------------------
    def on_published(self, ev: Published, now: float) -> list[Action]:
        if ev.k <= self.k:
            raise ValueError(f"Published: iteration {ev.k} after {self.k}")
        self.k = ev.k
        outs = self.live_out(ev.k)
        # Within the gap a token queue allows, and one iteration more.
        return self.sends(outs + self.counting_me(outs, (self.max_ig or 1) + 1), ev.k)

    def on_mix_requested(self, ev: MixRequested, now: float) -> list[Action]:
        if ev.k != self.k:
            raise ValueError(f"MixRequested: iteration {ev.k}, but {self.k} is published")
        self.want = ev.k
        return self._try(now)

    def on_update(self, ev: UpdateArrived, now: float) -> list[Action]:
        j, k = ev.src, ev.k
        if j in self.dead:
            return [Drop(j, k)]
        if j not in self.topo.in_neighbors(self.me, k):
            return self._hold_early_edge(j, k)
        self.seen[j] = max(self.seen.get(j, -1), k)
        self.counted_by.pop(j, None)       # our views of the graph agree again
        h = self.held.setdefault(j, set())
        if self.staleness is None:
            if k <= self.mixed:            # too late for its iteration: never used
                return [Drop(j, k)]
            h.add(k)
        else:
            if k <= self._newest(j):       # out of order: older than what we hold
                return [Drop(j, k)]
            out: list[Action] = []
            self._drop(j, sorted(h), out)
            h.add(k)
            return out + self._try(now)
        return self._try(now)

    def _hold_early_edge(self, j: int, k: int) -> list[Action]:
        """An update from a live worker that is not my in-neighbour: it repaired its graph before I
        did (it found a dead worker between us first) and sent me its newest update when the edge
        appeared on its side. Dropped, that update was never sent again: once my own repair made j
        my in-neighbour I waited for an update of my iteration, and when j was ahead of me it sent
        nothing more before my next update, which waited on its one (a deadlock until the silent-
        peer timeout). So its newest such update is kept (one per sender, freed like any other)
        and its tag counts, as if the edge had been there; no mix uses it while j is not my
        in-neighbour. The other way round, j counts me as its neighbour: it gets my updates
        (Policy.answer_out_of_edge)."""
        self.seen[j] = max(self.seen.get(j, -1), k)
        out: list[Action] = list(self.answer_out_of_edge(j, k, self.live_out(max(self.k, 0))))
        h = self.held.setdefault(j, set())
        if k <= self.mixed or k <= self._newest(j):
            return out + [Drop(j, k)]
        self._drop(j, sorted(x for x in h if j not in self.topo.in_neighbors(self.me, x)), out)
        h.add(k)
        return out

    def on_tokens(self, ev: TokensArrived, now: float) -> list[Action]:
        self.granted[ev.src] = self.granted.get(ev.src, 0) + ev.n
        return self._try(now)

    def on_update_lost(self, ev: UpdateLost, now: float) -> list[Action]:
        return self._try(now)

    def on_peer_down(self, ev: PeerDown, now: float) -> list[Action]:
        out: list[Action] = []
        self._drop(ev.peer, sorted(self.held.get(ev.peer, ())), out)
        return out + self._retopo() + self._try(now)

    def on_peer_up(self, ev: PeerUp, now: float) -> list[Action]:
        out = self._retopo()
        # Reset the edge as if the peer had granted up to its iteration.
        self.granted[ev.peer] = ev.k
        self.spent[ev.peer] = max(self.k, 0)
        self.seen.pop(ev.peer, None)  # a restarted peer's tags start again
        if self.k >= 0 and ev.peer in self.live_out(self.k):
            out += self.sends([ev.peer], self.k)
        return out + self._try(now)

    def _retopo(self) -> list[Action]:
        """Repair the graph for the current dead set (see the module docstring)."""
        old = self.topo
        k = max(self.k, 0)
        self.topo = topology.repair(self.base, self.dead)
        if self.topo is old:
            return []
        out: list[Action] = []
        before = set(old.out_neighbors(self.me, k))
        for j in self.live_out(k):
            if j not in before:
                self.granted[j] = self.spent[j] = max(self.k, 0)
                if self.k >= 0:
                    out += self.sends([j], self.k)
        ins = set(self.topo.in_neighbors(self.me, k))
        for j in list(self.held):
            if j not in ins:
                self._drop(j, sorted(self.held[j]), out)
        return out

    def on_tick(self, ev: Tick, now: float) -> list[Action]:
        return self._try(now)

    # --- the decision -----------------------------------------------------------------------
    def _gather(self, k: int) -> tuple[list[tuple[int, int]], list[int]]:
        """(usable (src, iteration) entries, in-neighbours still missing) for iteration k."""
        nb = self.live_in(k)
        if self.staleness is None:
            got = []
            for j in nb:
                h = self.held.get(j, ())
                if k in h:
                    got.append((j, k))
                elif self.seen.get(j, -1) > k:
                    # j went past k without sending it to me (it skipped, or was not my neighbour
                    # then): its next update stands in.
                    later = [x for x in h if x > k]
                    if later:
                        got.append((j, min(later)))
        else:
            got = [(j, x) for j in nb if (x := self._newest(j)) >= max(0, k - self.staleness)]
        have = {j for j, _ in got}
        reach = self.staleness or 0
        return got, [j for j in nb if j not in have and not self.excused(j, k, reach)]

    def _entries(self, k: int, got: list[tuple[int, int]]) -> list[tuple[int, int, float]]:
        """Self first, then the usable updates, with the topology's (not renormalised) weights."""
        row = self.topo.weights(self.me, k)
        if row.get(self.me, 0) <= 0:
            raise ValueError(f"topology: worker {self.me} gives itself no weight in row {row}")
        return [(self.me, k, row[self.me])] + [(j, kj, row[j]) for j, kj in got]

    def holds(self, src: int) -> bool:
        oldest = self.mixed + 1 - (self.staleness or 0)
        return any(x >= oldest for x in self.held.get(src, ()))

    def mix_weight(self, src: int, k: int) -> float | None:
        if not self.eager_mix or src in self.dead or src not in self.live_in(k):
            return None
        return self.topo.weights(self.me, k).get(src)

    def preview(self, k: int) -> tuple[tuple[int, int, float], ...] | None:
        """Pure: the entries the mix of k would use if it were decided now (the updates in hand,
        whatever the backup count and the tokens say), with the topology's weights before
        renormalisation; None once k is mixed or while k is not the published iteration. The mix
        itself uses the entries in hand when it is decided, each weight divided by their sum."""
        if k != self.k or self.mixed >= k:
            return None
        return tuple(self._entries(k, self._gather(k)[0]))

    def _catch_up_target(self, k: int) -> int | None:
        """The newest tag of a live in-neighbour when it lies beyond k + max_ig (impossible while the
        tokens bind every edge: only after a partition healed or an edge was rebuilt); else None."""
        if self.max_ig is None:
            return None
        k_seen = max((self.seen.get(j, -1) for j in self.live_in(k)), default=-1)
        return k_seen if k_seen > k + self.max_ig else None

    def _try(self, now: float) -> list[Action]:
        k = self.want
        if k < 0 or k != self.k or self.mixed >= k:
            return []
        got, missing = self._gather(k)
        # A lost update (UpdateLost) counts as one of the `backup` updates a mix may go without.
        need = max(0, min(len(self.live_in(k)) - self.backup, len(got) + len(missing)))
        if len(got) < need:
            self._wait("updates", missing, now)
            return [Wait(f"updates of iteration {k} from {missing}")]
        outs = self.live_out(k + 1)
        steps = 1
        if self.max_ig is not None:
            avail = min((self.tokens(j) for j in outs), default=steps + self.max_skip)
            if avail < 1:
                short = [j for j in outs if self.tokens(j) < 1]
                self._wait("tokens", short, now)
                return [Wait(f"tokens from {short}")]
        ahead = self._catch_up_target(k)
        if ahead is not None:
            steps = ahead - k      # not capped by tokens: see "Catch-up" in the module docstring
        elif self.skip:
            ins = self.live_in(k)
            k_seen = max((self.seen.get(j, -1) for j in ins), default=-1)
            if k_seen > k + 1:
                steps = 1 + min(k_seen - k - 1, self.max_skip)
            if self.max_ig is not None:
                steps = max(1, min(steps, avail))
        self._unwait()
        raw = self._entries(k, got)
        total = sum(w for _, _, w in raw)
        entries = [(j, kj, w / total) for j, kj, w in raw]
        out: list[Action] = [Mix(k, tuple(entries), waited=tuple(j for j, _ in got))]
        self.mixes += 1
        self.mixed = k
        self.want = -1
        if self.max_ig is not None:
            for j in outs:
                self.spent[j] = self.spent.get(j, 0) + steps
        if self.max_ig is not None:
            out.extend(Grant(j, steps) for j in self.live_in(k))
        # Free what can never be used again.
        for j, h in self.held.items():
            if self.staleness is None:
                self._drop(j, sorted(x for x in h if x <= k + steps - 1), out)
        if steps > 1:
            self.skipped += steps - 1
            out.append(Skip(k + steps))
        return out

    def state(self) -> dict[str, Any]:
        s = super().state()
        s.update({
            "mode": self.mode() + ("+skip" if self.skip else ""),
            "max_ig": self.max_ig,
            "tokens": {j: self.tokens(j) for j in self.live_out(max(self.k, 0))} if self.max_ig else {},
            "queue": {j: len(h) for j, h in self.held.items() if h},
            "peer_iteration": dict(self.seen),
            "gap": {j: self.k - v for j, v in self.seen.items()},
            "skipped": self.skipped,
        })
        return s


def options_from_config(cfg: Any, name: str) -> dict[str, Any]:
    o: dict[str, Any] = {"max_ig": cfg.sync.hop_max_ig, "max_skip": cfg.sync.hop_max_skip}
    if "backup" in name:
        o["backup"] = cfg.sync.hop_backup
    if "staleness" in name:
        o["staleness"] = cfg.sync.hop_staleness if cfg.sync.hop_staleness >= 0 else 2
    return o


_OPTIONS = ("max_ig", "backup", "staleness", "skip", "max_skip")


def _hop(name: str, description: str, defaults: dict[str, Any], preference: int) -> Algorithm:
    return Algorithm(name, description, Hop, defaults, _OPTIONS, options_from_config, preference=preference)


ALGORITHMS = (
    _hop("hop", "Hop standard mode: all in-neighbours, token queues bound the gap", {}, 1),
    _hop("hop-backup", "Hop with b backup in-neighbours", {"backup": 1}, 2),
    _hop("hop-staleness", "Hop with bounded staleness s", {"staleness": 2}, 3),
    _hop("hop-backup-skip", "Hop, backup b + iteration skipping", {"backup": 1, "skip": True}, 4),
    _hop("hop-staleness-skip", "Hop, staleness s + iteration skipping", {"staleness": 2, "skip": True}, 5),
)
