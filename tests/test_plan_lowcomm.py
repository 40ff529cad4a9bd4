"""The low-communication rows of the runtime model (peerd.plan.lowcomm): closed forms on a uniform
network, agreement with the simulator's DiLoCo mode, the communication-bound rule and the
recommendation, and `peerd plan`'s output."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from cli.plan import plan as plan_cmd
from peerd.config import Config
from peerd.plan import lowcomm, model
from peerd.plan.model import Compute, Network, Options, Prediction
from peerd.sim.engine import SimSpec, Simulator
from peerd.sim.outer import OuterSpec, codec_factor
from peerd.sync import registry, topology as T

OO = lowcomm.OuterOptions(iterations=200)


@pytest.mark.parametrize("topo,deg", [("complete", 3), ("ring", 2)])
def test_row_closed_forms_on_a_uniform_network(topo, deg):
    """No latency, no spread: a sync of s steps pushes m = M c / F bytes at B to each neighbour.
    tau = 0 exposes it (s C + m / B), tau = s hides it (max(s C, m / B)), in between
    max(s C, m / B + (s - tau) C)."""
    n, C, B, M = 4, 0.1, 1e6, 1e6
    net, comp = Network.uniform(n, B, 0.0), Compute.of(n, C)
    for H, F, tau, codec in [(8, 1, 0, "none"), (8, 1, 8, "none"), (8, 2, 2, "int8"), (16, 4, 1, "fp16"),
                             (12, 1, 3, "int4"), (30, 2, 50, "none")]:
        r = lowcomm.row(net, comp, M, topo, H, F, tau, codec, Options(), OO)
        s, m = H // F, M * codec_factor(codec) / F
        t = min(tau, s)
        assert r.overlap == t and r.inner_steps == H and r.fragments == F
        assert r.sync_s == pytest.approx(max(s * C, m / B + (s - t) * C), rel=1e-9)
        assert r.step_s == pytest.approx(r.sync_s / s) and r.compute_step_s == pytest.approx(C)
        assert r.bytes_sync == pytest.approx(deg * m) and r.bytes_round == pytest.approx(deg * M * codec_factor(codec))
        assert r.bytes_step == pytest.approx(r.bytes_round / H)
        assert r.hidden == (r.step_s <= 1.05 * C)


@pytest.mark.parametrize("topo", ["complete", "ring"])
def test_rows_agree_with_the_simulators_outer_mode(topo):
    """The same DiLoCo schedule through the simulator (the real D-PSGD policy, timing only, the
    daemon's ordered sender): seconds per sync in steady state equal the row's, with latency."""
    n, C, B, L, P = 4, 0.1, 1e6, 0.002, 64 * 1024
    net, comp = Network.uniform(n, B, L), Compute.of(n, C)
    for H, F, tau, codec in [(8, 1, 0, "none"), (8, 1, 4, "none"), (8, 2, 2, "int8"), (16, 4, 1, "fp16")]:
        r = lowcomm.row(net, comp, 4 * P, topo, H, F, tau, codec, Options(), OO)
        times: list[float] = []
        spec = SimSpec(n=n, params=P, iterations=80, compute=C, bandwidth=B, latency=L, timing_only=True,
                       stop_at_target=False, compress=codec, outer=OuterSpec(inner_steps=H, fragments=F, overlap=tau))
        Simulator(spec, registry.build("d-psgd", n, T.make(topo, n)),
                  on_publish=lambda s, i, k: times.append(s.now) if i == 0 else None).run()
        assert (times[70] - times[30]) / 40 == pytest.approx(r.sync_s, rel=1e-6), (H, F, tau, codec)


def _best(net: Network, comp: Compute, nbytes: float) -> Prediction:
    preds = model.plan(net, comp, nbytes, Options(iterations=100, sim_iterations=60), overlap_off=False)
    return model.recommend(preds)[0]


def test_compute_bound_keeps_the_recommendation():
    n, C, M = 4, 0.2, 1e6
    net, comp = Network.uniform(n, 1e10, 1e-4), Compute.of(n, C)
    best = _best(net, comp, M)
    op = lowcomm.plan_outer(net, comp, M, best, Options(), OO)
    assert not op.communication_bound and op.recommended is None
    assert op.compute_s == pytest.approx(C, rel=0.01) and op.exposed_s < op.compute_s
    assert "not communication-bound" in op.why and [r.topology for r in op.rows] == ["complete", "ring"]


def test_communication_bound_recommends_the_smallest_h_that_hides():
    """100 MB over 100 MB/s pairs against 0.1 s steps: every per-iteration row waits ~1 s a step.
    The rule picks the least lossy codec that hides with H <= 500 (none), the smallest F whose push
    crosses within tau_max = 5 steps (F = 2 needs 0.501 s > 0.5 s: F = 4), the overlap that covers
    it (0.251 s: tau = 3) and the smallest H (s = tau here). With no overlap allowed, the exchange
    is paid every sync and H grows until it costs under 5 % a step: one step fewer does not hide."""
    n, C, M, B = 4, 0.1, 1e8, 1e8
    net, comp = Network.uniform(n, B, 1e-3), Compute.of(n, C)
    best = _best(net, comp, M)
    op = lowcomm.plan_outer(net, comp, M, best, Options(), OO)
    assert op.communication_bound and op.exposed_s > op.compute_s
    rec = op.recommended
    assert rec is not None and rec.hidden and rec.codec == "none"
    assert (rec.fragments, rec.overlap, rec.inner_steps) == (4, 3, 12)
    assert rec.topology == "complete"      # ring needs the same H here: the tie goes to DiLoCo as published
    assert "communication-bound" in op.why and "H=12" in op.why
    no_overlap = lowcomm.choose(net, comp, M, "ring", Options(), lowcomm.OuterOptions(iterations=200, overlap=0))
    s = no_overlap.inner_steps // no_overlap.fragments
    assert no_overlap.hidden and no_overlap.overlap == 0 and s > 1
    fewer = lowcomm.row(net, comp, M, "ring", (s - 1) * no_overlap.fragments, no_overlap.fragments, 0,
                        no_overlap.codec, Options(), OO)
    assert not fewer.hidden
    # paid every sync: s C + X <= 1.05 s C, X = 0.251 s -> s >= 50.2
    assert s == math.ceil((1e-3 + M / 4 / B) / (0.05 * C)) == 51


def test_codec_order_and_fixed_settings():
    """A round must carry M c at 10 MB/s: none needs H >= 100, fp16 >= 50, int8 >= 26 steps of
    0.1 s. With H <= 40 the rule passes none and fp16 by and takes int8; a codec, F, tau the user
    fixed are kept; a codec that cannot hide within H_max is shown as not hiding."""
    n, C, M, B = 4, 0.1, 1e8, 1e7           # a model takes 10 s a push: 100 steps of compute
    net, comp = Network.uniform(n, B, 1e-3), Compute.of(n, C)
    oo = lowcomm.OuterOptions(iterations=150, max_inner_steps=40)
    r = lowcomm.choose(net, comp, M, "ring", Options(), oo)
    assert r.hidden and r.codec == "int8" and 26 <= r.inner_steps <= 40
    fixed = lowcomm.choose(net, comp, M, "ring", Options(),
                           lowcomm.OuterOptions(iterations=150, codec="int4", fragments=4, overlap=2))
    assert (fixed.codec, fixed.fragments, fixed.overlap) == ("int4", 4, 2) and fixed.hidden
    none = lowcomm.choose(net, comp, M, "ring", Options(), lowcomm.OuterOptions(iterations=150, codec="none",
                                                                                  max_inner_steps=40))
    assert not none.hidden and none.codec == "none"


def test_plan_cli_shows_the_rows_and_recommends_the_mode():
    args = ["--profile", "two-sites", "--model-bytes", "100000000", "--step-time", "0.2"]
    r = CliRunner().invoke(plan_cmd, args)
    assert r.exit_code == 0, r.output
    out = r.output
    assert "recommended: netmax on ring" in out          # today's per-iteration pick stays listed
    assert "low-communication mode (DiLoCo" in out and "recommended instead: DiLoCo on" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("  all-hosts") or ln.startswith("  gossip")]
    assert len(rows) == 2 and sum("<- recommended" in ln for ln in rows) == 1
    j = json.loads(CliRunner().invoke(plan_cmd, [*args, "--json", "--compress", "int8", "--inner-steps", "64"]).output)
    low = j["low_communication"]
    assert low["communication_bound"] and low["exposed_s"] > low["compute_s"]
    assert {row["codec"] for row in low["rows"]} == {"int8"} and len(low["rows"]) == 4
    assert [row["inner_steps"] for row in low["rows"]][2:] == [64, 64]
    assert low["recommended"]["hidden"] and low["recommended"]["algorithm"] == "diloco"
    # compute-bound: the rows are shown, nothing is recommended instead
    small = CliRunner().invoke(plan_cmd, ["--profile", "lan", "--model-bytes", "1000000", "--step-time", "0.2"])
    assert small.exit_code == 0 and "not communication-bound" in small.output
    assert "recommended instead" not in small.output


def test_config_bounds_reach_the_rule():
    cfg = Config(plan_outer_max_inner_steps=64, plan_outer_max_overlap=2, plan_outer_hide_fraction=0.1)
    oo = lowcomm.OuterOptions.from_config(cfg, codec="int8")
    assert (oo.max_inner_steps, oo.max_overlap, oo.hide_fraction, oo.codec) == (64, 2, 0.1, "int8")
    net, comp = Network.uniform(4, 1e8, 1e-3), Compute.of(4, 0.1)
    r = lowcomm.choose(net, comp, 1e8, "complete", Options(), oo)
    assert r.overlap <= 2 and r.inner_steps <= 64 and np.isfinite(r.step_s)
