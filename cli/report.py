"""`peerd report RUN_DIR`: plots and a markdown table from a `peerd bench scenarios` run."""
from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def report(run_dir: str) -> None:
    """Write PNG plots (accuracy and loss vs wall time per contender, each host's iteration over
    time, the measured link matrix) and report.md with the result table into RUN_DIR."""
    from peerd.bench import report as rp

    try:
        out = rp.write(Path(run_dir))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except ImportError:
        raise click.ClickException("plots need matplotlib: pip install 'peerd[plot]'") from None
    click.echo(out.read_text())
    click.echo(f"written: {out} and the PNGs next to it")
