"""The trainer's side of the control API: an Exchange backed by the local peerd daemon.

    from peerd.train import attach
    exchange = attach()                      # finds the daemon from the environment it set
    opt = DecentralizedOptimizer(model.parameters(), exchange, "sgd", lr=0.05, momentum=0.9)

Tensors never travel over protobuf here. The daemon hands out two shared-memory slot files at
attach; publish(k) copies x_k into slot k % 2 and tells the daemon, which snapshots it before it
answers; mix(k) asks the daemon to write the mix into the other slot and returns a view of it.
A CPU trainer's parameters can live in slot 0 itself (``param_home``, which the
DecentralizedOptimizer takes): publish is then the RPC alone, every mix goes to slot 1, and the
update x_{k+1} = mix_k - lr*d reads slot 1 and writes slot 0 directly. Slot 0 is not written
between Publish(k) and the reply to Mix(k): the daemon snapshots it before it answers a mix.

Directives (`peerd ctl pause|resume|checkpoint|stop|skip-to`) arrive on a stream that a
background thread reads from attach on; the training loop takes them at an iteration boundary
with ``directives()`` (non-blocking) or ``next_directive(timeout)``. The built-in worker honours
them (peerd.train.worker.apply_directives); a user's script may call the same helper.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Sequence

import grpc
import torch

from peerd.train.exchange import MixResult
from peerd.train.flat import Layout, LayoutMismatch
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import control_pb2_grpc


class NoDaemon(RuntimeError):
    """No daemon to attach to (the script was not started by `peerd train`)."""


# Seconds our deadline on a Mix gives the daemon beyond its own bound, in which it answers (or
# says why it cannot) before we give up on it.
MIX_MARGIN = 60.0


def _map(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(nbytes, 1))
    return torch.tensor([], dtype=torch.uint8).set_(storage)[:nbytes]


class DaemonExchange:
    def __init__(self, socket_path: str, session: str = "", timeout: float = 120.0) -> None:
        if not Path(socket_path).exists():
            raise NoDaemon(f"no peerd control socket at {socket_path}")
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = control_pb2_grpc.ControlStub(self._channel)
        self.session = session
        self.timeout = timeout
        self._mix_timeout = timeout       # grows with the daemon's bound on a Mix (AttachReply)
        self._published_at = 0.0
        self._iteration_s = 0.0           # seconds between our last two publishes
        self.rank = 0
        self.world = 1
        self.node_id = ""
        self._slots: list[torch.Tensor] = []
        self._layout: Layout | None = None
        self._directives: queue.Queue = queue.Queue()
        self._metric: cpb.Metric | None = None   # rides on the next Mix
        self._publishing = None                  # the Publish call in flight (its reply is read at mix)
        self._stream = None
        self._hosted = False                     # the parameters live in slot 0 (param_home)

        self.initial: torch.Tensor | None = None
        self.join_note = ""

    def attach(self, layout: Layout) -> int:
        req = cpb.AttachRequest(layout=[cpb.LayoutEntry(name=n, dtype=d, shape=s) for n, d, s in layout.specs()],
                                total_bytes=layout.total_bytes, pid=os.getpid(),
                                run_id=os.environ.get("PEERD_RUN_ID", ""))
        # The daemon's allowance for a join pull (train_attach_timeout), when it spawned us.
        deadline = time.monotonic() + max(self.timeout, float(os.environ.get("PEERD_ATTACH_TIMEOUT") or 0))
        while True:
            try:
                reply = self._stub.Attach(req, timeout=max(1.0, deadline - time.monotonic()))
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise LayoutMismatch(e.details()) from None
                # the daemon's own UNAVAILABLE (not a daemon that is gone): a call it made to a peer
                # was cut, the peer found dead meanwhile; it says try again
                said_by_daemon = e.code() == grpc.StatusCode.UNAVAILABLE and (e.details() or "").startswith("peerd:")
                if not said_by_daemon or time.monotonic() + 1.0 >= deadline:
                    raise
                time.sleep(1.0)
        self.session, self.rank, self.world, self.node_id = reply.session_id, reply.rank, reply.world, reply.node_id
        # A big model over a slow link: the daemon's Mix may take minutes; ours must outlast it.
        self._mix_timeout = max(self.timeout, reply.mix_timeout_s + MIX_MARGIN)
        self._slots = [_map(p, layout.total_bytes) for p in reply.slot_paths]
        self._layout = layout
        self._stream = self._stub.Directives(cpb.DirectivesRequest(session_id=self.session))
        threading.Thread(target=self._read_directives, args=(self._stream,), name="peerd-directives",
                         daemon=True).start()
        # Joining a running swarm: the neighbours' current parameters, to start from.
        self.initial = self._slots[0].clone() if reply.start_from_slot else None
        self.join_note = reply.join_note
        return reply.start_iteration

    def _read_directives(self, stream) -> None:
        try:
            for d in stream:
                self._directives.put(d)
        except grpc.RpcError:
            pass  # the stream ends with the run, the daemon or close()

    def directives(self) -> list[cpb.Directive]:
        """Directives received since the last call, oldest first (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._directives.get_nowait())
            except queue.Empty:
                return out

    def next_directive(self, timeout: float) -> cpb.Directive | None:
        """Wait at most `timeout` seconds for the next directive."""
        try:
            return self._directives.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def param_home(self, device: torch.device) -> torch.Tensor | None:
        """Slot 0, for the trainer's flat parameters to live in (CPU only; None elsewhere)."""
        if torch.device(device).type != "cpu" or not self._slots:
            return None
        self._hosted = True
        return self._slots[0]

    def _slot_of(self, iteration: int) -> int:
        return 0 if self._hosted else iteration % 2

    def host_buffer(self, iteration: int) -> torch.Tensor:
        """The slot that publish(iteration) reads: a trainer whose parameters live elsewhere (a
        GPU) may copy x_k straight into it and publish the slot itself (no second copy)."""
        return self._slots[self._slot_of(iteration)]

    def publish(self, iteration: int, buf: torch.Tensor, *, mass: float = 1.0,
                ranges: Sequence[int] | None = None) -> None:
        slot = self._slot_of(iteration)
        if buf.data_ptr() != self._slots[slot].data_ptr():
            self._slots[slot].copy_(buf)
        now = time.monotonic()
        if self._published_at:
            self._iteration_s = now - self._published_at
        self._published_at = now
        self._await_publish()
        # The reply is not waited for here: the daemon answers at once but then snapshots the slot
        # (and may compute the mix) on the same loop; the trainer reads the reply at mix time.
        self._publishing = self._stub.Publish.future(
            cpb.PublishRequest(session_id=self.session, iteration=iteration, slot=slot,
                               mass=mass if mass != 1.0 else 0.0, ranges=list(ranges or ())), timeout=self.timeout)

    def _await_publish(self) -> None:
        call, self._publishing = self._publishing, None
        if call is not None:
            call.result()   # raises the daemon's refusal, if any

    def mix(self, iteration: int) -> MixResult:
        slot = 1 - self._slot_of(iteration)
        self._await_publish()   # Mix(k) must reach the daemon after Publish(k)
        metric, self._metric = self._metric, None
        # A neighbour may be a whole iteration behind (a DiLoCo round lasts minutes): the bound
        # grows with the time between our own publishes, as the daemon's waits do.
        reply = self._stub.Mix(cpb.MixRequest(session_id=self.session, iteration=iteration, slot=slot,
                                              metric=metric), timeout=self._mix_timeout + 3 * self._iteration_s)
        used = len(reply.entries)
        return MixResult(iteration, self._slots[slot] if used else None,
                         skip_to=reply.skip_to or None, used=used)

    def report(self, iteration: int, loss: float, samples: int = 0, step_time_s: float = 0.0,
               **extra: float) -> None:
        """Metrics of the step that reached `iteration`: they ride on the next Mix (no RPC of
        their own); the last ones go at close, or at `flush()`. A newer report replaces one not
        yet sent, evaluation results excepted (they are sent before being replaced)."""
        metric = cpb.Metric(session_id=self.session, iteration=iteration, loss=loss, samples=samples,
                            step_time_s=step_time_s, extra={k: float(v) for k, v in extra.items()})
        if self._metric is not None and set(self._metric.extra) - {"compute_s"}:
            self.flush()
        self._metric = metric

    def flush(self) -> None:
        """Send a metric still waiting for a Mix."""
        metric, self._metric = self._metric, None
        if metric is not None:
            self._stub.ReportMetrics(iter([metric]), timeout=self.timeout)

    def close(self) -> None:
        self._await_publish()
        self.flush()
        if self._stream is not None:
            self._stream.cancel()
        self._channel.close()


def attach(timeout: float = 120.0) -> DaemonExchange:
    """The exchange of the daemon that spawned this process (`peerd train --script ...`)."""
    sock = os.environ.get("PEERD_CONTROL_SOCKET")
    if not sock:
        raise NoDaemon("PEERD_CONTROL_SOCKET is not set: start this script with "
                       "`peerd train --script SCRIPT` on a host where `peerd up` runs")
    return DaemonExchange(sock, os.environ.get("PEERD_SESSION", ""), timeout)
