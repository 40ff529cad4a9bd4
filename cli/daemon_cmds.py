"""`peerd up`, `peerd down`, `peerd status`, `peerd peers`, `peerd links`, `peerd version`, `peerd keys ...`."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import click
import grpc

from peerd import PROTOCOL_VERSION, __version__
from peerd import config as config_mod
from peerd.config import FIELDS, ConfigError, default_data_dir


def config_options(fn):
    """One flag per setting of the daemon's Config sections. `peerd up --help` shows the common ones;
    the rest are hidden there and listed by `--help-all` and docs/configuration.md. Settings of the
    lab, bench and container sections stay settable by TOML and PEERD_*."""
    for key, s in reversed(list(FIELDS.items())):
        if s.scope != "daemon":
            continue
        flag = "--" + s.metadata.get("flag", key).replace("_", "-")
        default = s.default
        if isinstance(default, bool):
            # --mdns/--no-mdns; None when neither is given, so TOML and PEERD_* still apply
            flag = f"{flag}/--no-{flag[2:]}"
        help_text = s.help
        if default not in ("", (), None):
            help_text += f"  [default: {default}; env PEERD_{key.upper()}]"
        else:
            help_text += f"  [env PEERD_{key.upper()}]"
        kwargs: dict = {"default": None, "help": help_text, "hidden": not s.metadata.get("common")}
        if isinstance(default, tuple):
            kwargs.update(multiple=True, default=(), metavar=s.metadata.get("metavar", "HOST:PORT"))
        elif isinstance(default, bool):
            kwargs.update(is_flag=True)
        elif isinstance(default, int):
            kwargs.update(type=int)
        elif isinstance(default, float):
            kwargs.update(type=float)
        if "choices" in s.metadata:   # the help names the choices; a short metavar keeps --help narrow
            kwargs.update(type=click.Choice(s.metadata["choices"]), metavar=key.rsplit("_", 1)[-1].upper())
        fn = click.option(flag, key, **kwargs)(fn)
    return click.option("--help-all", is_flag=True, expose_value=False, is_eager=True, callback=_help_all,
                        help="Show every setting as a flag (each also a TOML key and a PEERD_* variable: "
                             "docs/configuration.md) and exit.")(fn)


def _help_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    for param in ctx.command.params:
        if isinstance(param, click.Option):
            param.hidden = False
    click.echo(ctx.get_help())
    ctx.exit()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC, milliseconds), level, logger, message, and
    the traceback as `exception` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exception"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """The daemon's log on stderr: `--log-format text` (time, level, logger, message) or json."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file with any of the settings below (flags and PEERD_* override it)")
@config_options
def up(config_file: str | None, **flags) -> None:
    """Run the peerd daemon on this host until SIGINT/SIGTERM: signed calls (mutual TLS off
    loopback) on --listen, control on a socket in --data-dir; joins through --peer or mDNS.
    """
    from peerd.net.auth import SecretError, load_secret
    from peerd.node.daemon import StartupError, run_daemon
    from peerd.node.identity import DataDirError

    try:
        cfg = config_mod.load(config_file, overrides=flags)
        setup_logging(cfg.node.log_level, cfg.node.log_format)
        # With your own CA (--tls-cert/--tls-key/--tls-ca) the CA decides membership: no secret.
        secret = b"" if cfg.node.tls_cert else load_secret(cfg.node.secret_file)
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


def control_socket(data_dir: str | None) -> Path:
    return Path(data_dir or os.environ.get("PEERD_DATA_DIR") or default_data_dir()).expanduser().absolute() / "peerd.sock"


def control_stub(data_dir: str | None):
    from peerd.v1 import control_pb2_grpc

    path = control_socket(data_dir)
    if not path.exists():
        raise click.ClickException(f"no daemon control socket at {path}: is `peerd up` running with this "
                                   f"--data-dir?")
    if not listening(path):
        raise click.ClickException(f"no daemon answers on {path}: a socket left by a daemon that was killed? "
                                   f"`peerd up` with this --data-dir starts one (and replaces it)")
    channel = grpc.insecure_channel(f"unix://{path}")
    return channel, control_pb2_grpc.ControlStub(channel)


def listening(path) -> bool:
    """Something accepts connections on the unix socket `path` (a killed daemon leaves the file)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            return False
        except OSError:
            return True          # another error (permissions, a busy backlog): let gRPC say what it is
    return True


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
        click.echo(json.dumps(status_dict(reply), indent=2, allow_nan=False))
        return
    alive = sum(p.state == "alive" for p in reply.peers)
    click.echo(f"node      {reply.node_id} (incarnation {reply.incarnation})\n"
               f"address   {reply.address}  ({'TLS' if reply.tls else 'plaintext'}; --tls {reply.tls_mode})\n"
               f"members   certified by {reply.trust}; {reply.revoked_nodes} node(s) revoked\n"
               f"run       {reply.run_id}\n"
               f"uptime    {reply.uptime_s:.0f}s\n"
               f"version   peerd {reply.peerd_version}, protocol {reply.protocol_version}, loop {reply.event_loop}\n"
               f"data dir  {reply.data_dir}\n"
               f"peers     {alive} alive of {len(reply.peers)}")
    if reply.metrics_url:
        click.echo(f"metrics   {reply.metrics_url}")
    click.echo(f"reachable {reply.reachability}  (dial-backs by peers: {reply.dial_backs_reached} connected, "
               f"{reply.dial_backs_failed} failed; docs/nat.md)")
    if reply.tunnels_to or reply.tunnels_from or reply.relayed_to:
        click.echo(f"tunnels   {len(reply.tunnels_to)} kept to peers that cannot dial this host; "
                   f"{len(reply.tunnels_from)} peer(s) reached through their tunnels, {len(reply.relayed_to)} "
                   f"through a relay; {reply.tunnelled_connections} connection(s), "
                   f"{reply.tunnelled_bytes / 1e6:.1f} MB carried")
    if reply.relay:
        click.echo(f"relay     on: {reply.relayed_connections} connection(s), {reply.relayed_bytes / 1e6:.1f} MB "
                   f"relayed for others")
    if reply.refused_calls or reply.rate_limited_calls:
        click.echo(f"refused   {reply.refused_calls} calls without valid credentials, "
                   f"{reply.rate_limited_calls} more rate-limited")
    for line in _seed_lines(reply):
        click.echo(line)
    if reply.peers:
        click.echo("\n" + _table(_peer_rows(reply), PEER_HEADER))


def _seed_lines(reply) -> list[str]:
    """One line per --peer seed: the node that answered there, or why none has yet."""
    states = {p.node_id: p.state for p in reply.peers}
    lines = []
    for s in reply.seeds:
        what = f"{s.node_id} ({states.get(s.node_id, 'not a member')})" if s.node_id else "no node joined there"
        if s.failures:
            what += f"; failing: {s.last_error} ({s.failures} tries, retried with back-off)"
        lines.append(f"{'seeds' if not lines else '':<9} {s.address}  {what}")
    return lines


@click.command()
@data_dir_option
@json_option
@timeout_option
def peers(data_dir: str | None, as_json: bool, timeout: float) -> None:
    """List the peers this host's daemon knows, with their state."""
    reply = fetch_status(data_dir, timeout)
    if as_json:
        click.echo(json.dumps(status_dict(reply)["peers"], indent=2, allow_nan=False))
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
@data_dir_option
@click.option("--timeout", default=30.0, show_default=True,
              help="seconds to wait until the daemon has stopped (it stops its trainer and tells its peers first)")
def down(data_dir: str | None, timeout: float) -> None:
    """Stop this host's daemon gracefully, as SIGTERM does: it stops its trainer, tells its peers it
    leaves, closes its sockets and exits. Exits 0 once it has stopped, 1 when no daemon answers or
    it is still there after --timeout."""
    from peerd.v1 import control_pb2 as cpb

    sock = control_socket(data_dir)
    channel, stub = control_stub(data_dir)
    try:
        reply = stub.Shutdown(cpb.ShutdownRequest(reason="peerd down"), timeout=min(timeout, 10.0))
    except grpc.RpcError as e:
        raise click.ClickException(f"daemon did not answer: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    deadline = time.monotonic() + timeout
    # The daemon removes its control socket at the end of its shutdown, then exits.
    while sock.exists() or _same_daemon(reply.pid):
        if time.monotonic() >= deadline:
            raise click.ClickException(f"the daemon (pid {reply.pid}) is still shutting down after {timeout:g}s; "
                                       f"its log says why (`peerd up` stops what is left after shutdown_timeout)")
        time.sleep(0.1)
    click.echo(f"peerd daemon (pid {reply.pid}) stopped")


def _same_daemon(pid: int) -> bool:
    """Whether `pid` is still a peerd process here (a daemon in another pid namespace, e.g. a
    container sharing its data dir, has a pid that means nothing here: then only its socket counts)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"peerd" in cmdline or b"cli.main" in cmdline


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
    """Manage the cluster secret and node keys (docs/security.md)."""


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


def _data_path(data_dir: str | None) -> Path:
    return Path(data_dir or os.environ.get("PEERD_DATA_DIR") or default_data_dir()).expanduser().absolute()


@keys.command("show")
@data_dir_option
@click.option("--tls-cert", default="", help="your CA's certificate of this node, when it has one")
def keys_show(data_dir: str | None, tls_cert: str) -> None:
    """Print this node's id (the hash of its public key) and its public key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from peerd.net import pki
    from peerd.node.identity import NODE_KEY_FILE

    if tls_cert:
        public = x509.load_pem_x509_certificates(Path(tls_cert).read_bytes())[0].public_key()
    else:
        path = _data_path(data_dir) / NODE_KEY_FILE
        if not path.exists():
            raise click.ClickException(f"no node key at {path}: it is made at the first `peerd up` with this --data-dir")
        try:
            public = pki.load_key(path).public_key()
        except pki.PkiError as e:
            raise click.ClickException(str(e)) from None
    click.echo(f"node id     {pki.node_id_of(public)}")
    click.echo(public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
               .decode().rstrip())


@keys.command("revoke")
@click.argument("node_id")
@click.option("--reason", default="", help="why (kept with the revocation, shown in logs)")
@click.option("--secret-file", default="", help="the cluster secret (default: $PEERD_SECRET)")
@click.option("--ca-cert", default="", help="with your own CA: its certificate (the first in --tls-ca)")
@click.option("--ca-key", default="", help="with your own CA: its private key, which signs the revocation")
@data_dir_option
@timeout_option
def keys_revoke(node_id: str, reason: str, secret_file: str, ca_cert: str, ca_key: str, data_dir: str | None,
                timeout: float) -> None:
    """Revoke NODE_ID: no daemon admits it again. The revocation is signed with the cluster CA key
    (derived from the secret, or --ca-key) and given to the local daemon, which keeps it and
    spreads it to every daemon with its heartbeats; with no daemon running it is written into the
    data dir, for the next start. A host that still knows the secret can mint a new node key:
    rotate the secret (docs/security.md) to shut it out for good."""
    from peerd.net import pki
    from peerd.net.auth import SecretError, load_secret, secrets_of
    from peerd.node.convert import revocation_to_pb
    from peerd.node.identity import REVOKED_FILE
    from peerd.v1 import control_pb2 as cpb

    try:
        if ca_key:
            trust = pki.ClusterTrust.from_files(ca_cert, ca_key) if ca_cert else None
            if trust is None:
                raise click.ClickException("--ca-key needs --ca-cert")
        else:
            trust = pki.ClusterTrust.from_secrets(secrets_of(load_secret(secret_file)))
        rev = trust.revoke(node_id.strip().lower(), reason)
    except (pki.PkiError, SecretError) as e:
        raise click.ClickException(str(e)) from None
    sock = _data_path(data_dir) / "peerd.sock"
    if sock.exists():
        msg = revocation_to_pb(rev)
        channel, stub = control_stub(data_dir)
        try:
            reply = stub.Revoke(cpb.RevokeRequest(node_id=msg.node_id, revoked_at=msg.revoked_at, reason=msg.reason,
                                                  signature=msg.signature), timeout=timeout)
        except grpc.RpcError as e:
            raise click.ClickException(f"daemon did not take it: {e.code().name}: {e.details()}") from None
        finally:
            channel.close()
        click.echo(f"revoked {rev.node}: the daemon {'keeps and spreads it' if reply.added else 'knew it already'} "
                   f"({reply.revoked_nodes} revoked in all)")
        return
    store = pki.Revocations(trust, _data_path(data_dir) / REVOKED_FILE)
    store.add([rev])
    click.echo(f"revoked {rev.node}: no daemon runs with this data dir; written to {store.path} for its next start")


@keys.command("rotate")
@data_dir_option
@click.option("--yes", is_flag=True, help="do not ask")
def keys_rotate(data_dir: str | None, yes: bool) -> None:
    """Give this node a new key, and so a new node id (the daemon must not be running). For a node
    whose key leaked or was revoked: revoke the old id, rotate, start again."""
    from peerd.net import pki
    from peerd.node.identity import NODE_KEY_FILE

    path = _data_path(data_dir)
    if (path / "peerd.sock").exists():
        raise click.ClickException(f"a daemon runs with {path} (stop it first)")
    key = path / NODE_KEY_FILE
    old = pki.node_id_of(pki.load_key(key).public_key()) if key.exists() else "none"
    if not yes:
        click.confirm(f"replace node key {old} in {path}? Runs that name it must be started again", abort=True)
    new = pki.new_key()
    if key.exists():
        key.replace(path / f"{NODE_KEY_FILE}.old")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    pki.write_private(key, pki.key_pem(new))
    click.echo(f"node key rotated: {old} -> {pki.node_id_of(new.public_key())} (the old key is {NODE_KEY_FILE}.old)")


COMMANDS = [up, down, status, peers, links, version, keys]
