"""The Train RPC (`peerd train`): find or form the run, start it, stream its progress, end it.

The caller leaving stops the run. A run whose trainer finished keeps answering its peers' pulls
and taking their updates, with its final parameters, for a bounded time (`train_drain_timeout`).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from peerd.node.run import autoplan, joining
from peerd.node.run.run import TrainingRun
from peerd.node.run.spec import RunError, RunSpec
from peerd.node.run_host import RunHost
from peerd.v1 import control_pb2 as cpb

log = logging.getLogger("peerd.train")


async def _placed(host: RunHost, spec: RunSpec, context):
    """Progress records while this host waits for its run (rejoin, late join, or a new one formed);
    the last item is the member table."""
    cfg = host.env.cfg
    started = time.monotonic()
    host.waiting = spec                     # DescribeRun tells the other hosts: a run forms among askers
    try:
        while True:
            try:
                nodes, why = await joining.place(host.env, host.rankings, spec)
            except joining.JoinRefused as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"peerd: {e}")
            if nodes is not None:
                yield nodes
                return
            waited = time.monotonic() - started
            if waited > spec.join_timeout:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"peerd: no run to take part in after {spec.join_timeout:.0f}s: {why}")
            yield cpb.TrainProgress(state="waiting", world=spec.world, elapsed_s=waited, message=why)
            await asyncio.sleep(cfg.train.join_retry)
    finally:
        if host.waiting is spec:
            host.waiting = None


async def serve_train(host: RunHost, request: cpb.TrainRequest, context: grpc.aio.ServicerContext) -> None:
    """The Train RPC: form the world, run the trainer, stream progress (context.write); the caller
    leaving stops it.

    A coroutine, not an async generator: when the caller goes away, gRPC cancels this task at the
    await it is in, and the `finally` below stops the run at once. (An async generator suspended at
    a yield is only closed when it is collected: a `peerd train` cancelled after its first reply
    left a run without a trainer that refused every later `peerd train`.)"""
    cfg = host.env.cfg
    try:
        spec = RunSpec.from_request(request, cfg.train.join_timeout, cfg.train.max_world, cfg.train.max_world_limit)
    except RunError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {e}")
    if host.training is not None:
        if not host.training.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "peerd: a training run is already active on this daemon")
        await host.training.stop()   # a finished run still serving its peers gives way
        host.end_run(host.training)
    auto = spec.algorithm == "auto"
    nodes: list[str] = []
    async for item in _placed(host, spec, context):
        if isinstance(item, list):
            nodes = item
        else:
            await context.write(item)
    inputs = None
    if auto and spec.algorithm != "auto":   # took the choice of the run it found (joining.place)
        msg = (f"auto: took {spec.algorithm} on {spec.topology}, the run's choice "
               f"(its first host plans for every host; see its log for the runner-up)")
        log.info("%s", msg)
        await context.write(cpb.TrainProgress(state="waiting", world=spec.world, message=msg))
    if spec.algorithm == "auto":
        try:
            inputs, msg = await _auto(host, spec, nodes)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: --algo auto: {e}")
        await context.write(cpb.TrainProgress(state="waiting", world=spec.world, message=msg))
    if host.training is not None:   # another Train formed a run while this one waited
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "peerd: a training run is already active on this daemon")
    try:
        run = TrainingRun(host.env, spec, nodes)
    except (ValueError, RunError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peerd: {e}")
    supervisor = None
    try:
        if inputs is not None:
            run.replanner = autoplan.Replanner(cfg, (spec.algorithm, spec.topology), inputs)
            run.replanner.last_check = time.monotonic()
        host.start_run(run)
        log.info("run %s (tag %s): rank %d, world %d, max %d, %s on %s, members %s", cfg.node.run_id, run.tag,
                 run.rank, spec.world, run.n, spec.algorithm, spec.topology, ", ".join(n or "-" for n in nodes))
        supervisor = asyncio.get_running_loop().create_task(run.supervise())
        how = "world formed" if run.rank < spec.world else "joined the run under way"
        await context.write(cpb.TrainProgress(state="waiting", rank=run.rank, world=sum(map(bool, run.nodes)),
                                              message=f"{how}: rank {run.rank} of {run.n}; starting the trainer"))
        async for progress in _progress(host, run):
            await context.write(progress)
    finally:
        if supervisor is not None:
            supervisor.cancel()
        # Shielded: a second cancellation (the daemon shutting down) cannot leave the run half-ended.
        await asyncio.shield(asyncio.get_running_loop().create_task(_end(host, run), name=f"end run {run.tag}"))


async def _end(host: RunHost, run: TrainingRun) -> None:
    """The Train call is over: a finished run drains in the background, any other one stops now."""
    if run.progress.state in ("done", "degraded") and host.training is run:
        # Our trainer is done, our peers may not be: keep answering their pulls and taking
        # their updates (with our final parameters) for a bounded time.
        run.draining = True
        asyncio.get_running_loop().create_task(_drain(host, run))
        return
    await run.stop()
    host.end_run(run)


async def _progress(host: RunHost, run: TrainingRun):
    """A progress record at every change, at least every train_progress_interval, until the run ends."""
    while not run.done.is_set():
        try:
            await asyncio.wait_for(run.changed.wait(), host.env.cfg.train.progress_interval)
        except asyncio.TimeoutError:
            pass
        run.changed.clear()
        if run.replanner is not None and run.replanner.due(time.monotonic()):
            note = await _replan(host, run)
            if note:
                msg = run.progress_message()
                msg.message = note
                yield msg
                continue
        yield run.progress_message()
    yield run.progress_message()


async def _drain(host: RunHost, run: TrainingRun) -> None:
    timeout = host.env.cfg.train.drain_timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and host.training is run and not run.drained():
        await asyncio.sleep(0.1)
    log.info("run %s drained after %.1fs", run.tag, timeout - (deadline - time.monotonic()))
    if host.training is run:
        await run.stop()
        host.end_run(run)


async def _auto(host: RunHost, spec: RunSpec, nodes: list[str]):
    """Resolve `--algo auto` into an algorithm and topology (see peerd.node.run.autoplan)."""
    cfg = host.env.cfg
    mean = float(spec.options.get("step_time", 0) or cfg.plan.default_step_time)
    std = float(spec.options.get("step_time_std", 0) or 0)
    nbytes = autoplan.model_bytes_of(spec.task, spec.options)
    inputs = autoplan.gather(host.env, nodes, nbytes, mean, std)
    best, second = await asyncio.to_thread(autoplan.decide, inputs, cfg)
    spec.algorithm, spec.topology = best.algorithm, best.topology
    for w in inputs.warnings:
        log.warning("auto plan: %s", w)
    msg = (f"auto: chose {autoplan.describe(best)}; runner-up {autoplan.describe(second)} "
           f"(model {nbytes / 1e6:.2f} MB, step {mean:.3f} s)")
    log.info("%s", msg)
    return inputs, msg


async def _replan(host: RunHost, run: TrainingRun) -> str | None:
    """A progress tick is the safe point: re-plan from current links and the measured step time."""
    rp = run.replanner
    p = run.progress
    last = rp.last
    mean = p.compute_s.mean if p.compute_s.n >= 5 else float(last.comp.mean[0])
    std = p.compute_s.spread if p.compute_s.n >= 5 else float(last.comp.std[0])
    nbytes = float(run.model_bytes()) or last.model_bytes
    current = autoplan.gather(host.env, run.nodes, nbytes, mean, std)
    try:
        return await asyncio.to_thread(rp.check, time.monotonic(), current)
    except ValueError as e:
        log.warning("re-plan failed: %s", e)
        return None
