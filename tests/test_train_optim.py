"""DecentralizedOptimizer against reference implementations.

With a one-worker LocalGroup the mix is the identity, so SGD and DAdam must follow torch's own
SGD/Adam/AdamW; AccumAdam follows a literal transcription of papers.md 4.5. With real mixing the
rule is x_{k+1} = mix_k - lr * d(x_k), checked against torch optimizers stepped on copies.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from peerd.train.exchange import LocalGroup
from peerd.train.optim import DecentralizedOptimizer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _loss(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


CASES = [
    ("sgd", dict(lr=0.1), torch.optim.SGD, dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01), torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd", dict(lr=0.05, momentum=0.8, nesterov=True), torch.optim.SGD,
     dict(lr=0.05, momentum=0.8, nesterov=True)),
    ("adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01), torch.optim.Adam,
     dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01)),
    ("adamw", dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("inner,kw,ref_cls,ref_kw", CASES)
def test_identity_mix_matches_torch(inner, kw, ref_cls, ref_kw):
    start = _net()
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = DecentralizedOptimizer(ours.parameters(), LocalGroup(1).worker(0), inner, **kw)
    ref_opt = ref_cls(ref.parameters(), **ref_kw)
    for batch in _batches(25):
        opt.zero_grad()
        _loss(ours, batch).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        ref_opt.step()
    assert _max_diff(ours, start) > 1e-2            # it did move
    assert _max_diff(ours, ref) < 1e-5
    assert opt.iteration == 25 and opt.stats["late_publishes"] == 0


def _accum_adam_reference(model, batches, lr, betas, eps, wd, T, decoupled=False):
    """papers.md 4.5 written out literally, one parameter tensor at a time."""
    b1, b2 = betas
    ps = list(model.parameters())
    M = [torch.zeros_like(p) for p in ps]
    V = [torch.zeros_like(p) for p in ps]
    A = [torch.zeros_like(p) for p in ps]
    for t, batch in enumerate(batches, start=1):
        model.zero_grad()
        _loss(model, batch).backward()
        k = math.ceil(t / T)
        with torch.no_grad():
            for i, p in enumerate(ps):
                g = p.grad.clone()
                if wd and not decoupled:
                    g = g + wd * p
                if wd and decoupled:
                    p.mul_(1 - lr * wd)
                A[i] += g / T
                m_t = b1 * M[i] + (1 - b1) * g
                v_t = b2 * V[i] + (1 - b2) * g * g
                p -= (lr / (1 - b1 ** k)) * m_t / (torch.sqrt(v_t) / math.sqrt(1 - b2 ** k) + eps)
                if t % T == 0:
                    M[i] = b1 * M[i] + (1 - b1) * A[i]
                    V[i] = b2 * V[i] + (1 - b2) * A[i] * A[i]
                    A[i] = torch.zeros_like(p)


@pytest.mark.parametrize("T,wd,inner", [(1, 0.0, "accumadam"), (3, 0.01, "accumadam"),
                                        (4, 0.1, "accumadamw")])
def test_accumadam_matches_the_formula(T, wd, inner):
    start = _net(3)
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    batches = _batches(23, seed=5)
    opt = DecentralizedOptimizer(ours.parameters(), LocalGroup(1).worker(0), inner, lr=1e-2,
                                 betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, accum_iter=T)
    for batch in batches:
        opt.zero_grad()
        _loss(ours, batch).backward()
        opt.step()
    _accum_adam_reference(ref, batches, 1e-2, (0.9, 0.99), 1e-8, wd, T, decoupled=inner.endswith("w"))
    assert _max_diff(ours, start) > 1e-2
    assert _max_diff(ours, ref) < 1e-5


def test_accumadam_with_T1_is_adam():
    start = _net(4)
    a, b = copy.deepcopy(start), copy.deepcopy(start)
    oa = DecentralizedOptimizer(a.parameters(), LocalGroup(1).worker(0), "accumadam", lr=1e-2, accum_iter=1)
    ob = DecentralizedOptimizer(b.parameters(), LocalGroup(1).worker(0), "adam", lr=1e-2)
    for batch in _batches(10):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            _loss(m, batch).backward()
            o.step()
    assert _max_diff(a, b) < 1e-6


@pytest.mark.parametrize("inner,kw,ref_cls,ref_kw", [CASES[1], CASES[3]])
def test_real_mix_is_mix_minus_lr_direction(inner, kw, ref_cls, ref_kw):
    """3 workers, complete graph: x_{k+1} = mean_j x_j^k + (x'_k - x_k), x' = torch step at x_k."""
    world = 3
    group = LocalGroup(world, "complete")
    models = [_net(s) for s in range(world)]          # different starting points
    refs = [copy.deepcopy(m) for m in models]
    opts = [DecentralizedOptimizer(m.parameters(), group.worker(r), inner, **kw)
            for r, m in enumerate(models)]
    ref_opts = [ref_cls(m.parameters(), **ref_kw) for m in refs]
    data = [_batches(8, seed=10 + r) for r in range(world)]
    for k in range(8):
        for o in opts:
            o.zero_grad()
        for r in range(world):
            _loss(models[r], data[r][k]).backward()
        for o in opts:
            o.step()
        xk = [[p.detach().clone() for p in m.parameters()] for m in refs]
        mix = [torch.stack(ps).mean(0) for ps in zip(*xk)]
        for r in range(world):
            ref_opts[r].zero_grad()
            _loss(refs[r], data[r][k]).backward()
            ref_opts[r].step()
            with torch.no_grad():
                for p, x0, mx in zip(refs[r].parameters(), xk[r], mix):
                    p.copy_(mx + (p - x0))
    for m, ref in zip(models, refs):
        assert _max_diff(m, ref) < 1e-5


def test_any_torch_optimizer_as_inner_matches_the_builtin_rule():
    def run(make):
        group = LocalGroup(3, "ring")
        models = [_net(s) for s in range(3)]
        opts = [make(m, group.worker(r)) for r, m in enumerate(models)]
        data = [_batches(6, seed=20 + r) for r in range(3)]
        for k in range(6):
            for o in opts:
                o.zero_grad()
            for r in range(3):
                _loss(models[r], data[r][k]).backward()
            for o in opts:
                o.step()
        return models

    builtin = run(lambda m, ex: DecentralizedOptimizer(m.parameters(), ex, "sgd", lr=0.1, momentum=0.9))
    wrapped = run(lambda m, ex: DecentralizedOptimizer(
        m.parameters(), ex, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)))
    for a, b in zip(builtin, wrapped):
        assert _max_diff(a, b) < 1e-5
    with pytest.raises(ValueError, match="params differ from the inner optimizer's parameters"):
        m = _net()
        DecentralizedOptimizer(m[0].parameters(), LocalGroup(1).worker(0), torch.optim.SGD(m.parameters(), lr=0.1))


def test_skip_to_moves_the_iteration_not_the_moments():
    group = LocalGroup(2, "complete")
    group.schedule_skip(at=2, to=10)
    models = [_net(0), _net(0)]
    opts = [DecentralizedOptimizer(m.parameters(), group.worker(r), "adam", lr=1e-2)
            for r, m in enumerate(models)]
    iters = []
    for batch in _batches(5):
        iters.append(opts[0].iteration)
        for o in opts:
            o.zero_grad()
        for m in models:
            _loss(m, batch).backward()
        for o in opts:
            o.step()
    assert iters == [0, 1, 2, 10, 11]
    assert all(o.iteration == 12 and o.local_steps == 5 and o.stats["skips"] == 1 for o in opts)


def test_non_finite_gradient_is_not_applied():
    model = _net()
    opt = DecentralizedOptimizer(model.parameters(), LocalGroup(1).worker(0), "adam", lr=1e-2)
    for batch in _batches(2):
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    moments = [t.clone() for t in opt._bufs["exp_avg"]]
    opt.zero_grad()
    (_loss(model, _batches(1)[0]) * float("nan")).backward()
    opt.step()
    assert opt.stats["nonfinite_grads"] == 1 and opt.local_steps == 2 and opt.iteration == 3
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(torch.equal(a, b) for a, b in zip(opt._bufs["exp_avg"], moments))


def test_neighbour_with_nan_parameters_is_not_mixed_in():
    group = LocalGroup(2, "complete")
    models = [_net(0), _net(1)]
    opts = [DecentralizedOptimizer(m.parameters(), group.worker(r), "sgd", lr=0.0)
            for r, m in enumerate(models)]
    with torch.no_grad():
        models[1][0].weight[0, 0] = float("inf")
    want = [p.detach().clone() for p in models[0].parameters()]
    for o in opts:
        o.zero_grad()
    for o in opts:
        o.step()
    assert opts[0].stats["dropped"] == 1 and opts[1].stats["dropped"] == 1
    for m in models:            # both now hold worker 0's finite model
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), want))


def test_step_without_zero_grad_publishes_late_and_grads_survive_model_zero_grad():
    start = _net()
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = DecentralizedOptimizer(ours.parameters(), LocalGroup(1).worker(0), "sgd", lr=0.1, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for batch in _batches(4):
        ours.zero_grad()                 # torch's default: grads to None
        _loss(ours, batch).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, batch).backward()
        ref_opt.step()
    assert opt.stats["late_publishes"] == 4
    assert _max_diff(ours, ref) < 1e-6


def test_param_groups_and_lr_scheduler():
    start = _net()
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters()}]

    opt = DecentralizedOptimizer(groups(ours), LocalGroup(1).worker(0), "sgd", lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(groups(ref), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    for batch in _batches(8):
        for m, o, s in ((ours, opt, sched), (ref, ref_opt, ref_sched)):
            o.zero_grad()
            _loss(m, batch).backward()
            o.step()
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert len(opt.flat.segments) == 2
    assert _max_diff(ours, ref) < 1e-6


def test_state_dict_round_trip():
    batches = _batches(8)

    def train(model, opt, part):
        for batch in part:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()

    a = _net()
    oa = DecentralizedOptimizer(a.parameters(), LocalGroup(1).worker(0), "accumadam", lr=1e-2, accum_iter=3)
    train(a, oa, batches[:4])
    saved_params = copy.deepcopy(a.state_dict())
    saved = oa.state_dict()
    train(a, oa, batches[4:])
    b = _net(9)
    b.load_state_dict(saved_params)
    ob = DecentralizedOptimizer(b.parameters(), LocalGroup(1).worker(0), "accumadam", lr=1e-2, accum_iter=3)
    ob.load_state_dict(saved)
    assert ob.iteration == 4 and ob.local_steps == 4
    group = LocalGroup(1)          # the new exchange starts at the checkpoint's iteration
    ob.exchange = group.worker(0)
    ob.exchange.attach(ob.layout)
    train(b, ob, batches[4:])
    assert _max_diff(a, b) == 0.0
    with pytest.raises(ValueError, match="checkpoint is for inner optimizer 'accumadam', this one is 'sgd'"):
        DecentralizedOptimizer(_net().parameters(), LocalGroup(1).worker(0), "sgd").load_state_dict(saved)


def test_bad_arguments_are_named():
    m = _net()
    with pytest.raises(ValueError, match="unknown inner optimizer 'lamb'"):
        DecentralizedOptimizer(m.parameters(), LocalGroup(1).worker(0), "lamb")
    with pytest.raises(ValueError, match="accum_iter must be >= 1"):
        DecentralizedOptimizer(m.parameters(), LocalGroup(1).worker(0), "accumadam", accum_iter=0)
    with pytest.raises(ValueError, match="betas must lie in"):
        DecentralizedOptimizer(m.parameters(), LocalGroup(1).worker(0), "adam", betas=(1.0, 0.9))
    opt = DecentralizedOptimizer(m[0].parameters(), LocalGroup(1).worker(0), "sgd")
    with pytest.raises(RuntimeError, match="parameter groups are fixed"):
        opt.add_param_group({"params": m[2].parameters()})


def test_zero_grad_publishes_before_the_gradient_is_computed():
    group = LocalGroup(2, "ring")
    models = [_net(0), _net(0)]
    opts = [DecentralizedOptimizer(m.parameters(), group.worker(r), "sgd", lr=0.1)
            for r, m in enumerate(models)]
    for k, batch in enumerate(_batches(3)):
        opts[0].zero_grad()
        assert (0, k) in group._slots and (1, k) not in group._slots   # x_k is out, backward not run
        opts[1].zero_grad()
        for m in models:
            _loss(m, batch).backward()
        for o in opts:
            o.step()
    assert all(o.stats["late_publishes"] == 0 for o in opts)


class _CorruptingExchange:
    """Fault injection around a real LocalExchange: its mix result gets an Inf written into it."""

    def __init__(self, inner):
        self.inner = inner

    def attach(self, layout):
        self.layout = layout
        return self.inner.attach(layout)

    def publish(self, iteration, buf):
        self.inner.publish(iteration, buf)

    def mix(self, iteration):
        res = self.inner.mix(iteration)
        self.layout.typed(res.params)[0][3] = float("inf")
        return res

    def close(self):
        self.inner.close()


def test_a_non_finite_mix_result_is_never_applied():
    start = _net()
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = DecentralizedOptimizer(ours.parameters(), _CorruptingExchange(LocalGroup(1).worker(0)), "sgd", lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for batch in _batches(3):
        for m, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(m, batch).backward()
            o.step()
    assert opt.stats["nonfinite_mix"] == 3
    assert _max_diff(ours, ref) < 1e-6      # the local steps went on from x_k


def test_named_parameters_name_the_layout():
    m = _net()
    opt = DecentralizedOptimizer(m.named_parameters(), LocalGroup(1).worker(0), "sgd")
    assert [e.name for e in opt.layout.entries] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    plain = DecentralizedOptimizer(_net().parameters(), LocalGroup(1).worker(0), "sgd")
    assert [e.name for e in plain.layout.entries] == ["param0", "param1", "param2", "param3"]
