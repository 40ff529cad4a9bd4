"""`peerd container start`, the image's entrypoint, run for real outside Docker.

A container's network namespace is stood in for by a namespace of our own: two namespaces joined by
one veth (`eth0` in each), and the entrypoint run in one of them as root, as Docker would start it
with `user: root`. What is checked is what a container would see: the tc classes the lab's shaping
code gives, the rate a TCP stream gets through them, the daemon running as an unprivileged user
with no capabilities left, and the warning (or the refusal, with PEERD_SHAPE_STRICT) when root or
CAP_NET_ADMIN is missing (taken away with setpriv, as Docker does without `cap_add`).

Traffic goes only between the two namespaces; every namespace is deleted at the end, which takes
the veth and the qdiscs with it.
"""
from __future__ import annotations

import os
import grp
import pwd
import re
import secrets
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from peerd import config as config_mod
from peerd import container as container_mod
from peerd.lab import shaping
from peerd.lab.profile import ProfileError
from tests.netns_lab import lab_available

ROOT = Path(__file__).resolve().parent.parent
STEP = 120.0         # bound on one entrypoint run (two Python starts with torch) or tc/ip command
DAEMON_READY = 60.0  # bound on a daemon creating its control socket

# --- without root: parsing, resolution, users --------------------------------------------------


def cfg(**env: str) -> config_mod.Config:
    return config_mod.load(env={f"PEERD_{k.upper()}": v for k, v in env.items()})


def test_link_profile_from_the_environment():
    p = container_mod.link_profile(cfg(shape_rate="50mbit", shape_to="peer1=10mbit, 10.9.0.0/16=1gbit",
                                       shape_delay="20ms", shape_dev="eth1"))
    assert p == container_mod.LinkProfile("eth1", 50 * 10**6, (("peer1", 10**7), ("10.9.0.0/16", 10**9)), 0.02)
    assert container_mod.link_profile(cfg()).empty


@pytest.mark.parametrize("env, var", [({"shape_rate": "50mbt"}, "PEERD_SHAPE_RATE"),
                                      ({"shape_to": "peer1:10mbit"}, "PEERD_SHAPE_TO"),
                                      ({"shape_to": "peer1=10mbit,peer1=20mbit"}, "PEERD_SHAPE_TO"),
                                      ({"shape_to": "peer1=fast"}, "PEERD_SHAPE_TO (peer1)"),
                                      ({"shape_delay": "20"}, "PEERD_SHAPE_DELAY"),
                                      ({"shape_dev": "a-very-long-interface"}, "PEERD_SHAPE_DEV")])
def test_a_bad_profile_names_its_variable(env, var):
    with pytest.raises(ProfileError, match=re.escape(var)):
        container_mod.link_profile(cfg(**env))


@pytest.mark.parametrize("raw, ok", [("", 1.0), ("4", 4.0), ("1", 1.0), ("0.5", None), ("slow", None), ("nan", None)])
def test_straggler_factor(raw, ok):
    if ok is None:
        with pytest.raises(ProfileError, match="PEERD_SLOWDOWN"):
            container_mod.slowdown({"PEERD_SLOWDOWN": raw})
    else:
        assert container_mod.slowdown({"PEERD_SLOWDOWN": raw}) == ok


def test_destinations_resolve_to_addresses_or_prefixes():
    far = time.monotonic() + 5
    assert container_mod.resolve("10.1.2.3", far) == ("10.1.2.3",)
    assert container_mod.resolve("10.1.2.3/16", far) == ("10.1.0.0/16",)
    assert container_mod.resolve("localhost", far) == ("127.0.0.1",)
    with pytest.raises(container_mod.ShapeError, match="no IPv4 prefix"):
        container_mod.resolve("10.1.0.0/33", far)
    started = time.monotonic()
    with pytest.raises(container_mod.ShapeError, match="did not resolve"):
        container_mod.resolve("no-such-peer.invalid", time.monotonic() + 1)
    assert time.monotonic() - started < STEP  # bounded, never a hang


def test_delay_makes_every_leaf_a_netem_queue():
    q = dict(queue_ms=20.0, queue_min_bytes=131072, control_share=0.05)
    lines = shaping.htb_commands("eth0", 10**8, [shaping.DstClass(10**7, ("10.9.0.0/16",))], **q, delay_s=0.02)
    leaves = [ln for ln in lines if ln.startswith("qdisc add") and "parent 1:" in ln]
    assert len(leaves) == 3 and all("netem delay 20ms limit " in ln for ln in leaves)
    # room for 40 ms (delay + queue) at 100 Mbit: 500 kB, 331 frames -> netem's floor of 1000
    assert all(int(ln.rsplit(" ", 1)[1]) >= 1000 for ln in leaves)
    assert any("match ip dst 10.9.0.0/16 flowid 1:100" in ln for ln in lines)
    assert shaping.htb_commands("eth0", None, [], **q, delay_s=0.02)[0].startswith("qdisc add dev eth0 root")
    assert not any("netem" in ln for ln in shaping.htb_commands("eth0", 10**8, [], **q))


def test_dry_run_prints_the_lab_tc_commands():
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "PEERD_SHAPE_RATE": "100mbit",
           "PEERD_SHAPE_TO": "10.9.0.0/16=1gbit,localhost=5mbit", "PEERD_LAB_QUEUE_MS": "50"}
    p = subprocess.run([sys.executable, "-m", "cli.main", "container", "start", "--dry-run"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=STEP)
    assert p.returncode == 0, p.stderr
    want = shaping.htb_commands("eth0", 10**8, [shaping.DstClass(10**9, ("10.9.0.0/16",)),
                                                shaping.DstClass(5 * 10**6, ("127.0.0.1",))],
                                **shaping.settings(config_mod.Config(lab_queue_ms=50.0)))
    assert p.stdout.splitlines() == want


def test_users_root_is_refused():
    for spec in ("0", "0:0", "root", "1000:0"):
        with pytest.raises(container_mod.ShapeError, match="root"):
            container_mod.user_ids(spec)
    with pytest.raises(container_mod.ShapeError, match="no user"):
        container_mod.user_ids("no-such-user-x")
    assert container_mod.user_ids("61001:61002")[:2] == (61001, 61002)


# --- as root, in a pair of namespaces -------------------------------------------------------------



def lab(test):
    """Root and namespaces; slow: each entrypoint run starts Python twice (the entry, then peerd),
    seconds on a busy host."""
    return pytest.mark.lab(pytest.mark.slow(test))


class Pair:
    """Namespaces a and b, joined by a veth named eth0 on both sides, 10.N.M.1 and .2."""

    def __init__(self) -> None:
        tag = secrets.token_hex(2)
        self.ns = {"a": f"pdc{tag}a", "b": f"pdc{tag}b"}
        net = f"10.{secrets.randbelow(100) + 100}.{secrets.randbelow(256)}"
        self.ip = {"a": f"{net}.1", "b": f"{net}.2"}
        self.made: list[str] = []
        try:
            for side in "ab":
                sh("ip", "netns", "add", self.ns[side])
                self.made.append(self.ns[side])
            sh("ip", "-n", self.ns["a"], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
               "netns", self.ns["b"])
            for side in "ab":
                for cmd in (["link", "set", "lo", "up"], ["addr", "add", f"{self.ip[side]}/24", "dev", "eth0"],
                            ["link", "set", "eth0", "up"]):
                    sh("ip", "-n", self.ns[side], *cmd)
        except BaseException:
            self.close()
            raise

    def tc(self, side: str, *args: str, check: bool = True) -> str:
        return sh("tc", "-n", self.ns[side], *args, check=check)

    def unshape(self) -> None:
        for side in "ab":
            self.tc(side, "qdisc", "del", "dev", "eth0", "root", check=False)

    def close(self) -> None:
        for ns in self.made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=STEP).stdout
            for pid in map(int, out.split()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=STEP)
        self.made.clear()


def sh(*argv: str, check: bool = True) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=STEP)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {p.stderr.strip()}")
    return p.stdout


@pytest.fixture(scope="module")
def pair():
    why = lab_available()
    if why:
        pytest.skip(why)
    p = Pair()
    yield p
    p.close()


@pytest.fixture
def shaped(pair):
    pair.unshape()
    yield pair
    pair.unshape()


@pytest.fixture(scope="module")
def nobody():
    """A throwaway uid/gid that no user of this machine has."""
    taken = {u.pw_uid for u in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    uid = next(u for u in (61000 + secrets.randbelow(4000) for _ in range(100)) if u not in taken)
    return uid, uid


def _others_can_run(exe: str) -> bool:
    """Whether a user who is neither owner nor group member may execute `exe` (every directory on
    the way searchable, the file executable), judged by mode bits."""
    path = Path(os.path.realpath(exe))
    return all(d.stat().st_mode & 0o001 for d in path.parents) and bool(path.stat().st_mode & 0o001)


@pytest.fixture(scope="module")
def python():
    """(interpreter, PYTHONPATH) the entrypoint runs with: one an unprivileged user can run.

    The entrypoint execs peerd with its own interpreter after dropping root, so that interpreter
    must be runnable by the user (in the image: /opt/venv/bin/python3). Where the test venv's
    interpreter lives under a root-only directory (/root/.pyenv here), the system interpreter of the
    same version is used instead, with the venv's site-packages on PYTHONPATH."""
    if _others_can_run(sys.executable):
        return sys.executable, str(ROOT)
    same = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/local/bin:/usr/bin")
    if not same or not _others_can_run(same):
        pytest.skip(f"{sys.executable} is not runnable by an unprivileged user, and no system Python "
                    f"{sys.version_info.major}.{sys.version_info.minor} is")
    site_dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    return same, os.pathsep.join([str(ROOT), *site_dirs])


def entry_env(python, **env: str) -> dict[str, str]:
    """The environment of a container: only PATH and what the service sets (PEERD_*)."""
    return {"PATH": os.environ["PATH"], "PYTHONPATH": python[1],
            **{f"PEERD_{k.upper()}": v for k, v in env.items()}}


def entry(pair: Pair, python, args: list[str], env: dict[str, str], wrap: list[str] = (), **kw) -> subprocess.Popen:
    """`peerd container start -- ARGS` in namespace a, as root (or as `wrap` (setpriv) makes it),
    with the interpreter the `python` fixture chose."""
    argv = ["ip", "netns", "exec", pair.ns["a"], *wrap, python[0], "-m", "cli.main",
            "container", "start", "--", *args]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def run_entry(pair: Pair, python, args: list[str], env: dict[str, str],
              wrap: list[str] = ()) -> subprocess.CompletedProcess:
    p = entry(pair, python, args, env, wrap)
    try:
        out, err = p.communicate(timeout=STEP)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=STEP)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def classes(pair: Pair, side: str = "a") -> dict[str, str]:
    """classid -> its `tc class show` line."""
    out = pair.tc(side, "class", "show", "dev", "eth0")
    return {m.group(1): ln for ln in out.splitlines() if (m := re.match(r"class htb (1:\w+) ", ln))}


def rate(line: str) -> str:
    return re.search(r" rate (\S+)", line).group(1)


TRANSFER_BYTES = 4 << 20

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); s.settimeout(float(sys.argv[2]))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[2]))
n, first = 0, None
while (b := c.recv(1 << 16)):
    first = first or time.monotonic()
    n += len(b)
print(n, time.monotonic() - first, flush=True)
"""

SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5201), timeout=float(sys.argv[3]))
c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def transfer(pair: Pair, nbytes: int) -> float:
    """Goodput a -> b of one TCP stream, bit/s, timed at the receiver from its first byte."""
    rx = subprocess.Popen(["ip", "netns", "exec", pair.ns["b"], sys.executable, "-c", RECEIVER, pair.ip["b"],
                           str(STEP)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready", rx.stderr.read()
        tx = subprocess.run(["ip", "netns", "exec", pair.ns["a"], sys.executable, "-c", SENDER, pair.ip["b"],
                             str(nbytes), str(STEP)], capture_output=True, text=True, timeout=STEP)
        assert tx.returncode == 0, tx.stderr
        out, err = rx.communicate(timeout=STEP)
        n, secs = out.split()
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(timeout=STEP)
    assert int(n) == nbytes, err
    return int(n) * 8 / float(secs)


@lab
def test_profile_is_applied_with_the_lab_layout_and_holds_a_stream_to_its_rate(shaped, nobody, python):
    b = shaped.ip["b"]
    p = run_entry(shaped, python, ["version"], entry_env(python, shape_rate="200mbit", shape_to=f"{b}=20mbit",
                                                         container_user=f"{nobody[0]}:{nobody[1]}"))
    assert p.returncode == 0 and p.stdout.startswith("peerd "), p.stderr
    assert f"link profile applied: eth0: rate 200mbit, to {b} 20mbit" in p.stderr
    got = classes(shaped)
    want = [ln.split("classid ")[1].split()[0] for ln in shaping.htb_commands(
        "eth0", 2 * 10**8, shaping.per_destination({b: 2 * 10**7}), **shaping.settings(config_mod.Config()))
        if ln.startswith("class add")]
    assert sorted(got) == sorted(want) == ["1:1", "1:100", "1:2", "1:3"]
    assert rate(got["1:1"]) == "200Mbit" and got["1:100"].split(" ceil ")[1].startswith("20Mbit")
    hexdst = "".join(f"{int(x):02x}" for x in b.split("."))
    assert f"match {hexdst}/ffffffff at 16" in shaped.tc("a", "filter", "show", "dev", "eth0")
    # One TCP stream a -> b gets the destination's rate: about 95.6 % of it is TCP payload.
    want = 20e6 * shaping.GOODPUT_RATIO
    goodput = transfer(shaped, TRANSFER_BYTES)
    if not 0.85 < goodput / want < 1.08:      # one transfer in many loses time to a loaded CPU: a
        again = transfer(shaped, TRANSFER_BYTES)   # second reading decides (a wrong shaper is off twice)
        goodput = min((goodput, again), key=lambda g: abs(g / want - 1))
    ratio = goodput / want
    print(f"goodput a->b through a 20mbit class: {goodput / 1e6:.2f} Mbit/s, {ratio:.3f} of the expected")
    assert 0.85 < ratio < 1.08, f"{goodput / 1e6:.1f} Mbit/s through a 20mbit class (ratio {ratio:.2f})"
    # A second start (a restarted container) replaces the old root qdisc instead of failing.
    again = run_entry(shaped, python, ["version"],
                      entry_env(python, shape_rate="30mbit", container_user=f"{nobody[0]}"))
    assert again.returncode == 0, again.stderr
    assert rate(classes(shaped)["1:1"]) == "30Mbit" and "1:100" not in classes(shaped)


@lab
def test_peerd_runs_unprivileged_after_shaping(shaped, nobody, python):
    """The daemon the entrypoint execs keeps its pid, and runs as the target uid/gid with no
    supplementary groups and no capabilities; root could shape before that."""
    uid, gid = nobody
    home = Path(tempfile.mkdtemp(prefix="peerd-cs-"))  # not under pytest's root-only tmp dir
    try:
        os.chown(home, uid, gid)
        secret = home / "secret"
        secret.write_text(secrets.token_hex(32) + "\n")
        secret.chmod(0o600)
        os.chown(secret, uid, gid)
        data = home / "data"
        args = ["up", "--listen", f"{shaped.ip['a']}:7070", "--data-dir", str(data), "--run-id", "cs",
                "--secret-file", str(secret), "--no-mdns"]
        env = entry_env(python, shape_rate="50mbit", shape_strict="1", container_user=f"{uid}:{gid}")
        proc = entry(shaped, python, args, env)
        try:
            deadline = time.monotonic() + DAEMON_READY
            while not (data / "peerd.sock").exists():
                assert proc.poll() is None, f"exited {proc.returncode}: {proc.communicate(timeout=STEP)[1]}"
                assert time.monotonic() < deadline, f"no daemon socket within {DAEMON_READY} s"
                time.sleep(0.1)
            status = dict(ln.split(":", 1) for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            assert b"cli.main" in cmdline and b"up" in cmdline and b"container" not in cmdline
            assert status["Uid"].split() == [str(uid)] * 4
            assert status["Gid"].split() == [str(gid)] * 4
            assert status["Groups"].split() == []
            for cap in ("CapEff", "CapPrm", "CapAmb", "CapInh"):
                assert int(status[cap], 16) == 0, f"{cap} {status[cap].strip()}"
            assert data.stat().st_uid == uid  # the daemon made its data dir as the user
            assert rate(classes(shaped)["1:1"]) == "50Mbit"
            st = subprocess.run([python[0], "-m", "cli.main", "status", "--data-dir", str(data), "--timeout", "10"],
                                cwd=ROOT, env=entry_env(python), capture_output=True, text=True, timeout=STEP)
            assert st.returncode == 0, st.stderr
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=STEP)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=STEP)
    finally:
        shutil.rmtree(home, ignore_errors=True)


NO_NET_ADMIN = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]


@lab
def test_without_net_admin_peerd_starts_unshaped_and_says_why(shaped, nobody, python):
    env = entry_env(python, shape_rate="50mbit", container_user=str(nobody[0]))
    p = run_entry(shaped, python, ["version"], env, wrap=NO_NET_ADMIN)
    assert p.returncode == 0 and p.stdout.startswith("peerd "), p.stderr
    assert "shaping is OFF" in p.stderr and "CAP_NET_ADMIN" in p.stderr and "cap_add: [NET_ADMIN]" in p.stderr
    assert "htb" not in shaped.tc("a", "qdisc", "show", "dev", "eth0")


@lab
def test_without_net_admin_strict_does_not_start_peerd(shaped, nobody, python):
    env = entry_env(python, shape_rate="50mbit", shape_strict="true", container_user=str(nobody[0]))
    p = run_entry(shaped, python, ["version"], env, wrap=NO_NET_ADMIN)
    assert p.returncode != 0 and not p.stdout, p.stdout
    assert "CAP_NET_ADMIN" in p.stderr and "peerd is not started" in p.stderr


@lab
def test_not_root_runs_peerd_as_is_and_says_shaping_is_off(shaped, nobody, python):
    uid, gid = nobody
    wrap = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    # `docker run IMAGE peerd version` hands the entrypoint a leading `peerd`: it is dropped.
    p = run_entry(shaped, python, ["peerd", "version"], entry_env(python, shape_rate="50mbit"), wrap=wrap)
    assert p.returncode == 0 and p.stdout.startswith("peerd "), p.stderr
    assert "shaping is OFF" in p.stderr and "not root" in p.stderr


@lab
def test_a_destination_that_never_resolves_leaves_the_link_unshaped(shaped, nobody, python):
    env = entry_env(python, shape_rate="50mbit", shape_to="no-such-peer.invalid=10mbit", shape_resolve_timeout="1",
                    container_user=str(nobody[0]))
    p = run_entry(shaped, python, ["version"], env)
    assert p.returncode == 0 and "shaping is OFF" in p.stderr and "did not resolve" in p.stderr, p.stderr
    assert "htb" not in shaped.tc("a", "qdisc", "show", "dev", "eth0")  # all or nothing


@lab
def test_delay_is_applied_where_netem_exists_and_said_missing_where_not(shaped, nobody, python):
    # Does this kernel have netem? Asked on b's side, independently of the code under test.
    probe = subprocess.run(["tc", "-n", shaped.ns["b"], "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True, timeout=STEP)
    netem = probe.returncode == 0
    shaped.unshape()
    env = entry_env(python, shape_rate="50mbit", shape_delay="20ms", container_user=str(nobody[0]))
    p = run_entry(shaped, python, ["version"], env)
    assert p.returncode == 0 and p.stdout.startswith("peerd "), p.stderr
    qdiscs = shaped.tc("a", "qdisc", "show", "dev", "eth0")
    assert rate(classes(shaped)["1:1"]) == "50Mbit"
    if netem:
        assert "netem" in qdiscs and "delay 20ms" in qdiscs and "NOT applied" not in p.stderr
    else:
        assert "netem" not in qdiscs and "PEERD_SHAPE_DELAY=20ms is NOT applied" in p.stderr
        strict = run_entry(shaped, python, ["version"], {**env, "PEERD_SHAPE_STRICT": "1"})
        assert strict.returncode != 0 and not strict.stdout and "netem" in strict.stderr
        shaped.unshape()
        only = run_entry(shaped, python, ["version"], {**env, "PEERD_SHAPE_RATE": ""})  # a delay and nothing else
        assert only.returncode == 0 and "shaping is OFF" in only.stderr and "netem" in only.stderr, only.stderr
        assert "htb" not in shaped.tc("a", "qdisc", "show", "dev", "eth0")
