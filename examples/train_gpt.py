"""The built-in GPT on the stdlib corpus, trained from your own script with DecentralizedOptimizer.

On each host (with `peerd up` running):  peerd train --script examples/train_gpt.py --world 4
Options go to the script:  --script examples/train_gpt.py --script=--size=small --script=--iterations=2000
"""
import argparse

import torch

from peerd.train import DecentralizedOptimizer, attach
from peerd.train.device import StagedExchange, make_engine, resolve_device
from peerd.train.lm import StdlibGPT, sample

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="tiny")             # tiny (0.45M parameters), small (25.5M), base (99.8M)
ap.add_argument("--iterations", type=int, default=300)
args = ap.parse_args()

torch.set_num_threads(1)
exchange = attach()                                   # the daemon that started this script
device = resolve_device("auto")                       # CUDA when present, else the CPU
if (engine := make_engine(device)) is not None:       # on a GPU: x_k and the mix travel on a copy stream
    exchange = StagedExchange(exchange, device, engine)
task = StdlibGPT(args.size)
model = task.build(seed=0).to(device)                 # the same initial model on every host
opt = DecentralizedOptimizer(model.named_parameters(), exchange, "adam", lr=task.defaults["lr"], betas=(0.9, 0.95))
shard = task.shard(exchange.rank, exchange.world)     # this host's own files of the corpus
batches = task.batches(shard, batch_size=task.defaults["batch_size"], seed=exchange.rank)
while opt.iteration < args.iterations:
    opt.zero_grad()                                   # publishes x_k: the exchange overlaps backward
    loss = task.loss(model, next(batches))
    loss.backward()
    opt.step()                                        # x_{k+1} = mix_k - lr * adam_direction(x_k)
    extra = {}
    if opt.iteration % 100 == 0 or opt.iteration >= args.iterations:
        extra = {f"eval_{k}": v for k, v in task.evaluate(model).items()}   # eval_loss, eval_bpb
    exchange.report(opt.iteration, loss.item(), **extra)                    # shown by `peerd train`
val = task.evaluate(model)
print(f"rank {exchange.rank}: validation {val['bpb']:.3f} bits per byte "
      f"(unigram baseline {task.baseline(shard)['unigram_bpb']:.3f}) after {opt.iteration} iterations")
print(sample(model, "def __init__(self", length=120))
exchange.close()
