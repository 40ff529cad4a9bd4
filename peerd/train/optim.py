"""DecentralizedOptimizer: a torch optimizer whose step mixes parameters with other workers.

Per iteration k (Decent-DP's communicate-while-adapt schema, D-PSGD's rule)::

    opt.zero_grad()      # zeroes grads and publishes x_k: the exchange runs during forward/backward
    loss(model(x), y).backward()
    opt.step()           # waits for mix_k, then x_{k+1} = mix_k - lr * d(x_k)

d is the inner optimizer's direction from the gradient at x_k, computed with local state only:
- "sgd": torch.optim.SGD's rule (momentum, nesterov, weight decay added to the gradient).
- "adam" (DAdam): Adam with local moments and bias correction; only parameters are mixed.
- "accumadam": AccumAdam (papers.md 4.5): parameters move every step with the fresh gradient,
  the moments absorb the block-averaged gradient every ``accum_iter`` steps.
- "adamw" / "accumadamw": the same with decoupled weight decay, x_{k+1} = (1-lr*wd) mix_k - lr*d.
- any torch.optim.Optimizer instance over the same parameters: it steps x_k to x'_k and we set
  x_{k+1} = mix_k + (x'_k - x_k), which is the rule above for whatever d it implements.

Design choices:
- Parameters are views into one flat buffer (peerd.train.flat); the built-in rules run a few
  tensor ops per (group, dtype) segment, no per-parameter Python loop.
- Weight decay as L2 uses x_k, the point where the gradient was taken, so with an identity mix
  the result equals torch's SGD/Adam/AdamW step for step.
- If ``step()`` runs without a publish for k (no ``zero_grad``/``begin_step``), it publishes then
  (correct, without overlap; counted as ``late_publishes``).
- A gradient holding NaN/Inf is not applied: x_{k+1} = mix_k, states untouched, counted. A mix
  result holding NaN/Inf (an exchange should never return one) is not applied either: the step
  then starts from x_k, counted as ``nonfinite_mix``.
- Bias corrections count local updates, not iterations, so a skip (``MixResult.skip_to``)
  moves the iteration counter without touching the moments' step count.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from peerd.train.exchange import Exchange, MixResult
from peerd.train.flat import FlatParams, all_finite

_RULES = {"sgd": "sgd", "adam": "adam", "dadam": "adam", "adamw": "adamw", "dadamw": "adamw",
          "accumadam": "accumadam", "accumadamw": "accumadamw"}


class DecentralizedOptimizer(torch.optim.Optimizer):
    """``DecentralizedOptimizer(params, exchange, inner="sgd", lr=..., ...)``.

    params: ``model.parameters()``, ``model.named_parameters()`` (names show in layout errors) or
    torch-style groups (per-group lr, momentum, betas, weight_decay; LR schedulers work).
    exchange: this worker's ``Exchange`` (``LocalGroup(...).worker(rank)``, or the daemon's).
    inner: "sgd", "adam" (DAdam), "adamw", "accumadam", "accumadamw", or a torch optimizer built
    over the same parameters (then its own hyper-parameters apply and the keywords are unused).
    ``iteration`` is the exchange iteration k, ``local_steps`` the number of applied updates,
    ``stats`` the counters (late publishes, NaN/Inf refused, dropped neighbour buffers, skips).
    """

    def __init__(self, params: Iterable[Any] | None, exchange: Exchange,
                 inner: str | torch.optim.Optimizer = "sgd", *, lr: float = 1e-3,
                 momentum: float = 0.0, nesterov: bool = False,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, accum_iter: int = 4, skip_nonfinite: bool = True):
        self.torch_inner: torch.optim.Optimizer | None = None
        if isinstance(inner, torch.optim.Optimizer):
            self.torch_inner = inner
            self.rule = "torch"
            if params is not None:
                mine = {id(p) for p in _flatten_params(params)}
                theirs = {id(p) for g in inner.param_groups for p in g["params"]}
                if mine != theirs:
                    raise ValueError("params differ from the inner optimizer's parameters "
                                     f"({len(mine)} given, {len(theirs)} in the inner optimizer)")
            super().__init__(inner.param_groups, {})
        else:
            if inner not in _RULES:
                raise ValueError(f"unknown inner optimizer {inner!r}: one of {sorted(_RULES)} "
                                 "or a torch.optim.Optimizer")
            self.rule = _RULES[inner]
            if lr < 0 or eps < 0 or weight_decay < 0 or not 0 <= momentum < 1:
                raise ValueError(f"bad hyper-parameter: lr={lr}, momentum={momentum}, eps={eps}, "
                                 f"weight_decay={weight_decay}")
            if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
                raise ValueError(f"betas must lie in [0, 1), got {betas}")
            if accum_iter < 1:
                raise ValueError(f"accum_iter must be >= 1, got {accum_iter}")
            if nesterov and momentum <= 0:
                raise ValueError("nesterov needs momentum > 0")
            defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, betas=betas, eps=eps,
                            weight_decay=weight_decay, accum_iter=accum_iter)
            super().__init__(params, defaults)
        groups = [list(g["params"]) for g in self.param_groups]
        names = None
        if all("param_names" in g for g in self.param_groups):
            names = [list(g["param_names"]) for g in self.param_groups]
        self.flat = FlatParams(groups, names)
        self._frozen = True
        self.layout = self.flat.layout
        self.exchange = exchange
        self.iteration = exchange.attach(self.layout)
        home = getattr(exchange, "param_home", None)
        if home is not None and (buf := home(self.flat.device)) is not None:
            self.flat.rehome(buf)     # x lives where the exchange reads it: publish copies nothing
        initial = getattr(exchange, "initial", None)
        if initial is not None:       # joining a running swarm: start from the neighbours' parameters
            self.flat.buffer.copy_(initial)
        self.local_steps = 0
        self.skip_nonfinite = skip_nonfinite
        self.stats = dict(steps=0, late_publishes=0, nonfinite_grads=0, nonfinite_mix=0, dropped=0,
                          unmixed=0, skips=0)
        self._published = False
        self._x = self.flat.views(self.flat.buffer)
        self._g = self.flat.views(self.flat.grad_buffer)
        self._bufs: dict[str, list[torch.Tensor]] = {}
        self._save: torch.Tensor | None = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen", False):
            raise RuntimeError("parameter groups are fixed once the flat buffer is built; "
                               "create a new DecentralizedOptimizer instead")
        super().add_param_group(param_group)

    # -- the two calls of an iteration ------------------------------------------------------
    def begin_step(self) -> None:
        """Publish x_k (once per iteration). ``zero_grad`` calls this."""
        if not self._published:
            self.exchange.publish(self.iteration, self.flat.buffer)
            self._published = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient in place (grads stay views; set_to_none is ignored) and publish."""
        self.flat.zero_grad()
        self.begin_step()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._published:
            self.stats["late_publishes"] += 1
            self.begin_step()
        if not self.flat.grads_in_place():
            self.flat.repair_grads()
        res = self.exchange.mix(self.iteration)
        if res.iteration != self.iteration:
            raise RuntimeError(f"exchange answered iteration {res.iteration} to a mix of {self.iteration}")
        finite = True
        if self.skip_nonfinite:
            finite = all(all_finite(g) for g in self._g)
        if res.staged is not None and finite and self.rule != "torch":
            self.local_steps += 1
            self._update_staged(res)
        else:
            if res.staged is not None:
                res.staged.arrive_all()
            mix = self._mix_views(res)
            if finite:
                self.local_steps += 1
                self._update(mix)
            else:
                self.stats["nonfinite_grads"] += 1
                for x, m in zip(self._x, mix):
                    if m is not x:
                        x.copy_(m)
            if res.staged is not None:
                res.staged.applied(len(res.staged.chunks) - 1)
        self.stats["steps"] += 1
        self.stats["dropped"] += res.dropped
        if res.params is None:
            self.stats["unmixed"] += 1
        if res.skip_to is not None:
            if res.skip_to <= self.iteration:
                raise RuntimeError(f"skip to iteration {res.skip_to} from {self.iteration} goes backwards")
            self.stats["skips"] += 1
            self.iteration = res.skip_to
        else:
            self.iteration += 1
        self._published = False
        return loss

    # -- internals ----------------------------------------------------------------------------
    def _mix_views(self, res: MixResult) -> list[torch.Tensor]:
        if res.params is None:
            return self._x
        buf = res.params
        if buf.device != self.flat.device:
            buf = buf.to(self.flat.device, non_blocking=True)
        views = self.flat.views(buf)
        if not all(all_finite(v) for v in views):   # an exchange must not do this; never apply it
            self.stats["nonfinite_mix"] += 1
            return self._x
        return views

    def _state(self, name: str) -> list[torch.Tensor]:
        if name not in self._bufs:
            self._bufs[name] = [torch.zeros_like(x) for x in self._x]
        return self._bufs[name]

    def _update_staged(self, res: MixResult) -> None:
        """The update chunk by chunk as the mix arrives on the device (peerd.train.device): chunk i
        is updated while chunk i+1 is still being copied. A chunk holding NaN/Inf (an exchange
        should never return one) is not applied: that chunk starts from x_k (counted once)."""
        from peerd.train.device import device_ranges
        staged = res.staged
        key = tuple(staged.chunks)
        if getattr(self, "_pieces_key", None) != key:
            self._pieces_key, self._pieces = key, device_ranges(staged.chunks, self.flat.segments)
        mix = self.flat.views(res.params)
        bad = False
        for ci, pieces in enumerate(self._pieces):
            staged.arrive(ci)
            parts = [mix[i][lo:hi] for i, lo, hi in pieces]
            if not all(all_finite(p) for p in parts):
                bad = True
                parts = [self._x[i][lo:hi] for i, lo, hi in pieces]
            for (i, lo, hi), m in zip(pieces, parts):
                self._update_range(i, lo, hi, m)
            staged.applied(ci)
        if bad:
            self.stats["nonfinite_mix"] += 1

    def _update(self, mix: list[torch.Tensor]) -> None:
        if self.rule == "torch":
            return self._update_torch(mix)
        for i, x in enumerate(self._x):
            self._update_range(i, 0, x.numel(), mix[i])

    def _update_range(self, i: int, lo: int, hi: int, m: torch.Tensor) -> None:
        """x_{k+1} = mix_k - lr * d(x_k) on elements [lo, hi) of segment i (``m``: the mix there).
        Every rule is element-wise, so a segment updated in pieces equals one updated whole."""
        t = self.local_steps
        seg = self.flat.segments[i]
        grp = self.param_groups[seg.group]
        x, g = self._x[i][lo:hi], self._g[i][lo:hi]

        def st(name: str) -> torch.Tensor:
            return self._state(name)[i][lo:hi]
        lr, wd = grp["lr"], grp["weight_decay"]
        decoupled = self.rule in ("adamw", "accumadamw")
        if wd and not decoupled:
            g = torch.add(g, x, alpha=wd, out=st("scratch_g"))
        if decoupled and wd:
            base = torch.mul(m, 1 - lr * wd, out=st("scratch_m"))
        else:
            base = m
        if self.rule == "sgd":
            d = g
            mom = grp["momentum"]
            if mom:
                buf = st("momentum")
                if t == 1:
                    buf.copy_(g)
                else:
                    buf.mul_(mom).add_(g)
                d = torch.add(g, buf, alpha=mom, out=st("scratch_d")) if grp["nesterov"] else buf
            torch.add(base, d, alpha=-lr, out=x)
        elif self.rule in ("adam", "adamw"):
            b1, b2 = grp["betas"]
            ea, eas = st("exp_avg"), st("exp_avg_sq")
            ea.lerp_(g, 1 - b1)
            eas.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = torch.sqrt(eas, out=st("scratch_d"))
            denom.div_(math.sqrt(1 - b2 ** t)).add_(grp["eps"])
            torch.addcdiv(base, ea, denom, value=-lr / (1 - b1 ** t), out=x)
        else:  # accumadam, accumadamw: papers.md 4.5, block k = ceil(t / T)
            b1, b2 = grp["betas"]
            T = grp["accum_iter"]
            k = -(-t // T)
            mbar, vbar, acc = st("mbar"), st("vbar"), st("accum")
            acc.add_(g, alpha=1.0 / T)
            mt = torch.mul(mbar, b1, out=st("scratch_d")).add_(g, alpha=1 - b1)
            vt = torch.mul(vbar, b2, out=st("scratch_v")).addcmul_(g, g, value=1 - b2)
            vt.sqrt_().div_(math.sqrt(1 - b2 ** k)).add_(grp["eps"])
            torch.addcdiv(base, mt, vt, value=-lr / (1 - b1 ** k), out=x)
            if t % T == 0:
                mbar.mul_(b1).add_(acc, alpha=1 - b1)
                vbar.mul_(b2).addcmul_(acc, acc, value=1 - b2)
                acc.zero_()

    def _update_torch(self, mix: list[torch.Tensor]) -> None:
        assert self.torch_inner is not None
        if self._save is None:
            self._save = torch.empty_like(self.flat.buffer)
        self._save.copy_(self.flat.buffer)
        self.torch_inner.step()
        for x, x0, m in zip(self._x, self.flat.views(self._save), mix):
            if m is x:
                continue                   # identity mix: x' is already the answer
            x.sub_(x0).add_(m)

    def seed_moments(self, warm: tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Start Adam from a warm start's moments and step count (peerd.train.warmstart) instead
        of zeros, so that its first steps continue the warm start's run."""
        if self.rule == "torch":
            from peerd.train.warmstart import seed_torch_adam
            seed_torch_adam(self.torch_inner, warm)
            return
        if self.rule not in ("adam", "adamw"):
            raise ValueError(f"a warm start's Adam moments need inner optimizer adam or adamw, not {self.rule!r}")
        step, by_param = warm
        for key, which in (("exp_avg", 0), ("exp_avg_sq", 1)):
            seg_bufs = self._state(key)
            for p, e in zip(self.flat.params, self.layout.entries):
                seg = next(i for i, s in enumerate(self.flat.segments)
                           if s.offset <= e.offset < s.offset + s.numel * p.element_size())
                lo = (e.offset - self.flat.segments[seg].offset) // p.element_size()
                seg_bufs[seg][lo:lo + e.numel].copy_(by_param[id(p)][which].reshape(-1))
        self.local_steps = step

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                  for g in self.param_groups]
        out = dict(iteration=self.iteration, local_steps=self.local_steps, rule=self.rule,
                   layout=self.layout.specs(), param_groups=groups,
                   state={n: [t.clone() for t in ts] for n, ts in self._bufs.items()
                          if not n.startswith("scratch")})
        if self.torch_inner is not None:
            out["inner"] = self.torch_inner.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rule"] != self.rule:
            raise ValueError(f"checkpoint is for inner optimizer {state['rule']!r}, this one is {self.rule!r}")
        from peerd.train.flat import Layout
        Layout.build(state["layout"]).check(self.layout, here="in the checkpoint", there="here")
        self.iteration = int(state["iteration"])
        self.local_steps = int(state["local_steps"])
        for g, saved in zip(self.param_groups, state["param_groups"]):
            g.update(saved)
        for n, ts in state["state"].items():
            for dst, src in zip(self._state(n), ts):
                dst.copy_(src)
        if self.torch_inner is not None:
            self.torch_inner.load_state_dict(state["inner"])
        self._published = False


def _flatten_params(params: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            out += _flatten_params(item["params"])
        elif isinstance(item, tuple):
            out.append(item[1])            # (name, param)
        else:
            out.append(item)
    return out
