"""`peerd up`, `peerd status`, `peerd peers`, `peerd links`, `peerd version`, `peerd keys new`."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click
import grpc

from peerd import PROTOCOL_VERSION, __version__
from peerd import config as config_mod
from peerd.config import FIELDS, ConfigError, default_data_dir


def config_options(fn):
    """One flag per daemon Config field, so `peerd up --help` documents every bound and default.
    Fields of other commands (metadata scope, e.g. "lab") stay settable by TOML and PEERD_*."""
    for name, f in reversed(list(FIELDS.items())):
        if f.metadata.get("scope", "daemon") != "daemon":
            continue
        flag = "--" + f.metadata.get("flag", name).replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            # --mdns/--no-mdns; None when neither is given, so TOML and PEERD_* still apply
            flag = f"{flag}/--no-{flag[2:]}"
        help_text = f"{f.metadata['help']}"
        if default not in ("", (), None):
            help_text += f"  [default: {default}; env PEERD_{name.upper()}]"
        else:
            help_text += f"  [env PEERD_{name.upper()}]"
        kwargs: dict = {"default": None, "help": help_text}
        if isinstance(default, tuple):
            kwargs.update(multiple=True, default=(), metavar="HOST:PORT")
        elif isinstance(default, bool):
            kwargs.update(is_flag=True)
        elif isinstance(default, int):
            kwargs.update(type=int)
        elif isinstance(default, float):
            kwargs.update(type=float)
        if "choices" in f.metadata:
            kwargs["type"] = click.Choice(f.metadata["choices"])
        fn = click.option(flag, name, **kwargs)(fn)
    return fn


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file with any of the settings below (flags and PEERD_* override it)")
@config_options
def up(config_file: str | None, **flags) -> None:
    """Run the peerd daemon on this host until SIGINT/SIGTERM.

    Serves the Peer service on --listen (authenticated with the cluster secret), the Control service
    on a unix socket in --data-dir, contacts --peer seeds and learns the rest of the swarm by gossip.
    """
    from peerd.net.auth import SecretError, load_secret
    from peerd.node.daemon import StartupError, run_daemon
    from peerd.node.identity import DataDirError

    try:
        cfg = config_mod.load(config_file, overrides=flags)
        setup_logging(cfg.log_level)
        secret = load_secret(cfg.secret_file)
        code = run_daemon(cfg, secret)
    except (ConfigError, SecretError, StartupError, DataDirError) as e:
        click.echo(f"peerd up: {e}", err=True)
        sys.exit(2)
    # Everything the daemon owns is stopped, closed and removed by now; the interpreter's own
    # teardown (gRPC's threads, torch) took seconds on a loaded host, past the 5 s a Ctrl+C gets.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


data_dir_option = click.option("--data-dir", default=None,
                               help="the daemon's data dir (default: $PEERD_DATA_DIR, else "
                                    "$XDG_DATA_HOME/peerd or ~/.local/share/peerd, as for `peerd up`)")
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
timeout_option = click.option("--timeout", default=3.0, show_default=True, help="seconds to wait for the daemon")


def control_stub(data_dir: str | None):
    from peerd.v1 import control_pb2_grpc

    path = Path(data_dir or os.environ.get("PEERD_DATA_DIR") or default_data_dir()).expanduser().absolute() / "peerd.sock"
    if not path.exists():
        raise click.ClickException(f"no daemon control socket at {path}: is `peerd up` running with this "
                                   f"--data-dir?")
    channel = grpc.insecure_channel(f"unix://{path}")
    return channel, control_pb2_grpc.ControlStub(channel)


def fetch_status(data_dir: str | None, timeout: float):
    from peerd.v1 import control_pb2 as cpb

    channel, stub = control_stub(data_dir)
    try:
        return stub.Status(cpb.StatusRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise click.ClickException(f"daemon did not answer: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()


def status_dict(reply) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _peer_rows(reply) -> list[list[str]]:
    return [[p.node_id, p.address, p.state, f"{p.last_heartbeat_age_s:.1f}s",
             f"{p.rtt_ms:.2f}" if p.rtt_ms else "-", p.device_kind or "-", _bad(p)] for p in reply.peers]


def _bad(p) -> str:
    """Bad updates of a peer, and FLAGGED while its updates are ignored."""
    if p.flagged_for_s > 0:
        return f"{p.bad_updates} FLAGGED {p.flagged_for_s:.0f}s"
    return str(p.bad_updates) if p.bad_updates else "-"


PEER_HEADER = ["NODE", "ADDRESS", "STATE", "LAST HEARD", "RTT MS", "DEVICE", "BAD UPDATES"]


@click.command()
@data_dir_option
@json_option
@timeout_option
def status(data_dir: str | None, as_json: bool, timeout: float) -> None:
    """Show this host's daemon: id, address, uptime and its peers."""
    reply = fetch_status(data_dir, timeout)
    if as_json:
        click.echo(json.dumps(status_dict(reply), indent=2))
        return
    alive = sum(p.state == "alive" for p in reply.peers)
    click.echo(f"node      {reply.node_id} (incarnation {reply.incarnation})\n"
               f"address   {reply.address}{'  (TLS)' if reply.tls else ''}\n"
               f"run       {reply.run_id}\n"
               f"uptime    {reply.uptime_s:.0f}s\n"
               f"version   peerd {reply.peerd_version}, protocol {reply.protocol_version}, loop {reply.event_loop}\n"
               f"data dir  {reply.data_dir}\n"
               f"peers     {alive} alive of {len(reply.peers)}")
    if reply.refused_calls or reply.rate_limited_calls:
        click.echo(f"refused   {reply.refused_calls} calls without valid credentials, "
                   f"{reply.rate_limited_calls} more rate-limited")
    if reply.peers:
        click.echo("\n" + _table(_peer_rows(reply), PEER_HEADER))


@click.command()
@data_dir_option
@json_option
@timeout_option
def peers(data_dir: str | None, as_json: bool, timeout: float) -> None:
    """List the peers this host's daemon knows, with their state."""
    reply = fetch_status(data_dir, timeout)
    if as_json:
        click.echo(json.dumps(status_dict(reply)["peers"], indent=2))
        return
    click.echo(_table(_peer_rows(reply), PEER_HEADER) if reply.peers else "no peers yet")


@click.command()
@data_dir_option
@json_option
@timeout_option
def links(data_dir: str | None, as_json: bool, timeout: float) -> None:
    """Show the link matrix this host's daemon knows: capacity (Mbit/s, the best recent sample),
    throughput (Mbit/s, recent average +- spread), RTT (ms) and age of every measured link, each
    measured by the row's host towards the column's (its own and gossiped)."""
    from google.protobuf.json_format import MessageToDict

    from peerd.net.links import render_links
    from peerd.v1 import control_pb2 as cpb

    channel, stub = control_stub(data_dir)
    try:
        reply = stub.Links(cpb.LinksRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise click.ClickException(f"daemon did not answer: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    matrix = MessageToDict(reply, preserving_proto_field_name=True)
    click.echo(render_links(matrix, "json" if as_json else "text"), nl=as_json)


@click.command()
@json_option
def version(as_json: bool) -> None:
    """Print the versions of peerd, its protocol and the libraries it runs on."""
    import google.protobuf

    info = {"peerd": __version__, "protocol": PROTOCOL_VERSION, "python": sys.version.split()[0],
            "grpcio": grpc.__version__, "protobuf": google.protobuf.__version__}
    try:
        from importlib.metadata import version as v
        info["uvloop"] = v("uvloop")
        info["zeroconf"] = v("zeroconf")
    except Exception:  # noqa: BLE001 - optional extras
        pass
    if as_json:
        click.echo(json.dumps(info))
    else:
        click.echo("  ".join(f"{k} {val}" for k, val in info.items()))


@click.group()
def keys() -> None:
    """Manage the cluster secret."""


@keys.command("new")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="overwrite an existing file")
def keys_new(path: str, force: bool) -> None:
    """Write a new random cluster secret to PATH (mode 600); copy it to every host."""
    from peerd.net.auth import new_secret

    p = Path(path)
    if p.exists() and not force:
        raise click.ClickException(f"{p} exists; pass --force to overwrite")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(new_secret() + "\n")
    click.echo(f"wrote a new cluster secret to {p}")


COMMANDS = [up, status, peers, links, version, keys]
