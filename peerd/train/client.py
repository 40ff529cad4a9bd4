"""The trainer's side of the control API: an Exchange backed by the local peerd daemon.

    from peerd.train import attach
    exchange = attach()                      # finds the daemon from the environment it set
    opt = DecentralizedOptimizer(model.parameters(), exchange, "sgd", lr=0.05, momentum=0.9)

Tensors never travel over protobuf here. The daemon hands out two shared-memory slot files at
attach; publish(k) copies x_k into slot k % 2 and tells the daemon, which snapshots it before it
answers; mix(k) asks the daemon to write the mix into the other slot and returns a view of it.
"""
from __future__ import annotations

import os
from pathlib import Path

import grpc
import torch

from peerd.train.exchange import MixResult
from peerd.train.flat import Layout, LayoutMismatch
from peerd.v1 import control_pb2 as cpb
from peerd.v1 import control_pb2_grpc


class NoDaemon(RuntimeError):
    """No daemon to attach to (the script was not started by `peerd train`)."""


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
        self.rank = 0
        self.world = 1
        self.node_id = ""
        self._slots: list[torch.Tensor] = []
        self._layout: Layout | None = None
        self.initial: torch.Tensor | None = None
        self.join_note = ""

    def attach(self, layout: Layout) -> int:
        req = cpb.AttachRequest(layout=[cpb.LayoutEntry(name=n, dtype=d, shape=s) for n, d, s in layout.specs()],
                                total_bytes=layout.total_bytes, pid=os.getpid(),
                                run_id=os.environ.get("PEERD_RUN_ID", ""))
        try:
            reply = self._stub.Attach(req, timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LayoutMismatch(e.details()) from None
            raise
        self.session, self.rank, self.world, self.node_id = reply.session_id, reply.rank, reply.world, reply.node_id
        self._slots = [_map(p, layout.total_bytes) for p in reply.slot_paths]
        self._layout = layout
        # Joining a running swarm: the neighbours' current parameters, to start from.
        self.initial = self._slots[0].clone() if reply.start_from_slot else None
        self.join_note = reply.join_note
        return reply.start_iteration

    def publish(self, iteration: int, buf: torch.Tensor) -> None:
        slot = iteration % 2
        self._slots[slot].copy_(buf)
        self._stub.Publish(cpb.PublishRequest(session_id=self.session, iteration=iteration, slot=slot),
                           timeout=self.timeout)

    def mix(self, iteration: int) -> MixResult:
        slot = (iteration + 1) % 2
        reply = self._stub.Mix(cpb.MixRequest(session_id=self.session, iteration=iteration, slot=slot),
                               timeout=self.timeout)
        used = len(reply.entries)
        return MixResult(iteration, self._slots[slot] if used else None,
                         skip_to=reply.skip_to or None, used=used)

    def report(self, iteration: int, loss: float, samples: int = 0, step_time_s: float = 0.0,
               **extra: float) -> None:
        metric = cpb.Metric(session_id=self.session, iteration=iteration, loss=loss, samples=samples,
                            step_time_s=step_time_s, extra={k: float(v) for k, v in extra.items()})
        self._stub.ReportMetrics(iter([metric]), timeout=self.timeout)

    def close(self) -> None:
        self._channel.close()


def attach(timeout: float = 120.0) -> DaemonExchange:
    """The exchange of the daemon that spawned this process (`peerd train --script ...`)."""
    sock = os.environ.get("PEERD_CONTROL_SOCKET")
    if not sock:
        raise NoDaemon("PEERD_CONTROL_SOCKET is not set: start this script with "
                       "`peerd train --script SCRIPT` on a host where `peerd up` runs")
    return DaemonExchange(sock, os.environ.get("PEERD_SESSION", ""), timeout)
