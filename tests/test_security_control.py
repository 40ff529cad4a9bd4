"""Issue 36, the local control API and the run's set-up: every request checked (INVALID_ARGUMENT or
FAILED_PRECONDITION, never UNKNOWN, never a failed run), a cancelled Train always cleans up, NaN
metrics leave `peerd status --json` strict, slots are the user's alone, `--max-world` is bounded and
its vacant ranks cost one repair; long strings from peers are cut short."""
from __future__ import annotations

import json
import math
import os
import queue
import threading
import time

import grpc
import pytest
from click.testing import CliRunner

from cli.main import cli
from peerd import PROTOCOL_VERSION
from peerd.config import Config
from peerd.node.run.run import vacate
from peerd.node.run.spec import RunError, RunSpec
from peerd.sync import events as ev
from peerd.sync import registry, topology
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import control_pb2_grpc
from peerd.v1 import peer_pb2 as pb
from tests.daemons import wait_for
from tests.members import call, member

SLEEPER = "import sys, os, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(120)\n"


def strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


class Train:
    """A Train call in a thread: its progress records in a queue; cancel() is the caller leaving."""

    def __init__(self, stub, request: cpb.TrainRequest) -> None:
        self.call = stub.Train(request)
        self.records: queue.Queue = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for p in self.call:
                self.records.put(p)
        except grpc.RpcError as e:
            self.error = e

    def next(self, timeout: float = 60.0) -> cpb.TrainProgress:
        return self.records.get(timeout=timeout)

    def cancel(self) -> None:
        self.call.cancel()
        self.thread.join(10)


def sleeper_request(tmp_path, name: str) -> tuple[cpb.TrainRequest, object]:
    script, pidfile = tmp_path / "sleeper.py", tmp_path / f"{name}.pid"
    script.write_text(SLEEPER)
    return cpb.TrainRequest(script=[str(script), str(pidfile)], world=1, max_world=2, iterations=1000), pidfile


def slot_private(path: str) -> bool:
    """Nobody but the daemon's user can open a slot: a file of mode 600, or a memfd reached through
    /proc/PID/fd/N (that directory is the process owner's alone)."""
    if path.startswith("/proc/"):
        fd_dir = os.path.dirname(path)
        return os.stat(fd_dir).st_mode & 0o077 == 0 and os.stat(fd_dir).st_uid == os.getuid()
    return os.stat(path).st_mode & 0o777 == 0o600


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:   # a zombie the daemon has not reaped is gone too
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def control(daemons):
    d = daemons("ctl")
    ch = grpc.insecure_channel(f"unix://{d.data_dir / 'peerd.sock'}")
    yield d, ch, control_pb2_grpc.ControlStub(ch)
    ch.close()


def code_of(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


# --- finding 6: a cancelled Train cleans up --------------------------------------------------------

def test_a_cancelled_train_always_cleans_up(control, tmp_path):
    """Cancelled at once (1 ms after it was sent: the run formed, its first reply on the way), a bit
    later, or once its trainer runs: no run is left behind, the trainer is stopped, and the next
    Train is taken. Before, the first case left a run without a trainer that refused every later
    `peerd train` ("a training run is already active") until the daemon restarted."""
    d, ch, stub = control
    for i, delay in enumerate([0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.001, 0.002, 0.005, -1]):
        req, pidfile = sleeper_request(tmp_path, f"t{i}")
        t = Train(stub, req)
        if delay < 0:
            assert "world formed" in t.next().message
            wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the trainer to start")
        else:
            time.sleep(delay)
        t.cancel()
        wait_for(lambda: d.status()["training_json"] == "", 10, f"the run to end (cancelled after {delay}s)")
        if pidfile.exists():
            pid = int(wait_for(lambda: pidfile.read_text(), 5, "the pid"))
            wait_for(lambda: gone(pid), 15, "the trainer to be stopped")
    req, _ = sleeper_request(tmp_path, "last")
    t = Train(stub, req)
    assert "world formed" in t.next().message     # not "a training run is already active"
    t.cancel()


# --- finding 6: Mix, metrics, directives, malformed bodies; finding 8: NaN and strict JSON, slots ---

def test_bad_control_requests_are_refused_and_the_run_goes_on(control, tmp_path):
    d, ch, stub = control
    req, pidfile = sleeper_request(tmp_path, "mix")
    t = Train(stub, req)
    try:
        t.next()
        wait_for(lambda: pidfile.exists(), 30, "the trainer process")
        # the test is the trainer: attach, publish 0, then ask for absurd mixes
        reply = stub.Attach(cpb.AttachRequest(layout=[cpb.LayoutEntry(name="w", dtype="float32", shape=[64])]),
                            timeout=30)
        session = reply.session_id
        for path in reply.slot_paths:
            assert slot_private(path), path
        stub.Publish(cpb.PublishRequest(session_id=session, iteration=0, slot=0), timeout=10)
        for k in (2**64 - 1, 1, 7):
            err = code_of(lambda: stub.Mix(cpb.MixRequest(session_id=session, iteration=k, slot=1), timeout=10))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "last one published is 0" in err.details()
        err = code_of(lambda: stub.Mix(cpb.MixRequest(session_id=session, iteration=0, slot=9), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the real Mix, with NaN and infinite metrics riding on it, is answered
        metric = cpb.Metric(session_id=session, iteration=0, loss=math.nan, step_time_s=math.inf,
                            extra={"checkpoint_failures": math.nan, "compute_s": math.inf, "accuracy": 0.5})
        mixed = stub.Mix(cpb.MixRequest(session_id=session, iteration=0, slot=1, metric=metric), timeout=30)
        assert mixed.iteration == 0
        ack = ch.stream_unary("/peerd.v1.Control/ReportMetrics")(
            iter([metric.SerializeToString()]), timeout=10)
        assert ack == b""
        # unknown directive kind, absurd iteration; a known one is delivered
        for directive in (cpb.Directive(kind=99), cpb.Directive(kind=0),
                          cpb.Directive(kind=cpb.Directive.KIND_SKIP_TO, iteration=2**64 - 1)):
            err = code_of(lambda: stub.Direct(cpb.DirectRequest(directive=directive), timeout=10))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, directive
        assert stub.Direct(cpb.DirectRequest(directive=cpb.Directive(kind=cpb.Directive.KIND_CHECKPOINT)),
                           timeout=10).delivered == 0
        # malformed bodies of every streaming call: INVALID_ARGUMENT, never UNKNOWN
        garbage = b"\xff\xff\xff\x07garbage"
        for method in ("Train", "Directives"):
            err = code_of(lambda: list(ch.unary_stream(f"/peerd.v1.Control/{method}")(garbage, timeout=10)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.details(), method
        err = code_of(lambda: ch.stream_unary("/peerd.v1.Control/ReportMetrics")(iter([garbage]), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.details()
        err = code_of(lambda: stub.Attach(cpb.AttachRequest(layout=[cpb.LayoutEntry(
            name="w", dtype="float32", shape=[1 << 40])]), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in err.details()
        # the run is unharmed, and status is strict JSON with a NaN loss in it
        st = d.status()
        training = strict(st["training_json"])
        assert training["policy"]["iteration"] == 0 and training["policy"]["mixes"] == 1
        out = CliRunner().invoke(cli, ["status", "--json", "--data-dir", str(d.data_dir)])
        assert out.exit_code == 0
        strict(out.output)
        assert t.error is None
        states = set()
        while not t.records.empty():
            states.add(t.next().state)
        assert "failed" not in states
        assert "policy error" not in d.read_log() and "Traceback" not in d.read_log()
    finally:
        t.cancel()


# --- finding 7 and 8: the spec --------------------------------------------------------------------

def test_train_requests_out_of_bounds_are_refused_clearly(control):
    d, ch, stub = control
    base = dict(task="svm", world=1, max_world=2, iterations=10)
    cases = {
        "max-world": dict(max_world=3000),
        "beyond this daemon's limit": dict(world=300, max_world=300),
        "join-timeout": dict(join_timeout_s=math.nan),
        "join-timeout:": dict(join_timeout_s=-5.0),
        "slowdown": dict(slowdown=math.nan),
        "task:": dict(task="x" * 100_000),
        "backup": dict(options={"backup": "many"}),
        "options:": dict(options={f"k{i}": "v" for i in range(100)}),
        "topology": dict(topology="unix:///etc/passwd"),
    }
    for needle, fields in cases.items():
        err = code_of(lambda: list(stub.Train(cpb.TrainRequest(**{**base, **fields}), timeout=10)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details(), (needle, err.details())
        assert len(err.details()) < 400
    assert d.status()["training_json"] == ""


def test_spec_checks_numbers_and_lengths():
    def spec(**kw):
        return RunSpec.from_request(cpb.TrainRequest(**{"task": "svm", "world": 2, **kw}), 60.0, 0, 256)
    assert spec().join_timeout == 60.0 and spec(join_timeout_s=5).join_timeout == 5
    assert spec(slowdown=0).slowdown == 1.0
    for bad in (dict(join_timeout_s=math.inf), dict(join_timeout_s=-1e-9), dict(slowdown=-1), dict(slowdown=1e9),
                dict(max_world=257), dict(iterations=2**60), dict(options={"step_time": "nan"}),
                dict(script=["a\0b"])):
        with pytest.raises(RunError):
            spec(**bad)
    # the graph for the run's ranks is checked at once, not when every host has come
    with pytest.raises(RunError, match="one host alone: --topology complete"):
        spec(world=1)
    with pytest.raises(RunError, match="exp cannot hold 3 ranks"):
        spec(world=3, topology="exp")
    assert spec(world=1, topology="complete").world == 1 and spec(world=3, max_world=4, topology="exp").world == 3


@pytest.mark.parametrize("algo", sorted(registry.ALGORITHMS))
def test_vacant_ranks_are_one_event_with_the_same_result(algo, monkeypatch):
    """A run of max_world n with world w has n - w vacant ranks. They reach the policy as one event
    (one graph repair, one NetMax solve) instead of n - w, and the policy ends in the same state."""
    cfg, n, nodes = Config(), 24, [f"n{i}" for i in range(6)] + [""] * 18
    topo_name = "exp" if algo in ("sgp",) else "ring"

    def build():
        topo = topology.make(topo_name, n if topo_name != "exp" else 32)
        size = topo.n
        return registry.build_one(algo, size, topo, 0, seed=1, **registry.options(cfg, algo)), size

    one, size = build()
    table = nodes + [""] * (size - len(nodes))
    repairs = []
    real = topology.repair
    monkeypatch.setattr(topology, "repair", lambda t, dead: (repairs.append(len(dead)), real(t, dead))[1])
    fed: list = []
    assert vacate(one, table, lambda e: (fed.append(e), one.on_event(e, 0.0))) == size - 6
    assert len(fed) == 1 and isinstance(fed[0], ev.PeerDown)
    assert len(repairs) <= 1
    each, _ = build()
    for r, node in enumerate(table):
        if not node:
            each.on_event(ev.PeerDown(r), 0.0)
    work = {"solves"}                 # NetMax counts its solves: one instead of one per rank
    assert {k: v for k, v in one.state().items() if k not in work} == \
        {k: v for k, v in each.state().items() if k not in work}
    assert one.dead == each.dead == set(range(6, size))


# --- finding 8: strings from peers are cut short --------------------------------------------------

def test_long_strings_from_a_peer_are_cut_short_in_errors_and_logs(daemons):
    d = daemons("strings")
    m = member()
    huge = "r" * 100_000
    with grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        for request, method in ((pb.Hello(node_id=m.node_id, protocol_version=PROTOCOL_VERSION, run_id=huge,
                                          address="127.0.0.1:9", incarnation=1), "SayHello"),
                                (pb.TokenGrant(sender=m.node_id, run_id=huge, tokens=1), "GrantTokens"),
                                (pb.Leave(node_id=m.node_id, incarnation=1, reason=huge), "SayLeave"),
                                (pb.Hello(node_id=m.node_id, protocol_version=PROTOCOL_VERSION, run_id="default",
                                          address="127.0.0.1:9", incarnation=1,
                                          capabilities=pb.Capabilities(gpu_name="g" * 3_000_000)), "SayHello")):
            try:
                call(ch, f"/peerd.v1.Peer/{method}", request, m, d.node_id)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT), method
                assert len(e.details()) < 400, (method, len(e.details()))
    time.sleep(0.5)
    assert max(len(line) for line in d.read_log().splitlines()) < 2000
    assert m.node_id not in {p["node_id"] for p in d.status()["peers"]}   # 3 MB of capabilities: refused
