"""The trainer process of a built-in task, as `peerd train` has the daemon spawn it.

    python -m peerd.train.worker --task digits --iterations 300 [--non-iid] [--eval-every 50]

It attaches to the daemon named in its environment, resumes from its last checkpoint when there
is one (a restart after a crash), honours the host's slowdown factor (PEERD_SLOWDOWN: each step
takes that many times its real compute time, for experiments), writes checkpoints atomically, and
reports loss and evaluation metrics to the daemon. Benchmarks pace the steps (peerd/train/pace.py:
--step-time, --slow-prob, --slow-factor) and ask for a per-iteration trace (--trace: one JSON line
per iteration, {"it", "start", "t", "compute_s"}, in the checkpoint directory's trace.jsonl).
"""
from __future__ import annotations

import argparse
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

log = logging.getLogger("peerd.trainer")


def save_checkpoint(directory: Path, iteration: int, model: torch.nn.Module, opt: DecentralizedOptimizer) -> Path:
    """Write to a temporary file, fsync, rename: a crash or a full disk keeps the previous one."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "latest.pt"
    tmp = directory / f".latest.pt.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save({"iteration": iteration, "model": model.state_dict(), "optimizer": opt.state_dict()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.error("checkpoint at iteration %d FAILED (%s); the previous checkpoint is kept", iteration, e)
        raise
    return path


def load_checkpoint(directory: Path) -> dict | None:
    path = directory / "latest.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


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
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
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
    while opt.iteration < end:
        t0, started = time.perf_counter(), time.time()
        it = opt.iteration
        opt.zero_grad()                      # publishes x_k: the exchange overlaps forward/backward
        loss = task.loss(model, next(batches))
        loss.backward()
        compute = pace.pad(it, t0)
        opt.step()
        if trace is not None:
            trace.write(json.dumps({"it": opt.iteration, "start": started, "t": time.time(), "compute_s": round(compute, 6)}) + "\n")
            trace.flush()
        extra = {}
        if args.eval_every and (opt.iteration - last_eval >= args.eval_every or opt.iteration >= end):
            last_eval = opt.iteration
            extra = {("accuracy" if k == "accuracy" else f"eval_{k}"): v for k, v in task.evaluate(model).items()}
        exchange.report(opt.iteration, loss.item(), step_time_s=time.perf_counter() - t0, **extra)
        if args.checkpoint_every and opt.iteration % args.checkpoint_every == 0 or opt.iteration >= end:
            save_checkpoint(ckpt_dir, opt.iteration, model, opt)
    exchange.close()
    if trace is not None:
        trace.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
