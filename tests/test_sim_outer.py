"""The simulator's DiLoCo mode (peerd.sim.outer): the same algorithm as peerd.train.outer step for
step, periodic averaging as its simple case, weights by inner steps, fixed H against a time budget
under a straggler, the wire's bytes, and `peerd sim --outer diloco`."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from cli.sim import sim as sim_cmd
from peerd.sim import outer as so
from peerd.sim.engine import SimSpec, Simulator
from peerd.sim.outer import OuterSpec, Wire, wire_bytes
from peerd.sim.scenarios import claims, run
from peerd.sync import registry, topology as T


def _sim(spec: SimSpec, topo: str = "complete", algo: str = "d-psgd") -> Simulator:
    return Simulator(spec, registry.build(algo, spec.n, T.make(topo, spec.n)), name=algo)


def _local_sgd(spec: SimSpec, steps_per_round: list[int], rounds: int, olr: float = 1.0, mu: float = 0.0,
               by_steps: bool = True) -> np.ndarray:
    """Reference: every worker takes its steps of SGD on its shard, then the outer step on the
    average weighted by steps, or equally (complete graph, F = 1, tau = 0)."""
    obj = _sim(spec).obj
    n = spec.n
    s = np.asarray(steps_per_round if by_steps else [1] * n, dtype=float)
    start, u = obj.x0.copy(), np.zeros(spec.params)
    for _ in range(rounds):
        X = np.tile(start, (n, 1))
        for i in range(n):
            for _ in range(steps_per_round[i]):
                X[i] -= spec.lr * obj.grad(i, X[i], 0)
        delta = start - (s[:, None] * X).sum(0) / s.sum()
        u = mu * u + delta
        start = start - olr * (delta + mu * u)
    return start


@pytest.mark.parametrize("olr,mu", [(1.0, 0.0), (0.7, 0.9)])
def test_complete_graph_one_fragment_is_local_sgd_with_averaging(olr, mu):
    """outer_lr 1, momentum 0: periodic averaging (local SGD); otherwise DiLoCo's Nesterov step."""
    H, R = 5, 6
    spec = SimSpec(n=4, params=300, iterations=R, compute=0.1, lr=0.1, noise=0.0, hetero=0.5,
                   stop_at_target=False, outer=OuterSpec(inner_steps=H, outer_lr=olr, outer_momentum=mu))
    sim = _sim(spec)
    res = sim.run()
    ref = _local_sgd(spec, [H] * 4, R, olr, mu)
    assert np.allclose(sim.outer.XS, ref[None, :], atol=1e-12)
    # every worker: R syncs mixed, then H more steps before it publishes R and stops
    assert res.computed == [(R + 1) * H] * 4 and res.iterations == [R] * 4
    assert all(sim.outer.mass[(i, k)] == H for i in range(4) for k in range(R))


def test_same_algorithm_as_the_outer_optimizer_with_fragments_and_overlap():
    """Fragments (F = 3 over 1,000 float64 values: bounds on 512 bytes) and overlap tau = 1, outer
    Nesterov: the simulator's x_start equals peerd.train.outer.OuterOptimizer's on LocalGroup."""
    torch = pytest.importorskip("torch")
    from peerd.train.exchange import LocalGroup
    from peerd.train.outer import FRAGMENT_ALIGN, OuterOptimizer, fragment_bounds

    n, P, H, F, tau, R = 3, 1000, 6, 3, 1, 7
    spec = SimSpec(n=n, params=P, bytes_per_param=8, iterations=R, compute=0.1, lr=0.1, noise=0.0,
                   hetero=0.5, stop_at_target=False,
                   outer=OuterSpec(inner_steps=H, fragments=F, overlap=tau, outer_lr=0.7, outer_momentum=0.9))
    sim = _sim(spec)
    sim.run()
    assert so.FRAGMENT_ALIGN == FRAGMENT_ALIGN and so.fragment_bounds(8 * P, F) == fragment_bounds(8 * P, F)
    assert len(sim.outer.bounds) == F and sim.outer.bounds[0] == (0, 384)
    obj = sim.obj
    group = LocalGroup(n, "complete", timeout=20)
    starts, errors = {}, []

    def work(rank: int) -> None:
        try:
            x = torch.zeros(P, dtype=torch.float64, requires_grad=True)
            h, c = torch.tensor(obj.h[rank]), torch.tensor(obj.c[rank])
            opt = OuterOptimizer([x], group.worker(rank), "sgd", lr=spec.lr, outer_lr=0.7, outer_momentum=0.9,
                                 inner_steps=H, fragments=F, overlap=tau)
            for _ in range(R * (H // F) + tau):       # up to the mix of sync R - 1
                opt.zero_grad()
                (0.5 * (h * (x - c) ** 2).sum()).backward()
                opt.step()
            starts[rank] = opt.x_start.view(torch.float64).numpy().copy()
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in range(n):
        assert np.allclose(sim.outer.XS[r], starts[r], atol=1e-9)


def test_time_budget_weighs_each_publish_by_its_steps():
    """Worker 0 half as fast: in a 1 s round it takes 4 steps of 0.25 s where the others take 8 of
    0.125 s; its publish weighs 4 against their 8 (outer_lr 1: x_start is the weighted average)."""
    R = 5
    spec = SimSpec(n=3, params=200, iterations=R, compute=0.125, factors={0: 2.0}, lr=0.1, noise=0.0, hetero=0.5,
                   stop_at_target=False, outer=OuterSpec(round_seconds=1.0, outer_lr=1.0, outer_momentum=0.0))
    sim = _sim(spec)
    res = sim.run()
    assert [sim.outer.mass[(i, k)] for k in range(R) for i in range(3)] == [4.0, 8.0, 8.0] * R
    assert np.allclose(sim.outer.XS, _local_sgd(spec, [4, 8, 8], R)[None, :], atol=1e-12)
    # the same simulated time for every worker (R + 1 rounds of 1 s, plus the exchanges)
    assert res.computed == [4 * (R + 1), 8 * (R + 1), 8 * (R + 1)]
    assert max(sim.finish) - min(sim.finish) < 0.01 and R + 1 <= res.sim_time < R + 1.01
    # equal weights instead: the slow worker's short walk pulls as hard as the others'
    eq = _sim(replace(spec, outer=replace(spec.outer, weigh_by_steps=False)))
    eq.run()
    ref = _local_sgd(spec, [4, 8, 8], R, by_steps=False)
    assert np.allclose(eq.outer.XS, ref[None, :], atol=1e-12)
    assert not np.allclose(ref, _local_sgd(spec, [4, 8, 8], R), atol=1e-6)


@pytest.mark.parametrize("topo", ["complete", "ring"])
def test_time_budget_beats_fixed_h_under_a_straggler(topo):
    """One worker 3x slower. Fixed H = 8: every round waits for it (3 s a round). Time budget 1 s:
    the straggler takes 2-3 steps a round where the others take 8 (a round stretches by the wait
    for its publish, which OuterOptimizer's schedule absorbs), every worker finishes at the same
    simulated time, and the average model reaches the target sooner."""
    base = SimSpec(n=6, params=500, iterations=30, compute=0.125, factors={0: 3.0}, lr=0.05,
                   hetero=0.1, target=1e-3, stop_at_target=False)
    fixed = _sim(replace(base, outer=OuterSpec(inner_steps=8)), topo)
    budget = _sim(replace(base, outer=OuterSpec(round_seconds=1.0)), topo)
    f, b = fixed.run(), budget.run()
    assert f.computed == [8 * 31] * 6
    assert 2 * 31 < b.computed[0] <= 3 * 31 and b.computed[1:] == [8 * 31] * 5
    assert max(budget.finish) - min(budget.finish) < 0.5 and 3 * 31 <= f.sim_time
    assert b.sim_time < 1.15 * 31
    assert np.mean(b.idle_fraction) < 0.1 < 0.5 < np.mean(f.idle_fraction[1:])
    assert b.time_to_target is not None and f.time_to_target is not None
    assert b.time_to_target < 0.5 * f.time_to_target


def test_overlap_hides_a_slow_exchange():
    """A sync's exchange takes 0.5 s (4 kB at 8 kB/s) against 0.1 s steps: with tau = 0 every sync
    waits for it; with tau = 5 the mix is collected after five more steps and nobody waits."""
    base = SimSpec(n=4, params=1000, iterations=12, compute=0.1, bandwidth=8e3, latency=1e-3,
                   stop_at_target=False)
    t0 = run("d-psgd", replace(base, outer=OuterSpec(inner_steps=10)), "ring")
    t5 = run("d-psgd", replace(base, outer=OuterSpec(inner_steps=10, overlap=5)), "ring")
    assert t0.computed == t5.computed == [130] * 4
    assert t0.sim_time > 13 + 12 * 0.5 and t5.sim_time < 13.7
    assert np.mean(t5.idle_fraction) < 0.05 < 0.3 < np.mean(t0.idle_fraction)


def test_wire_bytes_codecs_fragments_and_keyframes():
    from peerd.net.quant import segment_bytes
    for v in (1, 127, 128, 129, 1000, 10_000):
        assert wire_bytes(v, "int8") == segment_bytes(v, 8) and wire_bytes(v, "int4") == segment_bytes(v, 4)
    assert wire_bytes(1000, "none") == 4000 and wire_bytes(1000, "bf16") == 2000
    assert so.codec_factor("int8") == pytest.approx(1.03125 / 4) and so.codec_factor("int4") == pytest.approx(0.53125 / 4)
    with pytest.raises(ValueError, match="unknown codec"):
        wire_bytes(1, "zip")
    # F = 4 over 1,024 float32 values: the first publish carries everything, then a quarter each
    w = Wire(3, 1024, 4, "int8", [(0, 256), (256, 512), (512, 768), (768, 1024)])
    assert [w.message(0, 1, k) for k in range(3)] == [segment_bytes(1024, 8)] + [segment_bytes(256, 8)] * 2
    # a receiver that missed version 2 gets a keyframe (the whole copy, raw), then increments again
    assert w.message(0, 2, 3) == 4 * 1024 and w.keyframes == 1
    assert w.message(0, 2, 4) == segment_bytes(256, 8) and w.message(0, 1, 4) == 4 * 1024
    plain = Wire(2, 1000, 4, "fp16")
    assert not plain.copy_mode and plain.message(0, 1, 5) == 2000


def test_sim_bytes_per_inner_step():
    """Ring of 4, F = 2, H = 8, int8: after the first (whole) publish each sync sends half the
    model's int8 bytes to each of 2 neighbours every 4 inner steps (the final publish, 21, too)."""
    spec = SimSpec(n=4, params=1024, iterations=21, compute=0.1, compress="int8", stop_at_target=False,
                   outer=OuterSpec(inner_steps=8, fragments=2))
    res = run("d-psgd", spec, "ring")
    half = wire_bytes(512, "int8")
    assert res.bytes_sent == 4 * 2 * (wire_bytes(1024, "int8") + 21 * half)
    assert res.computed == [4 * 22] * 4 and res.keyframes == 0
    assert res.record()["bytes_per_worker_step"] == pytest.approx(res.bytes_sent / 4 / 88)
    # one-peer exponential graph: each push goes to a peer that missed the previous version
    exp = run("d-psgd", replace(spec, n=8, iterations=6), "exp")
    assert exp.keyframes > 0


def test_refuses_bad_settings():
    with pytest.raises(ValueError, match="exactly one"):
        OuterSpec()
    with pytest.raises(ValueError, match="exactly one"):
        OuterSpec(inner_steps=4, round_seconds=1.0)
    with pytest.raises(ValueError, match="outer_momentum"):
        OuterSpec(inner_steps=4, outer_momentum=1.0)
    with pytest.raises(ValueError, match="synchronous"):
        run("ad-psgd", SimSpec(n=4, outer=OuterSpec(inner_steps=4)), "complete")


def test_outer_defaults_are_the_optimizers():
    pytest.importorskip("torch")
    import inspect

    from peerd.train.outer import OuterOptimizer
    p = inspect.signature(OuterOptimizer).parameters
    d = OuterSpec(inner_steps=1)
    assert (d.outer_lr, d.outer_momentum, d.nesterov, d.weigh_by_steps) == (
        p["outer_lr"].default, p["outer_momentum"].default, p["nesterov"].default, p["weigh_by_steps"].default)


def test_cli_outer_mode_json_and_table():
    args = ["-a", "d-psgd", "--workers", "4", "--topology", "ring", "--params", "1024", "--iterations", "10",
            "--outer", "diloco", "--inner-steps", "8", "--fragments", "2", "--overlap", "1",
            "--compress", "int8", "--no-stop"]
    r = CliRunner().invoke(sim_cmd, [*args, "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    assert rec["outer"] == {"inner_steps": 8, "round_seconds": 0.0, "fragments": 2, "overlap": 1, "outer_lr": 0.7,
                            "outer_momentum": 0.9, "nesterov": True, "weigh_by_steps": True, "compress": "int8"}
    # 11 syncs of H / F = 4 steps; to 2 neighbours: the whole model once, then a half per sync
    assert rec["mean_computed"] == 44
    assert rec["bytes_per_worker_step"] == pytest.approx(2 * (wire_bytes(1024, "int8") + 10 * wire_bytes(512, "int8")) / 44)
    t = CliRunner().invoke(sim_cmd, args)
    assert t.exit_code == 0, t.output
    assert "B/wkr/step" in t.output.splitlines()[0] and "diloco" in t.output.splitlines()[2]
    eq = json.loads(CliRunner().invoke(sim_cmd, [*args, "--equal-weights", "--json"]).output)
    assert eq["outer"]["weigh_by_steps"] is False and eq["label"].endswith("equal int8")
    bad = CliRunner().invoke(sim_cmd, ["--outer", "diloco"])
    assert bad.exit_code != 0 and "--inner-steps" in bad.output
    bad = CliRunner().invoke(sim_cmd, ["--inner-steps", "4"])
    assert bad.exit_code != 0 and "--outer diloco" in bad.output


@pytest.mark.parametrize("algo", ["d-psgd", "hop", "hop-backup-skip", "hop-staleness-skip", "aau", "sgp"])
@pytest.mark.parametrize("extra", [{}, {"crash": {3: 5.0}}, {"join": {5: 3.0}}])
def test_every_synchronous_algorithm_runs_outer_rounds(algo, extra):
    """Each synchronous policy drives DiLoCo rounds (fixed H with fragments and overlap, and a time
    budget) through a crash and a late join: every live worker finishes its syncs, none stalls."""
    base = SimSpec(n=8, params=512, iterations=30, compute=0.1, lr=0.05, factors={0: 2.0}, p_slow=0.1,
                   slow_factor=3, stop_at_target=False, compress="int8", **extra)
    for o in (OuterSpec(inner_steps=8, fragments=2, overlap=1), OuterSpec(round_seconds=0.8)):
        r = run(algo, replace(base, outer=o), "exp" if algo == "sgp" else "ring")
        assert not r.stalled
        assert all(k == 30 for i, k in enumerate(r.iterations) if i not in base.crash)
        assert r.loss is not None and r.loss < 0.2


def test_two_sites_diloco_scenario_claims():
    r = CliRunner().invoke(sim_cmd, ["--scenario", "two-sites-diloco", "--json"])
    assert r.exit_code == 0, r.output
    recs = {x["label"]: x for x in map(json.loads, r.output.splitlines())}
    assert list(recs) == ["d-psgd/complete", "d-psgd/ring", "diloco/complete H=16", "diloco/complete T=0.8s",
                          "diloco/ring H=16", "diloco/ring T=0.8s", "diloco/complete T=0.8s F=2 tau=2 int8",
                          "diloco/ring T=0.8s F=2 tau=2 int8"]
    checks = claims("two-sites-diloco", list(recs.values()))
    assert len(checks) == 4 and all(c["holds"] for c in checks), checks
    assert all(x["time_to_target"] is not None for x in recs.values())
    t = CliRunner().invoke(sim_cmd, ["--scenario", "two-sites-diloco"])
    assert "holds  diloco/ring: time budget time to target <= fixed H" in t.output
