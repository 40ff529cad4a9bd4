"""The Docker page, docs/docker.md (or, without it, the "## Docker" section of README.md), runs
against the real files: every command in it is taken apart and checked with the Compose v2 binary,
the Dockerfile, the peerd CLI and the tests' own base-image recipe, so the text cannot drift from
docker/ or from what tests/test_docker_engine.py runs."""
from __future__ import annotations

import functools
import re

import click
import pytest

from cli import container as container_cli
from peerd import config as config_mod
from peerd import container as container_mod
from peerd.lab.profile import ProfileError
from tests.docker_engine import base_recipe
from tests.docker_files import (DOCKER, ROOT, compose, dockerfile_args, dockerfile_exec_form, parse_peerd,
                                resolved, shell_commands)

HEADING = re.compile(r"^## Docker[ \t]*$", re.M)
PAGE = ROOT / "docs" / "docker.md"
PROGRAMS = {"docker", "peerd", "openssl", "chmod", "debootstrap", "tar"}


def readme_section() -> str:
    """The README's "## Docker" section, if it has one ("" otherwise)."""
    text = (ROOT / "README.md").read_text()
    m = HEADING.search(text)
    if not m:
        return ""
    end = re.compile(r"^## ", re.M).search(text, m.start() + 3)
    return text[m.start():end.start() if end else len(text)]


def docker_section() -> str:
    """The Docker page: docs/docker.md, else the README's section."""
    if PAGE.exists():
        return PAGE.read_text()
    assert readme_section(), "no docs/docker.md, and no '## Docker' section in README.md"
    return readme_section()


def commands() -> list[list[str]]:
    """Each simple command of the page and of the README's Docker section: `a && b` split,
    redirections and VAR=value kept apart."""
    out = []
    texts = [docker_section()] + ([readme_section()] if PAGE.exists() and readme_section() else [])
    for argv in (a for text in texts for a in shell_commands(text)):
        cur: list[str] = []
        for tok in argv + ["&&"]:
            if tok in ("&&", ";", "||", "|"):
                if cur:
                    out.append(cur)
                cur = []
            else:
                cur.append(tok)
    return out


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        k, _, v = argv[0].partition("=")
        env[k] = v
        argv = argv[1:]
    return env, argv


@functools.cache
def compose_options(sub: str | None) -> dict[str, bool]:
    """Options of `docker compose [SUB]` as the real binary lists them: name -> takes a value."""
    p = compose((), args=([sub] if sub else []) + ["--help"])
    assert p.returncode == 0, p.stderr
    opts = {}
    for m in re.finditer(r"^\s+(?:(-\w), )?(--[\w-]+)(?: (\w+))?", p.stdout, re.M):
        short, long, value = m.groups()
        for name in filter(None, (short, long)):
            opts[name] = value is not None
    return opts


def take_options(argv: list[str], known: dict[str, bool], where: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Leading options of argv, checked against `known`: ([(option, value)], rest)."""
    opts, i = [], 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        assert name in known, f"{where}: `{name}` is no option of docker compose (v2.40.3)"
        if known[name] and not eq:
            i += 1
            value = argv[i]
        opts.append((name, value))
        i += 1
    return opts, argv[i:]


def check_docker_compose(env: dict[str, str], argv: list[str], line: str) -> None:
    opts, rest = take_options(argv, compose_options(None), line)
    files = [v for k, v in opts if k in ("-f", "--file")]
    profiles = [v for k, v in opts if k == "--profile"]
    assert files, f"{line}: name the compose file with -f"
    for f in files:
        assert (ROOT / f).is_file(), f"{line}: no file {f}"
    text = "".join((ROOT / f).read_text() for f in files)
    for var in env:
        assert re.search(r"\$\{" + var + r"\b", text), f"{line}: {var} is not used by {files}"
    assert rest, f"{line}: no compose subcommand"
    sub, rest = rest[0], rest[1:]
    services = resolved(files, profiles, env=env)["services"]
    sub_opts, args = take_options(rest, compose_options(sub), line)
    for k, v in sub_opts:
        if k == "--scale":
            assert v.split("=")[0] in services, f"{line}: no service {v.split('=')[0]} to scale"
    for name, svc in services.items():  # the link profile and straggler factor each peer gets
        env = {k: v for k, v in (svc.get("environment") or {}).items() if v is not None}
        container_mod.link_profile(config_mod.load(env=env))
        container_mod.slowdown(env)
    if sub == "exec":
        assert args and args[0] in services, f"{line}: no service {args[:1]}"
        assert args[1:2] == ["peerd"], f"{line}: runs something other than peerd"
        parse_peerd(args[2:])
    elif sub == "run":  # the arguments go to the image's entrypoint, `peerd container start --`
        assert args and args[0] in services, f"{line}: no service {args[:1]}"
        cmd, params = parse_peerd(dockerfile_exec_form("ENTRYPOINT")[1:] + args[1:])
        assert cmd is container_cli.start
        inner = list(params["args"])
        parse_peerd(inner[1:] if inner[:1] == ["peerd"] else inner)  # the entrypoint drops a leading `peerd`
    else:
        for s in args:
            assert s in services, f"{line}: no service {s}"


def check_docker_build(argv: list[str], line: str) -> None:
    assert argv[-1] == ".", f"{line}: build from the repository root (context `.`)"
    opts = list(zip(argv[:-1:2], argv[1:-1:2]))
    assert len(argv) % 2 == 1 and all(k in ("-f", "-t", "--build-arg", "--network") for k, _ in opts), \
        f"{line}: only -f, -t, --build-arg and --network are checked"
    assert all(v == "host" for k, v in opts if k == "--network"), f"{line}: --network host or none"
    assert ("-f", "docker/Dockerfile") in opts, f"{line}: -f docker/Dockerfile"
    image = resolved(("docker/compose.yaml",))["services"]["peer1"]["image"]
    assert ("-t", image) in opts, f"{line}: tag it {image}, the image the compose files use"
    for name in (v.split("=")[0] for k, v in opts if k == "--build-arg"):
        assert name in dockerfile_args(), f"{line}: the Dockerfile has no ARG {name}"


def check_base_image(steps: dict[str, list[str]], bases: set[str]) -> None:
    """The "Without a registry" recipe: debootstrap exactly as the tests make their base image,
    tar of that directory into `docker import`, and a build that uses the imported tag."""
    deboot, tar, imp = steps.get("debootstrap"), steps.get("tar"), steps.get("import")
    assert deboot and tar and imp, "the page does not show how to make a base image without a registry"
    recipe = base_recipe()
    assert deboot[1:1 + len(recipe)] == recipe and len(deboot) == len(recipe) + 3, \
        f"debootstrap {deboot[1:]}: not the recipe the tests build with ({' '.join(recipe)} DIR MIRROR)"
    target, mirror = deboot[-2:]
    assert mirror.startswith(("http://", "https://")), f"debootstrap: {mirror} is no mirror URL"
    assert tar[tar.index("-C") + 1] == target and tar[-1] == "." and "--numeric-owner" in tar, tar
    assert imp[:3] == ["docker", "import", "-"] and len(imp) == 4, imp
    assert imp[3] in bases, f"no build uses the imported base {imp[3]} (BASE_IMAGE={bases})"


def test_walkthrough_commands_match_the_files():
    seen = {"compose": set(), "build": 0}
    steps: dict[str, list[str]] = {}
    bases: set[str] = set()
    for argv in commands():
        line = " ".join(argv)
        env, argv = split_env(argv)
        argv = [a for i, a in enumerate(argv) if a not in (">", ">>") and (i == 0 or argv[i - 1] not in (">", ">>"))]
        assert argv[0] in PROGRAMS, f"{line}: unexpected program {argv[0]}"
        if argv[0] == "peerd":
            parse_peerd(argv[1:])
        elif argv[:2] == ["docker", "compose"]:
            check_docker_compose(env, argv[2:], line)
            seen["compose"].update(argv[i + 1] for i, a in enumerate(argv) if a == "-f")
        elif argv[:2] == ["docker", "build"]:
            check_docker_build(argv[2:], line)
            seen["build"] += 1
            bases.update(a.split("=", 1)[1] for a in argv if a.startswith("BASE_IMAGE="))
        elif argv[:2] == ["docker", "import"]:
            steps["import"] = argv
        elif argv[0] in ("debootstrap", "tar"):
            steps[argv[0]] = argv
        else:
            assert argv[0] != "docker", f"{line}: only `docker build`, `import` and `compose` are checked"
    files = {f"docker/{p.name}" for p in DOCKER.glob("*.yaml")}
    assert seen["compose"] == files, f"compose files never used in the walkthrough: {files - seen['compose']}"
    assert seen["build"], "the walkthrough never builds the image"
    check_base_image(steps, bases)


def test_walkthrough_documents_every_build_argument_and_says_how_it_is_checked():
    section = docker_section()
    for arg in dockerfile_args():
        assert f"`{arg}`" in section, f"build argument {arg} is not documented"
    assert "on a real Docker Engine in CI" in section and "tests/test_docker_engine.py" in section
    for must in ("cap_add: [NET_ADMIN]", "PEERD_SHAPE_STRICT", "shaping is OFF", "netem"):
        assert must in section, f"the walkthrough does not say {must!r}"
    for var in re.findall(r"\$\{((?:PEER\d|EXTRA)_LINK_\w+)", (DOCKER / "compose.yaml").read_text()):
        assert f"`{var.replace(var.split('_')[0], 'PEER1')}`" in section, f"{var} is not documented"


@pytest.mark.parametrize("bad", ["docker compose -f docker/compose.yaml up -d --scale nobody=2",
                                 "docker compose -f docker/compose.yaml exec peer1 peerd stats",
                                 "docker compose -f docker/compose.yaml up --detached",
                                 "docker build -f docker/Dockerfile -t peerd:local --build-arg CUDA=1 .",
                                 "PEER1_LINK_RATE=50mbt docker compose -f docker/compose.yaml up -d",
                                 "PEER2_LINK_TO=peer1:10mbit docker compose -f docker/compose.yaml up -d",
                                 "PEER2_SLOWDOWN=0.5 docker compose -f docker/compose.yaml up -d",
                                 "PEER1_LINK_RATE=1mbit docker compose -f docker/compose.host.yaml up -d",
                                 "docker compose -f docker/compose.yaml exec peer1 peerd container begin",
                                 "docker compose -f docker/compose.yaml run peer1 stats"])
def test_the_checker_rejects_wrong_commands(bad):
    env, argv = split_env(bad.split())
    with pytest.raises((AssertionError, click.UsageError, ProfileError)):
        if argv[1] == "build":
            check_docker_build(argv[2:], bad)
        else:
            check_docker_compose(env, argv[2:], bad)
