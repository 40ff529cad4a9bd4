"""`peerd container start`: the Docker image's entrypoint (peerd/container.py)."""
from __future__ import annotations

import os

import click

from peerd import config as config_mod
from peerd import container as container_mod
from peerd.lab.profile import ProfileError


@click.group()
def container() -> None:
    """Run peerd inside a container (the image's entrypoint)."""


@container.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--dry-run", is_flag=True,
              help="print the tc commands of the link profile (names resolved) and exit")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def start(dry_run: bool, args: tuple[str, ...]) -> None:
    """Shape this container's link, then run `peerd ARGS` as an unprivileged user.

    \b
    The link profile comes from PEERD_SHAPE_* (Config shape_*):
      PEERD_SHAPE_RATE=50mbit              everything this container sends
      PEERD_SHAPE_TO=peer1=10mbit,...      per destination: host name, IPv4 address or prefix
      PEERD_SHAPE_DELAY=20ms               added to every packet sent (needs netem)
    Shaping needs root and CAP_NET_ADMIN (`user: root`, `cap_add: [NET_ADMIN]`). Without them
    peerd starts unshaped with a warning, or not at all with PEERD_SHAPE_STRICT=1. As root, peerd
    runs as container_user (PEERD_CONTAINER_USER, default `peerd`). Example:

    \b
      peerd container start -- up --listen 0.0.0.0:7070 --data-dir /data
    """
    from cli.daemon_cmds import setup_logging

    argv = list(args[1:] if args[:1] == ("peerd",) else args)  # `docker run IMAGE peerd status`
    try:
        cfg = config_mod.load()
        profile = container_mod.link_profile(cfg)
        if dry_run:
            lines = container_mod.tc_lines(profile, container_mod.classes(profile, cfg), cfg)
            click.echo("\n".join(lines) if lines else "# no link profile: nothing to shape")
            return
        if not argv:
            raise click.UsageError("nothing to run: give the peerd command, e.g. `-- up --listen 0.0.0.0:7070`")
        setup_logging(cfg.node.log_level, cfg.node.log_format)
        container_mod.start(argv, cfg, dict(os.environ))
    except (config_mod.ConfigError, ProfileError, container_mod.ShapeError) as e:
        raise click.ClickException(str(e)) from None
