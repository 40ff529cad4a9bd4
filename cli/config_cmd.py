"""`peerd config show` and `peerd config reference`: the settings as a user sets them."""
from __future__ import annotations

import dataclasses
import json
import sys

import click

from peerd import config as config_mod


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(str(v)) for v in value) + "]"
    return json.dumps(str(value))


def to_toml(cfg: config_mod.Config, only_changed: bool = False) -> str:
    """The config as a TOML file in sections (what `--config FILE` reads)."""
    out: list[str] = []
    for section in config_mod.SECTIONS:
        rows = []
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if only_changed and value == f.default:
                continue
            rows.append(f"{f.name} = {_toml_value(value)}")
        if rows:
            out += [f"[{section}]", *rows, ""]
    return "\n".join(out)


@click.group()
def config() -> None:
    """Show the settings in effect, or the reference of every setting."""


@config.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML file to read, as `peerd up --config` does")
@click.option("--all", "show_all", is_flag=True, help="every setting, not only those that differ from the default")
def show(config_file: str | None, show_all: bool) -> None:
    """The settings a daemon started here would use (defaults < TOML < PEERD_*), as TOML."""
    try:
        cfg = config_mod.load(config_file)
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from None
    text = to_toml(cfg, only_changed=not show_all)
    click.echo(text if text else "# every setting at its default (--all lists them)")


@config.command()
def reference() -> None:
    """The configuration reference in Markdown (docs/configuration.md is this output)."""
    sys.stdout.write(config_mod.reference() + "\n")
