"""The `peerd` command line."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """peerd: one daemon per host; decentralized training across mixed hardware and links."""


def _register() -> None:
    # Each area of the CLI lives in its own module; adding one is one line here.
    from cli import bench, container, daemon_cmds, demo, lab, plan, report, sim, train

    for command in daemon_cmds.COMMANDS:
        cli.add_command(command)
    for command in (demo.demo, train.train, train.ctl, lab.lab, bench.bench, sim.sim, container.container, plan.plan,
                    report.report):
        cli.add_command(command)
    from cli import lab_churn
    for command in lab_churn.COMMANDS:
        lab.lab.add_command(command)


_register()

if __name__ == "__main__":
    cli()
