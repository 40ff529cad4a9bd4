"""The trainer process of a built-in task, as `peerd train` has the daemon spawn it.

    python -m peerd.train.worker --task digits --iterations 300 [--non-iid] [--eval-every 50]

It attaches to the daemon named in its environment, resumes from its last checkpoint when there
is one (a restart after a crash), honours the host's slowdown factor (PEERD_SLOWDOWN: each step
takes that many times its real compute time, for experiments), writes checkpoints atomically, and
reports loss and evaluation metrics to the daemon. At every iteration boundary it honours the
daemon's directives (`apply_directives`): pause until resume, skip to an iteration, checkpoint now,
stop cleanly after a final checkpoint. Benchmarks pace the steps (peerd/train/pace.py:
--step-time, --slow-prob, --slow-factor) and ask for a per-iteration trace (--trace: one JSON line
per iteration, {"it", "start", "t", "compute_s", "mix_s"}, in the checkpoint directory's trace.jsonl).
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from peerd.train.client import attach
from peerd.train.optim import DecentralizedOptimizer
from peerd.train.pace import Pace
from peerd.train.tasks import get_task
from peerd.v1 import control_pb2 as cpb

log = logging.getLogger("peerd.trainer")


class _Writes:
    """A file for torch.save that keeps the OSError of a failed write (ENOSPC, EIO): torch's zip
    writer replaces it with a RuntimeError that does not say what happened."""

    def __init__(self, fh) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.fh.flush()


def save_checkpoint(directory: Path, iteration: int, model: torch.nn.Module, opt: DecentralizedOptimizer) -> Path:
    """Write to a temporary file, fsync, rename: a crash or a full disk keeps the previous one."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "latest.pt"
    tmp = directory / f".latest.pt.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            out = _Writes(fh)
            try:
                torch.save({"iteration": iteration, "model": model.state_dict(), "optimizer": opt.state_dict()},
                           out)
            except RuntimeError:
                if out.error is not None:  # torch reports a failed write as "unexpected pos"
                    raise out.error from None
                raise
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a partial file would hold the space the next try needs
        if isinstance(e, OSError):
            log.error("CHECKPOINT FAILED at iteration %d (%s); the previous checkpoint is kept", iteration, e)
        raise
    return path


def load_checkpoint(directory: Path) -> dict | None:
    for stale in directory.glob(".latest.pt.tmp*"):   # a write cut short by a kill or a full disk
        stale.unlink(missing_ok=True)
    path = directory / "latest.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def apply_directives(exchange, opt: DecentralizedOptimizer, checkpoint, pause_timeout: float) -> bool:
    """Honour the pending directives at an iteration boundary; False: stop now (after a checkpoint).

    Pause blocks here until RESUME or STOP, at most `pause_timeout` seconds. RESUME and SKIP_TO
    move the next iteration forward to the directive's (never back)."""
    D = cpb.Directive
    pending = collections.deque(exchange.directives())
    paused, deadline = False, 0.0
    while True:
        if not pending:
            if not paused:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("paused %.0fs without a resume: resuming", pause_timeout)
                return True
            d = exchange.next_directive(min(left, 1.0))
            if d is not None:
                pending.append(d)
            continue
        d = pending.popleft()
        if d.kind == D.KIND_PAUSE:
            if not paused:
                log.info("paused at iteration %d", opt.iteration)
            paused, deadline = True, time.monotonic() + pause_timeout
        elif d.kind in (D.KIND_RESUME, D.KIND_SKIP_TO):
            if d.kind == D.KIND_RESUME:
                paused = False
            if d.iteration > opt.iteration:
                log.info("%s: continuing at iteration %d (was %d)", D.Kind.Name(d.kind), d.iteration, opt.iteration)
                opt.iteration = d.iteration
        elif d.kind == D.KIND_CHECKPOINT:
            log.info("checkpoint now (iteration %d): %s", opt.iteration, checkpoint())
        elif d.kind == D.KIND_STOP:
            log.info("stop at iteration %d: %s", opt.iteration, checkpoint())
            return False

def _terminated(*_: object) -> None:
    """SIGTERM from the daemon: leave now. Checkpoints are atomic, so nothing is torn; skipping
    the interpreter's teardown (torch, gRPC) keeps a stop within its bound on a loaded host."""
    logging.shutdown()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="peerd.train.worker")
    ap.add_argument("--task", required=True)
    ap.add_argument("--iterations", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--non-iid", action="store_true")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=int, default=int(os.environ.get("PEERD_CHECKPOINT_EVERY", "25")))
    ap.add_argument("--lr", type=float)
    ap.add_argument("--momentum", type=float)
    ap.add_argument("--optimizer")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--accum-iter", type=int)
    ap.add_argument("--step-time", type=float, default=0.0, help="pad each step to this many seconds (x slowdown)")
    ap.add_argument("--slow-prob", type=float, default=0.0, help="chance an iteration is --slow-factor slower")
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--trace", action="store_true", help="append one JSON line per iteration to trace.jsonl")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer: %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _terminated)
    torch.set_num_threads(1)

    task = get_task(args.task)
    exchange = attach()
    slowdown = float(os.environ.get("PEERD_SLOWDOWN", "1") or 1)
    ckpt_dir = Path(os.environ.get("PEERD_CHECKPOINT_DIR", "checkpoints"))
    defaults = dict(task.defaults)
    inner = args.optimizer or defaults.pop("inner", "sgd")
    batch_size = args.batch_size or defaults.pop("batch_size", 32)
    defaults.pop("inner", None)
    defaults.pop("batch_size", None)
    for key in ("lr", "momentum", "accum_iter"):
        if getattr(args, key) is not None:
            defaults[key] = getattr(args, key)

    model = task.build(args.seed)
    ckpt = load_checkpoint(ckpt_dir)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    opt = DecentralizedOptimizer(model.parameters(), exchange, inner, **defaults)
    if ckpt is not None:
        start = opt.iteration  # where the daemon's run is now: never go back before it
        opt.load_state_dict(ckpt["optimizer"])
        opt.iteration = max(opt.iteration, start)
        log.info("resumed from the checkpoint of iteration %d, continuing at %d", ckpt["iteration"], opt.iteration)
    if getattr(exchange, "join_note", ""):
        log.info("joined a running swarm: %s", exchange.join_note)
    rank, world = exchange.rank, exchange.world
    batches = task.batches(task.shard(rank, world, args.non_iid, args.seed), batch_size, args.seed)
    end = args.iterations
    log.info("rank %d of %d, task %s, optimizer %s, from iteration %d to %d, slowdown %.1fx",
             rank, world, args.task, inner, opt.iteration, end, slowdown)
    pace = Pace(args.step_time, max(1.0, slowdown), args.slow_prob, args.slow_factor, args.seed, rank)
    if args.trace:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    trace = open(ckpt_dir / "trace.jsonl", "a") if args.trace else None
    last_eval = opt.iteration
    pause_timeout = float(os.environ.get("PEERD_PAUSE_TIMEOUT", "3600"))
    failed_checkpoints = 0
    while opt.iteration < end:
        if not apply_directives(exchange, opt, lambda: save_checkpoint(ckpt_dir, opt.iteration, model, opt),
                                pause_timeout):
            break
        t0, started = time.perf_counter(), time.time()
        it = opt.iteration
        opt.zero_grad()                      # publishes x_k: the exchange overlaps forward/backward
        loss = task.loss(model, next(batches))
        loss.backward()
        compute_s = pace.pad(it, t0)         # the gradient alone, paced (what `peerd plan` models)
        t_mix = time.perf_counter()
        opt.step()                           # waits for the daemon's mix of x_k, applies it
        mix_s = time.perf_counter() - t_mix
        if trace is not None:
            trace.write(json.dumps({"it": opt.iteration, "start": started, "t": time.time(), "compute_s": round(compute_s, 6),
                                    "mix_s": round(mix_s, 6)}) + "\n")
            trace.flush()
        extra = {"compute_s": compute_s}
        if args.eval_every and (opt.iteration - last_eval >= args.eval_every or opt.iteration >= end):
            last_eval = opt.iteration
            extra.update({("accuracy" if k == "accuracy" else f"eval_{k}"): v for k, v in task.evaluate(model).items()})
        if args.checkpoint_every and opt.iteration % args.checkpoint_every == 0 or opt.iteration >= end:
            try:
                save_checkpoint(ckpt_dir, opt.iteration, model, opt)
            except OSError:
                failed_checkpoints += 1  # logged; training goes on, the daemon hears the count
        if failed_checkpoints:
            extra["checkpoint_failures"] = failed_checkpoints
        exchange.report(opt.iteration, loss.item(), step_time_s=time.perf_counter() - t0, **extra)
    exchange.close()
    if trace is not None:
        trace.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
