"""The All-Reduce baseline: one rank of torch DDP over gloo, started the way torchrun users start it.

    python -m torch.distributed.run --nnodes N --node-rank R --master-addr IP --master-port P \
        --nproc-per-node 1 -m peerd.bench.ddp_worker --task digits-wide --iterations K ...

Like for like with `peerd train`: the same task, model and initial weights (seed), the same data
shard per rank (`task.shard(rank, world)`), batch size, optimizer and learning rate (the task's
defaults), and the same emulated compute (peerd/train/pace.py). The forward pass is padded to the
step's emulated compute time before `backward()`, whose gradient all-reduce DDP overlaps with the
(real, ~1 ms) backward pass. Every collective is bounded by the gloo timeout, so a lost rank ends
the run with an error instead of a hang.

Writes (paths given): a trace with one JSON line per iteration {"it", "start", "t", "compute_s", "mix_s"}
(mix_s: backward + all-reduce + optimizer step, the counterpart of peerd's mix), progress
records shaped like `peerd train --json` ({"t", "state", "iteration", "loss", "metric_name",
"metric", "rank"}), and, on rank 0, the final model's state dict.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from peerd.train.pace import Pace
from peerd.train import warmstart
from peerd.train.tasks import get_task


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="peerd.bench.ddp_worker")
    ap.add_argument("--task", required=True)
    ap.add_argument("--iterations", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--non-iid", action="store_true", help="label-sorted shards, as `peerd train --non-iid`")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--slowdown", type=float, default=float(os.environ.get("PEERD_SLOWDOWN", "1") or 1))
    ap.add_argument("--slow-prob", type=float, default=0.0)
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="gloo timeout, seconds")
    ap.add_argument("--model-size", default=None, help="gpt: as `peerd train --model-size`")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--eval-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--init", default=None, help="a warm start (weights, and Adam moments when it has them)")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--model-out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {k: v for k, v in (("model_size", args.model_size), ("context", args.context),
                                 ("eval_tokens", args.eval_tokens)) if v is not None}
    task = get_task(args.task, **options)
    hp = dict(task.defaults)
    batch_size = args.batch_size or hp.pop("batch_size", 32)
    inner = hp.pop("inner", "sgd")
    module = task.build(args.seed)
    warm = None
    if args.init:
        warm = warmstart.load_init(module, args.init)
    model = DDP(module)
    if inner == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp.get("momentum", 0.0),
                              weight_decay=hp.get("weight_decay", 0.0))
    elif inner in ("adam", "adamw"):   # peerd's adam with weight decay 0 is torch's Adam step for step
        opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=hp.get("betas", (0.9, 0.999)),
                                weight_decay=hp.get("weight_decay", 0.0))
        if warm is not None:
            warmstart.seed_torch_adam(opt, warm)
    else:
        raise SystemExit(f"task {args.task}: the DDP baseline implements sgd and adam(w), not {inner!r}")
    batches = task.batches(task.shard(rank, world, args.non_iid, args.seed), batch_size, args.seed)
    pace = Pace(args.step_time, max(1.0, args.slowdown), args.slow_prob, args.slow_factor, args.seed, rank)

    dist.barrier()  # every rank starts its first step together, as the peerd runs do
    with open(args.trace, "w") as trace, open(args.progress, "w") as progress:
        def report(it: int, loss: float, extra: dict[str, float], state: str = "training") -> None:
            name = "accuracy" if "accuracy" in extra else "loss" if "loss" in extra else ""
            rec = {"t": time.time(), "state": state, "iteration": it, "loss": loss, "rank": rank,
                   "metric_name": name, "metric": extra.get(name, 0.0)}
            progress.write(json.dumps(rec) + "\n")
            progress.flush()

        report(0, 0.0, {})
        for it in range(args.iterations):
            t0, started = time.perf_counter(), time.time()
            opt.zero_grad()
            loss = task.loss(model, next(batches))
            compute = pace.pad(it, t0)
            t_mix = time.perf_counter()
            loss.backward()                  # DDP all-reduces the gradients here
            opt.step()
            mix_s = time.perf_counter() - t_mix
            trace.write(json.dumps({"it": it + 1, "start": started, "t": time.time(), "compute_s": round(compute, 6),
                                    "mix_s": round(mix_s, 6)}) + "\n")
            trace.flush()                    # the benchmark shows progress from it
            extra = {}
            if args.eval_every and ((it + 1) % args.eval_every == 0 or it + 1 == args.iterations):
                extra = task.evaluate(model.module)
            report(it + 1, loss.item(), extra)
        trace.flush()
        report(args.iterations, loss.item(), {}, state="done")
    if rank == 0:
        torch.save({"model": model.module.state_dict()}, args.model_out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
