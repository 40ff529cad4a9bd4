"""The one policy interface: one instance per worker, fed events, returning actions.

    actions = policy.on_event(event, now)     # now: seconds, any monotonic origin; never read here
    policy.state()                            # dict for observability (gaps, tokens, queues, waits)

A policy never sleeps, reads a clock or does I/O. The driver (daemon, simulator, tests) must:
- deliver Published(k) when the trainer publishes iteration k, MixRequested(k) when the gradient of
  iteration k is ready;
- carry out actions in order (a Mix is applied before any later action; a Skip right after a Mix
  changes which iteration the trainer publishes next);
- keep every received (src, k) until the policy Drops it;
- deliver a Tick at a Wait's `until` deadline, if it has one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from peerd.sync.events import (Action, Event, LinkEstimates, MixRequested, PeerDown, PeerUp,
                               Published, PullFailed, PullRequested, Send, Tick, TokensArrived, UpdateArrived,
                               UpdateLost, WaitInfo)


class Policy:
    """Base class: dispatch by event type; subclasses override the handlers they need.

    What a driver needs to know about an algorithm is declared here, never inferred from its name:
    """
    name = "policy"
    # No barrier: each worker runs at its own pace (`peerd train --budget swarm` counts their work).
    asynchronous = False
    # The worker pulls its neighbours' parameters (Pull actions) instead of being pushed updates.
    pulls = False
    # Which LinkEstimates matrix on_estimates consumes: "none", "arrival" (when each in-neighbour's
    # update arrives) or "pull" (a pull's round trip); see peerd.sim.engine.Simulator.estimates.
    estimates = "none"
    # Whether a newer update may replace an older one still queued, unsent, to the same neighbour
    # (the driver's sender coalesces when its config allows): true where the receiver takes a
    # neighbour's next update in place of one it never got (Hop's backup and staleness modes).
    coalesces = False
    # Whether the mix of k is fully determined by the iteration-k updates (every live in-neighbour,
    # exact k): a driver may then request it at Published(k) and compute it during the gradient.
    eager_mix = False
    # The graph must be static (token queues, spanning trees, pull probabilities).
    static_graph = False
    # How many of its newest published iterations the policy may still Send or Mix: the driver keeps
    # that many snapshots of its own parameters (and any still streaming). Every policy here sends
    # and mixes only its newest.
    own_snapshots = 1

    def __init__(self, me: int, n: int) -> None:
        if not 0 <= me < n:
            raise ValueError(f"me: worker {me} outside 0..{n - 1}")
        self.me = me
        self.n = n
        self.k = -1            # iteration last published (-1: none yet)
        self.mixes = 0         # mixes emitted
        self.dead: set[int] = set()
        self.waiting = WaitInfo()
        self.sent: dict[int, int] = {}   # peer -> the newest of our iterations pushed to it since it was last down
        self.lost: dict[int, int] = {}   # peer -> the newest iteration of its updates that will not come
        self.counted_by: dict[int, int] = {}   # not my out-neighbour, sends to me: its newest tag (answer_out_of_edge)

    def on_event(self, ev: Event, now: float) -> list[Action]:
        match ev:
            case Published():
                return self.on_published(ev, now)
            case MixRequested():
                return self.on_mix_requested(ev, now)
            case UpdateArrived():
                return self.on_update(ev, now)
            case UpdateLost():
                self.lost[ev.src] = max(ev.k, self.lost.get(ev.src, -1))
                return self.on_update_lost(ev, now)
            case TokensArrived():
                return self.on_tokens(ev, now)
            case PullRequested():
                return self.on_pull_request(ev, now)
            case PullFailed():
                return self.on_pull_failed(ev, now)
            case PeerDown():
                self.dead.add(ev.peer)
                self.lost.pop(ev.peer, None)   # back, it sends from where it rejoins
                self.counted_by.pop(ev.peer, None)
                self.sent.pop(ev.peer, None)   # what was on its way may be lost
                return self.on_peer_down(ev, now)
            case PeerUp():
                self.dead.discard(ev.peer)
                self.lost.pop(ev.peer, None)
                return self.on_peer_up(ev, now)
            case LinkEstimates():
                return self.on_estimates(ev, now)
            case Tick():
                return self.on_tick(ev, now)
        raise TypeError(f"event: unknown event {ev!r}")

    def sends(self, peers: Iterable[int], k: int) -> list[Send]:
        """Send(j, k) to each of `peers` that has not had our k since it was last down: a peer
        re-admitted right after our publish (a restarted trainer resyncs its neighbours at its first
        publish) would otherwise get the same update, a whole model, twice."""
        return [Send(j, k) for j in peers if self.note_sent(j, k)]

    def answer_out_of_edge(self, j: int, k: int, outs: list[int]) -> list[Send]:
        """An update of iteration k came from j, which is not among my out-neighbours `outs`: j
        counts me as its neighbour and waits for my updates, which I send to my own out-neighbours
        only (during churn two hosts' dead sets differ for a while, and so do their repaired
        graphs). j gets my newest now, and my next ones while it keeps sending to me
        (counting_me); without this it waited out the silent-peer timeout (a chaos run: 7.8 s at
        one iteration, the two a hop apart in its view and two in mine)."""
        self.counted_by[j] = max(self.counted_by.get(j, -1), k)
        return self.sends([j], self.k) if self.k >= 0 and j not in outs else []

    def counting_me(self, outs: list[int], lag: int) -> list[int]:
        """Workers outside `outs` that count me as their neighbour and sent me an update at most
        `lag` iterations behind mine: they get my updates too."""
        for j in [j for j, kj in self.counted_by.items() if j in self.dead or j in outs or self.k - kj > lag]:
            del self.counted_by[j]
        return sorted(self.counted_by)

    def note_sent(self, peer: int, k: int) -> bool:
        """Our k goes to `peer` (by our Send or the node's own push to a returning peer); False
        when it already went since the peer was last down."""
        if self.sent.get(peer) == k:
            return False
        self.sent[peer] = k
        return True

    # Defaults: ignore what the algorithm does not use.
    def on_published(self, ev: Published, now: float) -> list[Action]:
        self.k = ev.k
        return []

    def on_mix_requested(self, ev: MixRequested, now: float) -> list[Action]:
        raise NotImplementedError

    def on_update(self, ev: UpdateArrived, now: float) -> list[Action]:
        return []

    def on_update_lost(self, ev: UpdateLost, now: float) -> list[Action]:
        return []

    def excused(self, src: int, k: int, reach: int = 0) -> bool:
        """The mix of k does not wait for `src`: its update of k, or of a later iteration, will not
        come (UpdateLost; links are FIFO, so a lost later one means k came before it or was lost
        too). `reach`: a mix that takes an update up to `reach` iterations old is excused by one
        lost that far back. Without this a lost update of each of two neighbours waiting on one
        another deadlocks them (found by the simulator's property test with lossy links)."""
        return src in self.lost and self.lost[src] >= k - reach

    def on_tokens(self, ev: TokensArrived, now: float) -> list[Action]:
        return []

    def on_pull_request(self, ev: PullRequested, now: float) -> list[Action]:
        # Serve a pull with the newest published parameters.
        return [Send(ev.src, self.k)] if self.k >= 0 else []

    def on_pull_failed(self, ev: PullFailed, now: float) -> list[Action]:
        return []

    def on_peer_down(self, ev: PeerDown, now: float) -> list[Action]:
        return []

    def on_peer_up(self, ev: PeerUp, now: float) -> list[Action]:
        return []

    def on_estimates(self, ev: LinkEstimates, now: float) -> list[Action]:
        return []

    def estimates_work(self, times: Any) -> Callable[[], Any] | None:
        """Optional, pure: the heavy computation (if any) that on_estimates(LinkEstimates(times))
        would run, as a callable whose result the policy then finds cached, so that a driver can
        run it off its event loop first. None: nothing heavy (the default)."""
        return None

    def on_tick(self, ev: Tick, now: float) -> list[Action]:
        return []

    def holds(self, src: int) -> bool:
        """Optional, pure: an update from `src` is in hand that a mix of the current or a later
        iteration may still use. A neighbour that finished (it sends nothing more) stays in the
        graph until none is left, so that the update it sent last is mixed. False: nothing is
        held across events (the default)."""
        return False

    def mix_weight(self, src: int, k: int) -> float | None:
        """Optional, pure, for eager_mix policies: the (not renormalised) weight the mix of k will
        give src's iteration-k update, if src is a live in-neighbour at k; lets a driver sum the
        update as it arrives. None: not known ahead (the default)."""
        return None

    @classmethod
    def unsupported(cls, topo: Any) -> str | None:
        """Why this algorithm cannot run on `topo` (None: it can); `peerd plan` asks before it
        offers a contender."""
        if cls.static_graph and topo.period != 1:
            return "needs a static graph"
        return None

    @property
    def has_preview(self) -> bool:
        return type(self).preview is not Policy.preview

    def preview(self, k: int) -> tuple[tuple[int, int, float], ...] | None:
        """Optional, pure: the (src, iteration, weight) entries the mix of k would use if it were
        decided now, weights before renormalisation over the entries used; lets a driver sum the
        mix while updates arrive. None: no preview (the default) or nothing left to mix for k."""
        return None

    def _wait(self, reason: str, on: list[int], now: float) -> None:
        if self.waiting.reason != reason or self.waiting.on != on:
            self.waiting = WaitInfo(reason, now, on)

    def _unwait(self) -> None:
        self.waiting = WaitInfo()

    def state(self) -> dict[str, Any]:
        return {"algorithm": self.name, "me": self.me, "iteration": self.k, "mixes": self.mixes,
                "dead": sorted(self.dead),
                "waiting": {"reason": self.waiting.reason, "since": self.waiting.since,
                            "on": list(self.waiting.on)} if self.waiting.reason else None}


class PullBackoff:
    """How long a peer whose pull failed rests before it is pulled again (NetMax, AD-PSGD).

    The first failure rests `first` seconds, each further failure in a row doubles that, up to
    `most`; an answered pull resets the peer. Why not a fixed rest: the commonest failure is a
    peer whose trainer has not published yet (hosts start seconds apart), which answers a moment
    later; a fixed 10 s rest made the first tens of iterations local steps. A peer that keeps
    failing still rests `most`, so a broken link costs at most one pull timeout per `most`."""

    def __init__(self, first: float, most: float) -> None:
        if not 0 < first <= most:
            raise ValueError(f"pull_backoff: need 0 < first ({first}) <= most ({most})")
        self.first, self.most = first, most
        self.fails: dict[int, int] = {}
        self.until: dict[int, float] = {}

    def failed(self, peer: int, now: float) -> None:
        n = self.fails[peer] = self.fails.get(peer, 0) + 1
        self.until[peer] = now + min(self.most, self.first * 2 ** (n - 1))

    def answered(self, peer: int) -> None:
        self.fails.pop(peer, None)
        self.until.pop(peer, None)

    def ready(self, peer: int, now: float) -> bool:
        return self.until.get(peer, now) <= now


@dataclass(frozen=True)
class Algorithm:
    """An algorithm as `peerd train --algo NAME`, the simulator and `peerd plan` know it. Each
    algorithm module lists its own in an ALGORITHMS tuple; peerd.sync.registry collects them."""
    name: str
    description: str
    policy: type[Policy]                   # policy(me, topo, **options): one worker's policy
    defaults: dict[str, Any] = field(default_factory=dict)    # options every worker gets (e.g. backup=1)
    accepts: tuple[str, ...] = ()          # option names the policy takes ("seed" too if it draws
                                           # at random); others given are ignored
    from_config: Callable[[Any, str], dict[str, Any]] | None = None   # options from a peerd Config
    topology: str = ""                     # a graph it always runs on (SGP: exp-directed); "": the run's
    preference: int = 100                  # ties in `peerd plan` go to the lowest (simple, exact averaging first)
    planned: bool = True                   # a contender `peerd plan` and `--algo auto` consider (not ablations)
