"""Built-in training tasks: no user code, no downloads, the same data every time.

Every task has one interface::

    task.build(seed) -> nn.Module              # same seed, same initial model
    task.shard(rank, world, non_iid, seed) -> Shard
    task.batches(shard, batch_size, seed) -> endless iterator of batches
    task.loss(model, batch) -> scalar tensor
    task.evaluate(model) -> {"accuracy": ..., "loss": ...}   (or {"loss": ...})
    task.defaults                              # optimizer and batch size that train it well
    task.outer_step                            # --outer diloco's (outer lr, outer momentum), if not DiLoCo's

Tasks:
- "digits": 10-class 8x8 digit images. scikit-learn is not a dependency, so the images are drawn
  from ten 5x7 glyphs with a random shift, stroke thickening, dropped and stray pixels, contrast
  and Gaussian noise, from a fixed generator seed. Small CNN, SGD with momentum.
- "svm": linear SVM (hinge loss, L2 through weight decay) on generated sparse data (10 % of 100
  features non-zero, labels from a fixed hidden hyperplane, 5 % flipped): the Hop paper's second
  workload, at toy size. SGD.
- "lm": character-level tiny transformer language model on data/harbour.txt (original text
  shipped with the project, ~6 KB); the last 10 % is held out. Adam (DAdam / AccumAdam).
- "gpt": a GPT-style byte-level language model (25.5M parameters by default; presets tiny,
  small, base) on the Python standard library's own source files (peerd.train.lm).

Shards. Classification, iid: the training set shuffled with ``seed`` and dealt round robin.
Non-iid: the training set sorted by label (ties in shuffled order) and cut into ``world``
contiguous pieces, so a worker sees about classes/world labels (at most ceil(classes/world)+1).
LM, iid: the text cut into 64-character chunks, shuffled and dealt round robin; non-iid: one
contiguous piece of the text per worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from peerd.train.flat import Layout

DATA_SEED = 20190201       # data is generated with this, never with the run's seed


@dataclass
class Shard:
    rank: int
    world: int
    non_iid: bool
    tensors: tuple[torch.Tensor, ...]     # inputs, targets (classification) or (tokens,) (LM)
    labels: torch.Tensor | None = None    # class labels held, for skew checks

    def __len__(self) -> int:
        return len(self.tensors[0])


def _on(model: nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the model's device (a no-op on the CPU)."""
    dev = next(model.parameters()).device
    return tuple(t.to(dev) for t in tensors)


def _deal(n: int, rank: int, world: int, labels: torch.Tensor | None, non_iid: bool, seed: int) -> torch.Tensor:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if not non_iid:
        return perm[rank::world]
    if labels is None:
        idx = torch.arange(n)
    else:
        idx = perm[torch.sort(labels[perm], stable=True).indices]
    lo, hi = rank * n // world, (rank + 1) * n // world
    return idx[lo:hi]


class _Classification:
    name = ""
    classes = 0
    defaults: dict[str, Any] = {}

    def __init__(self) -> None:
        self._data: tuple[torch.Tensor, ...] | None = None

    def data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._data is None:
            self._data = self._generate()
        return self._data  # type: ignore[return-value]

    def _generate(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def shard(self, rank: int, world: int, non_iid: bool = False, seed: int = 0) -> Shard:
        x, y, _, _ = self.data()
        idx = _deal(len(y), rank, world, y, non_iid, seed)
        return Shard(rank, world, non_iid, (x[idx], y[idx]), y[idx])

    def batches(self, shard: Shard, batch_size: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(seed * 1000003 + shard.rank)
        n = len(shard)
        while True:
            perm = torch.randperm(n, generator=g)
            for i in range(0, n - batch_size + 1, batch_size):
                j = perm[i:i + batch_size]
                yield tuple(t[j] for t in shard.tensors)


class Digits(_Classification):
    """Small CNN on 8x8 generated digit images (values in [0, 1])."""
    name = "digits"
    classes = 10
    metric = "accuracy"
    defaults = dict(inner="sgd", lr=0.1, momentum=0.9, weight_decay=0.0, batch_size=32)
    # --outer diloco: plain averaging. The inner SGD moves far in a round (momentum 0.9 at lr 0.1),
    # and DiLoCo's outer Nesterov step (0.7, 0.9) on top of it overshoots more every round: 40
    # rounds of 8 steps on two hosts end at chance (0.09-0.11), against 0.97 with averaging
    # (docs/low-communication.md, "Outer step").
    outer_step = (1.0, 0.0)
    GLYPHS = (
        ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
        ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
        ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
        ("11111", "00010", "00100", "00010", "00001", "10001", "01110"),
        ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
        ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
        ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
        ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
        ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
        ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
    )

    def __init__(self, train: int = 3000, test: int = 1000) -> None:
        super().__init__()
        self.sizes = (train, test)

    def _generate(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(DATA_SEED)
        glyphs = torch.tensor([[[int(c) for c in row] for row in gl] for gl in self.GLYPHS],
                              dtype=torch.float32)                          # 10 x 7 x 5
        n = sum(self.sizes)
        y = torch.arange(n) % 10
        y = y[torch.randperm(n, generator=g)]
        img = torch.zeros(n, 8, 8)
        dx = torch.randint(0, 4, (n,), generator=g)
        dy = torch.randint(0, 2, (n,), generator=g)
        for i in range(n):  # generated once per process; not a hot path
            img[i, dy[i]:dy[i] + 7, dx[i]:dx[i] + 5] = glyphs[y[i]]
        thick = torch.rand(n, 1, 1, generator=g) < 0.3
        img = torch.where(thick, torch.maximum(img, F.pad(img, (1, 0))[:, :, :8]), img)
        img = img * (torch.rand(n, 8, 8, generator=g) > 0.1)                # dropped pixels
        img = torch.maximum(img, (torch.rand(n, 8, 8, generator=g) < 0.02).float())  # stray ones
        img = img * (0.7 + 0.3 * torch.rand(n, 1, 1, generator=g))
        img = (img + 0.15 * torch.randn(n, 8, 8, generator=g)).clamp(0, 1)
        x = img.unsqueeze(1)
        tr = self.sizes[0]
        return x[:tr], y[:tr], x[tr:], y[tr:]

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 4 * 4, 10))

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        _, _, x, y = _on(model, *self.data())
        out = model(x)
        return {"accuracy": (out.argmax(1) == y).float().mean().item(),
                "loss": F.cross_entropy(out, y).item()}


class DigitsWide(Digits):
    """The digit CNN with a wide hidden layer (about 1.1 MB of float32 parameters): the same data
    and compute class, but a model whose exchange costs real time on a shaped link (8.8 ms at
    1 Gbit, 176 ms at 50 Mbit), for benchmarks where communication must matter."""
    name = "digits-wide"

    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.hidden = hidden

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 4 * 4, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))


class Svm(_Classification):
    """Linear SVM, hinge loss, labels in {-1, +1}, on generated sparse data."""
    name = "svm"
    classes = 2
    metric = "accuracy"
    defaults = dict(inner="sgd", lr=0.2, momentum=0.0, weight_decay=1e-4, batch_size=32)

    def __init__(self, features: int = 100, density: float = 0.1, train: int = 4000, test: int = 1000,
                 flip: float = 0.05) -> None:
        super().__init__()
        self.features, self.density, self.sizes, self.flip = features, density, (train, test), flip

    def _generate(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(DATA_SEED + 1)
        n, d = sum(self.sizes), self.features
        w = torch.randn(d, generator=g)
        x = torch.randn(n, d, generator=g) * (torch.rand(n, d, generator=g) < self.density)
        y = torch.where(x @ w >= 0, 1, 0)
        y = torch.where(torch.rand(n, generator=g) < self.flip, 1 - y, y)
        tr = self.sizes[0]
        return x[:tr], y[:tr], x[tr:], y[tr:]

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Linear(self.features, 1)

    @staticmethod
    def _hinge(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = model(x).squeeze(1)
        return F.relu(1 - (2 * y - 1) * f).mean(), f

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._hinge(model, batch[0], batch[1])[0]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        _, _, x, y = _on(model, *self.data())
        loss, f = self._hinge(model, x, y)
        return {"accuracy": ((f >= 0).long() == y).float().mean().item(), "loss": loss.item()}


class TinyLM(nn.Module):
    def __init__(self, vocab: int, ctx: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(ctx, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class CharLM:
    """Character-level tiny transformer LM; vocabulary: newline + printable ASCII (96)."""
    name = "lm"
    metric = "loss"
    defaults = dict(inner="adam", lr=3e-3, betas=(0.9, 0.99), weight_decay=0.0, batch_size=16)
    TEXT = Path(__file__).with_name("data") / "harbour.txt"
    VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
    CHUNK = 64

    def __init__(self, ctx: int = 32, dim: int = 48, heads: int = 4, layers: int = 2) -> None:
        self.ctx, self.dim, self.heads, self.layers = ctx, dim, heads, layers
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None

    def encode(self, text: str) -> torch.Tensor:
        table = {c: i for i, c in enumerate(self.VOCAB)}
        unk = table["?"]
        return torch.tensor([table.get(c, unk) for c in text], dtype=torch.long)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._data is None:
            tokens = self.encode(self.TEXT.read_text(encoding="utf-8"))
            cut = len(tokens) * 9 // 10
            self._data = tokens[:cut], tokens[cut:]
        return self._data

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TinyLM(len(self.VOCAB), self.ctx, self.dim, self.heads, self.layers)

    def shard(self, rank: int, world: int, non_iid: bool = False, seed: int = 0) -> Shard:
        train, _ = self.data()
        chunks = train[: len(train) // self.CHUNK * self.CHUNK].view(-1, self.CHUNK)
        idx = _deal(len(chunks), rank, world, None, non_iid, seed)
        return Shard(rank, world, non_iid, (chunks[idx].reshape(-1),))

    def batches(self, shard: Shard, batch_size: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(seed * 1000003 + shard.rank)
        tokens = shard.tensors[0]
        span = len(tokens) - self.ctx - 1
        if span <= 0:
            raise ValueError(f"shard of {len(tokens)} characters is shorter than the context {self.ctx}")
        offs = torch.arange(self.ctx + 1)
        while True:
            start = torch.randint(0, span, (batch_size, 1), generator=g)
            w = tokens[start + offs]
            yield w[:, :-1], w[:, 1:]

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        logits = model(batch[0])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        _, val = _on(model, *self.data())
        n = (len(val) - 1) // self.ctx
        x = val[: n * self.ctx].view(n, self.ctx)
        y = val[1: n * self.ctx + 1].view(n, self.ctx)
        return {"loss": self.loss(model, (x, y)).item()}


def _gpt() -> Any:
    from peerd.train.lm import StdlibGPT
    return StdlibGPT()


TASKS: dict[str, Any] = {"digits": Digits(), "digits-wide": DigitsWide(), "svm": Svm(), "lm": CharLM(),
                         "gpt": _gpt()}


def get_task(name: str, **options: Any) -> Any:
    """The built-in task ``name``; ``options`` (not None) configure a task that takes them
    (gpt: model_size, context, eval_tokens, cache_dir)."""
    try:
        task = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}: one of {sorted(TASKS)}") from None
    options = {k: v for k, v in options.items() if v is not None}
    if not options:
        return task
    if not hasattr(task, "configure"):
        raise ValueError(f"task {name!r} takes no options (given: {sorted(options)})")
    return task.configure(**options)


# -- evaluation helpers -----------------------------------------------------------------------

def _vectors(buffers: Sequence[torch.Tensor], layout: Layout | None) -> list[torch.Tensor]:
    if layout is None:
        return [b.detach().reshape(-1).to(torch.float64) for b in buffers]
    return [torch.cat([t.to(torch.float64) for t in layout.typed(b)]) for b in buffers]


def consensus_distance(buffers: Sequence[torch.Tensor], layout: Layout | None = None) -> float:
    """mean_i ||x_i - xbar||_2 over workers' flat parameters (typed tensors, or uint8 + layout)."""
    vs = _vectors(buffers, layout)
    mean = torch.stack(vs).mean(0)
    return float(sum(torch.linalg.vector_norm(v - mean) for v in vs) / len(vs))


@torch.no_grad()
def average_model(models: Sequence[nn.Module]) -> nn.Module:
    """A copy of the first model holding the exact mean of all models' parameters."""
    import copy
    out = copy.deepcopy(models[0])
    for name, p in out.named_parameters():
        ps = [dict(m.named_parameters())[name] for m in models]
        p.copy_(torch.stack([q.detach().to(torch.float64) for q in ps]).mean(0))
    return out


def evaluate_average(task: Any, models: Sequence[nn.Module]) -> dict[str, float]:
    """The task's metrics for the averaged model, plus the consensus distance across models."""
    metrics = dict(task.evaluate(average_model(models)))
    metrics["consensus"] = consensus_distance(
        [torch.nn.utils.parameters_to_vector(m.parameters()) for m in models])
    return metrics


@dataclass
class LocalRun:
    """Result of ``train_local``: metrics of the averaged model over time, per-worker stats."""
    history: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    stats: list[dict[str, int]] = field(default_factory=list)
    models: list[nn.Module] = field(default_factory=list)


def _split(task: Any, overrides: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
    hp = {**task.defaults, **overrides}
    batch_size = hp.pop("batch_size")
    return hp.pop("inner"), batch_size, hp


def run_worker(task: Any, exchange: Any, iterations: int, *, rank: int | None = None,
               world: int | None = None, non_iid: bool = False, seed: int = 0,
               model: nn.Module | None = None,
               on_step: Callable[[int, float], None] | None = None,
               **opt_overrides: Any) -> tuple[nn.Module, Any]:
    """One worker of a built-in task: the loop a trainer process runs over its exchange.

    ``rank``/``world`` pick the shard; by default they are read from the exchange after attach
    (``exchange.rank``, ``exchange.world``: the daemon assigns them). Trains until the exchange
    iteration reaches start + ``iterations`` (iterations skipped by the exchange count as done). ``on_step(iteration, loss)`` after each step (costs a device sync).
    ``build`` seeds torch's global RNG: when workers share a process, build the models first and
    pass them as ``model``. Returns the model and its DecentralizedOptimizer.
    """
    from peerd.train.optim import DecentralizedOptimizer
    inner, batch_size, hp = _split(task, opt_overrides)
    model = task.build(seed) if model is None else model
    opt = DecentralizedOptimizer(model.parameters(), exchange, inner, **hp)
    rank = exchange.rank if rank is None else rank
    world = exchange.world if world is None else world
    batches = task.batches(task.shard(rank, world, non_iid, seed), batch_size, seed)
    end = opt.iteration + iterations
    while opt.iteration < end:
        opt.zero_grad()                           # publishes x_k
        loss = task.loss(model, next(batches))
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(opt.iteration, loss.item())
    return model, opt


def in_threads(world: int, work: Callable[[int], Any]) -> list[Any]:
    """work(rank) for every rank, each in its own thread (the workers of one LocalGroup); their
    results by rank. The first exception of any is raised here. Joins without a timeout: every mix
    of a LocalGroup waits at most its timeout."""
    import threading
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = work(r)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,), name=f"worker-{r}") for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return out


def train_outer_local(task: Any, world: int, rounds: int, inner_steps: int, outer_lr: float,
                      outer_momentum: float, topology: Any = "complete", seed: int = 0) -> list[nn.Module]:
    """DiLoCo in-process: `world` threads, each an OuterOptimizer with the task's inner optimizer
    and batch size, `rounds` syncs of `inner_steps` steps on a LocalGroup. The trained models."""
    from peerd.train.exchange import LocalGroup
    from peerd.train.outer import OuterOptimizer
    inner, batch_size, hp = _split(task, {})
    kw = {k: hp[k] for k in ("lr", "betas", "weight_decay", "momentum") if k in hp}
    group = LocalGroup(world, topology, timeout=60)
    models = [task.build(seed) for _ in range(world)]   # here: build seeds torch's global generator

    def work(r: int) -> nn.Module:
        model = models[r]
        opt = OuterOptimizer(model.parameters(), group.worker(r), inner, outer_lr=outer_lr,
                             outer_momentum=outer_momentum, inner_steps=inner_steps, **kw)
        batches = task.batches(task.shard(r, world, False, seed), batch_size, seed)
        for _ in range(inner_steps * rounds):
            opt.zero_grad()
            task.loss(model, next(batches)).backward()
            opt.step()
        opt.finish()
        return model
    return in_threads(world, work)


def train_local(task: Any, world: int = 4, iterations: int = 200, topology: Any = "ring",
                non_iid: bool = False, seed: int = 0, eval_every: int = 0, threads: bool = False,
                **opt_overrides: Any) -> LocalRun:
    """Train ``world`` workers of a task in this process over a LocalGroup.

    Every worker starts from the same model (``build(seed)``) and trains on its own shard. By
    default one thread steps all workers in phases (all publish, all compute, all mix) and the
    averaged model is evaluated every ``eval_every`` iterations (0: only at the end); with
    ``threads=True`` each worker runs ``run_worker`` in its own thread (evaluated at the end).
    The result is the same either way: the group is synchronous.
    """
    from peerd.train.exchange import LocalGroup
    from peerd.train.optim import DecentralizedOptimizer
    group = LocalGroup(world, topology)
    models = [task.build(seed) for _ in range(world)]
    run = LocalRun()
    if threads:
        opts: list[Any] = in_threads(world, lambda r: run_worker(
            task, group.worker(r), iterations, non_iid=non_iid, seed=seed, model=models[r], **opt_overrides)[1])
    else:
        inner, batch_size, hp = _split(task, opt_overrides)
        opts = [DecentralizedOptimizer(m.parameters(), group.worker(r), inner, **hp)
                for r, m in enumerate(models)]
        its = [task.batches(task.shard(r, world, non_iid, seed), batch_size, seed) for r in range(world)]
        for k in range(1, iterations + 1):
            for opt in opts:
                opt.zero_grad()                       # publishes x_k
            for m, it in zip(models, its):
                task.loss(m, next(it)).backward()
            for opt in opts:
                opt.step()
            if eval_every and k % eval_every == 0:
                run.history.append({"iteration": k, **evaluate_average(task, models)})
    run.final = {"iteration": iterations, **evaluate_average(task, models)}
    run.stats = [dict(o.stats) for o in opts]
    run.models = models
    return run
