"""Warm starts: one model trained in one process, saved with its Adam moments, so that every
contender of a benchmark starts from the same weights *and* the same optimizer state.

Why the moments: a warm start of weights alone restarts Adam from zero moments, and its first
steps (bias-corrected, at a small batch) throw the loss back up (2.78 -> 3.07 nats with the small
gpt) before it recovers; every contender pays that shock and a short benchmark mostly measures it.

The file: {"model": state_dict, "adam": {"step": t, "exp_avg": {name: tensor}, "exp_avg_sq":
{name: tensor}}, "meta": {...}}. `--init` takes it (or a bare state_dict, or a trainer checkpoint:
weights only). `load_init()` loads the weights and returns the moments for
`DecentralizedOptimizer.seed_moments`, `OuterOptimizer.seed_moments` and the DDP baseline.
"""
from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from peerd.files import atomic_write

log = logging.getLogger("peerd.train.warmstart")

# (Adam's step count, {id(parameter): (exp_avg, exp_avg_sq)})
Moments = tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def load_init(model: torch.nn.Module, path: str | Path) -> Moments | None:
    """Start `model` from the weights in `path` (a warm start, a state_dict, or a trainer
    checkpoint's "model"; strict: a file of another model size fails, naming the parameters) and
    return the warm start's Adam moments for its parameters, or None when the file has none. One
    read of the file for both."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    weights = state["model"] if isinstance(state, dict) and isinstance(state.get("model"), dict) else state
    model.load_state_dict(weights)
    adam = state.get("adam") if isinstance(state, dict) else None
    if not adam:
        return None
    out = {}
    for name, p in model.named_parameters():
        pair = []
        for key in ("exp_avg", "exp_avg_sq"):
            t = adam[key].get(name)
            if t is None or t.shape != p.shape:
                raise ValueError(f"{path}: Adam {key} of {name!r} is "
                                 f"{'missing' if t is None else tuple(t.shape)}, the model's is {tuple(p.shape)}")
            pair.append(t)
        out[id(p)] = (pair[0], pair[1])
    return int(adam["step"]), out


def seed_torch_adam(opt: torch.optim.Optimizer, warm: Moments) -> None:
    """Give a torch Adam/AdamW the warm start's moments for each of its parameters."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"a warm start's Adam moments need an Adam optimizer, not {type(opt).__name__}")
    step, by_param = warm
    for group in opt.param_groups:
        for p in group["params"]:
            m, v = by_param[id(p)]
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": m.to(p.device, p.dtype).clone(),
                            "exp_avg_sq": v.to(p.device, p.dtype).clone()}


def make(task, steps: int, batch_size: int, out: str | Path, *, seed: int = 0, lr: float | None = None,
         eval_every: int = 40, echo: Callable[[str], None] = print) -> dict:
    """Train `task`'s model from scratch in this process with Adam (the task's betas) for `steps`
    steps and write the warm start to `out`. Returns its metadata (evaluations included)."""
    d = task.defaults
    lr = lr or d["lr"]
    model = task.build(seed)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr, betas=d.get("betas", (0.9, 0.999)))
    batches = task.batches(task.shard(0, 1, False, seed), batch_size, seed)
    evals = [(0, task.evaluate(model)["loss"])]
    echo(f"warm start: {steps} steps of batch {batch_size}, lr {lr:g}; validation loss {evals[0][1]:.4f} at step 0")
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        opt.zero_grad()
        task.loss(model, next(batches)).backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            evals.append((step, task.evaluate(model)["loss"]))
            left = (time.monotonic() - t0) / step * (steps - step)
            echo(f"  step {step}/{steps}: validation loss {evals[-1][1]:.4f} ({time.monotonic() - t0:.0f}s, "
                 f"~{left:.0f}s left)")
    names = {id(p): n for n, p in model.named_parameters()}
    adam = {"step": steps, "exp_avg": {}, "exp_avg_sq": {}}
    for p in params:
        s = opt.state[p]
        adam["exp_avg"][names[id(p)]] = s["exp_avg"].detach().clone()
        adam["exp_avg_sq"][names[id(p)]] = s["exp_avg_sq"].detach().clone()
    meta = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "evals": evals,
            "seconds": round(time.monotonic() - t0, 1), "describe": task.describe() if hasattr(task, "describe") else ""}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "adam": adam, "meta": meta}, buf)
    atomic_write(out, buf.getbuffer())
    echo(f"warm start written to {out}: validation loss {evals[-1][1]:.4f} after {steps} steps")
    return meta
