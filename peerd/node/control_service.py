"""Server side of the Control service on the daemon's unix socket (local clients only)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from peerd.node.rpc import unary

from peerd.v1 import control_pb2 as cpb

if TYPE_CHECKING:
    from peerd.node.daemon import Daemon


class ControlService:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon

    async def Status(self, request: cpb.StatusRequest, context) -> cpb.StatusReply:
        return self.d.status_message()

    async def Links(self, request: cpb.LinksRequest, context) -> cpb.LinksReply:
        return self.d.links_message()

    def _run(self, session: str = ""):
        run = self.d.training
        if run is None or (session and session != run.session):
            return None
        return run

    async def Train(self, request: cpb.TrainRequest, context):
        from peerd.node.training import serve_train
        async for progress in serve_train(self.d, request, context):
            yield progress

    async def Attach(self, request: cpb.AttachRequest, context) -> cpb.AttachReply:
        from peerd.train.flat import LayoutMismatch
        run = self._run()
        if run is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "peerd: no training run on this daemon (start one with `peerd train`)")
        if request.run_id and request.run_id != self.d.cfg.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peerd: trainer of run {request.run_id!r}, daemon runs {self.d.cfg.run_id!r}")
        try:
            reply = await run.attach(request)
        except (LayoutMismatch, ValueError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: refused attach: {e}")
        return await run.join_swarm(reply)   # a host joining a running swarm starts from it

    async def Publish(self, request: cpb.PublishRequest, context) -> cpb.PublishReply:
        from peerd.node.training import RunError
        run = self._run(request.session_id)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peerd: no session {request.session_id!r}")
        try:
            run.publish(request)
        except RunError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
        return cpb.PublishReply()

    async def Mix(self, request: cpb.MixRequest, context) -> cpb.MixReply:
        from peerd.node.training import RunError
        run = self._run(request.session_id)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peerd: no session {request.session_id!r}")
        try:
            return await run.mix(request)
        except RunError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")

    async def ReportMetrics(self, request_iterator, context) -> cpb.MetricAck:
        async for metric in request_iterator:
            run = self._run(metric.session_id)
            if run is not None:
                run.on_metric(metric)
        return cpb.MetricAck()

    async def Directives(self, request: cpb.DirectivesRequest, context):
        run = self._run(request.session_id)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"peerd: no session {request.session_id!r}")
        async for d in run.directives(context):
            yield d

    async def Direct(self, request: cpb.DirectRequest, context) -> cpb.DirectReply:
        run = self._run()
        if run is None or run.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "peerd: no training run active on this daemon")
        if request.directive.kind == cpb.Directive.KIND_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "peerd: directive.kind: unspecified")
        return cpb.DirectReply(delivered=await run.direct(request.directive))

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Status": unary(self.Status, cpb.StatusRequest, cpb.StatusReply),
            "Links": unary(self.Links, cpb.LinksRequest, cpb.LinksReply),
            "Attach": unary(self.Attach, cpb.AttachRequest, cpb.AttachReply),
            "Publish": unary(self.Publish, cpb.PublishRequest, cpb.PublishReply),
            "Mix": unary(self.Mix, cpb.MixRequest, cpb.MixReply),
            "Direct": unary(self.Direct, cpb.DirectRequest, cpb.DirectReply),
            "Directives": grpc.unary_stream_rpc_method_handler(
                self.Directives, request_deserializer=cpb.DirectivesRequest.FromString,
                response_serializer=cpb.Directive.SerializeToString),
            "Train": grpc.unary_stream_rpc_method_handler(
                self.Train, request_deserializer=cpb.TrainRequest.FromString,
                response_serializer=cpb.TrainProgress.SerializeToString),
            "ReportMetrics": grpc.stream_unary_rpc_method_handler(
                self.ReportMetrics, request_deserializer=cpb.Metric.FromString,
                response_serializer=cpb.MetricAck.SerializeToString),
        }
