"""Bad updates per peer: counted, and a peer that keeps sending them is flagged for a cool-down.

A peer with the cluster secret can still send garbage: NaN/Inf (a diverged trainer), absurdly large
values (a bug, or bit rot before the checksum was computed), or a layout other than the run's.
Each such update is dropped where it is detected and recorded here. After `peer_max_offences`
offences since its last flag, the peer is flagged: its model updates are refused at the data
plane's door (before any buffer is reserved) for `peer_cooldown` seconds, then it is re-admitted
with a clean streak. Totals stay, for `peerd status` / `peerd peers`.

Sans-I/O but for logging: the clock is injectable, nothing here touches the network.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("peerd.offences")


@dataclass
class Record:
    total: int = 0            # bad updates ever, from this peer
    streak: int = 0           # bad updates since it was last flagged (or first seen)
    flags: int = 0            # times it was flagged
    flagged_until: float = 0.0
    last: str = ""            # what the last bad update was


class PeerOffences:
    def __init__(self, max_offences: int, cooldown: float, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_offences = max(1, max_offences)
        self.cooldown = cooldown
        self.max_peers = max_peers
        self._clock = clock
        self.peers: dict[str, Record] = {}

    def record(self, peer: str, what: str) -> bool:
        """Count one bad update from `peer`; True when this one flags it."""
        r = self.peers.get(peer)
        if r is None:
            if len(self.peers) >= self.max_peers:
                return False  # bounded memory; a peer table this big is itself the problem
            r = self.peers[peer] = Record()
        r.total += 1
        r.streak += 1
        r.last = what
        if r.streak >= self.max_offences and not self.flagged_for(peer):
            r.flags += 1
            r.streak = 0
            r.flagged_until = self._clock() + self.cooldown
            log.warning("peer %s FLAGGED after %d bad updates (last: %s): its updates are ignored for %.0fs",
                        peer, self.max_offences, what, self.cooldown)
            return True
        return False

    def flagged_for(self, peer: str) -> float:
        """Seconds left of `peer`'s cool-down; 0 when its updates are admitted."""
        r = self.peers.get(peer)
        if r is None or not r.flagged_until:
            return 0.0
        left = r.flagged_until - self._clock()
        if left <= 0:
            r.flagged_until = 0.0
            log.warning("peer %s re-admitted after its %.0fs cool-down (%d bad updates in all)",
                        peer, self.cooldown, r.total)
            return 0.0
        return left

    def view(self, peer: str) -> tuple[int, float, str]:
        """(bad updates in all, seconds of cool-down left, the last offence) for status."""
        r = self.peers.get(peer)
        if r is None:
            return 0, 0.0, ""
        return r.total, self.flagged_for(peer), r.last
