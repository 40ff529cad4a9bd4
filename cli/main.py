"""The `peerd` command line."""
from __future__ import annotations

import os

# gRPC's own INFO lines (one per failed TLS handshake, for one) would let anyone who can connect
# grow a daemon's log without bound; its errors still show. Read once, when gRPC starts: so here,
# before any command imports it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import click  # noqa: E402

from peerd import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "-V", "--version", prog_name="peerd", message="%(prog)s %(version)s",
                      help="Print peerd's version and exit (`peerd version` lists the libraries too).")
def cli() -> None:
    """peerd: one daemon per host; decentralized training across mixed hardware and links."""


def _register() -> None:
    # Each area of the CLI lives in its own module; adding one is one line here.
    from cli import bench, completion, config_cmd, container, daemon_cmds, demo, lab, live, plan, report, sim, train

    for command in daemon_cmds.COMMANDS:
        cli.add_command(command)
    for command in (demo.demo, train.train, train.ctl, lab.lab, bench.bench, sim.sim, container.container, plan.plan,
                    report.report, completion.completion, config_cmd.config, live.top):
        cli.add_command(command)
    from cli import lab_churn
    for command in lab_churn.COMMANDS:
        lab.lab.add_command(command)


_register()

if __name__ == "__main__":
    cli()
