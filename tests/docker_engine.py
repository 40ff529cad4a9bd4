"""A private Docker Engine for the tests: its own dockerd, a base image made with debootstrap, the
image `peerd:local` built from docker/Dockerfile, and Compose v2 as the `docker compose` plugin.

Nothing here touches the host's own Docker: dockerd runs on a private socket, exec root, pidfile,
config file and key file, all under one temporary directory, and a private data root kept in the
test cache (`Engine`), with no default bridge, no iptables rules and no change to the host's IP
forwarding; its containers reach each other on the compose project's own bridge network and nothing
else. `Engine.stop()` (also after a failure) removes its containers, networks and volumes, stops
dockerd by its pid, kills what is left of its own processes by pid, unmounts and deletes that
directory, and removes the cgroups and bridge devices it made.

No image registry is reachable here. The base image is a Debian 12 (bookworm, Python 3.11) root
file system made with debootstrap from the apt mirror the host uses, kept as a tarball in a cache
directory outside the clone (`cache_dir()`), so later runs only `docker import` it. The image's
Python packages are fetched by the host's own pip, with the host's whole configuration (its
find-links, extra indexes, certificates), into a wheel directory kept in the same cache; the build
(`--network host`) takes them from a simple index served from that directory on 127.0.0.1 for the
length of the build, and from nowhere else. torch is pinned to the exact build installed here (the
CPU one, from the local wheels), so the build can never fetch a CUDA build instead.

Bounds on every step are the module constants below; a step that overruns fails with its log.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.server
import ipaddress
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.parse
from pathlib import Path

from tests.docker_files import ROOT, compose_binary

IMAGE = "peerd:local"
SUITE = "bookworm"                       # Debian 12: Python 3.11
BASE_PACKAGES = ("python3", "python3-venv", "iproute2", "ca-certificates")
APT_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap"}
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

APT_TIMEOUT = 900.0         # apt-get update / install of docker.io and debootstrap
DEBOOTSTRAP_TIMEOUT = 1200.0
TAR_TIMEOUT = 300.0
PIP_TIMEOUT = 900.0          # the host's pip fetching the image's wheels
ENGINE_START = 60.0         # dockerd answering on its socket
ENGINE_STOP = 30.0          # dockerd exiting after SIGTERM (it stops its containers first)
DOCKER_TIMEOUT = 180.0      # one docker CLI call (import, inspect, exec, rm, ...)
BUILD_TIMEOUT = 1200.0      # docker build of peerd:local
COMPOSE_TIMEOUT = 300.0     # one docker compose call (up creates every container: vfs copies)


def unavailable() -> str | None:
    """None when this machine can run a private dockerd, else the reason to skip."""
    if sys.platform != "linux":
        return f"a private dockerd needs Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "needs root to run a private dockerd (CI runs as root)"
    return None


def which(tool: str) -> str | None:
    return shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), SBIN_PATH]))


def ensure_tools() -> dict[str, str]:
    """dockerd, docker and debootstrap, installed from Debian's packages when missing."""
    missing = sorted({pkg for tool, pkg in APT_PACKAGES.items() if which(tool) is None})
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": SBIN_PATH}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
        p = subprocess.run(install, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
        if p.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
            p = subprocess.run(install, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
        if p.returncode != 0:
            raise RuntimeError(f"`{' '.join(install)}` failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    tools = {t: which(t) for t in ("dockerd", "docker", "debootstrap")}
    absent = [t for t, path in tools.items() if path is None]
    if absent:
        raise RuntimeError(f"{', '.join(absent)} not found after installing {', '.join(APT_PACKAGES.values())}")
    return tools


def address_pool() -> str:
    """A /22 in 172.16.0.0/12 that no route of this host covers or overlaps, for the engine's
    networks (4 of /24): two engines on one machine, or a lab, never get the same subnet (dockerd
    would take 172.17.0.0/16 for its first network whatever the host already has)."""
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                         timeout=DOCKER_TIMEOUT).stdout
    routes = []
    for line in out.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "prohibit", "blackhole"):
            dest = line.split()[1] if dest != "default" and len(line.split()) > 1 else ""
        with contextlib.suppress(ValueError):
            if dest:
                routes.append(ipaddress.ip_network(dest, strict=False))
    rng = random.Random()
    for _ in range(1000):
        pool = ipaddress.ip_network(f"172.{rng.randrange(16, 32)}.{rng.randrange(0, 256, 4)}.0/22")
        if not any(pool.overlaps(r) for r in routes):
            return str(pool)
    raise RuntimeError("no free /22 in 172.16.0.0/12 for the engine's networks")


def storage_driver() -> str:
    """vfs (works on any file system, copies every layer in full), or $PEERD_TEST_DOCKER_STORAGE
    (e.g. overlay2, much faster where the kernel and the file system of /tmp support it)."""
    return os.environ.get("PEERD_TEST_DOCKER_STORAGE") or "vfs"


# --- the cache and the base image ---------------------------------------------------------------

def cache_dir() -> Path:
    """Where the base image tarball is kept between runs: $PEERD_TEST_CACHE, else
    $XDG_CACHE_HOME/peerd-test, else /var/cache/peerd-test. Never inside the clone."""
    if os.environ.get("PEERD_TEST_CACHE"):
        d = Path(os.environ["PEERD_TEST_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        d = Path(os.environ["XDG_CACHE_HOME"]) / "peerd-test"
    else:
        d = Path("/var/cache/peerd-test")
    d = d.resolve()
    if d == ROOT or ROOT in d.parents:
        raise RuntimeError(f"the test cache {d} must lie outside the clone {ROOT}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def apt_mirror() -> str:
    """The Debian mirror the host's apt uses for `SUITE` (deb822 or one-line sources)."""
    if os.environ.get("PEERD_TEST_DEBIAN_MIRROR"):
        return os.environ["PEERD_TEST_DEBIAN_MIRROR"]
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        if f.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([\w-]+):\s*(.*)$", stanza, re.M))
                if SUITE in fields.get("Suites", "").split() and "main" in fields.get("Components", "").split() \
                        and "deb" in fields.get("Types", "").split():
                    return fields["URIs"].split()[0]
        else:
            for line in text.splitlines():
                m = re.match(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line)
                if m and m.group(2) == SUITE and "main" in m.group(3).split():
                    return m.group(1)
    return "http://deb.debian.org/debian"


def base_recipe() -> list[str]:
    """debootstrap's arguments, less the target directory and the mirror (docs/docker.md shows it)."""
    return ["--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE]


def base_tarball(log) -> tuple[Path, bool]:
    """(the cached base tarball, whether it was made now). Made once per recipe, under a lock so
    that two runs never make it at the same time."""
    cache = cache_dir()
    key = hashlib.sha256(json.dumps(base_recipe()).encode()).hexdigest()[:12]
    tarball = cache / f"debian-{SUITE}-base-{key}.tar.gz"
    with open(cache / "base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tarball.exists():
            return tarball, False
        work = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=cache))
        try:
            rootfs = work / "rootfs"
            mirror = apt_mirror()
            cmd = [which("debootstrap") or "debootstrap", *base_recipe(), str(rootfs), mirror]
            log(f"base image: {' '.join(cmd)}")
            run_logged(cmd, work / "debootstrap.log", DEBOOTSTRAP_TIMEOUT, env={"PATH": SBIN_PATH})
            # What an image needs not carry: downloaded packages, package lists, the host's resolver.
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for p in (rootfs / junk).glob("*"):
                    if p.is_file():
                        p.unlink()
            for p in (rootfs / "var/cache/apt").glob("*.bin"):
                p.unlink()
            (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
            part = tarball.with_suffix(".part")
            run_logged(["tar", "--numeric-owner", "-czf", str(part), "-C", str(rootfs), "."],
                       work / "tar.log", TAR_TIMEOUT)
            part.rename(tarball)
            return tarball, True
        finally:
            remove_tree(work)


# --- processes, mounts, files ---------------------------------------------------------------------

def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None,
               cwd: Path | None = None) -> None:
    """Run cmd with its output in log_path; on failure or timeout raise with the log's tail."""
    with open(log_path, "ab") as out:
        try:
            p = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               timeout=timeout, env=env, cwd=cwd)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exited {rc}"
        raise RuntimeError(f"`{' '.join(cmd[:6])} ...` {why}; end of {log_path}:\n{tail}")


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below path, deepest first."""
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def remove_tree(path: Path) -> None:
    """Unmount whatever is mounted below path (debootstrap's /proc, dockerd's data root), then
    delete it without ever crossing into another file system."""
    if not path.exists():
        return
    for point in mounts_under(path):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=DOCKER_TIMEOUT)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True, timeout=DOCKER_TIMEOUT)


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (a path unique to one engine)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


# --- the packages the build installs -------------------------------------------------------------

def image_requirements() -> list[str]:
    """What `pip install` in docker/Dockerfile needs: torch pinned to the build installed here (the
    CPU one, from the local wheels), peerd's dependencies and its build backend (pyproject.toml)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [torch_requirement(), *meta["project"]["dependencies"], *meta["build-system"]["requires"]]


def torch_requirement() -> str:
    return f"torch=={importlib.metadata.version('torch')}"


def wheelhouse(log) -> tuple[Path, bool]:
    """(a directory of wheels for image_requirements(), whether it was filled now).

    The host's own pip fetches them, with the host's whole configuration (`pip config list`:
    find-links, extra indexes, certificates, constraints), so the image gets its packages from
    exactly where the host does; the build then needs nothing but this directory. Kept in the
    cache per requirement set, so a rebuild downloads nothing."""
    reqs = image_requirements()
    cache = cache_dir()
    key = hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:12]
    final = cache / f"wheels-{key}"
    with open(cache / "wheels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():
            return final, False
        work = Path(tempfile.mkdtemp(prefix="wheels-", dir=cache))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--dest", str(work / "w"),
                   "--progress-bar", "off", *reqs]
            log("wheels: pip " + " ".join(cmd[3:]))
            run_logged(cmd, work / "pip.log", PIP_TIMEOUT)
            for old in cache.glob("wheels-*"):      # an older requirement set's wheels
                if old.is_dir() and old != work:
                    remove_tree(old)
            (work / "w").rename(final)
            return final, True
        finally:
            remove_tree(work)


def _project(filename: str) -> str:
    """PEP 503 name of a wheel's project (the part before the first '-')."""
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


class _IndexHandler(http.server.BaseHTTPRequestHandler):
    wheels: Path = Path("/nonexistent")

    def do_GET(self) -> None:
        parts = [p for p in urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).split("/") if p]
        files = {f.name: f for f in self.wheels.glob("*.whl")}
        if len(parts) == 2 and parts[0] == "simple":
            names = sorted(n for n in files if _project(n) == re.sub(r"[-_.]+", "-", parts[1]).lower())
            if names:
                links = "".join(f'<a href="../../files/{urllib.parse.quote(n)}">{n}</a><br>\n' for n in names)
                return self._send(200, "text/html", f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode())
        elif len(parts) == 2 and parts[0] == "files" and parts[1] in files:
            with open(files[parts[1]], "rb") as f:
                return self._send(200, "application/octet-stream", f)
        self._send(404, "text/plain", b"not here\n")

    def _send(self, code: int, ctype: str, body) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        size = len(body) if isinstance(body, bytes) else os.fstat(body.fileno()).st_size
        self.send_header("Content-Length", str(size))
        self.end_headers()
        if isinstance(body, bytes):
            self.wfile.write(body)
        else:
            shutil.copyfileobj(body, self.wfile)

    def log_message(self, *args) -> None:
        pass


class PackageIndex:
    """A directory of wheels as a PEP 503 simple index on 127.0.0.1 (read-only, one build long).
    Its port is derived from the wheel directory's name where that port is free: the index URL is
    a build argument, and the same URL is what lets the next build reuse the engine's cached
    layers (any other port only costs that reuse)."""

    def __init__(self, wheels: Path) -> None:
        handler = type("Handler", (_IndexHandler,), {"wheels": wheels})
        stable = 20000 + int(hashlib.sha256(wheels.name.encode()).hexdigest(), 16) % 10000
        try:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", stable), handler)
        except OSError:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}/simple/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- the engine ---------------------------------------------------------------------------------

class Engine:
    """One private dockerd; `docker(...)` and `compose(...)` talk to it alone.

    Its data root is kept in the cache (`cache_dir()/dockerd`) between runs, so that a build
    reuses the layers below the project's code (the base image, torch, the dependencies: a build
    after a code change took 85 s instead of 160-230 s on 2 cores), unless another engine holds it (then a temporary one, as with
    PEERD_TEST_FRESH_ENGINE=1). The containers, networks and volumes of a run are removed at its
    start and its end; the images only when they are no longer tagged."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="peerd-dockerd-", dir="/tmp"))
        self.data_root = self.root / "data"
        self._kept_lock = None
        if os.environ.get("PEERD_TEST_FRESH_ENGINE", "") in ("", "0"):
            lock = open(cache_dir() / "dockerd.lock", "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._kept_lock, self.data_root = lock, cache_dir() / "dockerd"
            except OSError:
                lock.close()
        self.exec_root = self.root / "exec"
        self.socket = self.root / "docker.sock"
        self.pidfile = self.root / "docker.pid"
        self.log_path = self.root / "dockerd.log"
        self.config_dir = self.root / "client"      # DOCKER_CONFIG: Compose v2 as a CLI plugin
        self.cgroup_parent = f"peerd-test-{self.root.name.rsplit('-', 1)[-1]}"
        self.proc: subprocess.Popen | None = None
        self.tools: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.bridges: set[str] = set()
        self.base = ""                              # the imported base image's tag (import_base)

    @property
    def kept(self) -> bool:
        """Its data root outlives it (the cache's)."""
        return self._kept_lock is not None

    # -- life cycle
    def start(self) -> "Engine":
        try:
            return self._start()
        except RuntimeError:
            if not self.kept:
                raise
            self._stop_dockerd()
            remove_tree(self.data_root)          # a kept data root it cannot use: start afresh, once
            return self._start()

    def _start(self) -> "Engine":
        self.tools = ensure_tools()
        if self.kept:
            # a dockerd of an earlier run that was killed outright (its lock went with it) may
            # still run on this data root: only ours name it
            for pid in pids_mentioning(str(self.data_root)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        (self.config_dir / "cli-plugins").mkdir(parents=True)
        (self.config_dir / "cli-plugins" / "docker-compose").symlink_to(compose_binary())
        # The key file would go to /etc/docker/key.json (Docker 20.10) unless the config file moves it.
        (self.root / "daemon.json").write_text(json.dumps({"deprecated-key-path": str(self.root / "key.json")}))
        argv = [self.tools["dockerd"],
                "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
                "--bridge=none", "--userland-proxy=false", f"--storage-driver={storage_driver()}",
                "--data-root", str(self.data_root), "--exec-root", str(self.exec_root),
                "-H", f"unix://{self.socket}", "--pidfile", str(self.pidfile),
                "--config-file", str(self.root / "daemon.json"),
                "--default-address-pool", f"base={address_pool()},size=24",
                "--cgroup-parent", self.cgroup_parent]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={"PATH": SBIN_PATH}, start_new_session=True)
        log.close()
        deadline = time.monotonic() + ENGINE_START
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists() and self.docker("version", check=False, timeout=10).returncode == 0:
                if self.kept:
                    self.tidy()                  # what an earlier run left (it was killed)
                return self
            time.sleep(0.3)
        raise RuntimeError(f"dockerd did not answer within {ENGINE_START:.0f} s:\n{self.log_tail()}")

    def tidy(self) -> None:
        """Remove every container, network and volume, and the images no tag names (an earlier
        build's, once a newer one took its tag); keep the tagged images and their layers."""
        ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, check=False)
        for what in ("network", "volume", "image"):
            self.docker(what, "prune", "-f", check=False)

    def stop(self) -> None:
        """Stop dockerd by its pid and remove everything it made (a kept data root: all but the
        tagged images); safe to call more than once."""
        if self.kept and self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.tidy()
        self._stop_dockerd()
        remove_tree(self.root)
        for point in mounts_under(self.data_root):   # a kept data root: what a killed dockerd left mounted
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=DOCKER_TIMEOUT)
        if self._kept_lock is not None:
            self._kept_lock.close()
            self._kept_lock = None

    def _stop_dockerd(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                for net in self.docker("network", "ls", "-q", "--no-trunc", check=False, timeout=10).stdout.split():
                    self.bridges.add(f"br-{net[:12]}")
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=ENGINE_STOP)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=ENGINE_STOP)
        # what dockerd left running, if it had to be killed: its containerd and the shims, which all
        # name this engine's exec root on their command line
        for pid in pids_mentioning(str(self.exec_root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for procs in Path("/sys/fs/cgroup").glob(f"*/{self.cgroup_parent}/**/cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):     # container processes left behind
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        for bridge in sorted(self.bridges):
            if Path("/sys/class/net", bridge).exists():
                subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=DOCKER_TIMEOUT)
        for ctl in Path("/sys/fs/cgroup").glob(f"*/{self.cgroup_parent}"):
            for sub in sorted(ctl.rglob("*"), key=lambda p: len(str(p)), reverse=True):
                if sub.is_dir():
                    with contextlib.suppress(OSError):
                        sub.rmdir()
            with contextlib.suppress(OSError):
                ctl.rmdir()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no dockerd log)"

    # -- clients
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"PATH": SBIN_PATH, "HOME": os.environ.get("HOME", "/root"),
                "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_CONFIG": str(self.config_dir),
                "DOCKER_BUILDKIT": "0", **(extra or {})}

    def docker(self, *args: str, check: bool = True, timeout: float = DOCKER_TIMEOUT,
               input: str | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run([self.tools.get("docker", "docker"), *args], env=self.env(), capture_output=True,
                           text=True, timeout=timeout, input=input)
        if check and p.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
        return p

    def inspect(self, *names: str) -> list[dict]:
        return json.loads(self.docker("inspect", *names).stdout)

    # -- images
    def import_base(self, log) -> str:
        t0 = time.monotonic()
        tarball, made = base_tarball(log)
        self.timings["base_debootstrap_s" if made else "base_cached_s"] = time.monotonic() - t0
        tag = f"peerd-test-base:{tarball.name.split('.')[0].rsplit('-', 1)[-1]}"
        t0 = time.monotonic()
        if self.docker("image", "inspect", tag, check=False).returncode == 0:
            self.timings["base_kept_s"] = time.monotonic() - t0     # imported by an earlier run
            self.base = tag
            return tag
        try:
            self.docker("import", "--change", "ENV LANG=C.UTF-8", str(tarball), tag)
        except RuntimeError:
            if made:
                raise
            tarball.unlink(missing_ok=True)      # a damaged cache: make it again, once
            return self.import_base(log)
        self.timings["base_import_s"] = time.monotonic() - t0
        self.base = tag
        return tag

    def build_image(self, base: str, log) -> None:
        """docker build -f docker/Dockerfile -t peerd:local ., from `base`, with pip's index a
        local one (the host's wheels for the image, `wheelhouse()`); `--network host` so that the
        build reaches it on 127.0.0.1. Nothing else is reachable from, or needed by, the build."""
        t0 = time.monotonic()
        wheels, fetched = wheelhouse(log)
        self.timings["wheels_fetched_s" if fetched else "wheels_cached_s"] = time.monotonic() - t0
        index = PackageIndex(wheels)
        try:
            args = {"BASE_IMAGE": base, "TORCH": torch_requirement(), "PIP_INDEX_URL": index.url}
            cmd = [self.tools["docker"], "build", "--network", "host", "-f", "docker/Dockerfile", "-t", IMAGE]
            for k, v in args.items():
                cmd += ["--build-arg", f"{k}={v}"]
            cmd.append(".")
            log("build: " + " ".join(cmd[1:]))
            t0 = time.monotonic()
            run_logged(cmd, self.root / "build.log", BUILD_TIMEOUT, env=self.env(), cwd=ROOT)
            self.timings["build_s"] = time.monotonic() - t0
        finally:
            index.close()

    # -- compose
    def compose(self, project: str, files: list[str], *args: str, env: dict[str, str] | None = None,
                check: bool = True, timeout: float = COMPOSE_TIMEOUT) -> subprocess.CompletedProcess:
        argv = [self.tools["docker"], "compose", "-p", project]
        for f in files:
            argv += ["-f", str(f)]
        p = subprocess.run([*argv, *args], cwd=ROOT, env=self.env(env), capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} exited {p.returncode}:\n"
                               f"{p.stdout[-2000:]}{p.stderr[-3000:]}")
        return p
