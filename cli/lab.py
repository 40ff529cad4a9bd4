"""`peerd lab`: a multi-host testbed on this machine (network namespaces, shaped links, daemons)."""
from __future__ import annotations

import json
import os
import signal
import sys

import click

from peerd import config as config_mod
from peerd.lab import lab as lab_mod
from peerd.lab import profile as profile_mod
from peerd.lab.delaywire import CEILING_HINT_BPS
from peerd.lab.netns import LabError


def _cfg(config_file: str | None) -> config_mod.Config:
    try:
        return config_mod.load(config_file)
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from None


def _dir(cfg: config_mod.Config, lab_dir: str | None) -> str:
    return lab_dir or str(lab_mod.default_dir(cfg))


_dir_opt = click.option("--dir", "lab_dir", type=click.Path(file_okay=False),
                        help="lab directory (state, secret, logs, daemon data; default: lab_dir in Config)")
_config_opt = click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
                           help="peerd config TOML (lab_* settings)")


def _rate(bps: int | None) -> str:
    if bps is None:
        return "-"
    for unit, k in (("Gbit", 10**9), ("Mbit", 10**6), ("kbit", 10**3)):
        if bps >= k:
            return f"{bps / k:g}{unit}"
    return f"{bps}bit"


@click.group()
def lab() -> None:
    """Multi-host testbed on this machine: one network namespace and one daemon per host, links
    shaped per profile (root required)."""


@lab.command()
def profiles() -> None:
    """List the shipped profiles."""
    names = profile_mod.shipped()
    width = max(map(len, names), default=0)
    for name in names:
        p = profile_mod.load(name)
        click.echo(f"{name:<{width}}  {len(p.hosts)} hosts  {p.description}")


@lab.command()
@click.option("--hosts", "-n", type=int, default=None, help="number of hosts h1..hN (default: the profile's)")
@click.option("--profile", "-p", "profile", default="lan", show_default=True,
              help=f"profile TOML file, or a shipped one: {', '.join(profile_mod.shipped())}")
@_dir_opt
@click.option("--no-daemons", is_flag=True, help="build the network only; start no daemon")
@click.option("--no-seeds", is_flag=True, help="start the daemons without --peer seeds: they find each other by mDNS")
@click.option("--daemon-arg", multiple=True, metavar="ARG",
              help="extra argument for every daemon (repeatable), e.g. --daemon-arg=--log-level=debug")
@_config_opt
@click.option("--json", "as_json", is_flag=True, help="print the lab's status as JSON")
@click.option("--foreground", is_flag=True, help="stay in the foreground; Ctrl+C or SIGTERM takes the whole "
                                                 "lab down (processes, namespaces) before exiting")
def up(hosts: int | None, profile: str, lab_dir: str | None, no_daemons: bool, no_seeds: bool,
       daemon_arg: tuple[str, ...], config_file: str | None, as_json: bool, foreground: bool) -> None:
    """Create the hosts, shape their links, start one daemon per host.

    Interrupted (Ctrl+C, SIGTERM) while it builds, it removes what it made. With --foreground it
    then waits, and an interrupt takes the lab down; without, `peerd lab down` does."""
    cfg = _cfg(config_file)
    directory = _dir(cfg, lab_dir)
    # SIGTERM unwinds like Ctrl+C, through the cleanup of a half-built lab or the foreground wait.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        prof = profile_mod.load(profile, hosts)
        state = lab_mod.up(prof, directory, cfg, daemons=not no_daemons, daemon_args=daemon_arg,
                           seeds=not no_seeds)
    except (LabError, profile_mod.ProfileError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("peerd lab up: interrupted; what was made is removed", err=True)
        _exit_now(130)
    if foreground:
        try:
            _print_status(lab_mod.status(state["dir"]), as_json)
            click.echo("lab up in the foreground; Ctrl+C takes it down", err=True)
            while True:
                signal.pause()
        except KeyboardInterrupt:
            # The second signal must not cut the teardown short: ignore both until it is done.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                gone = lab_mod.down(state["dir"], cfg)
            except LabError as e:
                raise click.ClickException(str(e)) from None
            click.echo(f"lab down: removed {len(gone or [])} namespaces", err=True)
            _exit_now(0)
    _print_status(lab_mod.status(state["dir"]), as_json)
    for link in prof.site_links.values():
        if (link.delay_s or link.loss) and (link.rate_bps or 10**12) > CEILING_HINT_BPS:
            click.echo(f"warning: site link {link.src} -> {link.dst} goes through a userspace delay wire, "
                       f"which carries roughly {CEILING_HINT_BPS // 10**6} Mbit/s on a small machine; "
                       f"its rate ({_rate(link.rate_bps) if link.rate_bps else 'unshaped'}) may not be reached "
                       f"(measure with `peerd lab calibrate`)", err=True)


@lab.command()
@_dir_opt
@click.option("--purge", is_flag=True, help="also delete the lab directory (logs, daemon data)")
@_config_opt
def down(lab_dir: str | None, purge: bool, config_file: str | None) -> None:
    """Stop the lab's processes and delete its namespaces, devices and shaping (also after a crash)."""
    cfg = _cfg(config_file)
    try:
        gone = lab_mod.down(_dir(cfg, lab_dir), cfg, purge=purge)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    if gone is None:
        click.echo(f"no lab recorded in {_dir(cfg, lab_dir)}; nothing to remove")
    else:
        click.echo(f"removed {len(gone)} namespaces: {' '.join(gone)}")


@lab.command()
@_dir_opt
@_config_opt
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(lab_dir: str | None, config_file: str | None, as_json: bool) -> None:
    """Show the lab's hosts, addresses, stragglers, daemons and links."""
    cfg = _cfg(config_file)
    try:
        st = lab_mod.status(_dir(cfg, lab_dir))
    except LabError as e:
        raise click.ClickException(str(e)) from None
    _print_status(st, as_json)


@lab.command()
@_config_opt
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def calibrate(config_file: str | None, as_json: bool) -> None:
    """Measure achieved vs shaped rates (10/100/1000 Mbit, a 50 Mbit site link) and the delay
    wire's RTT and ceiling, in a throwaway lab (about 15 s)."""
    from peerd.lab import calibrate as cal

    cfg = _cfg(config_file)
    try:
        res = cal.run(cfg)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(res, indent=1) if as_json else cal.render(res))


@lab.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_dir_opt
@_config_opt
@click.argument("host")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(lab_dir: str | None, config_file: str | None, host: str, command: tuple[str, ...]) -> None:
    """Run COMMAND inside HOST's namespace: peerd lab exec h1 -- python -m peerd.lab.probe ping 10.250.X.2"""
    cfg = _cfg(config_file)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise click.UsageError("missing COMMAND after HOST")
    try:
        argv = lab_mod.Lab(_dir(cfg, lab_dir)).exec_argv(host, list(command))
    except LabError as e:
        raise click.ClickException(str(e)) from None
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _exit_now(code: int) -> None:
    """Everything the lab made is gone; skip the interpreter's teardown (seconds on a loaded host)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _print_status(st: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    click.echo(f"lab {st['id']} ({st['phase']}), profile {st['profile']}, subnet {st['subnet']}, "
               f"run id {st['run_id']}, dir {st['dir']}, TCP congestion control {st.get('tcp_congestion_control')}")
    click.echo(f"{'host':<6} {'ip':<15} {'site':<8} {'link':<9} {'slowdown':<9} {'netns':<6} daemon")
    for name, h in st["hosts"].items():
        d = "-" if h["daemon_pid"] is None else f"{h['daemon_pid']} ({'up' if h['daemon_alive'] else 'DEAD'})"
        click.echo(f"{name:<6} {h['ip']:<15} {h['site']:<8} {_rate(h['link_bps']):<9} {h['slowdown']:<9g} "
                   f"{'yes' if h['namespace_up'] else 'NO':<6} {d}")
    for site, w in st["wires"].items():
        click.echo(f"delay wire of site {site}: pid {w['pid']} ({'up' if w['alive'] else 'DEAD'})")
    shaped = [l for l in st["links"] if l["rate_bps"] or l["delay_s"] or l["site_rate_bps"]]
    if shaped:
        click.echo("links (src -> dst: pair rate, site-link rate, one-way delay):")
        for l in shaped:
            click.echo(f"  {l['src']} -> {l['dst']}: {_rate(l['rate_bps'])}, {_rate(l['site_rate_bps'])}, "
                       f"{l['delay_s'] * 1000:g} ms")


if __name__ == "__main__":
    lab()
