"""Flat parameter buffers: parameters and grads as views, layouts and their difference messages."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from peerd.train.flat import FlatParams, Layout, LayoutMismatch, average, flatten_module


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny tensors on shared cores: threads only contend
    yield
    torch.set_num_threads(n)


def _net(seed: int = 0, hidden: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def test_parameters_become_views_and_values_survive():
    model = _net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(5, 3)
    out_before = model(x).detach()
    flat = flatten_module(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
        assert p.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()
    assert torch.equal(model(x), out_before)
    assert [e.name for e in flat.layout.entries] == list(before)
    # writing the buffer moves the model (this is how a mix lands)
    with torch.no_grad():
        flat.views(flat.buffer)[0].add_(1.0)
    assert torch.equal(model[0].weight, before["0.weight"] + 1)


def test_round_trip_through_bytes():
    a, b = _net(0), _net(1)
    fa, fb = flatten_module(a), flatten_module(b)
    fb.load(fa.buffer.clone())
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_backward_accumulates_into_the_flat_grad_buffer():
    model = _net()
    flat = flatten_module(model)
    model(torch.randn(4, 3)).sum().backward()
    g = torch.cat([t for t in flat.views(flat.grad_buffer)])
    assert g.abs().sum() > 0
    assert torch.equal(g, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    # someone sets grads to None (torch's default zero_grad): the next backward lands elsewhere,
    # repair copies it back and re-points
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 3)).sum().backward()
    assert not flat.grads_in_place()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    flat.repair_grads()
    assert flat.grads_in_place()
    assert torch.equal(torch.cat([t for t in flat.views(flat.grad_buffer)]), expected)


def test_mixed_dtypes_give_one_aligned_run_per_dtype():
    p32a = nn.Parameter(torch.randn(3))
    p64 = nn.Parameter(torch.randn(5, dtype=torch.float64))
    p32b = nn.Parameter(torch.randn(2, 2))
    flat = FlatParams([[p32a, p64, p32b]], [["a", "d", "b"]])
    runs = flat.layout.runs()
    assert [(r.dtype, r.numel) for r in runs] == [("float32", 7), ("float64", 5)]
    assert all(r.offset % 64 == 0 for r in runs)
    assert [e.name for e in flat.layout.entries] == ["a", "b", "d"]      # stable by dtype
    assert flat.layout.total_bytes % 64 == 0
    assert p64.dtype == torch.float64 and p64.data_ptr() == flat.buffer.data_ptr() + runs[1].offset


def test_layout_rebuilt_from_specs_is_equal():
    flat = flatten_module(_net())
    again = Layout.build(flat.layout.specs())
    assert again == flat.layout and flat.layout.diff(again) is None


def test_layout_diff_names_the_first_difference():
    base = flatten_module(_net()).layout
    wide = flatten_module(_net(hidden=5)).layout
    assert base.diff(wide) == "parameter '0.weight': shape [4, 3] here, [5, 3] there"
    specs = base.specs()
    renamed = Layout.build([("enc.w" if n == "2.weight" else n, d, s) for n, d, s in specs])
    assert base.diff(renamed) == "parameter 2: named '2.weight' here, 'enc.w' there"
    half = Layout.build([(n, "float16" if n == "0.bias" else d, s) for n, d, s in specs])
    assert base.diff(half) == "parameter '0.bias': dtype float32 here, float16 there"
    fewer = Layout.build(specs[:-1])
    assert base.diff(fewer) == "4 parameters here, 3 there (first unmatched: '2.bias' here)"
    with pytest.raises(LayoutMismatch, match="shape \\[4, 3\\] at rank 1, \\[5, 3\\] at rank 0"):
        base.check(wide, here="at rank 1", there="at rank 0")


def test_layout_refuses_non_float_and_checks_buffers():
    with pytest.raises(ValueError, match="'steps': dtype int64 is not floating point"):
        Layout.build([("steps", "int64", (1,))])
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        Layout.build([("w", "float7", (1,))])
    layout = flatten_module(_net()).layout
    with pytest.raises(ValueError, match=f"1-D uint8 buffer of {layout.total_bytes} bytes"):
        layout.typed(torch.zeros(layout.total_bytes, dtype=torch.float32))


def test_average_is_exact_mean():
    nets = [_net(s) for s in range(3)]
    flats = [flatten_module(n) for n in nets]
    avg = average([f.buffer for f in flats], flats[0].layout)
    got = flats[0].layout.typed(avg)[0]
    want = torch.stack([f.views(f.buffer)[0] for f in flats]).mean(0)
    assert torch.allclose(got, want, atol=1e-7)


def test_all_finite_is_exact_even_when_the_sum_overflows():
    from peerd.train.flat import all_finite
    big = torch.full((8,), 3e38)                     # finite, but the float32 sum is inf
    assert not torch.isfinite(big.sum()) and all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(100)
        t[37] = bad
        assert not all_finite(t)
    mixed = torch.tensor([float("inf"), float("-inf")])  # the sum is nan
    assert not all_finite(mixed)
    assert all_finite(torch.randn(1000, dtype=torch.float16))


def test_frozen_parameters_are_refused_by_name():
    model = _net()
    model[2].bias.requires_grad_(False)
    with pytest.raises(ValueError, match="parameter '2.bias' does not require grad"):
        FlatParams([[p for _, p in model.named_parameters()]], [[n for n, _ in model.named_parameters()]])
    assert len(flatten_module(model).layout.entries) == 3     # flatten_module keeps trainable ones


def test_rehome_moves_parameters_into_a_given_buffer():
    model = _net()
    flat = flatten_module(model)
    x = torch.randn(5, 3)
    out_before = model(x).detach()
    before = flat.buffer.clone()
    home = torch.zeros_like(flat.buffer)
    flat.rehome(home)
    assert flat.buffer is home and torch.equal(home, before)
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
    assert torch.equal(model(x), out_before)
    model(x).square().sum().backward()          # grads still land in the flat grad buffer
    assert flat.grads_in_place() and flat.grad_buffer.any()
    with torch.no_grad():
        flat.views(home)[0].add_(1.0)            # writing the home moves the model
    assert not torch.equal(model(x), out_before)
    with pytest.raises(ValueError, match="rehome"):
        flat.rehome(torch.zeros(3, dtype=torch.uint8))
