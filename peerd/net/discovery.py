"""mDNS / DNS-SD discovery of peerd daemons on the local network.

Each daemon registers `<node_id>._peerd._tcp.local.` and browses the same type. The TXT record
carries who the daemon is (protocol version 1 keys):

    id    node id; must equal the instance label          (required)
    v     protocol version, decimal                       (required)
    run   run id                                          (required)
    dev   device kind ("cpu", "cuda", ...)                (optional)
    gpu   GPU name                                        (optional)
    gmem  GPU memory, bytes, decimal                      (optional)
    cpu   CPU count, decimal                              (optional)
    pv    peerd version                                   (optional)

Design choices:
- An announcement is only a *candidate*. It reaches the daemon through `on_candidate`; the daemon
  adopts the peer only after an authenticated Hello. mDNS is unauthenticated, so everything in it is
  parsed strictly and bounded: TXT size, each field's length and type, the address count. Records of
  other runs, other protocol versions, our own id, or malformed ones are ignored and logged once
  per (name, reason); `ignored` keeps the last reason per name for status output.
- A service that disappears is reported to `on_gone` as a hint only. Liveness belongs to the
  failure detector: a crashed host sends no goodbye and lingers in mDNS caches for up to 1125 s.
- We browse before we register: the browser's first query finds running peers in about 60 ms,
  while registering (RFC 6762 probing) takes about 1.2 s.
- Interfaces are chosen deliberately (`choose_interfaces`) and passed as explicit addresses:
  InterfaceChoice.Default fails on hosts without a default route, and All also binds docker and
  VPN interfaces.
- All our questions ask for multicast answers (QM). A unicast answer goes to <ip>:5353, and when
  several responders share that port on one host (avahi-daemon, two daemons, a test harness) the
  kernel hands it to just one of them: measured here, co-located resolves then time out.
- Every wait is bounded by a Config timeout; a record that will not resolve costs one bounded task.
"""
from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from peerd import PROTOCOL_VERSION
from peerd.config import Config

log = logging.getLogger("peerd.discovery")

SERVICE_TYPE = "_peerd._tcp.local."
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")   # one DNS label, no dots or escapes
MAX_RUN_ID_BYTES = 128
MAX_ADDRESSES = 8
_DEVICE_RE = re.compile(r"[a-z0-9_-]{1,16}\Z")
_KEY_RE = re.compile(rb"[a-z][a-z0-9_-]{0,8}\Z")
_MAX_INT = 2**63 - 1

# capability name (as in peer.proto's Capabilities) -> (TXT key, kind, max length)
CAPABILITY_KEYS: dict[str, tuple[str, str, int]] = {
    "device_kind": ("dev", "device", 16),
    "gpu_name": ("gpu", "text", 128),
    "gpu_memory_bytes": ("gmem", "int", 19),
    "cpu_count": ("cpu", "int", 19),
    "peerd_version": ("pv", "text", 32),
}
_TXT_TO_CAP = {key: (cap, kind, n) for cap, (key, kind, n) in CAPABILITY_KEYS.items()}


class DiscoveryError(RuntimeError):
    """mDNS could not start (no usable interface, bind failure, our name is taken)."""


class Ignored(ValueError):
    """An announcement that must not become a candidate; the message is the reason."""


@dataclass(frozen=True)
class Candidate:
    """A daemon seen on mDNS: not yet a peer (the daemon adopts it after an authenticated Hello)."""
    node_id: str
    addresses: tuple[str, ...]          # "ip:port" or "[ipv6]:port", as announced
    protocol_version: int
    run_id: str
    capabilities: dict[str, Any] = field(default_factory=dict, compare=True, hash=False)


# ---- interfaces -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Adapter:
    name: str
    ips: tuple[str, ...]                # IPv4 first, then global IPv6; no link-local IPv6


def list_adapters() -> list[Adapter]:
    """The host's interfaces and addresses (ifaddr, which python-zeroconf ships with)."""
    import ifaddr

    out = []
    for a in ifaddr.get_adapters():
        v4 = [ip.ip for ip in a.ips if isinstance(ip.ip, str)]
        v6 = [ip.ip[0] for ip in a.ips if isinstance(ip.ip, tuple)
              and not ipaddress.IPv6Address(ip.ip[0].split("%")[0]).is_link_local]
        out.append(Adapter(a.nice_name, tuple(v4 + v6)))
    return out


def _host_of(address: str) -> str:
    """'1.2.3.4:7070' -> '1.2.3.4', '[fd00::1]:7070' -> 'fd00::1', bare hosts unchanged."""
    address = address.strip()
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    if address.count(":") == 1:
        return address.rsplit(":", 1)[0]
    return address


def pick_interfaces(adapters: Sequence[Adapter], interface_flag: str | None, advertise_address: str | None,
                    skip: Iterable[str] = ("lo", "docker*", "br-*", "veth*")) -> list[tuple[str, str]]:
    """Choose (ifname, ip) pairs for mDNS from a list of adapters; see `choose_interfaces`."""
    skip = tuple(skip)
    by_ip = {ip: a.name for a in adapters for ip in a.ips}
    if interface_flag:
        chosen: list[tuple[str, str]] = []
        for item in (x.strip() for x in interface_flag.split(",")):
            if not item:
                continue
            if item in by_ip:
                chosen.append((by_ip[item], item))
                continue
            match = [a for a in adapters if a.name == item]
            v4 = [ip for a in match for ip in a.ips if ":" not in ip]
            if not v4:
                known = ", ".join(f"{a.name} ({' '.join(a.ips) or 'no address'})" for a in adapters)
                raise DiscoveryError(f"--interface {item!r}: no such interface with an IPv4 address, "
                                     f"or no such local address; this host has: {known}")
            chosen += [(item, ip) for ip in v4]
        if not chosen:
            raise DiscoveryError(f"--interface {interface_flag!r} names no interface")
        return list(dict.fromkeys(chosen))
    if advertise_address:
        host = _host_of(advertise_address)
        if host in by_ip:
            return [(by_ip[host], host)]
        # Not a local address (NAT, DNS name): fall through to the default rule.

    def v4_of(names: Iterable[Adapter]) -> list[tuple[str, str]]:
        return [(a.name, ip) for a in names for ip in a.ips
                if ":" not in ip and not ipaddress.IPv4Address(ip).is_link_local]

    def skipped(a: Adapter) -> bool:
        return any(fnmatch.fnmatchcase(a.name, pat) for pat in skip) or \
            any(ipaddress.ip_address(ip).is_loopback for ip in a.ips)

    preferred = v4_of(a for a in adapters if not skipped(a))
    if preferred:
        return preferred
    # Nothing else exists: bridges and veths before loopback (loopback reaches only this host).
    fallback = v4_of(a for a in adapters if skipped(a) and not any(
        ipaddress.ip_address(ip).is_loopback for ip in a.ips))
    return fallback or v4_of(adapters)


def choose_interfaces(interface_flag: str | None, advertise_address: str | None,
                      skip: Iterable[str] = ("lo", "docker*", "br-*", "veth*")) -> list[tuple[str, str]]:
    """The (ifname, ip) pairs mDNS should bind to on this host.

    - `interface_flag` (comma-separated interface names or local IPs) wins; an unknown name is an
      error that lists what exists.
    - Else, if `advertise_address` ('HOST[:PORT]') is a local address, its interface alone.
    - Else every interface with an IPv4 address except those matching `skip` or holding a loopback
      address; when nothing else exists, the skipped ones (loopback last).
    IPv6 is used only when named explicitly in `interface_flag`.
    """
    return pick_interfaces(list_adapters(), interface_flag, advertise_address, skip)


# ---- TXT records --------------------------------------------------------------------------------

def encode_txt(node_id: str, protocol_version: int, run_id: str,
               capabilities: Mapping[str, Any]) -> dict[str, str]:
    """Our TXT properties; raises ValueError naming the field that cannot be announced."""
    if not NODE_ID_RE.match(node_id):
        raise ValueError(f"node_id {node_id!r} is not usable as an mDNS instance name "
                         f"(1-63 chars of A-Z a-z 0-9 _ -, starting alphanumeric)")
    if not 0 <= protocol_version <= 0xFFFF:
        raise ValueError(f"protocol_version {protocol_version} out of range")
    if not run_id or len(run_id.encode()) > MAX_RUN_ID_BYTES or not run_id.isprintable():
        raise ValueError(f"run_id {run_id!r}: must be 1-{MAX_RUN_ID_BYTES} bytes of printable text")
    props = {"id": node_id, "v": str(protocol_version), "run": run_id}
    for cap, value in capabilities.items():
        if cap not in CAPABILITY_KEYS:
            continue            # e.g. step_time_s: changes while running; Hello and gossip carry it
        key, kind, _ = CAPABILITY_KEYS[cap]
        if value is None or value == "":
            continue
        text = str(int(value)) if kind == "int" else str(value)
        try:
            _check_value(key, text.encode())
        except Ignored as e:
            raise ValueError(f"capability {cap}={value!r}: {e}") from None
        props[key] = text
    return props


def _check_value(key: str, raw: bytes) -> str | int:
    cap = _TXT_TO_CAP.get(key)
    limit = cap[2] if cap else 255
    if len(raw) > limit:
        raise Ignored(f"TXT {key} is {len(raw)} bytes (limit {limit})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Ignored(f"TXT {key} is not UTF-8") from None
    if not text.isprintable():
        raise Ignored(f"TXT {key} has control characters")
    kind = cap[1] if cap else "text"
    if kind == "int":
        if not text.isascii() or not text.isdigit() or int(text) > _MAX_INT:
            raise Ignored(f"TXT {key}={text[:20]!r} is not a non-negative integer")
        return int(text)
    if kind == "device" and not _DEVICE_RE.match(text):
        raise Ignored(f"TXT {key}={text[:20]!r} is not a device kind")
    return text


def parse_txt(text: bytes, max_bytes: int) -> dict[str, bytes]:
    """Split a raw TXT rdata into key -> value; raises Ignored on anything malformed.

    Stricter than RFC 6763 on purpose: keys are short lowercase ASCII, every string has '=', and a
    repeated key is an error (instead of silently taking the first).
    """
    if len(text) > max_bytes:
        raise Ignored(f"TXT record is {len(text)} bytes (limit {max_bytes})")
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(text):
        n = text[pos]
        item = text[pos + 1: pos + 1 + n]
        if len(item) != n:
            raise Ignored("TXT record is truncated")
        pos += 1 + n
        if n == 0:
            continue
        key, sep, value = item.partition(b"=")
        if not sep or not _KEY_RE.match(key):
            raise Ignored(f"TXT string {item[:20]!r} is not key=value with a short lowercase key")
        k = key.decode()
        if k in out:
            raise Ignored(f"TXT key {k} repeated")
        out[k] = value
    return out


def candidate_from_record(instance: str, txt: bytes, port: int | None, addresses: Sequence[str], *,
                          own_id: str, run_id: str, protocol_version: int, max_txt_bytes: int,
                          allow_loopback: bool = False) -> Candidate:
    """Validate one resolved announcement; raises Ignored(reason) unless it is a usable candidate."""
    props = parse_txt(txt, max_txt_bytes)
    for required in ("id", "v", "run"):
        if required not in props:
            raise Ignored(f"TXT has no {required}")
    v_raw = props["v"]
    if not v_raw.isdigit() or len(v_raw) > 5:
        raise Ignored(f"TXT v={v_raw[:20]!r} is not a protocol version")
    if int(v_raw) != protocol_version:
        raise Ignored(f"protocol version {int(v_raw)} (we speak {protocol_version})")
    node_id = _check_value("id", props["id"])
    if not isinstance(node_id, str) or not NODE_ID_RE.match(node_id):
        raise Ignored(f"TXT id {str(node_id)[:40]!r} is not a node id")
    if node_id != instance:
        raise Ignored(f"TXT id {node_id!r} differs from the instance name {instance[:63]!r}")
    if node_id == own_id:
        raise Ignored("announces our own node id")
    if len(props["run"]) > MAX_RUN_ID_BYTES:
        raise Ignored(f"TXT run is {len(props['run'])} bytes (limit {MAX_RUN_ID_BYTES})")
    run = _check_value("run", props["run"])
    if run != run_id:
        raise Ignored(f"other run {str(run)[:40]!r}")
    caps: dict[str, Any] = {}
    for key, raw in props.items():
        if key in _TXT_TO_CAP:
            caps[_TXT_TO_CAP[key][0]] = _check_value(key, raw)
        elif key not in ("id", "v", "run") and len(raw) > 255:
            raise Ignored(f"TXT {key} too long")
    if port is None or not 0 < port < 65536:
        raise Ignored(f"bad port {port}")
    addrs: list[str] = []
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a.split("%")[0])
        except ValueError:
            continue
        if ip.is_unspecified or ip.is_multicast or (ip.is_loopback and not allow_loopback):
            continue
        addrs.append(f"[{a}]:{port}" if ip.version == 6 else f"{a}:{port}")
    if not addrs:
        raise Ignored(f"no usable address in {list(addresses)[:4]}")
    return Candidate(node_id, tuple(addrs[:MAX_ADDRESSES]), protocol_version, run, caps)


# ---- the service ----------------------------------------------------------------------------------

def own_addresses(addresses: Sequence[str], interfaces: Sequence[tuple[str, str]]) -> list[str]:
    """The IPs to announce: the given HOST[:PORT]s that are usable IPs, else the interfaces' IPs.

    A wildcard listen address (0.0.0.0, ::) or a DNS name cannot go into an A record, so those
    fall back to the addresses mDNS is bound to. Announcing loopback to a network is refused.
    """
    out = []
    for a in addresses:
        host = _host_of(a)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            log.warning("mDNS: %r is not an IP address; announcing the interface addresses instead", a)
            continue
        if not ip.is_unspecified:
            out.append(host)
    if not out:
        out = [ip for _, ip in interfaces]
    if all(ipaddress.ip_address(a).is_loopback for a in out) and \
            not all(ipaddress.ip_address(ip).is_loopback for _, ip in interfaces):
        raise DiscoveryError(f"the Peer service is reachable only at {', '.join(out)} (loopback), which "
                             f"peers on {', '.join(n for n, _ in interfaces)} cannot dial: listen on "
                             f"0.0.0.0 or an interface address, or set --advertise-address")
    return list(dict.fromkeys(out))


def _instance_of(name: str) -> str | None:
    suffix = "." + SERVICE_TYPE
    return name[: -len(suffix)] if name.lower().endswith(suffix) else None


class MdnsDiscovery:
    """Announce this daemon and report other daemons of the same run as candidates.

    `on_candidate(Candidate)` is called (on the event loop) for each newly seen or changed
    announcement that passed validation; `on_gone(node_id)` when a candidate's service is withdrawn
    (a hint only). Callbacks must not block; exceptions in them are logged.

    `addresses` are where the Peer service can be dialed (HOST[:PORT]; wildcards and names fall
    back to the interfaces' IPs). The constructor raises ValueError for values that cannot be
    announced and DiscoveryError for an unreachable setup; `start` raises DiscoveryError. Either
    way the daemon should log it and go on without mDNS: seeds still work.
    """

    def __init__(self, *, node_id: str, run_id: str, protocol_version: int, port: int,
                 addresses: Sequence[str], capabilities: Mapping[str, Any],
                 interfaces: Sequence[tuple[str, str]], on_candidate: Callable[[Candidate], None],
                 on_gone: Callable[[str], None] | None = None, cfg: Config | None = None) -> None:
        self.cfg = cfg or Config()
        self.node_id, self.run_id, self.protocol_version = node_id, run_id, protocol_version
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range")
        if not interfaces:
            raise DiscoveryError("no interface to run mDNS on")
        self.port = port
        self.interfaces = list(interfaces)
        self.addresses = own_addresses(addresses, self.interfaces)
        self._props = encode_txt(node_id, protocol_version, run_id, capabilities)
        self.on_candidate, self.on_gone = on_candidate, on_gone
        self.ignored: dict[str, str] = {}           # name -> last reason (bounded)
        self._accepted: dict[str, Candidate] = {}    # name -> last candidate emitted
        self._logged: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._pending: set[str] = set()
        self._sem = asyncio.Semaphore(self.cfg.mdns.max_resolving)
        self._azc = None
        self._browser = None
        self._info = None
        self._registered = False
        self._name = f"{node_id}.{SERVICE_TYPE}"
        self._loopback = all(ipaddress.ip_address(ip).is_loopback for _, ip in self.interfaces)

    # -- lifecycle --

    async def start(self) -> None:
        """Bind, browse, then register (bounded by mdns_register_timeout). Raises DiscoveryError."""
        from zeroconf import DNSQuestionType, IPVersion, NonUniqueNameException
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        ips = [ip for _, ip in self.interfaces]
        version = IPVersion.All if any(":" in ip for ip in ips) else IPVersion.V4Only
        if any(":" in ip for ip in ips) and all(":" in ip for ip in ips):
            version = IPVersion.V6Only
        try:
            self._azc = AsyncZeroconf(interfaces=ips, ip_version=version)
        except OSError as e:
            raise DiscoveryError(f"mDNS cannot bind {ips}: {e}") from None
        log.info("mDNS bound to %s", ", ".join(f"{n} {ip}" for n, ip in self.interfaces))
        self._browser = AsyncServiceBrowser(self._azc.zeroconf, [SERVICE_TYPE], handlers=[self._on_change],
                                            question_type=DNSQuestionType.QM)
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, self._name, port=self.port, properties=self._props,
            server=f"peerd-{self.node_id}.local.", parsed_addresses=self.addresses)
        try:
            async with asyncio.timeout(self.cfg.mdns.register_timeout):
                announced = await self._azc.async_register_service(self._info)
                self._registered = True
                await announced
        except NonUniqueNameException:
            await self._close()
            raise DiscoveryError(f"another host already announces node id {self.node_id!r} on mDNS") from None
        except TimeoutError:
            await self.stop()
            raise DiscoveryError(f"mDNS registration did not finish within "
                                 f"{self.cfg.mdns.register_timeout} s (mdns_register_timeout)") from None
        log.info("mDNS: announced %s at %s port %d", self._name, ", ".join(self.addresses), self.port)

    async def update_capabilities(self, capabilities: Mapping[str, Any]) -> None:
        """Re-announce with new capabilities (e.g. after the trainer reported its GPU)."""
        self._props = encode_txt(self.node_id, self.protocol_version, self.run_id, capabilities)
        if self._azc is None or not self._registered:
            return
        from zeroconf.asyncio import AsyncServiceInfo
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, self._name, port=self.port, properties=self._props,
            server=f"peerd-{self.node_id}.local.", parsed_addresses=self.addresses)
        async with asyncio.timeout(self.cfg.mdns.register_timeout):
            await (await self._azc.async_update_service(self._info))

    async def stop(self) -> None:
        """Withdraw our service (goodbye packets) and close; bounded by mdns_stop_timeout."""
        if self._azc is None:
            return
        try:
            async with asyncio.timeout(self.cfg.mdns.stop_timeout):
                if self._registered and self._info is not None:
                    self._registered = False
                    await (await self._azc.async_unregister_service(self._info))
        except TimeoutError:
            log.warning("mDNS goodbye not sent within %s s (mdns_stop_timeout)", self.cfg.mdns.stop_timeout)
        except Exception as e:  # never let shutdown fail on mDNS
            log.warning("mDNS goodbye failed: %s", e)
        await self._close()

    async def _close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.cfg.mdns.stop_timeout)
        azc, self._azc = self._azc, None
        browser, self._browser = self._browser, None
        try:
            async with asyncio.timeout(self.cfg.mdns.stop_timeout):
                if browser is not None:
                    await browser.async_cancel()
                if azc is not None:
                    await azc.async_close()
        except Exception as e:
            log.warning("mDNS close: %s", e)

    # -- browsing --

    def _on_change(self, zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        from zeroconf import ServiceStateChange

        if name.lower() == self._name.lower():
            return                                          # ourselves
        if state_change is ServiceStateChange.Removed:
            cand = self._accepted.pop(name, None)
            if cand is not None:
                log.info("mDNS: %s withdrew its service (liveness stays with the failure detector)",
                         cand.node_id)
                self._call(self.on_gone, cand.node_id)
            return
        instance = _instance_of(name)
        if instance is None or not NODE_ID_RE.match(instance):
            self._ignore(name, "instance name is not a node id")
            return
        if name in self._pending:
            return
        if len(self._pending) + len(self._accepted) + len(self.ignored) >= self.cfg.mdns.max_names \
                and name not in self._accepted and name not in self.ignored:
            self._log_once(name, f"tracking {self.cfg.mdns.max_names} names already (mdns_max_names)")
            return
        self._pending.add(name)
        task = asyncio.get_running_loop().create_task(self._resolve(name, instance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str, instance: str) -> None:
        from zeroconf import DNSQuestionType
        from zeroconf.asyncio import AsyncServiceInfo

        try:
            async with self._sem:
                if self._azc is None:
                    return
                info = AsyncServiceInfo(SERVICE_TYPE, name)
                timeout = self.cfg.mdns.resolve_timeout
                try:
                    async with asyncio.timeout(timeout + 1.0):
                        ok = await info.async_request(self._azc.zeroconf, timeout * 1000,
                                                      question_type=DNSQuestionType.QM)
                except TimeoutError:
                    ok = False
                if not ok:
                    self._ignore(name, f"did not resolve within {timeout} s")
                    return
                try:
                    cand = candidate_from_record(
                        instance, info.text or b"", info.port, info.parsed_scoped_addresses(),
                        own_id=self.node_id, run_id=self.run_id, protocol_version=self.protocol_version,
                        max_txt_bytes=self.cfg.mdns.max_txt_bytes, allow_loopback=self._loopback)
                except Ignored as e:
                    self._ignore(name, str(e))
                    return
                self.ignored.pop(name, None)
                if self._accepted.get(name) == cand:
                    return
                self._accepted[name] = cand
                log.info("mDNS: candidate %s at %s", cand.node_id, ", ".join(cand.addresses))
                self._call(self.on_candidate, cand)
        finally:
            self._pending.discard(name)

    def _ignore(self, name: str, reason: str) -> None:
        self._accepted.pop(name, None)
        if name in self.ignored or len(self.ignored) < self.cfg.mdns.max_names:
            self.ignored[name] = reason
        self._log_once(name, reason)

    def _log_once(self, name: str, reason: str) -> None:
        key = (name[:300], reason)
        if key in self._logged:
            return
        if len(self._logged) >= self.cfg.mdns.max_names:
            self._logged.clear()            # bounded memory; at worst a reason is logged again
        self._logged.add(key)
        log.warning("mDNS: ignoring %r: %s", name[:300], reason)

    def _call(self, fn: Callable[..., None] | None, arg: Any) -> None:
        if fn is None:
            return
        try:
            fn(arg)
        except Exception:
            log.exception("mDNS callback %r failed", fn)

    @property
    def candidates(self) -> list[Candidate]:
        return list(self._accepted.values())


# ---- `python -m peerd.net.discovery`: watch the network, print JSON lines ------------------------

def _main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json
    import time

    p = argparse.ArgumentParser(description="Announce a peerd service and print what mDNS finds, "
                                            "as JSON lines (a diagnostic; the daemon uses this module).")
    p.add_argument("--node-id", required=True)
    p.add_argument("--run-id", default="default")
    p.add_argument("--protocol-version", type=int, default=PROTOCOL_VERSION)
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--interface", default="")
    p.add_argument("--advertise-address", default="")
    p.add_argument("--device-kind", default="cpu")
    p.add_argument("--duration", type=float, default=5.0, help="seconds to run")
    p.add_argument("--update-at", type=float, default=0.0,
                   help="seconds after start to re-announce with --update-device-kind")
    p.add_argument("--update-device-kind", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.monotonic()

    def emit(**kw: Any) -> None:
        print(json.dumps({"t": round(time.monotonic() - t0, 3), **kw}), flush=True)

    async def run() -> int:
        ifaces = choose_interfaces(args.interface or None, args.advertise_address or None)
        disc = MdnsDiscovery(
            node_id=args.node_id, run_id=args.run_id, protocol_version=args.protocol_version,
            port=args.port, addresses=[args.advertise_address] if args.advertise_address else [],
            capabilities={"device_kind": args.device_kind, "cpu_count": len(__import__("os").sched_getaffinity(0))},
            interfaces=ifaces,
            on_candidate=lambda c: emit(event="candidate", node_id=c.node_id, addresses=list(c.addresses),
                                        protocol_version=c.protocol_version, run_id=c.run_id,
                                        capabilities=c.capabilities),
            on_gone=lambda n: emit(event="gone", node_id=n))
        emit(event="bound", interfaces=ifaces)
        try:
            await disc.start()
        except DiscoveryError as e:
            emit(event="error", error=str(e))
            return 1
        emit(event="registered")
        if args.update_at:
            await asyncio.sleep(max(0.0, args.update_at - (time.monotonic() - t0)))
            await disc.update_capabilities({"device_kind": args.update_device_kind})
            emit(event="updated")
        await asyncio.sleep(max(0.0, args.duration - (time.monotonic() - t0)))
        emit(event="ignored", ignored=disc.ignored)
        await disc.stop()
        emit(event="stopped")
        return 0

    return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(_main())
