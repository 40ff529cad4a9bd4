"""`peerd completion bash|zsh|fish`: print the shell completion script (click's own)."""
from __future__ import annotations

import os

import click
from click.shell_completion import get_completion_class

SHELLS = ("bash", "zsh", "fish")
# The variable click's completion reads; its name follows from the program name, `peerd`.
COMPLETE_VAR = "_PEERD_COMPLETE"


@click.command()
@click.argument("shell", type=click.Choice(SHELLS), required=False)
def completion(shell: str | None) -> None:
    """Print the completion script for SHELL (default: the one $SHELL names).

    \b
    bash:  eval "$(peerd completion bash)"        (in ~/.bashrc)
    zsh:   eval "$(peerd completion zsh)"         (in ~/.zshrc)
    fish:  peerd completion fish > ~/.config/fish/completions/peerd.fish
    """
    if shell is None:
        shell = os.path.basename(os.environ.get("SHELL", ""))
        if shell not in SHELLS:
            raise click.UsageError(f"name the shell ({', '.join(SHELLS)}): $SHELL is {shell or 'unset'!r}")
    from cli.main import cli

    cls = get_completion_class(shell)
    click.echo(cls(cli, {}, "peerd", COMPLETE_VAR).source(), nl=False)
