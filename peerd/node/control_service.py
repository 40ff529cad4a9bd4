"""Server side of the Control service on the daemon's unix socket (local clients only).

The socket is mode 600, so every caller is this user; still, every request is checked before it
reaches a run: a malformed message, an unknown enum value, an iteration the run never published or
a number that is not finite is answered INVALID_ARGUMENT or FAILED_PRECONDITION with what is wrong,
never UNKNOWN, and never fails the run.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Awaitable, Callable

import grpc

from peerd.net.wirecheck import clip
from peerd.node.rpc import stream_unary, unary, unary_stream
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import MAX_ITERATIONS, RunError
from peerd.node.run_host import RunHost
from peerd.node.train_service import serve_train
from peerd.train.flat import Layout, LayoutMismatch
from peerd.v1 import control_pb2 as cpb

log = logging.getLogger("peerd.control")

MAX_TEXT = 256                 # session and run ids, a directive's reason, a metric's name
MAX_EXTRAS = 64                # extra values in one metric
MAX_DIMS = 16
DIRECTIVE_KINDS = frozenset(cpb.Directive.Kind.values()) - {cpb.Directive.KIND_UNSPECIFIED}


def clean_metric(m: cpb.Metric) -> cpb.Metric:
    """A trainer's metric as the run may take it: the loss as reported (NaN says the trainer
    diverged), a non-finite step time as unknown (0), extras only finite and with short names,
    at most MAX_EXTRAS."""
    out = cpb.Metric(session_id=m.session_id, iteration=m.iteration, loss=m.loss, samples=m.samples,
                     step_time_s=m.step_time_s if math.isfinite(m.step_time_s) else 0.0)
    for i, (key, value) in enumerate(m.extra.items()):
        if i >= MAX_EXTRAS:
            break
        if len(key) <= MAX_TEXT and math.isfinite(value):
            out.extra[key] = value
    return out


class ControlService:
    def __init__(self, runs: RunHost, status: Callable[[], cpb.StatusReply],
                 links: Callable[[], cpb.LinksReply], swarm: Callable[[], Awaitable[cpb.SwarmReply]],
                 stop: Callable[[], None],
                 revoke: Callable[[cpb.RevokeRequest], tuple[bool, str]] | None = None) -> None:
        self.runs = runs
        self.status = status
        self.links = links
        self.swarm = swarm
        self.stop = stop            # the daemon's stop(): shuts it down as SIGTERM does
        self.revoke = revoke

    async def Status(self, request: cpb.StatusRequest, context) -> cpb.StatusReply:
        return self.status()

    async def Links(self, request: cpb.LinksRequest, context) -> cpb.LinksReply:
        return self.links()

    async def Swarm(self, request: cpb.SwarmRequest, context) -> cpb.SwarmReply:
        return await self.swarm()

    async def Shutdown(self, request: cpb.ShutdownRequest, context) -> cpb.ShutdownReply:
        """`peerd down`: the reply goes out while the daemon shuts down (in-flight calls get
        shutdown_grace), then the process exits."""
        log.info("shutdown requested through the control socket%s", f": {request.reason}" if request.reason else "")
        self.stop()
        return cpb.ShutdownReply(pid=os.getpid())

    def _run(self, session: str = "") -> TrainingRun | None:
        run = self.runs.training
        if run is None or (session and session != run.session):
            return None
        return run

    async def _session(self, session: str, context) -> TrainingRun:
        run = self._run(session)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peerd: no session {clip(session, 64)}")
        return run

    async def Train(self, request: cpb.TrainRequest, context) -> None:
        await serve_train(self.runs, request, context)

    async def Attach(self, request: cpb.AttachRequest, context) -> cpb.AttachReply:
        run = self._run()
        if run is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "peerd: no training run on this daemon (start one with `peerd train`)")
        run_id = self.runs.env.cfg.node.run_id
        if request.run_id and request.run_id != run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: trainer of run {clip(request.run_id, 64)}, daemon runs {run_id!r}")
        why = self._layout_problem(request)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: refused attach: {why}")
        try:
            return await run.attach(request, context.time_remaining())
        except (LayoutMismatch, ValueError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: refused attach: {str(e)[:400]}")
        except Exception as e:  # noqa: BLE001 - a bug: the run fails, the daemon serves on
            await self._internal_error(run, "Attach", e, context)

    def _layout_problem(self, request: cpb.AttachRequest) -> str:
        """Why the trainer's layout cannot be taken ("" when it can): bounded in entries, names,
        dimensions and bytes (the slots are files of that size)."""
        dp = self.runs.env.cfg.dataplane
        if not request.layout:
            return "the layout is empty"
        if len(request.layout) > dp.max_tensors:
            return f"{len(request.layout)} tensors in the layout (at most {dp.max_tensors})"
        for e in request.layout:
            if len(e.name) > MAX_TEXT or len(e.dtype) > 32 or len(e.shape) > MAX_DIMS:
                return f"layout entry {clip(e.name, 40)}: name, dtype or number of dimensions too long"
        try:
            layout = Layout.build((e.name, e.dtype, tuple(e.shape)) for e in request.layout)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return f"layout: {clip(str(e), 200)}"
        if layout.total_bytes > dp.max_transfer_bytes:
            return (f"the model is {layout.total_bytes} bytes; peers accept at most {dp.max_transfer_bytes} "
                    f"(dataplane_max_transfer_bytes)")
        return ""

    async def Publish(self, request: cpb.PublishRequest, context) -> cpb.PublishReply:
        run = await self._session(request.session_id, context)
        if request.iteration > MAX_ITERATIONS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: iteration {request.iteration} is out of range")
        try:
            run.api.publish(request)
        except RunError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
        except Exception as e:  # noqa: BLE001
            await self._internal_error(run, "Publish", e, context)
        return cpb.PublishReply()

    @staticmethod
    def published(run: TrainingRun) -> int:
        """The iteration the trainer published last (a Publish not yet taken in counts)."""
        pending = run.api.pending_publish
        return pending[0] if pending is not None else run.policy.k

    async def Mix(self, request: cpb.MixRequest, context) -> cpb.MixReply:
        run = await self._session(request.session_id, context)
        k, published = request.iteration, self.published(run)
        if k != published:
            # The policy mixes only the iteration it was told was published: anything else would
            # fail the run (Hop) or leave the trainer waiting (the others).
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: Mix of iteration {k}, but the last one published is {published}"
                                if published >= 0 else f"peerd: Mix of iteration {k} before any Publish")
        if request.slot >= len(run.mixer.slots):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: slot {request.slot} does not exist")
        if request.HasField("metric"):
            request.metric.CopyFrom(clean_metric(request.metric))
        try:
            return await run.api.mix(request)
        except RunError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
        except Exception as e:  # noqa: BLE001
            await self._internal_error(run, "Mix", e, context)

    @staticmethod
    async def _internal_error(run: TrainingRun, call: str, e: Exception, context) -> None:
        """A trainer's call hit a bug in the daemon: the run fails loudly (not a trainer crash,
        restarted and forgotten), the trainer gets INTERNAL saying so, the daemon serves on."""
        log.exception("internal error in the trainer's %s call", call)
        what = clip(f"{type(e).__name__}: {e}", 200)
        run.internal_error(f"{what} in the trainer's {call} call")
        await context.abort(grpc.StatusCode.INTERNAL, f"peerd: internal error in {call}, a peerd bug: {what}; "
                                                      f"the run is stopped (the daemon log has the traceback)")

    async def ReportMetrics(self, request_iterator, context) -> cpb.MetricAck:
        async for metric in request_iterator:
            run = self._run(metric.session_id)
            if run is not None:
                run.api.on_metric(clean_metric(metric))
        return cpb.MetricAck()

    async def Directives(self, request: cpb.DirectivesRequest, context):
        run = await self._session(request.session_id, context)
        async for d in run.api.directives(context):
            yield d

    async def Direct(self, request: cpb.DirectRequest, context) -> cpb.DirectReply:
        run = self._run()
        if run is None or run.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "peerd: no training run active on this daemon")
        d = request.directive
        if d.kind not in DIRECTIVE_KINDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"peerd: directive.kind: {'unspecified' if d.kind == 0 else f'unknown kind {d.kind}'}"
                                f" (one of {', '.join(cpb.Directive.Kind.Name(k) for k in sorted(DIRECTIVE_KINDS))})")
        if d.iteration > MAX_ITERATIONS or len(d.reason) > MAX_TEXT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peerd: directive: iteration or reason out of range")
        return cpb.DirectReply(delivered=await run.api.direct(d))

    async def Revoke(self, request: cpb.RevokeRequest, context) -> cpb.RevokeReply:
        if self.revoke is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "peerd: this daemon keeps no revocations")
        added, why = self.revoke(request)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {why}")
        return cpb.RevokeReply(added=added, revoked_nodes=self.status().revoked_nodes)

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Status": unary(self.Status, cpb.StatusRequest, cpb.StatusReply),
            "Links": unary(self.Links, cpb.LinksRequest, cpb.LinksReply),
            "Attach": unary(self.Attach, cpb.AttachRequest, cpb.AttachReply),
            "Publish": unary(self.Publish, cpb.PublishRequest, cpb.PublishReply),
            "Mix": unary(self.Mix, cpb.MixRequest, cpb.MixReply),
            "Direct": unary(self.Direct, cpb.DirectRequest, cpb.DirectReply),
            "Swarm": unary(self.Swarm, cpb.SwarmRequest, cpb.SwarmReply),
            "Shutdown": unary(self.Shutdown, cpb.ShutdownRequest, cpb.ShutdownReply),
            "Revoke": unary(self.Revoke, cpb.RevokeRequest, cpb.RevokeReply),
            "Directives": unary_stream(self.Directives, cpb.DirectivesRequest, cpb.Directive),
            "Train": unary_stream(self.Train, cpb.TrainRequest, cpb.TrainProgress),
            "ReportMetrics": stream_unary(self.ReportMetrics, cpb.Metric, cpb.MetricAck),
        }
