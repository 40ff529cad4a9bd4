"""Lab profiles: TOML files describing hosts, sites, link rates, delays and stragglers.

A profile is parsed and validated once into frozen dataclasses; every error names the field
(`site_links[0].delay: ...`) so a profile the lab cannot honour is refused before anything is made.

Schema (all keys optional except where noted; unknown keys are errors):

    name = "two-sites"
    description = "..."
    hosts = 4                         # default host count; `lab up --hosts N` overrides
    [defaults]
    rate = "1gbit"                    # every ordered host pair (omit: unshaped)
    [host.h1]
    link = "10mbit"                   # the host's access link, each direction (one rate per host)
    slowdown = 4.0                    # compute straggler factor (>= 1), exported as PEERD_SLOWDOWN
    relay = false                     # true: its daemon relays for hosts behind NAT (`peerd up --relay`)
    [sites.a]
    hosts = ["h1", "h2"]              # if any site is given, every host must be in exactly one
    rate = "1gbit"                    # pairs inside this site (overrides defaults.rate)
    nat = false                       # true: the site sits behind a NAT router that drops inbound
                                      # connections (its hosts get private addresses; h1 may not be in it)
    [[site_links]]
    sites = ["a", "b"]                # required
    rate = "50mbit"                   # aggregate between the two sites, each direction
    delay = "20ms"                    # one-way propagation delay, each direction
    loss = 0.0                        # drop fraction, each direction
    oneway = false                    # true: only sites[0] -> sites[1]
    [[pairs]]
    hosts = ["h1", "h2"]              # required
    rate = "10mbit"                   # this host pair, each direction (or oneway = true)

Hosts are always named h1..hN. Delay and loss exist only between sites: the latency element is a
userspace wire between a site's bridge and the core (the kernel here has no netem), so a host pair
that needs its own delay goes into single-host sites.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

MAX_HOSTS = 250          # one private /24, .1 .. .250
MIN_RATE = 8_000         # bit/s; tc cannot shape usefully below this
MAX_RATE = 100 * 10**9
MAX_DELAY = 10.0         # seconds, one way
MAX_NAT_SITES = 4        # each NAT router takes one of .251 .. .254 of the lab's /24

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SITE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


class ProfileError(ValueError):
    """A profile the lab cannot honour; the message names the offending field."""


@dataclass(frozen=True)
class Host:
    name: str
    index: int               # 1-based; h1 -> 1
    site: str
    link_bps: int | None     # access link rate, each direction; None = unshaped
    slowdown: float
    relay: bool = False      # its daemon runs with --relay


@dataclass(frozen=True)
class SiteLink:
    src: str
    dst: str
    rate_bps: int | None     # aggregate src -> dst
    delay_s: float           # one way
    loss: float


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    hosts: tuple[Host, ...]
    sites: tuple[str, ...]                          # in order; one implicit site "lan" if none given
    pair_rates: dict[tuple[str, str], int] = field(default_factory=dict)   # ordered (src, dst) -> bit/s
    site_links: dict[tuple[str, str], SiteLink] = field(default_factory=dict)  # ordered
    nat_sites: tuple[str, ...] = ()                 # sites behind a NAT router

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def site_hosts(self, site: str) -> list[Host]:
        return [h for h in self.hosts if h.site == site]

    def delay(self, src: str, dst: str) -> float:
        """One-way delay src -> dst in seconds."""
        link = self.site_links.get((self.host(src).site, self.host(dst).site))
        return link.delay_s if link else 0.0

    def site_rtt(self, a: str, b: str) -> float:
        """Round trip between sites a and b in seconds: both one-way delays."""
        return sum(l.delay_s for l in (self.site_links.get((a, b)), self.site_links.get((b, a))) if l)

    @property
    def delayed_sites(self) -> list[str]:
        """Sites whose uplink needs the userspace delay wire (some outgoing delay or loss)."""
        return [s for s in self.sites
                if any(l.src == s and (l.delay_s > 0 or l.loss > 0) for l in self.site_links.values())]


def parse_rate(value: Any, where: str) -> int:
    """'50mbit', '1gbit', '100kbit', '12.5mbps' or an int of bit/s -> bit/s."""
    if isinstance(value, bool):
        raise ProfileError(f"{where}: expected a rate like '100mbit', got {value!r}")
    if isinstance(value, int):
        bps = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ProfileError(f"{where}: expected a rate like '100mbit' (units: {', '.join(_UNITS)}), "
                               f"got {value!r}")
        bps = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ProfileError(f"{where}: expected a rate like '100mbit', got {value!r}")
    if not MIN_RATE <= bps <= MAX_RATE:
        raise ProfileError(f"{where}: rate {value!r} outside [{MIN_RATE} bit/s, {MAX_RATE // 10**9} gbit]")
    return bps


def parse_delay(value: Any, where: str) -> float:
    """'20ms', '500us', '1.5s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*", value) if isinstance(value, str) else None
    if not m:
        raise ProfileError(f"{where}: expected a delay like '20ms' (units: us, ms, s), got {value!r}")
    out = float(m.group(1)) * _TIME[m.group(2)]
    if out > MAX_DELAY:
        raise ProfileError(f"{where}: delay {value!r} above {MAX_DELAY:g} s")
    return out


def _table(value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}: expected a table, got {value!r}")
    for key in value:
        if key not in allowed:
            raise ProfileError(f"{where}.{key}: unknown setting (allowed: {', '.join(sorted(allowed))})"
                               if where else f"{key}: unknown setting (allowed: {', '.join(sorted(allowed))})")
    return value


def _host_list(value: Any, where: str, names: set[str], n: int) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ProfileError(f"{where}: expected a non-empty list of host names, got {value!r}")
    for v in value:
        if v not in names:
            raise ProfileError(f"{where}: no host {v!r} (hosts are h1..h{n})")
    if len(set(value)) != len(value):
        raise ProfileError(f"{where}: host listed twice in {value!r}")
    return value


def parse(data: dict[str, Any], n_hosts: int | None = None, source: str = "profile") -> Profile:
    """Validate a decoded TOML document; `n_hosts` (from --hosts) overrides the profile's count."""
    try:
        return _parse(data, n_hosts)
    except ProfileError as e:
        raise ProfileError(f"{source}: {e}") from None


def _parse(data: dict[str, Any], n_hosts: int | None) -> Profile:
    _table(data, "", {"name", "description", "hosts", "defaults", "host", "sites", "site_links", "pairs"})
    name, desc = data.get("name", "lab"), data.get("description", "")
    if not isinstance(name, str) or not isinstance(desc, str):
        raise ProfileError("name/description: expected strings")
    n = data.get("hosts") if n_hosts is None else n_hosts
    where_n = "hosts" if n_hosts is None else "--hosts"
    if n is None:
        raise ProfileError("hosts: the profile gives no host count; pass --hosts N")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
        raise ProfileError(f"{where_n}: expected an integer in 1..{MAX_HOSTS}, got {n!r}")
    names = [f"h{i}" for i in range(1, n + 1)]

    defaults = _table(data.get("defaults", {}), "defaults", {"rate"})
    default_rate = parse_rate(defaults["rate"], "defaults.rate") if "rate" in defaults else None

    links, slow, relay = _parse_hosts(data, names, n)
    sites, site_of, site_rate, nat = _parse_sites(data, names, n)
    pair_rates = _parse_pairs(data, names, n, site_of, site_rate, default_rate)
    site_links = _parse_site_links(data, sites)
    hosts = tuple(Host(h, i + 1, site_of[h], links[h], slow[h], h in relay) for i, h in enumerate(names))
    for h in relay:
        if site_of[h] in nat:
            raise ProfileError(f"host.{h}.relay: a relay must be reachable, and site {site_of[h]!r} is behind NAT")
    if nat and len(sites) < 2:
        raise ProfileError(f"sites.{nat[0]}.nat: a site behind NAT needs another site to be hidden from")
    if site_of[names[0]] in nat:
        raise ProfileError(f"sites.{site_of[names[0]]}.nat: h1 seeds every other host, so its site cannot be "
                           f"behind NAT (list the NAT'd site's hosts after a reachable site's)")
    if len(nat) > MAX_NAT_SITES:
        raise ProfileError(f"sites: at most {MAX_NAT_SITES} sites behind NAT, got {len(nat)}")
    return Profile(name, desc, hosts, sites, pair_rates, site_links, nat)


def _parse_hosts(data: dict[str, Any], names: list[str], n: int) -> tuple[dict[str, int | None], dict[str, float],
                                                                        set[str]]:
    """Per-host settings: access link rate, compute slowdown, relaying."""
    name_set = set(names)
    relay: set[str] = set()
    links: dict[str, int | None] = {h: None for h in names}
    slow: dict[str, float] = {h: 1.0 for h in names}
    for hname, spec in _table(data.get("host", {}), "host", name_set | set(data.get("host", {}))).items():
        where = f"host.{hname}"
        if hname not in name_set:
            raise ProfileError(f"{where}: no such host (hosts are h1..h{n}; raise --hosts or drop it)")
        _table(spec, where, {"link", "slowdown", "relay"})
        if not isinstance(spec.get("relay", False), bool):
            raise ProfileError(f"{where}.relay: expected true or false, got {spec['relay']!r}")
        if spec.get("relay"):
            relay.add(hname)
        if "link" in spec:
            links[hname] = parse_rate(spec["link"], f"{where}.link")
        if "slowdown" in spec:
            s = spec["slowdown"]
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 1.0 <= s <= 1000.0:
                raise ProfileError(f"{where}.slowdown: expected a factor in [1, 1000] "
                                   f"(compute takes this many times longer), got {s!r}")
            slow[hname] = float(s)
    return links, slow, relay


def _parse_sites(data: dict[str, Any], names: list[str], n: int) -> tuple[tuple[str, ...], dict[str, str],
                                                                        dict[str, int], tuple[str, ...]]:
    """[sites]: which site each host is in, each site's internal rate, the sites behind NAT."""
    name_set = set(names)
    nat: list[str] = []
    raw_sites = _table(data.get("sites", {}), "sites", set(data.get("sites", {})))
    site_of: dict[str, str] = {}
    site_rate: dict[str, int] = {}
    for sname, spec in raw_sites.items():
        where = f"sites.{sname}"
        if not _SITE_NAME.match(sname):
            raise ProfileError(f"{where}: site names are 1-32 letters, digits, '_' or '-'")
        _table(spec, where, {"hosts", "rate", "nat"})
        if not isinstance(spec.get("nat", False), bool):
            raise ProfileError(f"{where}.nat: expected true or false, got {spec['nat']!r}")
        if spec.get("nat"):
            nat.append(sname)
        if "hosts" not in spec:
            raise ProfileError(f"{where}.hosts: required")
        for h in _host_list(spec["hosts"], f"{where}.hosts", name_set, n):
            if h in site_of:
                raise ProfileError(f"{where}.hosts: {h} is already in site {site_of[h]!r}")
            site_of[h] = sname
        if "rate" in spec:
            site_rate[sname] = parse_rate(spec["rate"], f"{where}.rate")
    if raw_sites:
        missing = [h for h in names if h not in site_of]
        if missing:
            raise ProfileError(f"sites: hosts {', '.join(missing)} are in no site "
                               f"(with --hosts {n}, every host must be in exactly one site)")
        sites = tuple(raw_sites)
    else:
        sites = ("lan",)
        site_of = {h: "lan" for h in names}
    return sites, site_of, site_rate, tuple(nat)


def _parse_pairs(data: dict[str, Any], names: list[str], n: int, site_of: dict[str, str],
                 site_rate: dict[str, int], default_rate: int | None) -> dict[tuple[str, str], int]:
    """Pair rates: defaults, then site-internal rates, then explicit [[pairs]]."""
    name_set = set(names)
    pair_rates: dict[tuple[str, str], int] = {}
    for a in names:
        for b in names:
            if a == b:
                continue
            r = site_rate.get(site_of[a]) if site_of[a] == site_of[b] else None
            r = r if r is not None else default_rate
            if r is not None:
                pair_rates[(a, b)] = r
    raw_pairs = data.get("pairs", [])
    if not isinstance(raw_pairs, list):
        raise ProfileError("pairs: expected an array of tables ([[pairs]])")
    for i, spec in enumerate(raw_pairs):
        where = f"pairs[{i}]"
        _table(spec, where, {"hosts", "rate", "oneway", "delay", "loss"})
        for bad in ("delay", "loss"):
            if bad in spec:
                raise ProfileError(f"{where}.{bad}: per-host-pair {bad} cannot be honoured (no netem in "
                                   f"this kernel; delay/loss come from the wire between sites); put the "
                                   f"hosts in separate sites and set it in [[site_links]]")
        hs = _host_list(spec.get("hosts"), f"{where}.hosts", name_set, n)
        if len(hs) != 2:
            raise ProfileError(f"{where}.hosts: expected exactly two hosts, got {hs!r}")
        if "rate" not in spec:
            raise ProfileError(f"{where}.rate: required")
        r = parse_rate(spec["rate"], f"{where}.rate")
        oneway = spec.get("oneway", False)
        if not isinstance(oneway, bool):
            raise ProfileError(f"{where}.oneway: expected true or false, got {oneway!r}")
        pair_rates[(hs[0], hs[1])] = r
        if not oneway:
            pair_rates[(hs[1], hs[0])] = r
    return pair_rates


def _parse_site_links(data: dict[str, Any], sites: tuple[str, ...]) -> dict[tuple[str, str], "SiteLink"]:
    """[[site_links]]: rate, delay and loss between two sites."""
    site_links: dict[tuple[str, str], SiteLink] = {}
    raw_links = data.get("site_links", [])
    if not isinstance(raw_links, list):
        raise ProfileError("site_links: expected an array of tables ([[site_links]])")
    if raw_links and len(sites) < 2:
        raise ProfileError("site_links: needs at least two sites in [sites]")
    for i, spec in enumerate(raw_links):
        where = f"site_links[{i}]"
        _table(spec, where, {"sites", "rate", "delay", "loss", "oneway"})
        ss = spec.get("sites")
        if (not isinstance(ss, list) or len(ss) != 2 or ss[0] == ss[1]
                or not all(isinstance(s, str) and s in sites for s in ss)):
            raise ProfileError(f"{where}.sites: expected two different sites out of {list(sites)}, got {ss!r}")
        rate = parse_rate(spec["rate"], f"{where}.rate") if "rate" in spec else None
        delay = parse_delay(spec["delay"], f"{where}.delay") if "delay" in spec else 0.0
        loss = spec.get("loss", 0.0)
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0.0 <= loss < 1.0:
            raise ProfileError(f"{where}.loss: expected a fraction in [0, 1), got {loss!r}")
        oneway = spec.get("oneway", False)
        if not isinstance(oneway, bool):
            raise ProfileError(f"{where}.oneway: expected true or false, got {oneway!r}")
        for a, b in [(ss[0], ss[1])] + ([] if oneway else [(ss[1], ss[0])]):
            if (a, b) in site_links:
                raise ProfileError(f"{where}.sites: link {a} -> {b} is given twice")
            site_links[(a, b)] = SiteLink(a, b, rate, delay, float(loss))
    return site_links


def shipped() -> list[str]:
    """Names of the profiles shipped with peerd (peerd/lab/profiles/*.toml)."""
    return sorted(p.name[:-5] for p in resources.files("peerd.lab.profiles").iterdir()
                  if p.name.endswith(".toml"))


def load(path_or_name: str, n_hosts: int | None = None) -> Profile:
    """Load a profile file, or a shipped profile by name (`lan`, `two-sites`, `star`, `straggler`)."""
    path = Path(path_or_name)
    if path.is_file():
        text, source = path.read_text(), str(path)
    elif "/" not in path_or_name and path_or_name in shipped():
        res = resources.files("peerd.lab.profiles") / f"{path_or_name}.toml"
        text, source = res.read_text(), f"profile {path_or_name}"
    else:
        raise ProfileError(f"--profile: no file {path_or_name!r} and no shipped profile of that name "
                           f"(shipped: {', '.join(shipped())})")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{source}: not valid TOML: {e}") from None
    return parse(data, n_hosts, source)
