"""tc command generation for the lab's shaping (no root needed)."""
from __future__ import annotations

import re

import pytest

from peerd.lab import shaping

pytestmark = pytest.mark.lab

Q = dict(queue_ms=20.0, queue_min_bytes=131072, control_share=0.05)


def classes(lines: list[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for ln in lines:
        m = re.search(r"parent 1:1 classid (1:\w+) htb rate (\d+)bit ceil (\d+)bit", ln)
        if m:
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return out


def test_nothing_to_shape_means_no_commands():
    assert shaping.htb_commands("eth0", None, [], **Q) == []


@pytest.mark.parametrize("link", [10**7, 10**8, 10**9])
def test_limited_link_children_never_exceed_it(link):
    dst = shaping.per_destination({f"10.0.0.{i}": r for i, r in enumerate([5 * 10**6, 10**8, 10**10], 2)})
    cls = classes(shaping.htb_commands("eth0", link, dst, **Q))
    assert len(cls) == 2 + 3
    assert sum(rate for rate, _ in cls.values()) <= link
    assert all(rate <= ceil <= link for rate, ceil in cls.values())
    assert cls["1:101"][1] == min(10**8, link)


def test_unlimited_link_gives_each_destination_its_own_strict_rate():
    lines = shaping.htb_commands("eth0", None, shaping.per_destination({"10.0.0.2": 10**7, "10.0.0.3": 10**7}), **Q)
    cls = classes(lines)
    assert cls["1:100"] == (10**7, 10**7) and cls["1:101"] == (10**7, 10**7)
    assert sum("match ip dst 10.0.0.2/32 flowid 1:100" in ln for ln in lines) == 1
    assert sum("match ip dst 10.0.0.3/32 flowid 1:101" in ln for ln in lines) == 1


@pytest.mark.parametrize("rate", [10**5, 10**7, 10**9])
def test_leaf_queues_hold_a_gso_packet(rate):
    lines = shaping.htb_commands("eth0", rate, shaping.per_destination({"10.0.0.2": rate}), **Q)
    limits = [int(m.group(1)) for ln in lines if (m := re.search(r"bfifo limit (\d+)", ln))]
    assert limits and min(limits) >= 65536  # a smaller leaf drops every 64 KiB GSO skb: TCP stalls


def test_a_class_behind_a_round_trip_queues_one_bandwidth_delay_product_more():
    # the two-sites cut: 50 Mbit, 20 ms each way. 20 ms of queue at the rate is 125 kB, under the
    # 128 kB floor; the 40 ms round trip adds 250 kB, so cubic halving its window keeps the link busy.
    flat, cut = (shaping.htb_commands("a", None, [shaping.DstClass(5 * 10**7, ("10.0.0.0/24",), rtt_s=rtt)], **Q)
                 for rtt in (0.0, 0.04))
    limit = lambda lines: [int(m.group(1)) for ln in lines if "handle 100:" in ln
                           and (m := re.search(r"bfifo limit (\d+)", ln))]
    assert limit(flat) == [131072]
    assert limit(cut) == [5 * 10**7 // 8 * 60 // 1000]   # (20 ms + 40 ms) at 50 Mbit = 375 kB


def test_two_site_profile_gives_each_cut_its_round_trip():
    from peerd.lab import profile
    prof = profile.load("two-sites-6")
    sites = prof.sites
    assert prof.site_rtt(sites[0], sites[1]) == pytest.approx(0.04)
    assert prof.site_rtt(sites[0], sites[0]) == 0.0


def test_small_packets_go_to_the_control_class_first():
    lines = shaping.htb_commands("eth0", 10**7, [], **Q)
    ctl = [ln for ln in lines if "flowid 1:2" in ln]
    assert len(ctl) == 1 and "prio 1 u32 match u16 0x0000 0xfe00 at 2" in ctl[0]
    assert any("classid 1:2 " in ln and "prio 0" in ln for ln in lines)
