"""mDNS discovery in the daemon: announce this node, turn announcements into membership candidates.

- An announcement is only a candidate: the membership table admits a peer after an authenticated
  Hello (with the reply MAC proving the peer holds the secret too), exactly as for seeds and
  gossip. A rogue announcing our run id without the secret is tried, refused and dropped.
- A withdrawn announcement drops the candidates it created that were never adopted; an admitted
  peer stays until the failure detector says otherwise (a crashed host sends no goodbye, a
  restarting one sends a goodbye and is back a second later).
- Where to bind: `--interface` wins; else the interface of `--advertise-address` or of the listen
  address when either is a local IP; else every interface except loopback and virtual ones
  (peerd.net.discovery.choose_interfaces). A daemon listening on loopback only (the default
  127.0.0.1) cannot be dialed by other hosts, so without `--interface` it does not announce at
  all and says so; `--interface lo` announces on loopback, for daemons on one host.
- Failure to start mDNS never stops the daemon: seeds and gossip work without it.
"""
from __future__ import annotations

import ipaddress
import logging
import time

from peerd import PROTOCOL_VERSION
from peerd.config import Config
from peerd.net.discovery import Candidate, DiscoveryError, MdnsDiscovery, choose_interfaces
from peerd.net.membership import Membership, State
from peerd.node.convert import is_unspecified, split_host_port
from peerd.node.membership_service import Identity

log = logging.getLogger("peerd.discovery")
SOURCE = "mdns"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plan(cfg: Config, me: Identity, table: Membership) -> tuple[MdnsDiscovery | None, str]:
    """The discovery service to start, or None and why not."""
    if not cfg.mdns.enabled:
        return None, "mDNS discovery is off (--no-mdns); peers come from --peer seeds and gossip"
    listen_host, _ = split_host_port(cfg.node.listen, allow_zero=True)
    if not cfg.mdns.interface and not cfg.node.advertise_address and _is_loopback(listen_host):
        return None, (f"mDNS discovery is off: the Peer service listens on loopback ({cfg.node.listen}), which no "
                      f"other host can dial; listen on 0.0.0.0 or an interface address to be found on the "
                      f"network (or pass --interface lo for daemons on this host); --peer seeds work either way")
    try:
        hint = cfg.node.advertise_address or (None if is_unspecified(listen_host) else cfg.node.listen)
        interfaces = choose_interfaces(cfg.mdns.interface or None, hint, cfg.mdns.skip_interfaces)
        _, port = split_host_port(me.address)
        disc = MdnsDiscovery(node_id=me.node_id, run_id=cfg.node.run_id, protocol_version=PROTOCOL_VERSION,
                             port=port, addresses=[me.address], capabilities=me.caps,
                             interfaces=interfaces, on_candidate=lambda c: on_candidate(table, c),
                             on_gone=lambda n: on_gone(table, n), cfg=cfg)
    except (DiscoveryError, ValueError) as e:
        return None, f"mDNS discovery is off: {e}; --peer seeds and gossip still work"
    return disc, ""


def on_candidate(table: Membership, c: Candidate) -> None:
    m = table.get(c.node_id)
    if m is not None and m.state is not State.LEFT:
        return                       # known: its liveness and address are the failure detector's
    now = time.monotonic()
    for address in c.addresses:
        table.add_candidate(address, SOURCE, now, node_id=c.node_id)


def on_gone(table: Membership, node_id: str) -> None:
    cands = table.candidates
    for address in [a for a, c in cands.items() if c.node_id == node_id and c.source == SOURCE]:
        table.drop_candidate(address, time.monotonic())
