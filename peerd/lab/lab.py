"""`peerd lab`: N hosts on one Linux machine, each in its own network namespace.

Topology. One switch namespace holds a bridge per site; each host namespace has one `eth0`, a veth
whose other end is a port of its site's bridge. With several sites, every site bridge reaches a
core bridge through an uplink: a veth pair, or, where the site has outgoing delay or loss, a
delay wire (two TAPs joined by a userspace process, see delaywire.py). Hosts get addresses in one
private /24 and no default route, so their traffic can only reach each other.

A site behind NAT (`[sites.b] nat = true`) gets a private /24 of its own and a router namespace
whose two legs are ports of the site's bridge: the hosts' gateway on the private side, a public
address in the lab's /24 on the other. It masquerades what leaves and drops every connection that
starts outside, so other sites can only answer the site's hosts, never dial them; they reach the
site at the router's address, which is what shaping and delay wires match for it.

Shaping (see shaping.py) sits on the sender's side of each hop: a host's eth0 (per destination
host, and its access-link rate), the switch end of its veth (the access link towards the host),
and a site's uplink (per destination site). Propagation delay is added after the uplink queue.

Nothing is created in the root namespace: veths are created inside the switch namespace with
their peer placed straight into the host namespace, and TAPs are opened inside the switch
namespace. Deleting the lab's namespaces therefore deletes every device, and the only global names
are the namespaces `peerd-<id>-*`, with a random 4-hex lab id.

Crash safety. The state file in the lab directory is written before each namespace is created and
right after each process is started, so `down` finds everything even after `up` was SIGKILLed.
`down` also stops every process found inside the lab's namespaces (a process started but not yet
recorded, a `lab exec`, a trainer spawned by a daemon) and deletes every namespace carrying the
lab id. It is idempotent: running it twice, or on a half-built lab, is fine.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import peerd
from peerd.config import Config, default_data_dir
from peerd.lab import netns, shaping
from peerd.lab.netns import LabError
from peerd.lab.profile import Profile

STATE = "state.json"
SECRET = "secret"
SWITCH = "sw"


def default_dir(cfg: Config) -> Path:
    return Path(cfg.lab.dir or os.path.join(cfg.node.data_dir or default_data_dir(), "lab")).expanduser()


def ns_name(lab_id: str, host: str) -> str:
    return f"peerd-{lab_id}-{host}"


def daemon_argv(python: str, ip: str, port: int, data_dir: Path, run_id: str, secret_file: Path,
                peers: list[str], extra: tuple[str, ...] = (), site: str = "") -> list[str]:
    """The one place where the lab writes a daemon's command line (the daemon's CLI contract).
    The host's site goes to its daemon as `--site`, as a user labels hosts by location."""
    argv = [python, "-m", "cli.main", "up", "--listen", f"{ip}:{port}", "--data-dir", str(data_dir),
            "--run-id", run_id, "--secret-file", str(secret_file)] + (["--site", site] if site else [])
    for p in peers:
        argv += ["--peer", p]
    return argv + list(extra)


def _code_root() -> str:
    """Directory holding the `peerd` (and `cli`) packages, for PYTHONPATH of lab processes."""
    return str(Path(peerd.__file__).resolve().parent.parent)


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_code_root()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


# --- state file -------------------------------------------------------------------------------

def read_state(lab_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(lab_dir) / STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LabError(f"no lab recorded in {lab_dir} (no {STATE}); nothing to do") from None
    except (OSError, ValueError) as e:
        raise LabError(f"cannot read {path}: {e}") from None


def _save(lab_dir: Path, state: dict[str, Any]) -> None:
    tmp = lab_dir / (STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, lab_dir / STATE)


@contextlib.contextmanager
def _locked(lab_dir: Path):
    """One `up` or `down` at a time per lab directory; the kernel drops the lock if we die."""
    lab_dir.mkdir(parents=True, exist_ok=True)
    with open(lab_dir / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LabError(f"another `peerd lab up/down` is running on {lab_dir}") from None
        yield


# --- addresses -------------------------------------------------------------------------------

def _pick_subnet(lab_id: str) -> ipaddress.IPv4Network:
    """10.250.X.0/24 with X from the lab id, skipping any /24 the root namespace already uses.
    (Isolation comes from the namespaces; this only avoids confusing overlaps.)"""
    used = netns.run(["ip", "-4", "-o", "addr", "show"], 10) + netns.run(["ip", "-4", "route", "show"], 10)
    start = int(lab_id, 16) % 200
    for k in range(200):
        net = ipaddress.IPv4Network(f"10.250.{50 + (start + k) % 200}.0/24")
        if f"10.250.{net.network_address.packed[2]}." not in used:
            return net
    raise LabError("no free 10.250.X.0/24 subnet for the lab")


def _host_ip(net: ipaddress.IPv4Network, index: int) -> str:
    return str(net.network_address + index)


def _nat_plan(profile: Profile, lab_id: str, net: ipaddress.IPv4Network) -> dict[str, dict[str, str]]:
    """Each NAT'd site's router: its namespace, its public address in the lab's /24 (.251 up), and
    the site's private /24 (10.251+j.X.0/24), whose .254 is the router and the hosts' gateway."""
    third = net.network_address.packed[2]
    plan = {}
    for j, site in enumerate(profile.nat_sites):
        private = ipaddress.IPv4Network(f"10.{251 + j}.{third}.0/24")
        plan[site] = {"ns": ns_name(lab_id, f"nat{j}"), "public": str(net.network_address + 251 + j),
                      "subnet": str(private), "gateway": str(private.network_address + 254),
                      "inside": f"n{lab_id}{j}i", "outside": f"n{lab_id}{j}o"}
    return plan


def reach_ip(state: dict[str, Any], host: str) -> str:
    """The address hosts of other sites send to for `host`: its own, or its site's NAT router's."""
    h = state["hosts"][host]
    nat = state.get("nat", {}).get(h["site"])
    return nat["public"] if nat else h["ip"]


# --- up ---------------------------------------------------------------------------------------

def up(profile: Profile, lab_dir: str | os.PathLike, cfg: Config | None = None, *, daemons: bool = True,
       daemon_args: tuple[str, ...] = (), python: str | None = None, seeds: bool = True) -> dict[str, Any]:
    """Build the lab described by `profile`; return its state. On any failure the partial lab is
    torn down before the error propagates. `seeds=False` starts the daemons without --peer seeds:
    they must find each other by mDNS."""
    cfg = cfg or Config()
    netns.require_root()
    lab_dir = Path(lab_dir).resolve()
    with _locked(lab_dir):
        state = _up(profile, lab_dir, cfg, daemons, daemon_args, python or sys.executable, seeds)
    return state


def _up(profile: Profile, lab_dir: Path, cfg: Config, daemons: bool, daemon_args: tuple[str, ...],
        python: str, seeds: bool = True) -> dict[str, Any]:
    if (lab_dir / STATE).exists():
        old = read_state(lab_dir)
        raise LabError(f"a lab (id {old.get('id')}) is already recorded in {lab_dir}; "
                       f"run `peerd lab down --dir {lab_dir}` first, or use another --dir")
    if profile.delayed_sites and not os.path.exists("/dev/net/tun"):
        raise LabError("site_links with delay or loss need /dev/net/tun (TUN/TAP), which is missing")
    existing = netns.ns_list()
    while True:
        lab_id = secrets.token_hex(2)
        if not any(n.startswith(f"peerd-{lab_id}-") for n in existing):
            break
    net = _pick_subnet(lab_id)
    nat = _nat_plan(profile, lab_id, net)
    hosts = {h.name: {"ns": ns_name(lab_id, h.name),
                      "ip": _host_ip(ipaddress.IPv4Network(nat[h.site]["subnet"]) if h.site in nat else net, h.index),
                      "index": h.index, "site": h.site, "slowdown": h.slowdown, "link_bps": h.link_bps,
                      "relay": h.relay,
                      "data_dir": str(lab_dir / h.name / "data")} for h in profile.hosts}
    links = [{"src": a.name, "dst": b.name, "rate_bps": profile.pair_rates.get((a.name, b.name)),
              "delay_s": profile.delay(a.name, b.name),
              "site_rate_bps": (profile.site_links.get((a.site, b.site)).rate_bps
                                if (a.site, b.site) in profile.site_links else None)}
             for a in profile.hosts for b in profile.hosts if a is not b]
    state: dict[str, Any] = {
        "version": 1, "id": lab_id, "run_id": f"lab-{lab_id}", "dir": str(lab_dir), "phase": "creating",
        "created": time.time(), "profile": profile.name, "subnet": str(net),
        "switch": ns_name(lab_id, SWITCH), "namespaces": [], "processes": [], "hosts": hosts, "links": links,
        "nat": nat,
    }
    _save(lab_dir, state)
    try:
        _build(profile, state, lab_dir, cfg, daemons, daemon_args, python, seeds)
    except BaseException as e:
        try:
            _down(lab_dir, cfg, purge=False)
        except LabError as e2:
            print(f"peerd lab: cleanup after a failed up also failed: {e2}", file=sys.stderr)
        if isinstance(e, LabError):
            raise LabError(f"lab {lab_id} not created (what was made is removed again): {e}") from None
        raise
    state["phase"] = "up"
    _save(lab_dir, state)
    return state


CC_KEY = "net.ipv4.tcp_congestion_control"


def _set_congestion_control(namespaces: list[str], want: str, timeout: float) -> str:
    """Make `want` the TCP congestion control of every namespace; return what they run. A network
    namespace may only default to an algorithm in the host's net.ipv4.tcp_allowed_congestion_control:
    where `want` is not, the namespaces keep what they run (at lab up: the kernel's default) and a
    warning says how to allow it (the lab changes nothing outside its own namespaces)."""
    def set_all(name: str) -> None:
        for ns in namespaces:
            netns.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{CC_KEY}={name}"], timeout)

    default = netns.run(["ip", "netns", "exec", namespaces[0], "sysctl", "-n", CC_KEY], timeout).strip()
    if not want or want == default:
        return default
    try:
        set_all(want)
    except LabError as e:
        print(f"peerd lab: TCP congestion control {want!r} refused in the lab's namespaces ({e}); they keep "
              f"{default!r}. To allow {want!r}: sysctl -w "
              f"net.ipv4.tcp_allowed_congestion_control=\"$(sysctl -n net.ipv4.tcp_allowed_congestion_control) "
              f"{want}\" (or set lab_tcp_congestion_control to an allowed one, or '' for the default)",
              file=sys.stderr)
        set_all(default)    # all alike, whichever namespace refused
        return default
    return want


def _build(profile: Profile, state: dict[str, Any], lab_dir: Path, cfg: Config, daemons: bool,
           daemon_args: tuple[str, ...], python: str, seeds: bool = True) -> None:
    """Namespaces and links, delay wires, shaping, the secret, then the daemons; each recorded in
    the state file before it exists, so a crash in between leaks nothing `peerd lab down` misses."""
    uplink, bridge, core = _build_links(profile, state, lab_dir, cfg)
    _start_wires(profile, state, lab_dir, cfg, python, uplink, bridge, core)
    _shape(profile, state, cfg, uplink)
    secret = lab_dir / SECRET
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    if daemons:
        _start_daemons(profile, state, lab_dir, cfg, daemon_args, python, seeds, secret)


def _build_links(profile: Profile, state: dict[str, Any], lab_dir: Path,
                 cfg: Config) -> tuple[dict[str, tuple[str, str]], dict[str, str], str]:
    """Namespaces, bridges (one per site, a core between sites), veths and addresses; returns each
    site's uplink (device on the site bridge, device on the core bridge), the bridges and the core."""
    lab_id, t = state["id"], cfg.lab.cmd_timeout
    sw = state["switch"]
    hosts = state["hosts"]

    nat = state.get("nat", {})
    # Namespaces: recorded first, created second, so a crash in between leaks nothing.
    for ns in [sw] + [h["ns"] for h in hosts.values()] + [r["ns"] for r in nat.values()]:
        state["namespaces"].append(ns)
        _save(lab_dir, state)
        netns.ns_add(ns, t)

    site_idx = {s: k for k, s in enumerate(profile.sites)}
    bridge = {s: f"b{lab_id}s{k}" for s, k in site_idx.items()}
    core = f"b{lab_id}c"
    multi = len(profile.sites) > 1
    delayed = set(profile.delayed_sites)
    uplink = {s: ((f"t{lab_id}{k}a", f"t{lab_id}{k}b") if s in delayed else (f"u{lab_id}{k}a", f"u{lab_id}{k}b"))
              for s, k in site_idx.items()} if multi else {}

    br_opts = "type bridge stp_state 0 forward_delay 0 mcast_snooping 0"
    lines = ["link set lo up"]
    for s in profile.sites:
        lines += [f"link add {bridge[s]} {br_opts}", f"link set {bridge[s]} up"]
    if multi:
        lines += [f"link add {core} {br_opts}", f"link set {core} up"]
    for name, h in hosts.items():
        v = f"v{lab_id}h{h['index']}"
        lines += [f"link add {v} type veth peer name eth0 netns {h['ns']}",
                  f"link set {v} master {bridge[h['site']]}", f"link set {v} up"]
    for site, r in nat.items():     # the router: both its legs are ports of the site's bridge
        for dev, inner in ((r["inside"], "in0"), (r["outside"], "out0")):
            lines += [f"link add {dev} type veth peer name {inner} netns {r['ns']}",
                      f"link set {dev} master {bridge[site]}", f"link set {dev} up"]
    for s, (a, b) in uplink.items():
        if s not in delayed:
            lines += [f"link add {a} type veth peer name {b}", f"link set {a} master {bridge[s]}",
                      f"link set {b} master {core}", f"link set {a} up", f"link set {b} up"]
    netns.batch("ip", sw, lines, t)
    # What `peerd lab cut|heal` needs (churn.py): the core bridge and each site's port on it.
    state["core"] = core if multi else None
    state["uplinks"] = {s: b for s, (a, b) in uplink.items()}
    _save(lab_dir, state)
    prefix = ipaddress.IPv4Network(state["subnet"]).prefixlen
    for h in hosts.values():
        gateway = nat[h["site"]]["gateway"] if h["site"] in nat else None
        netns.batch("ip", h["ns"], ["link set lo up", f"addr add {h['ip']}/{prefix} dev eth0",
                                    "link set eth0 up"] + ([f"route add default via {gateway}"] if gateway else []), t)
        # Per network namespace: the same for every process of the host (daemons, DDP, probes).
        netns.run(["ip", "netns", "exec", h["ns"], "sysctl", "-qw",
                   f"net.ipv4.tcp_slow_start_after_idle={int(cfg.lab.tcp_slow_start_after_idle)}"], t)
    for site, r in nat.items():
        _build_router(r, state["subnet"], lab_dir, t)
    state["tcp_congestion_control"] = _set_congestion_control([h["ns"] for h in hosts.values()],
                                                              cfg.lab.tcp_congestion_control, t)
    _save(lab_dir, state)
    return uplink, bridge, core


def _build_router(r: dict[str, str], public_subnet: str, lab_dir: Path, t: float) -> None:
    """A NAT router: forwards its site's private /24 to the lab's /24 with masquerade, and drops
    every connection that starts outside (counted: `nft list chain ip peerd_nat forward`)."""
    private_len = ipaddress.IPv4Network(r["subnet"]).prefixlen
    public_len = ipaddress.IPv4Network(public_subnet).prefixlen
    netns.batch("ip", r["ns"], ["link set lo up", f"addr add {r['gateway']}/{private_len} dev in0", "link set in0 up",
                                f"addr add {r['public']}/{public_len} dev out0", "link set out0 up"], t)
    # Both legs hear every ARP of the bridge: each answers only for its own address, or the
    # site's hosts would send to the outside leg, where the filter drops what arrives.
    for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.all.arp_ignore=1",
                "net.ipv4.conf.all.arp_announce=2"):
        netns.run(["ip", "netns", "exec", r["ns"], "sysctl", "-qw", key], t)
    if shutil.which("nft") is None:
        raise LabError("a site behind NAT needs nft (Debian/Ubuntu: apt-get install nftables)")
    rules = lab_dir / f"{r['ns']}.nft"
    rules.write_text(NAT_RULES.format(private=r["subnet"]))
    netns.run(["ip", "netns", "exec", r["ns"], "nft", "-f", str(rules)], t)


NAT_RULES = """table ip peerd_nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "out0" ip saddr {private} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "in0" oifname "out0" accept
    iifname "out0" oifname "in0" ct state established,related accept
    iifname "out0" counter drop comment "inbound connections"
  }}
}}
"""


def _start_wires(profile: Profile, state: dict[str, Any], lab_dir: Path, cfg: Config, python: str,
                 uplink: dict[str, tuple[str, str]], bridge: dict[str, str], core: str) -> None:
    """Delay wires: one process per delayed site, holding its two TAPs."""
    sw, t = state["switch"], cfg.lab.cmd_timeout
    for s in profile.sites:
        if s not in set(profile.delayed_sites):
            continue
        a, b = uplink[s]
        out = {reach_ip(state, h.name): [l.delay_s, l.loss]
               for (src, dst), l in profile.site_links.items() if src == s
               for h in profile.site_hosts(dst)}
        spec = {"a": a, "b": b, "out": out, "max_bytes": cfg.lab.wire_max_bytes}
        proc = netns.spawn(sw, [python, "-m", "peerd.lab.delaywire", json.dumps(spec)], env=_child_env(),
                           log=lab_dir / f"wire-{s}.log", stdout_pipe=True)
        _record(lab_dir, state, f"wire:{s}", proc.pid)
        _wait_line(proc, "ready", cfg.lab.ready_timeout, f"delay wire of site {s}", lab_dir / f"wire-{s}.log")
        netns.batch("ip", sw, [f"link set {a} master {bridge[s]}", f"link set {b} master {core}",
                               f"link set {a} up", f"link set {b} up"], t)


def _shape(profile: Profile, state: dict[str, Any], cfg: Config, uplink: dict[str, tuple[str, str]]) -> None:
    """htb on every host's eth0 (its access link, per-pair rates) and on each site's uplink."""
    lab_id, sw, hosts, t = state["id"], state["switch"], state["hosts"], cfg.lab.cmd_timeout
    q = shaping.settings(cfg)
    sw_tc: list[str] = []
    nat = state.get("nat", {})
    for h in profile.hosts:
        # Behind NAT a host's packets for another site all go to that site's router: no per-host rate.
        rates = {hosts[dst]["ip"]: r for (src, dst), r in profile.pair_rates.items()
                 if src == h.name and (hosts[dst]["site"] == h.site or hosts[dst]["site"] not in nat)}
        netns.batch("tc", hosts[h.name]["ns"],
                    shaping.htb_commands("eth0", h.link_bps, shaping.per_destination(rates), **q), t)
        sw_tc += shaping.htb_commands(f"v{lab_id}h{h.index}", h.link_bps, [], **q)
    for s, (a, _) in uplink.items():
        classes = [shaping.DstClass(l.rate_bps, tuple(sorted({reach_ip(state, x.name) for x in profile.site_hosts(dst)})),
                                    rtt_s=profile.site_rtt(src, dst))
                   for (src, dst), l in profile.site_links.items() if src == s and l.rate_bps]
        sw_tc += shaping.htb_commands(a, None, classes, **q)
    netns.batch("tc", sw, sw_tc, t)


def _start_daemons(profile: Profile, state: dict[str, Any], lab_dir: Path, cfg: Config,
                   daemon_args: tuple[str, ...], python: str, seeds: bool, secret: Path) -> None:
    """One daemon per host, each seeded with the first host (the first with the second); waits
    until every one has its control socket."""
    hosts = state["hosts"]
    port = cfg.lab.daemon_port
    names = list(hosts)
    started = []
    for name, h in hosts.items():
        # h1 seeds everyone; h1 is seeded by the next host peers can dial (not one behind NAT)
        dialable = [n for n in names[1:] if hosts[n]["site"] not in state.get("nat", {})]
        seed = names[0] if name != names[0] else (dialable[0] if dialable else None)
        data_dir = Path(h["data_dir"])
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = daemon_argv(python, h["ip"], port, data_dir, state["run_id"], secret,
                           [f"{hosts[seed]['ip']}:{port}"] if seed and seeds else [],
                           (*daemon_args, *(["--relay"] if h.get("relay") else [])),
                           site=h["site"] if len(profile.sites) > 1 else "")
        log = lab_dir / name / "daemon.log"
        h["argv"] = argv                 # for a restart (churn.py)
        proc = netns.spawn(h["ns"], argv, env=_child_env({"PEERD_SLOWDOWN": f"{h['slowdown']:g}"}), log=log)
        _record(lab_dir, state, f"daemon:{name}", proc.pid)
        started.append((name, proc, data_dir / "peerd.sock", log))
    deadline = time.monotonic() + cfg.lab.ready_timeout
    for name, proc, sock, log in started:
        while not sock.exists():
            if proc.poll() is not None:
                raise LabError(f"daemon of {name} exited with code {proc.returncode} before it was ready; "
                               f"log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise LabError(f"daemon of {name} did not create {sock} within {cfg.lab.ready_timeout:g} s "
                               f"(lab_ready_timeout); log {log}:\n{_tail(log)}")
            time.sleep(0.05)


def _record(lab_dir: Path, state: dict[str, Any], role: str, pid: int) -> None:
    state["processes"].append({"role": role, "pid": pid, "start": netns.start_time(pid)})
    _save(lab_dir, state)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_line(proc: subprocess.Popen, want: str, timeout: float, what: str, log: Path) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LabError(f"{what} not ready within {timeout:g} s (lab_ready_timeout); log {log}:\n{_tail(log)}")
            r, _, _ = select.select([proc.stdout], [], [], min(left, 0.1))
            if r:
                chunk = os.read(proc.stdout.fileno(), 256)
                if not chunk:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=1)
                    raise LabError(f"{what} exited (code {proc.returncode}) before it was ready; "
                                   f"log {log}:\n{_tail(log)}")
                buf += chunk
        if buf.split(b"\n")[0].decode(errors="replace").strip() != want:
            raise LabError(f"{what} said {buf!r} instead of {want!r}; log {log}:\n{_tail(log)}")
    finally:
        proc.stdout.close()


# --- down -------------------------------------------------------------------------------------

def down(lab_dir: str | os.PathLike, cfg: Config | None = None, *, purge: bool = False) -> list[str] | None:
    """Stop every lab process and delete every lab namespace (and with them every device).
    Returns the namespaces deleted, or None when no lab is recorded in `lab_dir`. Idempotent;
    works on a half-built lab."""
    cfg = cfg or Config()
    netns.require_root()
    lab_dir = Path(lab_dir)
    if not (lab_dir / STATE).exists():
        return None
    with _locked(lab_dir):
        return _down(lab_dir, cfg, purge)


def _down(lab_dir: Path, cfg: Config, purge: bool) -> list[str] | None:
    if not (lab_dir / STATE).exists():
        return None
    state = read_state(lab_dir)
    lab_id, grace, t = state["id"], cfg.lab.stop_grace, cfg.lab.cmd_timeout
    prefix = f"peerd-{lab_id}-"
    stuck = netns.stop([(p["pid"], p["start"]) for p in state["processes"]], grace)
    ours = set(state["namespaces"]) | {n for n in netns.ns_list() if n.startswith(prefix)}
    for ns in sorted(ours):
        # Anything still running inside (a `lab exec`, a daemon's trainer, a process `up` started
        # but could not record) would keep the namespace and its devices alive after its name is gone.
        stuck += netns.stop([(p, netns.start_time(p)) for p in netns.ns_pids(ns, t)], grace)
    for ns in sorted(ours):
        netns.ns_delete(ns, t)
    left = sorted(n for n in netns.ns_list() if n.startswith(prefix))
    if left or stuck:
        raise LabError(f"lab {lab_id}: could not remove namespaces {left} / stop pids {stuck}; "
                       f"state kept in {lab_dir / STATE}")
    for name in (STATE, SECRET, ".lock"):
        (lab_dir / name).unlink(missing_ok=True)
    if purge:
        shutil.rmtree(lab_dir, ignore_errors=True)
    return sorted(ours)


# --- status and exec --------------------------------------------------------------------------

def status(lab_dir: str | os.PathLike) -> dict[str, Any]:
    """The recorded lab with liveness: which namespaces exist, which processes run."""
    state = read_state(lab_dir)
    present = netns.ns_list()
    procs = {p["role"]: p for p in state["processes"]}
    out = {k: state[k] for k in ("id", "run_id", "dir", "phase", "profile", "subnet")}
    out["tcp_congestion_control"] = state.get("tcp_congestion_control")
    out["hosts"] = {}
    for name, h in state["hosts"].items():
        d = procs.get(f"daemon:{name}")
        out["hosts"][name] = {**{k: h[k] for k in ("ns", "ip", "site", "slowdown", "link_bps", "data_dir")},
                              "namespace_up": h["ns"] in present,
                              "daemon_pid": d["pid"] if d else None,
                              "daemon_alive": bool(d) and netns.alive(d["pid"], d["start"])}
    out["wires"] = {r[5:]: {"pid": p["pid"], "alive": netns.alive(p["pid"], p["start"])}
                    for r, p in procs.items() if r.startswith("wire:")}
    out["links"] = state["links"]
    return out


class Lab:
    """A running lab, read from its directory: what later tests and benchmarks drive."""

    def __init__(self, lab_dir: str | os.PathLike) -> None:
        self.dir = Path(lab_dir)
        self.state = read_state(self.dir)
        self.id: str = self.state["id"]
        self.run_id: str = self.state["run_id"]
        self.hosts: list[str] = list(self.state["hosts"])

    def ip(self, host: str) -> str:
        return self._host(host)["ip"]

    def ns(self, host: str) -> str:
        return self._host(host)["ns"]

    def slowdown(self, host: str) -> float:
        return float(self._host(host)["slowdown"])

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside `host`'s namespace with its PEERD_SLOWDOWN, PEERD_DATA_DIR set to its
        daemon's data dir (so `peerd status` there talks to that daemon), the lab's code on
        PYTHONPATH and this Python's bin directory first on PATH (`sudo` resets PATH: `peerd` there
        is the venv's)."""
        env = _child_env()
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
        return ["ip", "netns", "exec", self.ns(host), "env", f"PEERD_SLOWDOWN={self.slowdown(host):g}",
                f"PEERD_DATA_DIR={self._host(host)['data_dir']}", f"PYTHONPATH={env['PYTHONPATH']}",
                f"PATH={path}", *argv]

    def run(self, host: str, argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(host, argv), timeout=timeout, capture_output=True, text=True, **kw)

    def popen(self, host: str, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(host, argv), **kw)

    def ping(self, src: str, dsts: list[str], count: int = 5, interval: float = 0.05,
             timeout: float = 2.0) -> list[dict[str, Any]]:
        """ICMP RTTs from `src` to each host in `dsts` (see probe.py)."""
        argv = [sys.executable, "-m", "peerd.lab.probe", "ping", *(self.ip(d) for d in dsts),
                "--count", str(count), "--interval", str(interval), "--timeout", str(timeout)]
        p = self.run(src, argv, timeout=30 + len(dsts) * count * (interval + timeout))
        if p.returncode != 0:
            raise LabError(f"ping from {src} failed: {p.stderr.strip()}")
        return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]

    def transfer(self, src: str, dst: str, nbytes: int, port: int = 5001, timeout: float = 60.0) -> dict[str, Any]:
        """Send `nbytes` over one TCP connection src -> dst; the receiver's goodput (see probe.py)."""
        sink = self.popen(dst, [sys.executable, "-m", "peerd.lab.probe", "sink", "--port", str(port),
                                "--bytes", str(nbytes), "--timeout", str(timeout)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None
            if not select.select([sink.stdout], [], [], timeout)[0] or sink.stdout.readline().strip() != "listening":
                raise LabError(f"receiver on {dst} did not start: {sink.stderr.read() if sink.poll() else ''}")
            s = self.run(src, [sys.executable, "-m", "peerd.lab.probe", "send", f"{self.ip(dst)}:{port}",
                               "--bytes", str(nbytes), "--timeout", str(timeout)], timeout=timeout + 10)
            if s.returncode != 0:
                raise LabError(f"sender on {src} failed: {s.stderr.strip()}")
            out, err = sink.communicate(timeout=timeout)
            if sink.returncode != 0:
                raise LabError(f"receiver on {dst} failed: {err.strip()}")
            return json.loads(out.strip().splitlines()[-1])
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()

    def _host(self, host: str) -> dict[str, Any]:
        try:
            return self.state["hosts"][host]
        except KeyError:
            raise LabError(f"no host {host!r} in lab {self.id} (hosts: {', '.join(self.hosts)})") from None
