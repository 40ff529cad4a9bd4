"""`peerd --version` and shell completion, as docs/getting-started.md documents them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerd import __version__

BIN = Path(sys.executable).parent
PEERD = str(BIN / "peerd")           # the console script: completion keys on the program's name


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PEERD_", "_PEERD_"))}
    full["PATH"] = f"{BIN}{os.pathsep}{full.get('PATH', '')}"
    full.update(env or {})
    return subprocess.run([PEERD, *args], capture_output=True, text=True, env=full, timeout=60)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_option(flag):
    p = run(flag)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"peerd {__version__}"


def test_version_command_still_lists_the_libraries():
    p = run("version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"peerd {__version__}") and "protocol" in p.stdout and "grpcio" in p.stdout


def bash_complete(script: str, words: list[str]) -> list[str]:
    """Source the completion script in bash and complete `words` (the last one being typed), as bash
    does on TAB: the function reads COMP_WORDS and COMP_CWORD and fills COMPREPLY."""
    words_q = " ".join(f"'{w}'" for w in words)
    prog = f"""{script}
COMP_WORDS=({words_q}); COMP_CWORD={len(words) - 1}; COMPREPLY=()
_peerd_completion peerd
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PEERD_", "_PEERD_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return [w for w in p.stdout.split("\n") if w]


def test_bash_completion_script_completes_commands_and_options():
    p = run("completion", "bash")
    assert p.returncode == 0, p.stderr
    script = p.stdout
    assert "complete -o nosort -F _peerd_completion peerd" in script
    assert bash_complete(script, ["peerd", "st"]) == ["status"]
    assert "--task" in bash_complete(script, ["peerd", "train", "--ta"])
    assert set(bash_complete(script, ["peerd", "lab", "c"])) == {"calibrate", "chaos", "cut"}
    # The documented alternative, click's own variable, prints the same script.
    assert run(env={"_PEERD_COMPLETE": "bash_source"}).stdout == script


@pytest.mark.parametrize("shell, marker", [("zsh", "#compdef peerd"), ("fish", "complete --no-files --command peerd")])
def test_zsh_and_fish_scripts(shell, marker):
    p = run("completion", shell)
    assert p.returncode == 0, p.stderr
    assert marker in p.stdout and "_PEERD_COMPLETE" in p.stdout
    assert run(env={"_PEERD_COMPLETE": f"{shell}_source"}).stdout == p.stdout


def test_completion_shell_from_environment_or_an_error():
    assert run("completion", env={"SHELL": "/usr/bin/zsh"}).stdout == run("completion", "zsh").stdout
    p = run("completion", env={"SHELL": ""})
    assert p.returncode == 2 and "bash, zsh, fish" in p.stderr
