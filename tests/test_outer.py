"""DiLoCo's outer loop (peerd.train.outer) on in-process exchanges: the published algorithm step for
step, weights by inner steps, wall-clock rounds, streaming fragments with overlap, bad input."""
from __future__ import annotations

import threading

import pytest
import torch

from peerd.train.exchange import LocalGroup
from peerd.train.outer import DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM, OuterOptimizer, fragment_bounds
from peerd.train.tasks import get_task, in_threads, train_outer_local

DIM = 300


def _data(rank: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, DIM, generator=g)
    w = torch.linspace(-1, 1, DIM)
    return x, x @ w + 0.1 * rank


def _model() -> torch.nn.Linear:
    """The same start on every call, also from threads at once (no global RNG)."""
    model = torch.nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, DIM, generator=torch.Generator().manual_seed(0)) / DIM ** 0.5)
    return model


def _loss(model, x, y):
    return ((model(x).squeeze(1) - y) ** 2).mean()


def _run_workers(world, make_opt, steps, topology="complete"):
    group = LocalGroup(world, topology, timeout=20)

    def work(rank):
        model = _model()
        opt = make_opt(model, group.worker(rank), rank)
        x, y = _data(rank)
        for _ in range(steps(rank)):
            opt.zero_grad()
            _loss(model, x, y).backward()
            opt.step()
        opt.finish()
        return model, opt
    done = in_threads(world, work)
    return {r: m for r, (m, _) in enumerate(done)}, {r: o for r, (_, o) in enumerate(done)}


def test_complete_graph_is_diloco_as_published():
    """Two hosts, fixed H=3, inner SGD, Nesterov outer: x_start matches a direct implementation."""
    H, rounds, lr, olr, mu = 3, 4, 0.05, 0.7, 0.9
    models, opts = _run_workers(2, lambda m, ex, r: OuterOptimizer(m.parameters(), ex, "sgd", lr=lr, outer_lr=olr,
                                                                   outer_momentum=mu, inner_steps=H),
                                lambda r: H * rounds)
    # the reference
    start = _model().weight.detach().clone()
    mom = torch.zeros_like(start)
    for _ in range(rounds):
        ends = []
        for rank in range(2):
            w = start.clone().requires_grad_(True)
            x, y = _data(rank)
            for _ in range(H):
                loss = (((x @ w.t()).squeeze(1) - y) ** 2).mean()
                (g,) = torch.autograd.grad(loss, w)
                w = (w - lr * g).detach().requires_grad_(True)
            ends.append(w.detach())
        delta = start - (ends[0] + ends[1]) / 2
        mom = mu * mom + delta
        start = start - olr * (delta + mu * mom)
    for rank in range(2):
        got = opts[rank].layout.typed(opts[rank].x_start)[0].view_as(start)
        assert torch.allclose(got, start, atol=1e-5), float((got - start).abs().max())
        assert torch.equal(models[rank].weight.detach(), got)      # x_local restarts at x_start
        assert opts[rank].iteration == rounds and opts[rank].stats["mixed"] == rounds


def test_mix_weighs_models_by_inner_steps():
    """A round-budget host that took 1 step against another's 3: the mix is (1 x_a + 3 x_b) / 4."""
    group = LocalGroup(2, "complete", timeout=20)
    seen = {}
    clock = {"t": 0.0}

    class Recording:
        def __init__(self, ex):
            self.ex = ex
            self.rank, self.world, self.initial = ex.rank, ex.world, None

        def attach(self, layout):
            return self.ex.attach(layout)

        def publish(self, k, buf, *, mass=1.0, ranges=None):
            seen[(self.rank, k)] = (mass, buf.clone())
            self.ex.publish(k, buf, mass=mass, ranges=ranges)

        def mix(self, k):
            res = self.ex.mix(k)
            seen[("mix", self.rank, k)] = res.params.clone()
            return res

    opts = []
    for rank in range(2):
        model = _model()
        opts.append((model, OuterOptimizer(model.parameters(), Recording(group.worker(rank)), "sgd", lr=0.01,
                                           round_seconds=10.0, clock=lambda: clock["t"])))
    results = []

    def host(rank, steps):
        model, opt = opts[rank]
        x, y = _data(rank)
        for _ in range(steps):
            opt.zero_grad()
            _loss(model, x, y).backward()
            if _ == steps - 1:
                barrier.wait()           # both at the round's end before the clock passes it
            opt.step()
        results.append(rank)

    barrier = threading.Barrier(2, action=lambda: clock.__setitem__("t", 10.5))
    threads = [threading.Thread(target=host, args=(0, 1)), threading.Thread(target=host, args=(1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [0, 1]
    (ma, xa), (mb, xb) = seen[(0, 0)], seen[(1, 0)]
    assert (ma, mb) == (1.0, 3.0)
    want = (1 * xa.view(torch.float32) + 3 * xb.view(torch.float32)) / 4
    got = seen[("mix", 0, 0)].view(torch.float32)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("fragments,overlap", [(1, 0), (3, 0), (3, 2)])
def test_streaming_fragments_train_and_stay_together(fragments, overlap):
    """Fragments sync in turn (each once per round), with or without overlap: the loss falls and
    on a ring of 4 (each host its own data) the hosts' models stay far closer together than the
    same hosts training alone."""
    H, rounds = 6, 8

    def make(m, ex, r):
        return OuterOptimizer(m.parameters(), ex, "sgd", lr=0.02, inner_steps=H, fragments=fragments, overlap=overlap)

    def spread(opts):
        w = torch.stack([o.x_start.view(torch.float32)[:DIM] for o in opts.values()])
        return float((w - w.mean(0)).norm() / w.mean(0).norm())

    models, opts = _run_workers(4, make, lambda r: H * rounds + overlap, topology="ring")
    _, alone = _run_workers(4, make, lambda r: H * rounds + overlap, topology=torch.eye(4))
    x, y = _data(0)
    with torch.no_grad():
        first = float(_loss(_model(), x, y))
        for rank in range(4):
            assert float(_loss(models[rank], x, y)) < 0.2 * first
            every = H // len(opts[rank].bounds)            # a sync of one fragment every H/F steps
            assert opts[rank].stats["syncs"] == (H * rounds + overlap) // every
    assert spread(opts) < 0.3 * spread(alone), (spread(opts), spread(alone))


def test_fragment_bounds_cover_the_buffer_on_block_edges():
    for total, f in ((1200, 1), (5000, 3), (512 * 7 + 64, 4), (64, 8)):
        b = fragment_bounds(total, f)
        assert b[0][0] == 0 and b[-1][1] == total
        assert all(lo % 512 == 0 and hi > lo for lo, hi in b)
        assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
    with pytest.raises(ValueError):
        fragment_bounds(100, 0)


def test_bad_configuration_and_nan_gradients():
    group = LocalGroup(1, "complete")
    with pytest.raises(ValueError, match="exactly one"):
        OuterOptimizer(_model().parameters(), group.worker(0), inner_steps=5, round_seconds=3)
    model = _model()
    opt = OuterOptimizer(model.parameters(), LocalGroup(1, "complete").worker(0), "sgd", lr=0.1, inner_steps=2)
    before = model.weight.detach().clone()
    opt.zero_grad()
    model.weight.grad.fill_(float("nan"))
    opt.step()
    assert torch.equal(model.weight.detach(), before) and opt.stats["nonfinite_grads"] == 1


def _digits_rounds(outer_lr: float, outer_momentum: float, H: int = 8, rounds: int = 40) -> float:
    """Two digits hosts on the complete graph with the task's inner SGD: the final accuracy."""
    task = get_task("digits")
    return task.evaluate(train_outer_local(task, 2, rounds, H, outer_lr, outer_momentum)[0])["accuracy"]


def test_the_digits_tasks_outer_step_trains_where_dilocos_overshoots():
    """40 rounds of 8 steps: DiLoCo's (0.7, 0.9) on top of the task's inner SGD (lr 0.1, momentum
    0.9) ends near chance (docs/low-communication.md, "Outer step by task"); the task's own outer
    step, which `peerd train --outer diloco` takes unless told otherwise, trains."""
    from peerd.train.worker import make_optimizer, parse_args
    task = get_task("digits")
    assert _digits_rounds(*task.outer_step) >= 0.9
    assert _digits_rounds(DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM) < 0.8
    model = task.build(0)
    for argv, want in (([], task.outer_step), (["--outer-lr", "0.5", "--outer-momentum", "0.3"], (0.5, 0.3))):
        args = parse_args(["--task", "digits", "--iterations", "1", "--outer", "diloco", "--inner-steps", "4", *argv])
        opt = make_optimizer(args, task, model, LocalGroup(1, "complete").worker(0), "sgd", dict(lr=0.1))
        assert (opt.outer_lr, opt.outer_momentum) == want
    args = parse_args(["--task", "svm", "--iterations", "1", "--outer", "diloco", "--inner-steps", "4"])
    opt = make_optimizer(args, get_task("svm"), get_task("svm").build(0), LocalGroup(1, "complete").worker(0), "sgd",
                         dict(lr=0.1))
    assert (opt.outer_lr, opt.outer_momentum) == (DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM)


def test_peerd_train_checks_the_low_communication_options():
    import click

    from cli.train import low_comm_options
    none = dict(inner_steps=None, round_seconds=None, fragments=None, overlap=None, outer_lr=None,
                outer_momentum=None)
    assert low_comm_options("none", **none, compress=None) == {}
    assert low_comm_options("none", **none, compress="int8") == {"compress": "int8"}
    assert low_comm_options("diloco", **{**none, "inner_steps": 50, "fragments": 4}, compress="int4") == \
        {"compress": "int4", "outer": "diloco", "inner_steps": "50", "fragments": "4"}
    for outer, bad in [("none", {"inner_steps": 5}),                      # needs --outer diloco
                       ("diloco", {}),                                   # neither H nor a budget
                       ("diloco", {"inner_steps": 5, "round_seconds": 2.0}),   # both
                       ("diloco", {"inner_steps": 0}), ("diloco", {"round_seconds": 1.0, "overlap": -1})]:
        with pytest.raises(click.UsageError):
            low_comm_options(outer, **{**none, **bad}, compress=None)


def test_device_and_init_path_are_each_hosts_own_but_the_init_file_is_shared():
    from peerd.node.run.spec import RunSpec, first_difference, shared_spec

    def spec(**options):
        return RunSpec(task="gpt", script=[], algorithm="d-psgd", topology="ring", world=2, iterations=5, seed=0,
                       non_iid=False, slowdown=1.0, options=options, eval_every=5, join_timeout=60.0, max_world=2)
    here = shared_spec(spec(device="cuda", init="/a/w.pt", init_sha256="x", outer="diloco"))
    there = shared_spec(spec(device="cpu", init="/b/w.pt", init_sha256="x", outer="diloco"))
    assert first_difference(here, there) is None
    other = shared_spec(spec(device="cpu", init="/b/w.pt", init_sha256="y", outer="diloco"))
    assert "init_sha256" in first_difference(here, other)


def test_a_host_that_joined_from_a_neighbour_keeps_that_models_outer_state_over_its_checkpoint():
    """A restarted daemon whose own checkpoint is older than the run starts from a neighbour's model
    (the exchange's `initial`). The worker then loads its checkpoint's optimizer state: its inner
    state is taken, its x_start, public copy and momentum are not (they belong to the old model)."""
    group = LocalGroup(1, "complete", timeout=20)
    old = OuterOptimizer(_model().parameters(), group.worker(0), "sgd", lr=0.01, inner_steps=3)
    old.x_start.fill_(0)
    old.momentum.fill_(1)
    state = old.state_dict()

    class Joining:
        def __init__(self, ex):
            self.ex, self.rank, self.world = ex, ex.rank, ex.world
            self.initial = None

        def attach(self, layout):
            k = self.ex.attach(layout)
            self.initial = torch.full((layout.total_bytes // 4,), 0.5).view(torch.uint8)
            return k

    group = LocalGroup(1, "complete", timeout=20)
    model = _model()
    opt = OuterOptimizer(model.parameters(), Joining(group.worker(0)), "sgd", lr=0.01, inner_steps=3)
    opt.load_state_dict(state)
    x = opt.flat.buffer.view(torch.float32)
    assert torch.all(x == 0.5) and torch.equal(opt.x_start, opt.flat.buffer) and torch.equal(opt.public, opt.flat.buffer)
    assert torch.count_nonzero(opt.momentum) == 0
