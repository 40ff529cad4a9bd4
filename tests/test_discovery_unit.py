"""TXT validation and interface choice, without a network (the lab tests cover the real thing)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from peerd.net.discovery import (Adapter, Candidate, DiscoveryError, Ignored, candidate_from_record,
                                 encode_txt, own_addresses, parse_txt, pick_interfaces)


def txt(props: dict[str, str | bytes]) -> bytes:
    out = b""
    for k, v in props.items():
        item = k.encode() + b"=" + (v if isinstance(v, bytes) else v.encode())
        out += bytes([len(item)]) + item
    return out


def check(instance="n2", props=None, port=7070, addrs=("10.1.2.3",), **kw):
    props = {"id": "n2", "v": "1", "run": "r"} if props is None else props
    args = dict(own_id="n1", run_id="r", protocol_version=1, max_txt_bytes=1024)
    args.update(kw)
    return candidate_from_record(instance, txt(props), port, list(addrs), **args)


def test_round_trip_of_our_own_record():
    props = encode_txt("n2", 1, "r", {"device_kind": "cuda", "gpu_name": "NVIDIA H200",
                                      "gpu_memory_bytes": 150_000_000_000, "cpu_count": 16,
                                      "peerd_version": "0.1.0"})
    c = check(props=props, addrs=("10.1.2.3", "fd00::5"))
    assert c == Candidate("n2", ("10.1.2.3:7070", "[fd00::5]:7070"), 1, "r",
                          {"device_kind": "cuda", "gpu_name": "NVIDIA H200",
                           "gpu_memory_bytes": 150_000_000_000, "cpu_count": 16, "peerd_version": "0.1.0"})


@pytest.mark.parametrize("props,instance,reason", [
    ({"id": "n2", "v": "2", "run": "r"}, "n2", "protocol version 2"),
    ({"id": "n2", "v": "1", "run": "other"}, "n2", "other run"),
    ({"id": "n1", "v": "1", "run": "r"}, "n1", "our own node id"),
    ({"id": "n3", "v": "1", "run": "r"}, "n2", "differs from the instance name"),
    ({"v": "1", "run": "r"}, "n2", "no id"),
    ({"id": "n2", "v": "x", "run": "r"}, "n2", "not a protocol version"),
    ({"id": "n2", "v": "1", "run": "r", "gmem": "-5"}, "n2", "not a non-negative integer"),
    ({"id": "n2", "v": "1", "run": "r", "cpu": "9" * 30}, "n2", "TXT cpu is 30 bytes"),
    ({"id": "n2", "v": "1", "run": "r", "dev": "GPU!"}, "n2", "not a device kind"),
    ({"id": "n2", "v": "1", "run": "r", "gpu": b"\xff"}, "n2", "not UTF-8"),
    ({"id": "n2", "v": "1", "run": "r" * 200}, "n2", "limit 128"),
    ({"id": "a b", "v": "1", "run": "r"}, "a b", "not a node id"),
])
def test_bad_records_are_ignored_with_a_reason(props, instance, reason):
    with pytest.raises(Ignored, match=reason):
        check(instance=instance, props=props)


def test_bad_port_and_addresses():
    with pytest.raises(Ignored, match="bad port"):
        check(port=0)
    with pytest.raises(Ignored, match="no usable address"):
        check(addrs=("0.0.0.0", "224.0.0.251", "127.0.0.1", "garbage"))
    assert check(addrs=("127.0.0.1",), allow_loopback=True).addresses == ("127.0.0.1:7070",)
    assert len(check(addrs=[f"10.0.0.{i}" for i in range(1, 50)]).addresses) == 8


def test_txt_size_truncation_and_duplicates():
    with pytest.raises(Ignored, match="limit 100"):
        parse_txt(b"\x05a=123" * 20, max_bytes=100)
    with pytest.raises(Ignored, match="truncated"):
        parse_txt(b"\x09a=1", 1024)
    with pytest.raises(Ignored, match="repeated"):
        parse_txt(b"\x03a=1\x03a=2", 1024)
    with pytest.raises(Ignored, match="key=value"):
        parse_txt(b"\x04flag", 1024)
    assert parse_txt(b"\x00\x03a=1", 1024) == {"a": b"1"}


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048), st.text(max_size=70), st.one_of(st.none(), st.integers(-5, 70000)),
       st.lists(st.text(max_size=50), max_size=10))
def test_any_garbage_is_either_a_candidate_or_ignored(raw, instance, port, addrs):
    try:
        c = candidate_from_record(instance, raw, port, addrs, own_id="n1", run_id="r",
                                  protocol_version=1, max_txt_bytes=1024)
    except Ignored:
        return
    assert c.node_id == instance and c.run_id == "r" and c.addresses


def test_encode_refuses_unannounceable_values():
    for bad in ("a.b", "", "x" * 64, "-x"):
        with pytest.raises(ValueError, match="node_id"):
            encode_txt(bad, 1, "r", {})
    assert encode_txt("n", 1, "r", {"step_time_s": 0.5, "device_kind": "cpu"}) == \
        {"id": "n", "v": "1", "run": "r", "dev": "cpu"}      # only the stable capabilities go out
    with pytest.raises(ValueError, match="gpu_name"):
        encode_txt("n", 1, "r", {"gpu_name": "G" * 200})
    with pytest.raises(ValueError, match="run_id"):
        encode_txt("n", 1, "", {})


ADAPTERS = [Adapter("lo", ("127.0.0.1", "::1")), Adapter("eth0", ("192.0.2.2", "fd00::2")),
            Adapter("wlan0", ("198.51.100.4",)), Adapter("docker0", ("172.17.0.1",)),
            Adapter("br-4f2a", ("172.18.0.1",)), Adapter("veth12ab", ("169.254.3.3",)),
            Adapter("tun0", ())]


def test_default_skips_virtual_and_loopback():
    assert pick_interfaces(ADAPTERS, None, None) == [("eth0", "192.0.2.2"), ("wlan0", "198.51.100.4")]


def test_flags_win_and_fallback_order():
    assert pick_interfaces(ADAPTERS, "docker0,fd00::2", None) == [("docker0", "172.17.0.1"), ("eth0", "fd00::2")]
    assert pick_interfaces(ADAPTERS, None, "198.51.100.4:7070") == [("wlan0", "198.51.100.4")]
    assert pick_interfaces(ADAPTERS, None, "peer.example.org:7070")[0] == ("eth0", "192.0.2.2")
    only_virtual = [a for a in ADAPTERS if a.name not in ("eth0", "wlan0")]
    assert pick_interfaces(only_virtual, None, None) == [("docker0", "172.17.0.1"), ("br-4f2a", "172.18.0.1")]
    assert pick_interfaces([ADAPTERS[0]], None, None) == [("lo", "127.0.0.1")]
    assert pick_interfaces(ADAPTERS, None, None, skip=("lo",))[-2:] == [("docker0", "172.17.0.1"),
                                                                         ("br-4f2a", "172.18.0.1")]
    with pytest.raises(DiscoveryError, match="tun0"):
        pick_interfaces(ADAPTERS, "tun0", None)


def test_own_addresses_fall_back_from_wildcards_and_names():
    ifs = [("eth0", "192.0.2.2"), ("wlan0", "198.51.100.4")]
    assert own_addresses(["0.0.0.0:7070"], ifs) == ["192.0.2.2", "198.51.100.4"]
    assert own_addresses(["gpu1.example.org:7070"], ifs) == ["192.0.2.2", "198.51.100.4"]
    assert own_addresses(["203.0.113.9:7070", "[fd00::9]:7070"], ifs) == ["203.0.113.9", "fd00::9"]
    assert own_addresses(["127.0.0.1:7070"], [("lo", "127.0.0.1")]) == ["127.0.0.1"]
    with pytest.raises(DiscoveryError, match="loopback"):
        own_addresses(["127.0.0.1:7070"], ifs)
