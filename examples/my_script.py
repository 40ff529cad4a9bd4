"""Your own model, trained together by every host of a peerd run.

On each host (with `peerd up` running):  peerd train --script examples/my_script.py --world 2
"""
import torch
from torch import nn

from peerd.train import DecentralizedOptimizer, attach

torch.set_num_threads(1)
exchange = attach()                                    # the daemon that started this script
torch.manual_seed(0)                                   # the same initial model on every host
model = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
opt = DecentralizedOptimizer(model.named_parameters(), exchange, "adam", lr=1e-2)

g = torch.Generator().manual_seed(exchange.rank)       # each host has its own data
x = torch.rand(2048, 2, generator=g) * 4 - 2
y = ((x.norm(dim=1) > 0.8) & (x.norm(dim=1) < 1.5)).long()
while opt.iteration < 300:
    idx = torch.randint(0, len(x), (64,), generator=g)
    opt.zero_grad()                                    # publishes x_k: the exchange overlaps backward
    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
    loss.backward()
    opt.step()                                         # x_{k+1} = mix_k - lr * adam_direction(x_k)
    exchange.report(opt.iteration, loss.item())        # shown by `peerd train`
accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"rank {exchange.rank}: accuracy {accuracy:.3f} on its own data after {opt.iteration} iterations")
