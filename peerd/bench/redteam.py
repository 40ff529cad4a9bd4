"""A red-team driver: hostile load on a live daemon, and what it cost the daemon (issue 36).

`peerd bench redteam` starts a target daemon and one honest peer on loopback (no training run),
then for `--seconds` throws at the target, all at once:

- fuzz: random bytes and mutated valid messages on every Peer RPC (the 9 unary ones, PushTensor's
  stream, PullTensor), signed correctly by a member (so they reach the handlers) and by a stranger;
- bad credentials: none, another cluster's, a broken signature, protocol 1's HMAC, a repeated
  header, a stale clock, a call signed for another daemon, replays of one captured call;
- bursts of 200 new connections, each making one unauthenticated call;
- 4 MiB bodies, unauthenticated and from a member;
- rounds of 128 concurrent unauthenticated calls with 4 MiB bodies;

while it asks the target's Status over the control socket every 100 ms and samples its memory
(VmRSS, and VmHWM: the peak). Afterwards: the honest peer must still be alive at the target, a new
member must still be admitted, no call may have ended UNKNOWN (a handler's exception), and the
target's log must hold no traceback. The result is one JSON record (and a table).

Fuzzed Hello and Heartbeat bodies name addresses, and a mutated one may name any address, which
the target then dials: as root the whole bench runs in a network namespace of its own with only
loopback (`run_isolated`), so nothing can leave the machine; otherwise the fuzz leaves address
fields alone (every address it sends is on 127.0.0.0/8).

    python -m peerd.bench.redteam --seconds 60 [--dir D]    # one run, here, JSON on stdout
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from peerd import PROTOCOL_VERSION
from peerd.net import pki
from peerd.net.auth import NODE_KEY, SIG_KEY, Authenticator, new_secret
from peerd.node.channels import Tls
from peerd.node.localswarm import LocalDaemon
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import control_pb2_grpc
from peerd.v1 import peer_pb2 as pb

SERVICE = "/peerd.v1.Peer/"
UNARY = {"SayHello": pb.Hello, "SendHeartbeat": pb.Heartbeat, "Ping": pb.PingRequest, "SayLeave": pb.Leave,
         "GrantTokens": pb.TokenGrant, "NoticeTrainer": pb.TrainerNotice, "DescribeRun": pb.RunQuery,
         "JoinRun": pb.JoinRequest, "AdmitToRun": pb.AdmitRequest}
BIG = 4 << 20
OWN = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 8 << 20),
       ("grpc.max_receive_message_length", 8 << 20)]
FAST = ["--heartbeat-interval", "0.2", "--suspect-after", "1.0", "--dead-after", "2.0", "--rpc-timeout", "1.0",
        "--connect-retry-max", "1.0", "--link-probe-max-bytes", str(1 << 20)]


@dataclass
class Result:
    seconds: float
    calls: int = 0
    codes: dict = field(default_factory=dict)        # status code name -> calls
    status_asked: int = 0
    status_failed: int = 0
    status_max_ms: float = 0.0
    status_p99_ms: float = 0.0
    status_median_ms: float = 0.0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_peak_mb: float = 0.0                         # VmHWM of the target: its peak over its life
    honest_peer_alive: bool = False
    new_member_admitted: bool = False
    tracebacks: int = 0
    refused_calls: int = 0
    rate_limited_calls: int = 0


def _mem(pid: int) -> tuple[float, float]:
    rss = peak = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    return rss, peak


def _member(secret: bytes) -> Authenticator:
    trust = pki.ClusterTrust.from_secrets([secret])
    return Authenticator(pki.Credentials.issued(trust), trust)


def channel(address: str, who: Authenticator | None, tls: bool) -> grpc.aio.Channel:
    """A connection of its own to `address`: with `tls`, over TLS with `who`'s certificate (a
    stranger's fails the handshake), or in plaintext when `who` is None (which a TLS port refuses)."""
    if tls and who is not None:
        creds = Tls("on", who.trust.pem, who.creds.key_pem, who.creds.cert_pem).channel_credentials()
        return grpc.aio.secure_channel(address, creds, options=[*OWN, ("grpc.ssl_target_name_override", pki.TLS_NAME)])
    return grpc.aio.insecure_channel(address, options=OWN)


def _valid(name: str, me: str, rng: random.Random) -> bytes:
    """A plausible message of each kind, to mutate."""
    msg = {"SayHello": lambda: pb.Hello(node_id=me, protocol_version=PROTOCOL_VERSION, run_id="default",
                                        address="127.0.0.1:9", incarnation=1,
                                        capabilities=pb.Capabilities(device_kind="cpu")),
           "SendHeartbeat": lambda: pb.Heartbeat(node_id=me, incarnation=1, address="127.0.0.1:9", peers=[
               pb.PeerInfo(node_id=os.urandom(16).hex(), address=f"127.9.{rng.randrange(256)}.1:{rng.randrange(1, 65535)}",
                           incarnation=1, state=pb.PEER_STATE_ALIVE) for _ in range(rng.randrange(40))]),
           "Ping": lambda: pb.PingRequest(nonce=rng.randrange(1 << 60), reply_bytes=rng.randrange(4096)),
           "SayLeave": lambda: pb.Leave(node_id=me, incarnation=1, reason="x" * rng.randrange(300)),
           "GrantTokens": lambda: pb.TokenGrant(sender=me, run_id="default", tokens=rng.randrange(1 << 31)),
           "NoticeTrainer": lambda: pb.TrainerNotice(sender=me, run_id="default", tag="t", state=rng.randrange(8)),
           "DescribeRun": lambda: pb.RunQuery(sender=me, run_id="default", founders=[me] * rng.randrange(20)),
           "JoinRun": lambda: pb.JoinRequest(sender=me, run_id="default", tag="t", spec_json="{" * rng.randrange(50)),
           "AdmitToRun": lambda: pb.AdmitRequest(sender=me, run_id="default", tag="t", node=me,
                                                 rank=rng.randrange(1 << 32))}[name]()
    return msg.SerializeToString()


ADDRESSED = ("SayHello", "SendHeartbeat")    # messages whose mutations could name any address


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    if not raw or rng.random() < 0.3:
        return os.urandom(rng.randrange(1, 4096))
    b = bytearray(raw)
    for _ in range(rng.randrange(1, 8)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


class RedTeam:
    def __init__(self, target: LocalDaemon, secret: bytes, seconds: float, seed: int = 0,
                 isolated: bool = False, tls: bool = False) -> None:
        self.tls = tls                # the target listens with TLS (--tls on)
        self.target, self.secret, self.seconds = target, secret, seconds
        self.isolated = isolated      # in a namespace of its own: mutated addresses cannot leave
        self.rng = random.Random(seed)
        self.codes: Counter = Counter()
        self.latencies: list[float] = []
        self.status_failed = 0
        self.member = _member(secret)
        self.stranger = _member(b"not-the-cluster-secret-" + os.urandom(8).hex().encode())
        self.peak = 0.0
        self.deadline = 0.0

    async def _outcome(self, call) -> None:
        """Count how one call ended. grpc.aio sometimes fails a client stream that the server cut
        short with CancelledError instead of an error: counted as CANCELLED (unless this task is
        the one being cancelled)."""
        try:
            await call
            self.codes["OK"] += 1
        except grpc.aio.AioRpcError as e:
            self.codes[e.code().name] += 1
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            self.codes["CANCELLED"] += 1

    async def _unary(self, ch, name: str, body: bytes, md, timeout: float = 5.0) -> None:
        await self._outcome(ch.unary_unary(SERVICE + name)(body, metadata=md, timeout=timeout))

    def _going(self) -> bool:
        return time.monotonic() < self.deadline

    async def fuzz(self) -> None:
        me, to, addr = self.member.node_id, self.target.node_id, self.target.address
        async with channel(addr, self.member, self.tls) as mine, channel(addr, self.stranger, self.tls) as theirs:
            while self._going():
                name = self.rng.choice(list(UNARY))
                body = _valid(name, me, self.rng)
                if self.isolated or name not in ADDRESSED:
                    body = _mutate(body, self.rng)
                signer, ch = (self.member, mine) if self.rng.random() < 0.8 else (self.stranger, theirs)
                await self._unary(ch, name, body, signer.sign(SERVICE + name, to, body))
                await self._streams(ch, signer)

    async def _streams(self, ch, signer: Authenticator) -> None:
        to = self.target.node_id
        frames = [os.urandom(self.rng.randrange(1, 2048)) for _ in range(self.rng.randrange(4))]
        await self._outcome(ch.stream_unary(SERVICE + "PushTensor")(iter(frames), metadata=signer.sign(
            SERVICE + "PushTensor", to, None), timeout=5))
        body = _mutate(pb.PullRequest(requester=signer.node_id, run_id="default").SerializeToString(), self.rng)

        async def pull():
            async for _ in ch.unary_stream(SERVICE + "PullTensor")(body, metadata=signer.sign(
                    SERVICE + "PullTensor", to, body), timeout=5):
                pass
        await self._outcome(pull())

    def _bad_credentials(self, body: bytes) -> list:
        to, m = self.target.node_id, self.member
        good = m.sign(SERVICE + "Ping", to, body)
        old = _member(self.secret)
        old._clock = lambda: time.time() - 3600
        return [None, self.stranger.sign(SERVICE + "Ping", to, body),
                [(k, "AAAA" + v[4:] if k == SIG_KEY else v) for k, v in good],
                [("x-peerd-node", "old"), ("x-peerd-mac", "ab" * 32)],
                [(NODE_KEY, os.urandom(16).hex()), *m.sign(SERVICE + "Ping", to, body)],
                old.sign(SERVICE + "Ping", to, body),
                m.sign(SERVICE + "Ping", os.urandom(16).hex(), body)]

    async def credentials(self) -> None:
        body = pb.PingRequest(nonce=1).SerializeToString()
        captured = self.member.sign(SERVICE + "Ping", self.target.node_id, body)
        async with channel(self.target.address, self.member, self.tls) as ch:
            await self._unary(ch, "Ping", body, captured)
            while self._going():
                for md in self._bad_credentials(body) + [captured] * 5:
                    await self._unary(ch, "Ping", body, md)

    async def bursts(self) -> None:
        body = pb.PingRequest().SerializeToString()
        while self._going():
            chans = [channel(self.target.address, None, self.tls) for _ in range(200)]
            await asyncio.gather(*(self._unary(c, "Ping", body, None) for c in chans))
            await asyncio.gather(*(c.close() for c in chans))
            await asyncio.sleep(0.5)

    async def big(self) -> None:
        body = pb.PingRequest(payload=os.urandom(BIG - 64)).SerializeToString()
        to = self.target.node_id
        async with channel(self.target.address, None, self.tls) as anon, \
                channel(self.target.address, self.member, self.tls) as ch:
            while self._going():
                await self._unary(anon, "Ping", body, None)
                await self._unary(ch, "Ping", body, self.member.sign(SERVICE + "Ping", to, body))

    async def concurrent(self) -> None:
        body = pb.PingRequest(payload=os.urandom(BIG - 64)).SerializeToString()
        chans = [channel(self.target.address, None, self.tls) for _ in range(8)]
        try:
            while self._going():
                await asyncio.gather(*(self._unary(chans[i % 8], "Ping", body, None, 20) for i in range(128)))
        finally:
            await asyncio.gather(*(c.close() for c in chans))

    def start_monitor(self) -> subprocess.Popen:
        """Status and memory sampled by a process of its own, so the latency measured is the
        target's, not this driver's (its event loop is busy attacking)."""
        return subprocess.Popen([sys.executable, "-m", "peerd.bench.redteam", "monitor", "--socket",
                                 str(self.target.data_dir / "peerd.sock"), "--pid", str(self.target.proc.pid),
                                 "--seconds", str(self.seconds)], stdout=subprocess.PIPE, text=True)

    async def run(self) -> None:
        monitor = self.start_monitor()
        self.deadline = time.monotonic() + self.seconds
        try:
            await asyncio.gather(self.fuzz(), self.fuzz(), self.credentials(), self.bursts(), self.big(),
                                 self.concurrent())
        finally:
            out, _ = monitor.communicate(timeout=60)
        m = json.loads(out.strip().splitlines()[-1])
        self.latencies, self.status_failed, self.peak = m["latencies"], m["failed"], m["peak_mb"]


def monitor(socket: str, pid: int, seconds: float) -> dict:
    """Ask Status every 100 ms for `seconds`, time it, sample the target's memory."""
    import grpc as g

    latencies, failed, peak = [], 0, 0.0
    with g.insecure_channel(f"unix://{socket}") as ch:
        stub = control_pb2_grpc.ControlStub(ch)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                stub.Status(cpb.StatusRequest(), timeout=5)
                latencies.append(time.perf_counter() - t0)
            except g.RpcError:
                failed += 1
            peak = max(peak, _mem(pid)[1])
            time.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))
    return {"latencies": latencies, "failed": failed, "peak_mb": peak}


async def _admitted(target: LocalDaemon, secret: bytes, tls: bool) -> bool:
    """A new member says Hello and is admitted (the target still does its job)."""
    m = _member(secret)
    body = pb.Hello(node_id=m.node_id, protocol_version=PROTOCOL_VERSION, run_id="default", address="127.0.0.1:9",
                    incarnation=int(time.time() * 1000)).SerializeToString()
    async with channel(target.address, m, tls) as ch:
        try:
            await ch.unary_unary(SERVICE + "SayHello")(body, metadata=m.sign(SERVICE + "SayHello", target.node_id,
                                                                               body), timeout=10)
        except grpc.aio.AioRpcError:
            return False
    return any(p.get("node_id") == m.node_id for p in (target.status(timeout=5) or {}).get("peers", []))


def run(seconds: float = 60.0, root: Path | None = None, extra: list[str] = (), log=print,
        isolated: bool = False, tls: str = "auto") -> Result:
    """Start the target and an honest peer, attack for `seconds`, and measure (here; see
    run_isolated)."""
    root = Path(root or tempfile.mkdtemp(prefix="peerd-redteam-"))
    root.mkdir(parents=True, exist_ok=True)
    secret_file = root / "secret"
    secret_file.write_text(new_secret() + "\n")
    secret_file.chmod(0o600)
    secret = secret_file.read_bytes().strip()
    extra = [*FAST, "--tls", tls, *extra]
    target = LocalDaemon(root / "target", secret_file, extra=extra).start()
    honest = None
    try:
        target.wait_ready(60)
        honest = LocalDaemon(root / "honest", secret_file, [target.address], extra=extra).start()
        honest.wait_ready(60)
        deadline = time.monotonic() + 30
        while honest.node_id not in {p["node_id"] for p in target.status()["peers"]} and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)                  # let it settle: probes, gossip
        rss0 = _mem(target.proc.pid)[0]
        log(f"target {target.node_id} at {target.address}, RSS {rss0:.0f} MB; attacking for {seconds:.0f} s")
        team = RedTeam(target, secret, seconds, isolated=isolated, tls=tls == "on")
        asyncio.run(team.run())
        time.sleep(1.0)
        st = target.status(timeout=10) or {}
        lat = sorted(team.latencies) or [float("nan")]
        res = Result(seconds=seconds, calls=sum(team.codes.values()), codes=dict(team.codes.most_common()),
                     status_asked=len(team.latencies) + team.status_failed, status_failed=team.status_failed,
                     status_max_ms=lat[-1] * 1000, status_p99_ms=lat[int(0.99 * (len(lat) - 1))] * 1000,
                     status_median_ms=statistics.median(lat) * 1000, rss_start_mb=rss0,
                     rss_end_mb=_mem(target.proc.pid)[0], rss_peak_mb=max(team.peak, _mem(target.proc.pid)[1]),
                     honest_peer_alive={p["node_id"]: p["state"] for p in st.get("peers", [])}.get(honest.node_id)
                     == "alive",
                     new_member_admitted=asyncio.run(_admitted(target, secret, tls == "on")),
                     tracebacks=target.read_log().count("Traceback"),
                     refused_calls=int(st.get("refused_calls", 0)), rate_limited_calls=int(st.get("rate_limited_calls", 0)))
        return res
    finally:
        for d in (honest, target):
            if d is not None:
                d.stop()


def run_isolated(seconds: float = 60.0, root: Path | None = None, log=print, tls: str = "auto") -> Result:
    """As root: the same run inside a new network namespace with only loopback (removed after),
    so no address a mutated message names can be reached. Otherwise: `run` here, with address
    fields left alone."""
    if os.geteuid() != 0:
        log("not root: running without a namespace; address fields are not fuzzed")
        return run(seconds, root, log=log, tls=tls)
    ns = f"peerd-rt-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=20)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True, timeout=20)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "peerd.bench.redteam", "--seconds", str(seconds),
               "--isolated", "--tls", tls] + (["--dir", str(root)] if root else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
        for line in proc.stderr.splitlines():
            log(line)
        if proc.returncode != 0:
            raise RuntimeError(f"red-team run failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return Result(**json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        subprocess.run(["ip", "netns", "del", ns], timeout=20)


def table(r: Result) -> str:
    rows = [("hostile calls", f"{r.calls} in {r.seconds:.0f} s"),
            ("outcomes", ", ".join(f"{k} {v}" for k, v in r.codes.items())),
            ("Status latency", f"median {r.status_median_ms:.1f} ms, p99 {r.status_p99_ms:.1f} ms, max "
                               f"{r.status_max_ms:.1f} ms ({r.status_asked} asked, {r.status_failed} failed)"),
            ("target RSS", f"{r.rss_start_mb:.0f} MB before, peak {r.rss_peak_mb:.0f} MB, {r.rss_end_mb:.0f} MB after"),
            ("honest peer alive after", str(r.honest_peer_alive)),
            ("new member admitted after", str(r.new_member_admitted)),
            ("tracebacks in its log", str(r.tracebacks)),
            ("refused / rate-limited (its count)", f"{r.refused_calls} / {r.rate_limited_calls}")]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a.ljust(w)}  {b}" for a, b in rows)


def to_json(r: Result) -> str:
    return json.dumps(asdict(r))


def main() -> None:
    if sys.argv[1:2] == ["monitor"]:
        m = argparse.ArgumentParser()
        m.add_argument("--socket")
        m.add_argument("--pid", type=int)
        m.add_argument("--seconds", type=float)
        a = m.parse_args(sys.argv[2:])
        print(json.dumps(monitor(a.socket, a.pid, a.seconds)), flush=True)
        return
    p = argparse.ArgumentParser(description="one red-team run against a daemon started here")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--isolated", action="store_true", help="this process runs in a namespace of its own")
    p.add_argument("--tls", default="auto", choices=("auto", "on", "off"), help="the daemons' --tls")
    args = p.parse_args()
    r = run(args.seconds, Path(args.dir) if args.dir else None, log=lambda s: print(s, file=sys.stderr),
            isolated=args.isolated, tls=args.tls)
    print(to_json(r), flush=True)


if __name__ == "__main__":
    main()
