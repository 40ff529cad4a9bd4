"""The membership table: who is in the swarm, and whether they are alive. Pure: time is an argument.

Rules (the daemon feeds events in and acts on what comes out):
- A peer enters the table only after an authenticated Hello, in either direction
  (`admit`). Addresses learned from seeds, gossip or mDNS are *candidates* until then.
- Liveness comes from direct contact only: a successful RPC to or from the peer (`heard_from`).
  Gossip never makes a peer alive; it only tells us whom to contact.
- Failure detector: no direct contact for `suspect_after` -> suspect; for `dead_after` -> dead;
  dead for `forget_dead_after` -> dropped. Dead peers are still contacted, with back-off, so a peer
  that comes back is re-admitted by its first successful contact.
- A peer that says goodbye (`left`) is not contacted any more until it, or gossip about a newer
  incarnation of it, shows up again.
- Incarnations grow on every restart of a node id (they are the start time in milliseconds, and
  the daemon refuses any beyond its clock plus the skew bound, peerd.node.membership_service), and
  an older incarnation does not overwrite a newer one while the newer one is heard from: once the
  newer one has been silent for `dead_after`, direct contact with the older one is taken (its
  clock went back, or the newer one was wrong), so nothing a single message says can make a live
  peer's own heartbeats ignored for good.
- Gossiped addresses are checked (peerd.net.wirecheck.split_address: host:port, an IP or a DNS
  name, no scheme); loopback ones only from a daemon that itself listens on loopback; one message
  adds at most `max_new` candidates.
- Gossip sends news (`gossip_rows`/`gossiped`): a heartbeat (or its reply) to a peer carries the rows
  whose address, incarnation or state changed since the last one delivered to it, and the whole
  table every `full_interval`, or whenever the peer is new or restarted. Gossip only tells a peer
  whom to contact, so a row it has already had is not news; the full table repairs any loss. A
  whole table each heartbeat was O(N^2) bytes per host per heartbeat interval.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable

from peerd.net.wirecheck import is_loopback_host, is_unspecified_host, split_address


class State(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass
class Member:
    node_id: str
    address: str
    run_id: str
    incarnation: int
    capabilities: dict
    state: State
    admitted_at: float
    last_heard: float
    rtt_s: float = 0.0
    state_since: float = 0.0


@dataclass
class Candidate:
    address: str
    source: str                  # "seed", "gossip", "mdns", "heartbeat"
    node_id: str = ""            # when known (gossip, mdns)
    next_attempt: float = 0.0
    failures: int = 0
    permanent: bool = False      # seeds are retried forever
    last_error: str = ""         # why the last try failed (`peerd status` shows it for seeds)


@dataclass
class Transition:
    node_id: str
    old: State | None
    new: State | None            # None: dropped from the table


@dataclass
class Timing:
    suspect_after: float = 3.0
    dead_after: float = 6.0
    forget_dead_after: float = 3600.0
    retry_base: float = 0.5
    retry_max: float = 10.0
    max_peers: int = 1024
    full_interval: float = 30.0      # seconds between gossip messages that carry the whole table


RTT_ALPHA = 0.25


def gossip_signature(m: Member) -> tuple:
    """What a gossip row says that a receiver acts on (see merge_gossip)."""
    return (m.address, m.incarnation, m.state)


@dataclass(frozen=True)
class GossipMark:
    """What one gossip message carried, for `gossiped` once it was delivered."""
    rows: dict[str, tuple]       # node id -> gossip_signature sent
    full: bool


@dataclass
class Membership:
    self_id: str
    timing: Timing = field(default_factory=Timing)
    members: dict[str, Member] = field(default_factory=dict)
    candidates: dict[str, Candidate] = field(default_factory=dict)
    _retry_at: dict[str, float] = field(default_factory=dict)   # node id -> next contact of a dead peer
    _failures: dict[str, int] = field(default_factory=dict)
    # (peer, way) -> what it has had from us: node id -> gossip_signature, and when the last full table went
    _gossip_sent: dict[tuple[str, str], dict[str, tuple]] = field(default_factory=dict)
    _gossip_full_at: dict[tuple[str, str], float] = field(default_factory=dict)

    # --- events -------------------------------------------------------------------------------
    def add_candidate(self, address: str, source: str, now: float, node_id: str = "",
                      permanent: bool = False) -> None:
        if node_id == self.self_id or address in self.candidates:
            return
        if node_id and node_id in self.members and self.members[node_id].state is not State.LEFT:
            return
        if len(self.candidates) >= self.timing.max_peers:
            return
        self.candidates[address] = Candidate(address, source, node_id, now, 0, permanent)

    def admit(self, node_id: str, address: str, run_id: str, incarnation: int,
              capabilities: dict, now: float) -> Transition | None:
        """An authenticated Hello succeeded (either direction)."""
        old = self.members.get(node_id)
        cand = self.candidates.get(address)
        if cand is not None and not cand.permanent:
            del self.candidates[address]
        if cand is not None and cand.permanent:
            cand.node_id, cand.failures, cand.next_attempt, cand.last_error = node_id, 0, now, ""
        if old is not None and incarnation < old.incarnation and not self._superseded(old, now):
            return None  # a stale Hello from a previous life
        if old is None and len(self.members) >= self.timing.max_peers:
            return None
        member = Member(node_id, address, run_id, incarnation, capabilities, State.ALIVE,
                        admitted_at=now, last_heard=now, state_since=now,
                        rtt_s=old.rtt_s if old else 0.0)
        self.members[node_id] = member
        if old is None or incarnation != old.incarnation:
            self._forget_gossip(node_id)  # a new or restarted peer knows nothing: its next table is whole
        self._failures.pop(node_id, None)
        self._retry_at.pop(node_id, None)
        prev = old.state if old else None
        return None if prev is State.ALIVE else Transition(node_id, prev, State.ALIVE)

    def heard_from(self, node_id: str, now: float, incarnation: int | None = None,
                   rtt_s: float | None = None) -> Transition | None:
        """Direct contact with an admitted peer. Returns the transition if it came back. A peer that
        said goodbye stays gone for that incarnation: its heartbeat or data sent before the goodbye
        may be processed after it (separate streams); only a restart (a newer incarnation) is back."""
        m = self.members.get(node_id)
        if m is None or (incarnation is not None and incarnation < m.incarnation
                         and not self._superseded(m, now)):
            return None
        if m.state is State.LEFT and (incarnation is None or incarnation <= m.incarnation):
            return None
        if incarnation is not None:
            if incarnation != m.incarnation:
                self._forget_gossip(node_id)
            m.incarnation = incarnation
        m.last_heard = now
        if rtt_s is not None:
            m.rtt_s = rtt_s if m.rtt_s == 0 else (1 - RTT_ALPHA) * m.rtt_s + RTT_ALPHA * rtt_s
        self._failures.pop(node_id, None)
        self._retry_at.pop(node_id, None)
        if m.state is State.ALIVE:
            return None
        old, m.state, m.state_since = m.state, State.ALIVE, now
        return Transition(node_id, old, State.ALIVE)

    def _superseded(self, m: Member, now: float) -> bool:
        """The recorded (higher) incarnation of `m` has not been heard from for dead_after: a lower
        one that reaches us directly is the node now."""
        return now - m.last_heard >= self.timing.dead_after

    def forget(self, node_id: str) -> Transition | None:
        """Drop a member at once (it was revoked); its candidates go too."""
        m = self.members.pop(node_id, None)
        for address in [a for a, c in self.candidates.items() if c.node_id == node_id]:
            del self.candidates[address]
        self._forget_gossip(node_id)
        self._retry_at.pop(node_id, None)
        self._failures.pop(node_id, None)
        return Transition(node_id, m.state, None) if m is not None else None

    def contact_failed(self, node_id: str, now: float) -> None:
        """An RPC to an admitted peer failed; back off retries of a dead peer."""
        n = self._failures.get(node_id, 0) + 1
        self._failures[node_id] = n
        self._retry_at[node_id] = now + min(self.timing.retry_max, self.timing.retry_base * 2 ** min(n, 16))

    def candidate_failed(self, address: str, now: float, why: str = "") -> None:
        c = self.candidates.get(address)
        if c is None:
            return
        c.failures += 1
        c.last_error = why
        c.next_attempt = now + min(self.timing.retry_max, self.timing.retry_base * 2 ** min(c.failures, 16))
        if not c.permanent and c.failures >= 8:
            del self.candidates[address]  # gossip/mDNS will tell us again if it is real

    def drop_candidate(self, address: str, now: float, why: str = "") -> None:
        """Not adopted (another run, an old protocol): forgotten, unless it is a seed, which is
        retried with back-off and shows `why` in `peerd status`."""
        c = self.candidates.get(address)
        if c is not None and c.permanent:
            self.candidate_failed(address, now, why)
        elif c is not None:
            del self.candidates[address]

    def left(self, node_id: str, incarnation: int, now: float) -> Transition | None:
        m = self.members.get(node_id)
        if m is None or incarnation < m.incarnation or m.state is State.LEFT:
            return None
        old, m.state, m.state_since = m.state, State.LEFT, now
        return Transition(node_id, old, State.LEFT)

    def merge_gossip(self, rows: Iterable[dict], now: float, source: str = "gossip", *,
                     allow_loopback: bool = True, max_new: int = 1 << 30) -> int:
        """Rows of another node's table: learn of nodes to contact; never mark anyone alive. Rows
        with an address no daemon should dial are skipped; at most `max_new` new candidates.
        Returns how many rows were skipped as bad."""
        bad = new = 0
        for row in rows:
            node_id, address = row.get("node_id", ""), row.get("address", "")
            if not node_id or not address or node_id == self.self_id:
                continue
            if row.get("state") not in (State.ALIVE, State.SUSPECT):
                continue
            hp = split_address(address)
            if hp is None or is_unspecified_host(hp[0]) or (is_loopback_host(hp[0]) and not allow_loopback):
                bad += 1
                continue
            m = self.members.get(node_id)
            if m is None:
                if new < max_new and address not in self.candidates:
                    new += 1
                    self.add_candidate(address, source, now, node_id=node_id)
            elif m.state in (State.DEAD, State.LEFT) and row.get("incarnation", 0) >= m.incarnation:
                # Someone hears from it: try it now rather than at the back-off time.
                if m.state is State.LEFT and row.get("incarnation", 0) > m.incarnation:
                    if new < max_new and address not in self.candidates:
                        new += 1
                        self.add_candidate(address, source, now, node_id=node_id)
                elif m.state is State.DEAD:
                    self._retry_at[node_id] = min(self._retry_at.get(node_id, now), now)
                    if address != m.address:
                        m.address = address
        return bad

    def tick(self, now: float) -> list[Transition]:
        out = []
        t = self.timing
        for node_id, m in list(self.members.items()):
            silent = now - m.last_heard
            new = m.state
            if m.state is State.ALIVE and silent >= t.suspect_after:
                new = State.SUSPECT
            if m.state in (State.ALIVE, State.SUSPECT) and silent >= t.dead_after:
                new = State.DEAD
            if m.state in (State.DEAD, State.LEFT) and now - m.state_since >= t.forget_dead_after:
                del self.members[node_id]
                self._forget_gossip(node_id)
                self._retry_at.pop(node_id, None)
                self._failures.pop(node_id, None)
                out.append(Transition(node_id, m.state, None))
                continue
            if new is not m.state:
                out.append(Transition(node_id, m.state, new))
                m.state, m.state_since = new, now
        return out

    # --- gossip -------------------------------------------------------------------------------
    def gossip_rows(self, peer: str, way: str, now: float) -> tuple[list[Member], GossipMark]:
        """Rows for one heartbeat ("hb") or reply ("reply") to `peer`: the whole table when due, else
        the rows it has not had in their present form; never its own row. Pass the mark to `gossiped`
        once delivered."""
        key = (peer, way)
        sent = self._gossip_sent.get(key)
        full = sent is None or now - self._gossip_full_at.get(key, -float("inf")) >= self.timing.full_interval
        if full:
            self._gossip_full_at[key] = now
            rows = [m for m in self.members.values() if m.node_id != peer]
        else:
            rows = [m for m in self.members.values()
                    if m.node_id != peer and sent.get(m.node_id) != gossip_signature(m)]
        return rows, GossipMark({m.node_id: gossip_signature(m) for m in rows}, full)

    def gossiped(self, peer: str, way: str, mark: GossipMark) -> None:
        if mark.full:
            self._gossip_sent[(peer, way)] = dict(mark.rows)
        elif (peer, way) in self._gossip_sent:
            self._gossip_sent[(peer, way)].update(mark.rows)

    def _forget_gossip(self, peer: str) -> None:
        for key in [k for k in self._gossip_sent if k[0] == peer]:
            del self._gossip_sent[key]
            self._gossip_full_at.pop(key, None)

    # --- queries ------------------------------------------------------------------------------
    def to_contact(self, now: float) -> list[Member]:
        """Admitted peers to heartbeat now: alive and suspect always, dead ones when their back-off is due."""
        out = []
        for node_id, m in self.members.items():
            if m.state in (State.ALIVE, State.SUSPECT):
                out.append(m)
            elif m.state is State.DEAD and self._retry_at.get(node_id, 0.0) <= now:
                out.append(m)
        return out

    def due_candidates(self, now: float) -> list[Candidate]:
        return [c for c in self.candidates.values() if c.next_attempt <= now
                and not (c.node_id and c.node_id in self.members
                         and self.members[c.node_id].state in (State.ALIVE, State.SUSPECT))]

    def alive(self) -> list[str]:
        return sorted(n for n, m in self.members.items() if m.state is State.ALIVE)

    def get(self, node_id: str) -> Member | None:
        return self.members.get(node_id)
