"""Train your own model with peerd's DecentralizedOptimizer: 4 workers, one process, a ring.

Each worker runs the ordinary torch loop on its own data; the only peerd-specific lines are the
optimizer and where it gets its exchange. Here the exchange is an in-process LocalGroup; on real
hosts the worker would get it from the local daemon instead.

    PYTHONPATH=. python examples/train_own_model.py
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from peerd.train import DecentralizedOptimizer, LocalGroup
from peerd.train.tasks import average_model, consensus_distance


def make_data(seed: int, n: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Points in the plane; class 1 inside a ring-shaped band. Each worker has its own sample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    r = x.norm(dim=1)
    return x, ((r > 0.8) & (r < 1.5)).long()


def make_model() -> nn.Module:
    torch.manual_seed(0)                       # every worker starts from the same model
    return nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def worker(rank: int, model: nn.Module, group: LocalGroup, steps: int) -> None:
    opt = DecentralizedOptimizer(model.named_parameters(), group.worker(rank), "adam", lr=1e-2)
    x, y = make_data(seed=rank)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,), generator=g)
        opt.zero_grad()                        # also publishes x_k: the exchange overlaps backward
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()                             # x_{k+1} = mix_k - lr * adam_direction(x_k)


def main(world: int = 4, steps: int = 300) -> float:
    torch.set_num_threads(1)                   # tiny model: one thread per worker is fastest
    group = LocalGroup(world, "ring")
    models = [make_model() for _ in range(world)]    # built here: torch's global RNG is not per thread
    threads = [threading.Thread(target=worker, args=(r, m, group, steps)) for r, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    x, y = make_data(seed=999)
    with torch.no_grad():
        acc = (average_model(models)(x).argmax(1) == y).float().mean().item()
    dist = consensus_distance([torch.nn.utils.parameters_to_vector(m.parameters()) for m in models])
    print(f"{world} workers, {steps} steps: averaged model accuracy {acc:.3f}, "
          f"consensus distance {dist:.4f}")
    return acc


if __name__ == "__main__":
    main()
