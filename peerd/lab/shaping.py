"""tc commands that shape one device's egress: htb with per-destination classes.

Layout on a shaped device (all rates in bit/s, tc prints them as "bit"):

    1:    htb root, unmatched traffic -> 1:3
    1:1   parent: the device's own rate (an access link) or UNLIMITED
    1:2   control: IPv4 packets under 512 bytes (pure ACKs, heartbeats, pings, small RPCs);
          prio 0 and its own short queue, so they do not wait behind bulk data
    1:3   default: everything not matched below, up to the parent rate
    1:1xx one class per destination group (a host, or all hosts of a site), rate = ceil = its rate

Leaf queues are bfifo sized to `queue_ms` of the class rate but never below `queue_min_bytes`:
a leaf smaller than one GSO super-packet (64 KiB) drops every large skb and TCP stalls. A class
whose path has a round trip (`DstClass.rtt_s`, a delayed site link) holds one bandwidth-delay
product more: a loss-based TCP (cubic, reno) halves its window at each drop, and only a queue of
about one BDP keeps the link busy while the window grows back (rule of thumb for routers; with
128 kB on a 50 Mbit, 40 ms cut, Hop on cubic ran 1.43 it/s against bbr's 2.07). With a
propagation delay (containers only, `peerd container start`), every leaf is a netem queue instead,
holding `delay` plus `queue_ms` worth of packets at the class rate: netem delays each packet, htb
above it still paces at the class rate. The lab has no netem here and uses a delay wire instead.

A destination is an IPv4 address or a CIDR prefix (a whole compose network, say).

htb was chosen over tbf even where one rate per device would do: only a classful qdisc can give
control traffic its own queue. Rates are link rates; TCP goodput is about 95.6 % of them
(1448 payload bytes per 1514-byte frame, which is what htb counts).
"""
from __future__ import annotations

from dataclasses import dataclass

UNLIMITED = 10 * 10**9      # the parent rate of a device shaped only per destination
SMALL_PACKET = 512           # IPv4 total length below which a packet is control traffic
GOODPUT_RATIO = 1448 / 1514  # TCP payload per frame htb counts (MSS 1448 with timestamps)


@dataclass(frozen=True)
class DstClass:
    """One shaped class: traffic to any of `dst_ips` shares `rate_bps`."""
    rate_bps: int
    dst_ips: tuple[str, ...]    # addresses, or prefixes "a.b.c.d/n"
    rtt_s: float = 0.0          # round trip of the path behind the class: its queue grows by one BDP


def settings(cfg) -> dict[str, float]:
    """The queue settings of htb_commands from a Config: the lab and containers shape alike."""
    return dict(queue_ms=cfg.lab.queue_ms, queue_min_bytes=cfg.lab.queue_min_bytes,
                control_share=cfg.lab.control_share)


def _queue(rate_bps: int, queue_ms: float, min_bytes: int) -> int:
    return max(min_bytes, int(rate_bps / 8 * queue_ms / 1000))


def _burst(rate_bps: int) -> str:
    # 1 ms at the rate: tc's default (one timer tick's worth, computed oddly for fast rates) leaves
    # a 1 Gbit class well under its rate, and a 10 Gbit one with a 0-byte burst.
    b = max(1600, rate_bps // 8 // 1000)
    return f"burst {b} cburst {b}"


def _quantum(rate_bps: int) -> int:
    # htb warns outside [1000, 200000]; a quantum of ~1 ms of data keeps siblings fair.
    return min(200_000, max(1514, rate_bps // 8 // 1000))


def _leaf(rate_bps: int, queue_ms: float, min_bytes: int, delay_s: float) -> str:
    if not delay_s:
        return f"bfifo limit {_queue(rate_bps, queue_ms, min_bytes)}"
    # netem counts packets: room for the packets in flight on the delay line plus the queue.
    frames = -(-int(rate_bps / 8 * (delay_s + queue_ms / 1000)) // 1514)
    return f"netem delay {delay_s * 1000:g}ms limit {max(1000, frames)}"


def htb_commands(dev: str, link_bps: int | None, classes: list[DstClass], *, queue_ms: float,
                 queue_min_bytes: int, control_share: float, delay_s: float = 0.0) -> list[str]:
    """`tc -batch` lines shaping `dev`'s egress. Empty when there is nothing to shape.
    `delay_s` > 0 adds that delay to every packet `dev` sends (needs the netem qdisc)."""
    if link_bps is None and not classes and not delay_s:
        return []
    parent = link_bps or UNLIMITED
    ctl_rate = max(64_000, int(parent * control_share))
    # A limited parent is shared: its children's guaranteed rates add up to the link (a class under
    # its rate sends without asking its parent), and each borrows up to its ceil, so together they
    # never exceed the link. An unlimited parent needs no sharing: rate = ceil.
    share = max(8_000, (parent - ctl_rate) // (len(classes) + 1)) if link_bps else None
    lines = [
        f"qdisc add dev {dev} root handle 1: htb default 3",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {parent}bit ceil {parent}bit "
        f"{_burst(parent)} quantum {_quantum(parent)}",
        f"class add dev {dev} parent 1:1 classid 1:2 htb rate {ctl_rate}bit ceil {parent}bit prio 0 "
        f"{_burst(parent)} quantum {_quantum(ctl_rate)}",
        f"qdisc add dev {dev} parent 1:2 handle 2: "
        + (_leaf(ctl_rate, queue_ms, queue_min_bytes, delay_s) if delay_s else "pfifo limit 1000"),
        f"class add dev {dev} parent 1:1 classid 1:3 htb rate {share or parent}bit ceil {parent}bit prio 1 "
        f"{_burst(parent)} quantum {_quantum(parent)}",
        f"qdisc add dev {dev} parent 1:3 handle 3: {_leaf(parent, queue_ms, queue_min_bytes, delay_s)}",
        f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match u16 0x0000 0x{0x10000 - SMALL_PACKET:04x} "
        f"at 2 flowid 1:2",
    ]
    for k, c in enumerate(classes):
        minor = 0x100 + k
        ceil = min(c.rate_bps, parent)
        rate = min(ceil, share) if share else ceil
        lines += [
            f"class add dev {dev} parent 1:1 classid 1:{minor:x} htb rate {rate}bit ceil {ceil}bit prio 1 "
            f"{_burst(ceil)} quantum {_quantum(ceil)}",
            f"qdisc add dev {dev} parent 1:{minor:x} handle {minor:x}: "
            f"{_leaf(ceil, queue_ms + c.rtt_s * 1000, queue_min_bytes, delay_s)}",
        ]
        lines += [f"filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip dst "
                  f"{ip if '/' in ip else ip + '/32'} flowid 1:{minor:x}" for ip in c.dst_ips]
    return lines


def per_destination(rates: dict[str, int]) -> list[DstClass]:
    """One class per destination host from {dst ip: rate}; equal rates still get separate
    buckets, so each ordered pair has its own rate."""
    return [DstClass(r, (ip,)) for ip, r in sorted(rates.items())]
