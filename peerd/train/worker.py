"""The trainer process of a built-in task, as `peerd train` has the daemon spawn it.

    python -m peerd.train.worker --task digits --iterations 300 [--non-iid] [--eval-every 50]
    python -m peerd.train.worker --task gpt --model-size small --device auto --iterations 1000

It attaches to the daemon named in its environment, resumes from its last checkpoint when there
is one (a restart after a crash), honours the host's slowdown factor (PEERD_SLOWDOWN: each step
takes that many times its real compute time, for experiments), writes checkpoints atomically, and
reports loss and evaluation metrics to the daemon. At every iteration boundary it honours the
daemon's directives (`apply_directives`): pause until resume, skip to an iteration, checkpoint now,
stop cleanly after a final checkpoint. Benchmarks pace the steps (peerd/train/pace.py:
--step-time, --slow-prob, --slow-factor) and ask for a per-iteration trace (--trace: one JSON line
per iteration, {"it", "start", "t", "compute_s", "mix_s"}, in the checkpoint directory's trace.jsonl).

Devices (--device auto|cpu|cuda, auto by default: CUDA when present): on a GPU the model and its
flat buffer live on the device and the exchange goes through host memory on a copy stream of its
own (peerd.train.device.StagedExchange; the trace then also carries each iteration's copy times
and how much of them overlapped compute). On the CPU the parameters live in the daemon's
shared-memory slot and nothing is copied. Tasks with options (gpt: --model-size, --context,
--eval-tokens) take them here; a task's unigram baseline (gpt) is reported with every evaluation.
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
from peerd.train.device import DEVICES, StagedExchange, make_engine, resolve_device
from peerd.train.optim import DecentralizedOptimizer
from peerd.train.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM, OuterOptimizer
from peerd.train.pace import Pace
from peerd.train import warmstart
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    ap.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)} or cuda:N (auto: CUDA when present)")
    ap.add_argument("--staging", default="auto", choices=("auto", "none", "thread"),
                    help="auto: copy through a CUDA stream on a GPU, none on the CPU; thread: the GPU path's "
                         "staged exchange on the CPU, copies on a thread (tests, `peerd bench device`)")
    ap.add_argument("--model-size", help="gpt: tiny, small (default), base")
    ap.add_argument("--context", type=int, help="gpt: sequence length (default: the model size's)")
    ap.add_argument("--eval-tokens", type=int, help="gpt: validation bytes per evaluation")
    ap.add_argument("--outer", default="none", choices=("none", "diloco"),
                    help="diloco: many inner steps between syncs, outer Nesterov on the mixed models "
                         "(peerd.train.outer); --iterations then counts syncs")
    ap.add_argument("--inner-steps", type=int, default=0, help="diloco: inner steps per round (a fixed H)")
    ap.add_argument("--round-seconds", type=float, default=0.0,
                    help="diloco: seconds of inner steps per round (a time budget: slow hosts take fewer steps)")
    ap.add_argument("--fragments", type=int, default=1, help="diloco: sync the model in this many fragments, in turn")
    ap.add_argument("--overlap", type=int, default=0, help="diloco: inner steps a sync's exchange overlaps")
    ap.add_argument("--outer-lr", type=float, help="diloco: outer learning rate (default: the task's, else 0.7)")
    ap.add_argument("--outer-momentum", type=float,
                    help="diloco: outer Nesterov momentum (default: the task's, else 0.9)")
    ap.add_argument("--init", help="start from these model weights (a state_dict or a trainer checkpoint) "
                                   "unless this run's own checkpoint exists")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer: %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _terminated)
    torch.set_num_threads(1)

    task = get_task(args.task, model_size=args.model_size, context=args.context, eval_tokens=args.eval_tokens)
    device = resolve_device(args.device)
    engine = make_engine(device, args.staging)
    exchange = attach()
    if engine is not None:
        exchange = StagedExchange(exchange, device, engine)
    slowdown = float(os.environ.get("PEERD_SLOWDOWN", "1") or 1)
    ckpt_dir = Path(os.environ.get("PEERD_CHECKPOINT_DIR", "checkpoints"))
    inner, batch_size, defaults = optimizer_settings(task, args)

    model, opt = build_model_and_optimizer(args, task, device, exchange, ckpt_dir, inner, defaults)
    if getattr(exchange, "join_note", ""):
        log.info("joined a running swarm: %s", exchange.join_note)
    rank, world = exchange.rank, exchange.world
    shard = task.shard(rank, world, args.non_iid, args.seed)
    batches = task.batches(shard, batch_size, args.seed)
    end = args.iterations
    log.info("rank %d of %d, task %s, optimizer %s, from iteration %d to %d, slowdown %.1fx, device %s%s",
             rank, world, args.task, inner, opt.iteration, end, slowdown, device,
             f" (copies: {engine.kind}, host memory {'pinned in place' if exchange.direct else 'bounced'})"
             if engine is not None else "")
    baseline = describe_task(task, shard)
    pace = Pace(args.step_time, max(1.0, slowdown), args.slow_prob, args.slow_factor, args.seed, rank)
    if args.trace:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    trace = open(ckpt_dir / "trace.jsonl", "a") if args.trace else None
    last_eval = opt.iteration
    pause_timeout = float(os.environ.get("PEERD_PAUSE_TIMEOUT", "3600"))
    failed_checkpoints = 0
    outer = args.outer != "none"
    while opt.iteration < end:
        if not apply_directives(exchange, opt, lambda: save_checkpoint(ckpt_dir, opt.iteration, model, opt),
                                pause_timeout):
            break
        t0, started = time.perf_counter(), time.time()
        it = opt.iteration
        opt.zero_grad()                      # publishes x_k: the exchange overlaps forward/backward (not diloco)
        loss = task.loss(model, tuple(t.to(device, non_blocking=True) for t in next(batches)))
        loss.backward()
        if engine is not None:
            engine.sync_compute()            # a GPU runs behind the host: time the gradient, not its launch
        compute_s = pace.pad(opt.steps if outer else it, t0)   # the gradient alone, paced (what `peerd plan` models)
        t_mix = time.perf_counter()
        synced = opt.step()                  # waits for the daemon's mix of x_k, applies it (diloco: at a sync)
        mix_s = time.perf_counter() - t_mix
        if trace is not None:
            line = {"it": opt.iteration, "start": started, "t": time.time(), "compute_s": round(compute_s, 6),
                    "mix_s": round(mix_s, 6)}
            times = exchange.last_times() if engine is not None else None
            if times is not None:            # the copies of an earlier iteration (read once complete)
                line["copies"] = {"it": times.iteration, **times.as_dict()}
            trace.write(json.dumps(line) + "\n")
            trace.flush()
        if outer and not synced:             # diloco: evaluations and checkpoints only when a sync advanced
            exchange.report(opt.iteration, loss.item(), step_time_s=time.perf_counter() - t0, compute_s=compute_s)
            continue
        extra = {"compute_s": compute_s}
        if args.eval_every and (opt.iteration - last_eval >= args.eval_every or opt.iteration >= end):
            last_eval = opt.iteration
            metrics = task.evaluate(model)
            extra.update({("accuracy" if k == "accuracy" else f"eval_{k}"): v for k, v in metrics.items()})
            extra.update(baseline)
            if "bpb" in metrics:
                log.info("iteration %d: validation loss %.4f, %.3f bits per byte%s", opt.iteration, metrics["loss"],
                         metrics["bpb"], "".join(f", {k} {v:.3f}" for k, v in baseline.items()))
        if args.checkpoint_every and opt.iteration % args.checkpoint_every == 0 or opt.iteration >= end:
            try:
                save_checkpoint(ckpt_dir, opt.iteration, model, opt)
            except OSError:
                failed_checkpoints += 1  # logged; training goes on, the daemon hears the count
        if failed_checkpoints:
            extra["checkpoint_failures"] = failed_checkpoints
        exchange.report(opt.iteration, loss.item(), step_time_s=time.perf_counter() - t0, **extra)
    if outer:
        opt.finish()
        log.info("diloco: %s", opt.summary())
    exchange.close()
    if trace is not None:
        trace.close()
    return 0


def build_model_and_optimizer(args, task, device, exchange, ckpt_dir: Path, inner: str, defaults: dict):
    """The model and its optimizer where this run stands: from our checkpoint (a restart), else from
    `--init` (weights, and Adam's moments when the warm start has them), else from the seed."""
    model = task.build(args.seed)
    ckpt = load_checkpoint(ckpt_dir)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    warm = None
    if ckpt is None and args.init:
        warm = warmstart.load_init(model, args.init)
        log.info("initial weights from %s", args.init)
    model.to(device)
    opt = make_optimizer(args, task, model, exchange, inner, defaults)
    if warm is not None:
        try:
            opt.seed_moments(warm)
            log.info("Adam moments from the warm start (its step %d)", warm[0])
        except ValueError as e:
            log.warning("the warm start's Adam moments are not used: %s", e)
    if ckpt is not None:
        start = opt.iteration  # where the daemon's run is now: never go back before it
        opt.load_state_dict(ckpt["optimizer"])
        opt.iteration = max(opt.iteration, start)
        log.info("resumed from the checkpoint of iteration %d, continuing at %d", ckpt["iteration"], opt.iteration)
    return model, opt


def optimizer_settings(task, args) -> tuple[str, int, dict]:
    """The inner optimizer's name, the batch size and the optimizer's settings: the task's, with
    the command line's on top."""
    defaults = dict(task.defaults)
    inner = args.optimizer or defaults.pop("inner", "sgd")
    batch_size = args.batch_size or defaults.pop("batch_size", 32)
    defaults.pop("inner", None)
    defaults.pop("batch_size", None)
    for key in ("lr", "momentum", "accum_iter"):
        if getattr(args, key) is not None:
            defaults[key] = getattr(args, key)
    return inner, batch_size, defaults


def describe_task(task, shard) -> dict[str, float]:
    """Log what the task trains on; its baseline metrics (gpt: the unigram model's), or {}."""
    if hasattr(task, "describe"):
        log.info("%s", task.describe())
    if hasattr(task, "corpus"):
        c = task.corpus()
        log.info("corpus %s: %d files, %.1f MB, sha256 %s%s; shard: %d files, %.2f MB", c.directory, len(c.files),
                 c.nbytes / 1e6, c.content_sha[:16], f", built in {c.build_s:.1f}s" if c.build_s else "",
                 len(shard.files), len(shard) / 1e6)
    if not hasattr(task, "baseline"):
        return {}
    baseline = task.baseline(shard)
    log.info("baseline on the validation windows: %s", baseline)
    return baseline


def make_optimizer(args, task, model, exchange, inner: str, defaults: dict):
    """DecentralizedOptimizer (one mix per step), or with --outer diloco an OuterOptimizer whose
    inner optimizer takes the task's settings."""
    if args.outer == "none":
        return DecentralizedOptimizer(model.parameters(), exchange, inner, **defaults)
    kw = {k: defaults[k] for k in ("lr", "betas", "weight_decay", "momentum") if k in defaults}
    if inner not in ("sgd", "adam", "adamw"):
        raise SystemExit(f"--outer diloco takes the inner optimizer sgd, adam or adamw, not {inner!r}")
    task_lr, task_momentum = getattr(task, "outer_step", (DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM))
    outer_lr = task_lr if args.outer_lr is None else args.outer_lr
    outer_momentum = task_momentum if args.outer_momentum is None else args.outer_momentum
    try:
        opt = OuterOptimizer(model.parameters(), exchange, inner, outer_lr=outer_lr,
                             outer_momentum=outer_momentum, inner_steps=args.inner_steps,
                             round_seconds=args.round_seconds, fragments=args.fragments, overlap=args.overlap, **kw)
    except ValueError as e:
        raise SystemExit(f"--outer diloco: {e}") from None
    log.info("diloco: %s, %d fragment(s), overlap %d, outer lr %g momentum %g%s, inner %s",
             f"{args.inner_steps} inner steps per round" if args.inner_steps else f"rounds of {args.round_seconds:g}s",
             args.fragments, args.overlap, outer_lr, outer_momentum,
             f" (the {task.name} task's)" if None in (args.outer_lr, args.outer_momentum) and hasattr(task, "outer_step") else "", inner)
    return opt


if __name__ == "__main__":
    sys.exit(main())
