"""The `peerd` command line."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """peerd: one daemon per host; decentralized training across mixed hardware and links."""


def _register() -> None:
    # Each area of the CLI lives in its own module; adding one is one line here.
    from cli import bench, daemon_cmds, demo, lab, report, sim, train

    for command in daemon_cmds.COMMANDS:
        cli.add_command(command)
    for command in (demo.demo, train.train, lab.lab, bench.bench, sim.sim, report.report):
        cli.add_command(command)


_register()

if __name__ == "__main__":
    cli()
