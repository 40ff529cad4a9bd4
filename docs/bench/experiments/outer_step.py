"""Which outer step `--outer diloco` should take on a built-in task: DiLoCo's Nesterov step
(lr 0.7, momentum 0.9), a lighter momentum, or plain averaging (lr 1, no momentum).

In-process (peerd.train.tasks.train_outer_local): `world` hosts as threads on the complete graph,
each with the real OuterOptimizer and the task's own inner optimizer and batch size, fixed H. Prints a
markdown table of the final metric per seed (accuracy, or validation loss for lm).

    .venv/bin/python docs/bench/experiments/outer_step.py [TASK] [SEEDS]     # digits, 3
"""
from __future__ import annotations

import sys
import time

import torch

from peerd.train.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM
from peerd.train.tasks import get_task, train_outer_local

STEPS = {"DiLoCo (0.7, 0.9)": (DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM), "momentum 0.5 (0.7, 0.5)": (0.7, 0.5),
         "averaging (1, 0)": (1.0, 0.0)}
SCHEDULES = [(8, 10), (20, 10), (50, 10), (8, 40)]   # (H, rounds)


def run(task, H: int, rounds: int, outer: tuple[float, float], seed: int, world: int = 2) -> float:
    models = train_outer_local(task, world, rounds, H, *outer, seed=seed)
    metrics = task.evaluate(models[0])
    return metrics.get("accuracy", metrics["loss"])


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "digits"
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    task = get_task(name)
    torch.set_num_threads(1)
    metric = "accuracy" if hasattr(task, "classes") else "validation loss"
    print(f"task {name}, 2 hosts on the complete graph, inner {task.defaults}; final {metric}, seeds 0-{seeds - 1}\n")
    print("| H | rounds | " + " | ".join(STEPS) + " |")
    print("|---:|---:|" + "---|" * len(STEPS))
    t0 = time.monotonic()
    for H, rounds in SCHEDULES:
        cells = []
        for outer in STEPS.values():
            vals = [run(task, H, rounds, outer, s) for s in range(seeds)]
            cells.append(" ".join(f"{v:.3f}" for v in vals))
        print(f"| {H} | {rounds} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
