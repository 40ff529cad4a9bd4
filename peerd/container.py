"""`peerd container start`: the image's entrypoint. Shape the container's link, drop root, exec peerd.

A compose service declares its link profile in PEERD_SHAPE_* variables (Config fields shape_*):
the rate of everything it sends, per-destination rates, and a propagation delay. At start, running
as root with CAP_NET_ADMIN, this module turns the profile into tc commands with the lab's own
`shaping.htb_commands` (same htb layout, control class, queue sizes from the same Config fields),
applies them to the container's interface, then drops to the unprivileged `container_user` and
execs `python -m cli.main ARGS` (the same entry the lab starts its daemons with). exec keeps the
pid, so the daemon gets SIGTERM from Docker directly.

Design choices:
- Egress only. A container can shape what it sends on its own interface; the other end of its
  veth is in the host's namespace. Giving every peer a profile shapes every direction.
- All or nothing. A profile that cannot be applied in full (no root, no CAP_NET_ADMIN, no `tc`, no
  interface, a destination that never resolves) is removed again, and the container either starts
  the daemon unshaped with a warning that says why (default) or exits (shape_strict). A malformed
  profile (a bad rate, say) is always fatal: it is a typo, not a property of the host.
- Delay needs netem, which some kernels lack (this project's CI kernel does). Then the rates are
  applied without the delay and a warning says so; with shape_strict the container exits.
- Destination names are resolved once, at start, with a bound (shape_resolve_timeout): Docker's
  DNS answers for a container only once it runs. A name with several addresses (a scaled service)
  puts all of them in one class.
- Privileges are dropped with setgroups/setgid/setuid before exec, then checked: getting root
  back must fail. The daemon is never run as root by this entrypoint.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from peerd.config import Config
from peerd.lab import netns, shaping
from peerd.lab.netns import LabError
from peerd.lab.profile import ProfileError, parse_delay, parse_rate

log = logging.getLogger("peerd.container")

CAP_NET_ADMIN = 12
RESOLVE_RETRY = 0.5  # seconds between DNS attempts for a destination not up yet


class ShapeError(RuntimeError):
    """A link profile that cannot be applied here; the message says why."""


@dataclass(frozen=True)
class LinkProfile:
    dev: str
    rate_bps: int | None
    to: tuple[tuple[str, int], ...]   # (destination as written, bit/s)
    delay_s: float

    @property
    def empty(self) -> bool:
        return self.rate_bps is None and not self.to and not self.delay_s


def link_profile(cfg: Config) -> LinkProfile:
    """The profile in cfg's shape_* fields; ProfileError names the PEERD_* variable that is wrong."""
    rate = parse_rate(cfg.container.shape_rate, "PEERD_SHAPE_RATE") if cfg.container.shape_rate else None
    to: list[tuple[str, int]] = []
    for item in cfg.container.shape_to:
        dest, sep, r = item.partition("=")
        dest = dest.strip()
        if not sep or not dest:
            raise ProfileError(f"PEERD_SHAPE_TO: expected DEST=RATE (e.g. peer1=10mbit), got {item!r}")
        if dest in {d for d, _ in to}:
            raise ProfileError(f"PEERD_SHAPE_TO: destination {dest!r} given twice")
        to.append((dest, parse_rate(r.strip(), f"PEERD_SHAPE_TO ({dest})")))
    delay = parse_delay(cfg.container.shape_delay, "PEERD_SHAPE_DELAY") if cfg.container.shape_delay else 0.0
    if not cfg.container.shape_dev or "/" in cfg.container.shape_dev or len(cfg.container.shape_dev) > 15:
        raise ProfileError(f"PEERD_SHAPE_DEV: not an interface name: {cfg.container.shape_dev!r}")
    return LinkProfile(cfg.container.shape_dev, rate, tuple(to), delay)


def slowdown(env: dict[str, str]) -> float:
    """The compute straggler factor PEERD_SLOWDOWN (trainers read it; checked here to fail early)."""
    raw = env.get("PEERD_SLOWDOWN", "") or "1"
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value <= 1000.0:
        raise ProfileError(f"PEERD_SLOWDOWN: expected a factor in [1, 1000], got {raw!r}")
    return value


def resolve(dest: str, deadline: float) -> tuple[str, ...]:
    """IPv4 addresses or the prefix `dest` stands for; names are retried until `deadline`
    (time.monotonic()), since a peer's name resolves only once its container runs."""
    try:
        return (str(ipaddress.IPv4Network(dest, strict=False)) if "/" in dest
                else str(ipaddress.IPv4Address(dest)),)
    except ValueError:
        if "/" in dest:
            raise ShapeError(f"PEERD_SHAPE_TO: {dest!r} is no IPv4 prefix") from None
    while True:
        try:
            infos = socket.getaddrinfo(dest, None, socket.AF_INET, socket.SOCK_STREAM)
            return tuple(sorted({info[4][0] for info in infos}))
        except socket.gaierror as e:
            if time.monotonic() + RESOLVE_RETRY > deadline:
                raise ShapeError(f"destination {dest!r} did not resolve to an IPv4 address "
                                 f"before shape_resolve_timeout: {e.strerror}") from None
            time.sleep(RESOLVE_RETRY)


def _capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def blocker(dev: str) -> str | None:
    """Why shaping cannot run in this process, or None."""
    if os.geteuid() != 0:
        return (f"the container runs as uid {os.geteuid()}, not root (tc needs root: set user: root "
                "on the service; peerd itself still runs unprivileged)")
    if not _capabilities() >> CAP_NET_ADMIN & 1:
        return "the container lacks CAP_NET_ADMIN (add cap_add: [NET_ADMIN] to the service)"
    if shutil.which("tc") is None:
        return "tc (iproute2) is not installed in the image"
    if not Path("/sys/class/net", dev).exists():
        return f"no interface {dev!r} in this container (set PEERD_SHAPE_DEV)"
    return None


def tc_lines(profile: LinkProfile, classes: list[shaping.DstClass], cfg: Config, delay: bool = True) -> list[str]:
    return shaping.htb_commands(profile.dev, profile.rate_bps, classes, **shaping.settings(cfg),
                                delay_s=profile.delay_s if delay else 0.0)


def classes(profile: LinkProfile, cfg: Config) -> list[shaping.DstClass]:
    deadline = time.monotonic() + cfg.container.shape_resolve_timeout
    return [shaping.DstClass(rate, resolve(dest, deadline)) for dest, rate in profile.to]


def apply(profile: LinkProfile, cfg: Config) -> list[str]:
    """Shape profile.dev's egress as the profile says; returns warnings (the delay could not be
    applied). Raises ShapeError, leaving the interface unshaped, when it cannot be applied."""
    why = blocker(profile.dev)
    if why:
        raise ShapeError(why)
    dst = classes(profile, cfg)
    t = cfg.container.shape_cmd_timeout
    clear = ["tc", "qdisc", "del", "dev", profile.dev, "root"]
    try:
        netns.run(clear, t, check=False)  # a restarted container may find its own old root qdisc
        try:
            netns.batch("tc", None, tc_lines(profile, dst, cfg), t)
            return []
        except LabError as e:
            netns.run(clear, t, check=False)
            if not (profile.delay_s and "qdisc kind is unknown" in str(e)):
                raise
        warning = (f"PEERD_SHAPE_DELAY={profile.delay_s * 1000:g}ms is NOT applied: this kernel has no "
                   "netem qdisc (sch_netem)")
        if profile.rate_bps is None and not profile.to:
            raise ShapeError(warning)
        try:
            netns.batch("tc", None, tc_lines(profile, dst, cfg, delay=False), t)
        except LabError:
            netns.run(clear, t, check=False)
            raise
        return [warning + "; only the rates are applied"]
    except LabError as e:
        raise ShapeError(str(e)) from None


def describe(profile: LinkProfile) -> str:
    parts = [f"{profile.dev}: rate {_rate(profile.rate_bps) if profile.rate_bps else 'unlimited'}"]
    parts += [f"to {dest} {_rate(r)}" for dest, r in profile.to]
    if profile.delay_s:
        parts.append(f"delay {profile.delay_s * 1000:g}ms")
    return ", ".join(parts)


def _rate(bps: int) -> str:
    for unit, k in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= k:
            return f"{bps / k:g}{unit}"
    return f"{bps}bit"


def user_ids(spec: str) -> tuple[int, int, str | None, str]:
    """(uid, gid, user name or None, home) of `spec`: a user name, UID or UID:GID."""
    name_or_uid, _, gid_s = spec.partition(":")
    try:
        ent = pwd.getpwuid(int(name_or_uid)) if name_or_uid.isdigit() else pwd.getpwnam(name_or_uid)
    except KeyError:
        ent = None
        if not name_or_uid.isdigit():
            raise ShapeError(f"container_user: no user {name_or_uid!r} in this image") from None
    uid = int(name_or_uid) if name_or_uid.isdigit() else ent.pw_uid
    if gid_s and not gid_s.isdigit():
        raise ShapeError(f"container_user: expected NAME, UID or UID:GID, got {spec!r}")
    gid = int(gid_s) if gid_s else (ent.pw_gid if ent else uid)
    if uid == 0 or gid == 0:
        raise ShapeError(f"container_user: {spec!r} is root; peerd is not run as root")
    return uid, gid, ent.pw_name if ent else None, ent.pw_dir if ent else "/"


def drop_privileges(spec: str) -> dict[str, str]:
    """Become `spec` for good (root only); returns the environment entries that name the user."""
    uid, gid, name, home = user_ids(spec)
    if name:
        os.initgroups(name, gid)  # the groups /etc/group gives the user, and gid
    else:
        os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise ShapeError(f"could regain root after switching to {spec!r}; refusing to run peerd")
    return {"HOME": home, "USER": name or str(uid), "LOGNAME": name or str(uid)}


def exec_peerd(args: list[str], env_extra: dict[str, str]) -> NoReturn:
    """Replace this process with `python -m cli.main ARGS` (the lab's daemon entry)."""
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "cli.main", *args], {**os.environ, **env_extra})


def start(args: list[str], cfg: Config, env: dict[str, str]) -> NoReturn:
    """Apply the link profile, drop root, exec `peerd ARGS`. ProfileError/ShapeError: do not start."""
    profile = link_profile(cfg)
    factor = slowdown(env)
    if not profile.empty:
        what = describe(profile)
        try:
            for warning in apply(profile, cfg):
                if cfg.container.shape_strict:
                    raise ShapeError(warning)
                log.warning("%s", warning)
            log.info("link profile applied: %s", what)
        except ShapeError as e:
            if cfg.container.shape_strict:
                raise ShapeError(f"link profile ({what}) cannot be applied in full: {e}. PEERD_SHAPE_STRICT is set, "
                                 "so peerd is not started") from None
            log.warning("shaping is OFF, peerd starts with an unshaped link: %s. Profile: %s "
                        "(PEERD_SHAPE_STRICT=1 stops the container instead)", e, what)
    if factor != 1:
        log.info("straggler factor %g (PEERD_SLOWDOWN)", factor)
    exec_peerd(args, drop_privileges(cfg.container.container_user) if os.geteuid() == 0 else {})
