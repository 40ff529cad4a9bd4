"""LocalGroup: synchronous neighbour averaging, mean preservation, NaN/Inf refusal, bounds."""
from __future__ import annotations

import threading

import pytest
import torch

from peerd.train.exchange import LocalGroup, topology_weights
from peerd.train.flat import Layout, LayoutMismatch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


LAYOUT = Layout.build([("w", "float32", (6, 5)), ("b", "float32", (5,)), ("s", "float64", (3,))])


def _buf(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8)
    for t in LAYOUT.typed(buf):
        t.copy_(torch.randn(t.numel(), generator=g, dtype=torch.float64))
    return buf


def _vec(buf: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.to(torch.float64) for t in LAYOUT.typed(buf)])


def _round(group: LocalGroup, k: int, bufs: list[torch.Tensor]):
    ws = [group.worker(r) for r in range(group.world)]
    if k == 0:
        for w in ws:
            w.attach(LAYOUT)
    for w, b in zip(ws, bufs):
        w.publish(k, b)
    return [w.mix(k) for w in ws]


@pytest.mark.parametrize("topology", ["ring", "complete"])
def test_mixing_preserves_the_mean_and_contracts(topology):
    world = 5
    group = LocalGroup(world, topology)
    w = group.weights
    assert torch.allclose(w.sum(0), torch.ones(world, dtype=torch.float64))   # doubly stochastic
    bufs = [_buf(r) for r in range(world)]
    mean0 = torch.stack([_vec(b) for b in bufs]).mean(0)
    spread0 = sum(float((_vec(b) - mean0).norm()) for b in bufs)
    for k in range(3):
        res = _round(group, k, bufs)
        assert all(r.iteration == k and r.dropped == 0 for r in res)
        assert all(r.used == (3 if topology == "ring" else world) for r in res)
        bufs = [r.params.clone() for r in res]
        mean = torch.stack([_vec(b) for b in bufs]).mean(0)
        assert torch.allclose(mean, mean0, atol=1e-6)
    spread = sum(float((_vec(b) - mean0).norm()) for b in bufs)
    assert spread < 0.8 * spread0
    if topology == "complete":
        assert spread < 1e-5


def test_ring_mix_is_the_neighbour_average():
    group = LocalGroup(4, "ring")
    bufs = [_buf(10 + r) for r in range(4)]
    res = _round(group, 0, bufs)
    for r in range(4):
        want = (_vec(bufs[r]) + _vec(bufs[(r - 1) % 4]) + _vec(bufs[(r + 1) % 4])) / 3
        assert torch.allclose(_vec(res[r].params), want, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_buffers_are_dropped_and_counted(bad):
    group = LocalGroup(4, "ring")
    bufs = [_buf(20 + r) for r in range(4)]
    LAYOUT.typed(bufs[1])[0][7] = bad
    res = _round(group, 0, bufs)
    assert group.nonfinite_published == [0, 1, 0, 0]
    # ranks 0, 1, 2 read rank 1's buffer; rank 3 does not
    assert [r.dropped for r in res] == [1, 1, 1, 0]
    assert group.dropped == [1, 1, 1, 0]
    for r in range(4):
        assert all(bool(torch.isfinite(t).all()) for t in LAYOUT.typed(res[r].params))
    # weights renormalised over the finite buffers
    assert torch.allclose(_vec(res[0].params), (_vec(bufs[0]) + _vec(bufs[3])) / 2, atol=1e-6)
    # the broken worker heals from its neighbours
    assert torch.allclose(_vec(res[1].params), (_vec(bufs[0]) + _vec(bufs[2])) / 2, atol=1e-6)


def test_nothing_finite_means_no_mix():
    group = LocalGroup(1)
    buf = _buf(1)
    LAYOUT.typed(buf)[1][0] = float("nan")
    (res,) = _round(group, 0, [buf])
    assert res.params is None and res.used == 0 and res.dropped == 1


def test_threads_one_per_worker():
    world, rounds = 4, 30
    group = LocalGroup(world, "ring", timeout=30)
    finals: list[torch.Tensor | None] = [None] * world
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            ex = group.worker(rank)
            ex.attach(LAYOUT)
            buf = _buf(rank)
            for k in range(rounds):
                ex.publish(k, buf)
                buf = ex.mix(k).params.clone()
            finals[rank] = buf
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    mean0 = torch.stack([_vec(_buf(r)) for r in range(world)]).mean(0)
    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(not t.is_alive() for t in threads)
    for f in finals:
        assert torch.allclose(_vec(f), mean0, atol=1e-4)
    assert not group._slots          # every snapshot was released


def test_mix_wait_is_bounded_and_names_the_missing_rank():
    group = LocalGroup(3, "complete", timeout=0.2)
    ws = [group.worker(r) for r in range(3)]
    for w in ws:
        w.attach(LAYOUT)
    ws[0].publish(0, _buf(0))
    ws[2].publish(0, _buf(2))
    with pytest.raises(TimeoutError, match=r"rank 0, iteration 0: no buffer from rank\(s\) \[1\] within 0.2s"):
        ws[0].mix(0)
    with pytest.raises(RuntimeError, match="rank 1 mixes iteration 0 before publishing it"):
        ws[1].mix(0)


def test_misuse_is_refused():
    group = LocalGroup(2)
    a, b = group.worker(0), group.worker(1)
    with pytest.raises(RuntimeError, match="publishes before attach"):
        a.publish(0, _buf(0))
    a.attach(LAYOUT)
    other = Layout.build([("w", "float32", (6, 4)), ("b", "float32", (5,)), ("s", "float64", (3,))])
    with pytest.raises(LayoutMismatch, match=r"'w': shape \[6, 4\] at rank 1, \[6, 5\] at rank 0"):
        b.attach(other)
    a.publish(3, _buf(0))
    with pytest.raises(ValueError, match="rank 0 publishes iteration 3 after 3"):
        a.publish(3, _buf(0))
    with pytest.raises(ValueError, match="rank 5 outside 0..1"):
        group.worker(5)


def test_topology_weights():
    assert torch.equal(topology_weights(2, "ring"), torch.full((2, 2), 0.5, dtype=torch.float64))
    assert torch.equal(topology_weights(1, "ring"), torch.ones(1, 1, dtype=torch.float64))
    w = topology_weights(6, "ring")
    assert torch.allclose(w.sum(1), torch.ones(6, dtype=torch.float64)) and (w > 0).sum() == 18
    with pytest.raises(ValueError, match="rows summing to 1"):
        topology_weights(2, [[0.5, 0.4], [0.5, 0.5]])
    with pytest.raises(ValueError, match=r"shape \[2, 2\], expected \[3, 3\]"):
        topology_weights(3, [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="unknown topology 'torus'"):
        topology_weights(4, "torus")
