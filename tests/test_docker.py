"""docker/: the compose files resolve, the Dockerfile lints clean, and every container runs the
same `peerd up` contract as `peerd lab` (see tests/docker_files.py for how, without an engine)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cli import container as container_cli
from cli import daemon_cmds
from peerd import config as config_mod
from peerd import container as container_mod
from peerd.config import FIELDS
from peerd.lab import shaping
from tests.docker_files import (COMBOS, DOCKERFILE, NON_CONFIG_ENV, ROOT, TOOL_TIMEOUT, compose,
                                dockerfile_exec_form, dockerfile_instructions, hadolint_binary,
                                long_flags, parse_peerd, resolved)

# The daemon's command-line contract shared by the lab, the image and the compose files:
# these flags on every daemon, plus --peer (repeatable) for its seeds. Anything per deployment
# goes through PEERD_* variables, which are Config fields too.
CONTRACT = {"--listen", "--data-dir", "--run-id", "--secret-file"}
HOST_ENV = {"PEERD_ADVERTISE_ADDRESS": "10.0.0.2:7070", "PEERD_PEERS": "10.0.0.1:7070,10.0.0.3:7070",
            "PEERD_LISTEN": "10.0.0.2:7070"}


def combo_id(combo) -> str:
    files, profiles = combo
    return "+".join(Path(f).name for f in files) + "".join(f"[{p}]" for p in profiles)


def service_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    return {k: v for k, v in env.items() if v is not None}


def load_config(command: list[str], env: dict[str, str]) -> config_mod.Config:
    cmd, params = parse_peerd(command)
    assert cmd is daemon_cmds.up, f"container runs `peerd {command[0]}`, not `peerd up`"
    assert params.pop("config_file") is None
    return config_mod.load(overrides=params, env=env)


def test_image_entrypoint_is_the_peerd_cli():
    """`peerd container start -- CMD`: the shaping entry, which then runs `peerd CMD` (the command a
    compose service gives) with `python -m cli.main`, the way the lab starts its daemons."""
    entry = dockerfile_exec_form("ENTRYPOINT")
    assert entry == ["peerd", "container", "start", "--"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["peerd"] == "cli.main:cli"  # the lab runs `python -m cli.main`: the same click group
    command = dockerfile_exec_form("CMD")
    cmd, params = parse_peerd(entry[1:] + command)
    assert cmd is container_cli.start and list(params["args"]) == command and not params["dry_run"]
    assert parse_peerd(command)[0] is daemon_cmds.up


def test_image_installs_tc_and_keeps_a_non_root_default_user():
    runs = " ".join(rest for word, rest in dockerfile_instructions() if word == "RUN")
    assert "iproute2" in runs and "tc -V" in runs
    users = [rest for word, rest in dockerfile_instructions() if word == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_image_default_command_follows_the_contract():
    command = dockerfile_exec_form("CMD")
    assert set(long_flags(command)) == CONTRACT
    cfg = load_config(command, env={})
    env = dict(kv.split("=", 1) for word, rest in dockerfile_instructions() if word == "ENV"
               for kv in rest.split())
    assert cfg.node.data_dir == env["PEERD_DATA_DIR"] == "/data"  # `peerd status` finds the same socket
    assert cfg.node.secret_file == "/run/secrets/peerd_secret"


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_compose_files_resolve(combo):
    files, profiles = combo
    p = compose(files, profiles, args=("config", "--quiet"))
    assert p.returncode == 0, p.stderr
    assert resolved(files, profiles)["services"]


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_containers_run_peerd_up_with_the_lab_contract(combo):
    files, profiles = combo
    model = resolved(files, profiles, env=HOST_ENV)
    services = model["services"]
    hostnames = {svc.get("hostname") or name: name for name, svc in services.items()}
    for name, svc in services.items():
        assert svc.get("entrypoint") is None, f"{name}: overrides the image's `peerd` entrypoint"
        command = svc["command"]
        assert set(long_flags(command)) - {"--peer"} == CONTRACT, f"{name}: {command}"
        env = service_env(svc)
        unknown = {k for k in env if k.startswith("PEERD_")} - {f"PEERD_{f.upper()}" for f in FIELDS} - NON_CONFIG_ENV
        assert not unknown, f"{name}: PEERD_* variables that are no Config field: {unknown}"
        assert "PEERD_SECRET" not in env, f"{name}: the secret must come as a compose secret"
        cfg = load_config(command, env)
        assert cfg.node.data_dir in {v["target"] for v in svc["volumes"]}, f"{name}: data dir is not a volume"
        assert cfg.node.secret_file in {s["target"] for s in svc["secrets"]}, f"{name}: secret not mounted"
        assert float(env.get("PEERD_SLOWDOWN", "1")) >= 1.0
        if svc.get("network_mode") == "host":
            # One container per machine: the machine's own address and seeds come from the shell.
            assert cfg.node.listen == HOST_ENV["PEERD_LISTEN"]
            assert cfg.node.advertise_address == HOST_ENV["PEERD_ADVERTISE_ADDRESS"]
            assert cfg.node.peers == tuple(HOST_ENV["PEERD_PEERS"].split(","))
            continue
        port = cfg.node.listen.rsplit(":", 1)[1]
        for seed in cfg.node.peers:
            host, seed_port = seed.rsplit(":", 1)
            assert host in hostnames and host != svc.get("hostname"), f"{name}: seed {seed} is no other peer"
            seed_cfg = load_config(services[hostnames[host]]["command"], service_env(services[hostnames[host]]))
            assert seed_cfg.node.listen.rsplit(":", 1)[1] == seed_port, f"{name}: seed {seed} has the wrong port"
        if cfg.node.advertise_address:
            assert cfg.node.advertise_address == f"{svc['hostname']}:{port}", f"{name}: advertises another name"


# A link profile and straggler factor for every trial service, as the walkthrough sets them.
LINK_ENV = {"PEER1_LINK_RATE": "50mbit", "PEER2_LINK_TO": "peer1=10mbit,peer3=20mbit", "PEER2_SLOWDOWN": "4",
            "PEER3_LINK_RATE": "100mbit", "PEER3_LINK_TO": "172.28.0.0/16=1gbit", "PEER3_LINK_DELAY": "20ms",
            "EXTRA_LINK_RATE": "5mbit", "PEERD_SHAPE_STRICT": "true"}


def test_link_profiles_and_stragglers_reach_each_service():
    services = resolved(*COMBOS[1], env=LINK_ENV)["services"]
    names = {svc.get("hostname") or name for name, svc in services.items()} | set(services)
    got = {}
    for name, svc in services.items():
        cfg = load_config(svc["command"], service_env(svc))
        profile = container_mod.link_profile(cfg)
        got[name] = (profile, container_mod.slowdown(service_env(svc)), cfg.container.shape_strict)
        for dest, _ in profile.to:  # a destination is another service, or an address/prefix
            assert dest in names - {name, svc.get("hostname")} or dest[0].isdigit(), f"{name}: {dest}"
        if not profile.empty:
            # What the entrypoint would run, with placeholder addresses for the service names.
            dst = [shaping.DstClass(r, (f"10.0.0.{k}",)) for k, (_, r) in enumerate(profile.to, 2)]
            assert container_mod.tc_lines(profile, dst, cfg)[0] == "qdisc add dev eth0 root handle 1: htb default 3"
    assert got["peer1"][0] == container_mod.LinkProfile("eth0", 50 * 10**6, (), 0.0)
    assert got["peer2"][0] == container_mod.LinkProfile("eth0", None, (("peer1", 10**7), ("peer3", 2 * 10**7)), 0.0)
    assert got["peer3"][0] == container_mod.LinkProfile("eth0", 10**8, (("172.28.0.0/16", 10**9),), 0.02)
    assert got["extra"][0].rate_bps == 5 * 10**6
    assert [got[n][1] for n in ("peer1", "peer2", "peer3", "extra")] == [1, 4, 1, 1]
    assert all(strict for _, _, strict in got.values())
    unset = resolved(*COMBOS[1])["services"]
    for name, svc in unset.items():  # nothing set: no shaping, not strict
        cfg = load_config(svc["command"], service_env(svc))
        assert container_mod.link_profile(cfg).empty and not cfg.container.shape_strict, name


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_shaping_services_start_as_root_with_net_admin(combo):
    """The entrypoint needs root and NET_ADMIN for tc, and drops root itself. The host-network file
    shapes nothing: tc there would shape the machine's own interface, and outlive the container."""
    for name, svc in resolved(*combo, env={**LINK_ENV, **HOST_ENV})["services"].items():
        env = service_env(svc)
        shapes = any(k.startswith("PEERD_SHAPE_") for k in env)
        if svc.get("network_mode") == "host":
            assert not shapes and not svc.get("cap_add") and svc.get("user") in (None, "peerd"), name
        else:
            assert shapes and svc.get("cap_add") == ["NET_ADMIN"] and svc.get("user") == "root", name
            assert "PEERD_CONTAINER_USER" not in env, f"{name}: peerd runs as the image's user peerd"


def test_every_trial_peer_has_its_own_data_volume():
    services = resolved(*COMBOS[1])["services"]  # with the scalable `extra`
    sources = [v.get("source") for s in services.values() for v in s["volumes"] if v["target"] == "/data"]
    named = [s for s in sources if s]
    assert len(named) == len(set(named)), "two peers share a data dir (and so a node id)"
    assert services["extra"]["volumes"][0].get("source") is None  # anonymous: one per replica
    seeded = [n for n, s in services.items() if "--peer" not in s["command"]]
    assert len(seeded) == 1, f"exactly one peer starts without seeds, got {seeded}"


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_shm_and_gpu(combo):
    files, profiles = combo
    gpu = any("gpu" in f for f in files)
    for name, svc in resolved(files, profiles)["services"].items():
        assert int(svc["shm_size"]) >= 1 << 30, f"{name}: /dev/shm below 1 GiB"
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert bool(devices) == gpu, f"{name}: GPU reservation {'missing' if gpu else 'unexpected'}"
        for d in devices:
            assert d["driver"] == "nvidia" and "gpu" in d["capabilities"]
    if gpu:
        one = resolved(files, profiles, env={"PEERD_GPUS": "1"})["services"]
        assert all(svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1 for svc in one.values())


def test_secret_is_never_in_the_image():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", ".dockerignore must exclude everything and allow back what the image needs"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert not {a for a in allowed if a.startswith("docker") or "secret" in a}
    copied = {src.rstrip("/") for word, rest in dockerfile_instructions() if word in ("COPY", "ADD")
              for src in rest.split()[:-1] if not src.startswith("--")}
    # `COPY .` copies the build context, which is the allowlist above
    assert copied <= allowed | {"."}, f"COPY of paths outside the .dockerignore allowlist: {copied - allowed}"
    for combo in COMBOS:
        for name, secret in resolved(*combo)["secrets"].items():
            assert set(secret) == {"name", "file"}, f"{name}: a compose secret from a file, not {secret}"
            assert Path(secret["file"]).name == "peerd-secret"
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/peerd-secret"], cwd=ROOT, timeout=TOOL_TIMEOUT)
    assert ignored.returncode == 0, "docker/peerd-secret is not git-ignored"


def test_dockerfile_lints_clean():
    p = subprocess.run([hadolint_binary(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    assert p.returncode == 0, f"hadolint:\n{p.stdout}{p.stderr}"


def test_healthcheck_is_peerd_status_and_tells_up_from_down(daemons, tmp_path):
    argv = dockerfile_exec_form("HEALTHCHECK")
    assert argv[0] == "peerd"
    cmd, _ = parse_peerd(argv[1:])
    assert cmd is daemon_cmds.status
    d = daemons("h1")

    def health(data_dir: Path) -> int:
        env = {**os.environ, "PEERD_DATA_DIR": str(data_dir)}
        return subprocess.run([sys.executable, "-m", "cli.main", *argv[1:]], env=env, capture_output=True,
                              timeout=TOOL_TIMEOUT, cwd=ROOT).returncode

    assert health(d.data_dir) == 0
    assert health(tmp_path / "no-daemon") != 0
    d.stop()
    assert health(d.data_dir) != 0


def test_lab_starts_daemons_with_the_same_contract():
    """Links the compose path to `peerd lab`: both must write the same `peerd up` command line."""
    lab = pytest.importorskip("peerd.lab.lab", reason="peerd lab is not merged yet")
    argv = lab.daemon_argv("python3", "10.250.0.2", 7070, Path("/d"), "run", Path("/s"), ["10.250.0.1:7070"])
    assert argv[1:3] == ["-m", "cli.main"]
    assert set(long_flags(argv)) - {"--peer"} == CONTRACT
    load_config(argv[3:], env={})


def test_build_context_holds_what_the_image_installs(tmp_path):
    """Lay out /opt/peerd as the Dockerfile's COPY lines do from the .dockerignore allowlist, then run
    the import check of its install step (`peerd version`) from that copy alone."""
    allowed = [ln.strip()[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip().startswith("!")]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        for pkg in ROOT.glob(pattern.rstrip("*") + "*/__init__.py"):
            assert pkg.parent.name in allowed, f"package {pkg.parent.name} is left out of the image"
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            *srcs, dst = rest.split()
            if srcs == ["."]:  # the build context: the allowlist, each entry under its own name
                srcs, dst = allowed, dst.rstrip("/") + "/"
            for src in srcs:  # WORKDIR is the copy's root
                dest = tmp_path / dst / src if dst.endswith("/") else tmp_path / dst
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / src, dest)
    assert {p.name for p in tmp_path.iterdir()} == set(allowed)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "cli.main", "version"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    assert p.returncode == 0 and p.stdout.startswith("peerd "), p.stderr
