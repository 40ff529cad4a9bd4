"""Benchmark records' per-host times and time split (peerd.bench.scenarios) and how `peerd plan
check` reads them: measured per-host compute and overhead, rank order, one iteration time."""
from __future__ import annotations

import json

import pytest

from peerd.bench import scenarios as sc
from peerd.lab import profile
from peerd.plan import check, model, sources


def _trace(n: int, compute: float, mix: float, other: float, start: float = 100.0) -> list[dict]:
    out, t = [], start
    for k in range(n):
        end = t + compute + mix
        out.append({"it": k + 1, "start": t, "t": end, "compute_s": compute, "mix_s": mix})
        t = end + other
    return out


def test_host_times_use_the_steady_part_and_split_the_iteration():
    tr = _trace(20, 0.1, 0.05, 0.02)
    tr[0]["t"] += 5.0                          # a slow first iteration (joining) is left out
    for r in tr[1:]:
        r["start"] += 5.0
        r["t"] += 5.0
    v = sc.host_times(tr)
    assert v["window_steps"] == 18            # 10 % of 20 = 2 warm-up iterations
    assert v["iter_time_s"] == pytest.approx(0.17)
    assert v["compute_mean_s"] == pytest.approx(0.1) and v["compute_std_s"] == pytest.approx(0.0)
    assert v["mix_s"] == pytest.approx(0.05) and v["other_s"] == pytest.approx(0.02)
    # Older traces without mix_s: no split, the iteration time still.
    old = [{k: x for k, x in r.items() if k != "mix_s"} for r in tr]
    v = sc.host_times(old)
    assert v["mix_s"] is None and v["other_s"] is None and v["iter_time_s"] == pytest.approx(0.17)


def test_the_steady_part_ends_when_the_first_host_finishes():
    tr = _trace(20, 0.1, 0.0, 0.0)
    for r in tr[15:]:                        # after the others finished, 1 s per iteration
        r["start"] += (r["it"] - 16) * 0.9
        r["t"] += (r["it"] - 15) * 0.9
    assert sc.host_times(tr)["iter_time_s"] > 0.3
    v = sc.host_times(tr, until=tr[14]["t"])
    assert v["window_steps"] == 13 and v["iter_time_s"] == pytest.approx(0.1)


def test_a_host_that_barely_ran_while_the_swarm_did_is_timed_over_that_part():
    """AD-PSGD on the star: the 10 Mbit active pulled 3 times (3 s each) while the others ran;
    once they finished it ran local steps at 0.1 s. Its pace in the swarm is 3 s/it, not 0.1."""
    tr = _trace(4, 0.1, 2.9, 0.0) + _trace(56, 0.1, 0.0, 0.0, start=112.0)
    for k, r in enumerate(tr):
        r["it"] = k + 1
    v = sc.host_times(tr, until=110.5)        # the first host finished during its 4th pull
    assert v.get("window_short") and v["window_iterations"] == 3 and v["window_steps"] == 3
    assert v["iter_time_s"] == pytest.approx(10.5 / 3)
    assert v["mix_s"] == pytest.approx(2.9) and v["step_s"] == pytest.approx(3.0)
    assert not sc.host_times(tr).get("window_short")          # no swarm end given: the whole trace
    # One that finished nothing while the swarm ran: a lower bound, its wall so far.
    late = _trace(5, 0.1, 4.9, 0.0)
    v = sc.host_times(late, until=103.0)
    assert v["window_short"] and v["iter_time_s"] == pytest.approx(3.0)


def test_bench_retime_recomputes_from_traces_and_keeps_records_without_them(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli

    fast, slow = _trace(40, 0.1, 0.0, 0.0), _trace(4, 0.1, 2.9, 0.0) + _trace(36, 0.1, 0.0, 0.0, start=112.0)
    for k, r in enumerate(slow):
        r["it"] = k + 1
    run = tmp_path / "mixed-links" / "ad-psgd" / "seed1"
    run.mkdir(parents=True)
    for h, tr in (("h1", slow), ("h2", fast)):
        (run / f"{h}.trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tr))
        (run / f"{h}.progress.jsonl").write_text(json.dumps({"state": "training", "rank": int(h[1]) - 1}) + "\n")
    old_host = {"iter_time_s": 0.1, "bytes_sent": 1e6}
    rec = {"scenario": "mixed-links", "contender": "ad-psgd", "seed": 1, "profile": "lan", "hosts": 2,
           "iter_time_s": 0.1, "per_host": {"h1": dict(old_host), "h2": dict(old_host)}}
    gone = {**rec, "seed": 0}                    # copied from another run: no traces here
    (tmp_path / "results.jsonl").write_text(json.dumps(gone) + "\n" + json.dumps(rec) + "\n")
    res = CliRunner().invoke(cli, ["bench", "retime", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "1 records retimed" in res.output and "kept as they were" in res.output
    assert "mixed-links/ad-psgd/seed 0" in res.output
    kept, new = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert kept == gone and (tmp_path / "results.jsonl.orig").exists()
    # the slow host is timed over the swarm's run (fast finished at 104): 4 s over 1 step
    assert new["per_host"]["h1"]["window_short"] and new["per_host"]["h1"]["iter_time_s"] == pytest.approx(4.0)
    assert new["iter_time_s"] == pytest.approx((4.0 + 0.1) / 2)


def test_skipped_iterations_count_in_the_iteration_time_not_in_the_step():
    tr = _trace(11, 0.4, 0.0, 0.0)
    for k, r in enumerate(tr):
        r["it"] = 4 * (k + 1)                # a straggler that skips 3 of every 4 iterations
    v = sc.host_times(tr)
    assert v["window_steps"] == 9 and v["window_iterations"] == 36
    assert v["iter_time_s"] == pytest.approx(0.1) and v["step_s"] == pytest.approx(0.4)


def test_split_takes_the_mix_floor_as_overhead_and_the_rest_as_wait():
    fast = sc.host_times(_trace(21, 0.1, 0.30, 0.01))     # waits for the straggler
    slow = sc.host_times(_trace(21, 0.4, 0.01, 0.01))     # never waits: its mix is the floor
    ph = {"h1": {**slow, "window_bytes_sent": 2e6}, "h2": {**fast, "window_bytes_sent": 4e6}}
    floor = sc.split_times(ph, "d-psgd", {"h1": 1e8, "h2": 1e8})
    assert floor == pytest.approx(0.01)
    assert ph["h1"]["wait_s"] == pytest.approx(0.0) and ph["h1"]["overhead_s"] == pytest.approx(0.01)
    assert ph["h2"]["wait_s"] == pytest.approx(0.29) and ph["h2"]["mix_overhead_s"] == pytest.approx(0.01)
    assert ph["h2"]["transfer_s"] == pytest.approx(4e6 / 18 / 1e8)    # 21 steps, 3 warm-up
    assert "mix_samples" not in ph["h1"]
    # DDP: the "mix" is the all-reduce itself, all of it counts as waiting.
    ph = {"h1": sc.host_times(_trace(21, 0.4, 0.02, 0.01)), "h2": sc.host_times(_trace(21, 0.1, 0.32, 0.01))}
    assert sc.split_times(ph, "ddp", {}) == 0.0
    assert ph["h1"]["wait_s"] == pytest.approx(0.02) and ph["h1"]["overhead_s"] == pytest.approx(0.01)
    assert ph["h1"]["transfer_s"] is None


def test_egress_rates_from_profiles():
    star = sc.egress_rates(profile.load("star-6", 6))
    assert star["h1"] == pytest.approx(10e6 / 8) and star["h6"] == pytest.approx(1e9 / 8)
    lan = sc.egress_rates(profile.load("lan", 6))
    assert set(lan.values()) == {1e9 / 8}


def _record(contender: str, compute: list[float], measured: float, prof: str = "straggler",
            ranks: list[int] | None = None, overhead: float | None = 0.01) -> dict:
    n = len(compute)
    ph = {f"h{i + 1}": {"rank": (ranks or list(range(n)))[i], "compute_mean_s": c, "compute_std_s": 0.0,
                         **({} if overhead is None else {"overhead_s": overhead})} for i, c in enumerate(compute)}
    return {"scenario": "s", "contender": contender, "profile": prof, "model_bytes": 1e6, "hosts": n,
            "iter_time_s": measured, "per_host": ph}


def _load(name: str, n: int) -> profile.Profile:
    return profile.load(name, n)


def test_check_feeds_the_measured_per_host_compute_without_the_profile_factor():
    # The straggler profile says h1 is 4x slower; the record measured h1 at 0.4 s: no 1.6 s.
    rec = _record("ddp", [0.4, 0.1, 0.1, 0.1, 0.1, 0.1], 0.45)
    [s] = check.check([rec], _load)
    pred = s.rows[0].predicted
    assert 0.41 < pred < 0.45                  # 0.4 + 0.01 overhead + ~10 ms of 1 MB ring at 1 Gbit
    # The overhead is the record's: 0.1 s more per host, 0.1 s more per iteration.
    rec2 = _record("ddp", [0.4, 0.1, 0.1, 0.1, 0.1, 0.1], 0.45, overhead=0.11)
    assert check.check([rec2], _load)[0].rows[0].predicted == pytest.approx(pred + 0.1, rel=1e-6)
    # Without a measured overhead: Config.plan_overhead (0).
    rec3 = _record("ddp", [0.4, 0.1, 0.1, 0.1, 0.1, 0.1], 0.45, overhead=None)
    row = check.check([rec3], _load)[0].rows[0]
    assert row.predicted == pytest.approx(pred - 0.01, rel=1e-6) and not row.overhead
    assert row.load is None
    scen = check.check([{**rec, "load_avg": [3.5, 7.25]}], _load)
    assert scen[0].rows[0].load == 7.25 and " 7.2" in check.render(scen)


def test_check_marks_runs_on_a_cpu_saturated_machine():
    rec = _record("ad-psgd", [0.1] * 6, 0.3)
    calm, busy, old = (check.check([r], _load)[0] for r in ({**rec, "cpu_busy": 0.4}, {**rec, "cpu_busy": 0.97}, rec))
    assert calm.rows[0].cpu == 0.4 and not calm.rows[0].cpu_saturated
    assert busy.rows[0].cpu_saturated and old.rows[0].cpu is None and not old.rows[0].cpu_saturated
    out = check.render([calm, busy, old])
    assert " 40%" in out and " 97%" in out and "(CPU saturated" in out
    assert "1 run(s) on a machine at least 90 % busy (1 of them beyond 25 %)" in out
    assert "0 of the other 2 within 25 %" in out     # 0.3 s measured, ~0.1 predicted: all three off
    assert busy.record()["rows"][0]["cpu_saturated"] is True


def test_tx_sampler_reads_the_machine_cpu_busy_share():
    class Fake(sc.TxSampler):
        def __init__(self):
            self.cpu = [(0.0, 100, 1000), (10.0, 1100, 2000), (20.0, 1200, 3000)]
    f = Fake()
    assert f.cpu_busy(0.0, 10.0) == pytest.approx(1.0)
    assert f.cpu_busy(10.0, 20.0) == pytest.approx(0.1)
    assert f.cpu_busy(5.0, 15.0) == pytest.approx(0.55)
    busy, total = sc.TxSampler.cpu_jiffies()   # this machine's /proc/stat
    assert 0 <= busy <= total and total > 0


def test_check_predicts_the_mean_over_hosts_for_asynchronous_contenders():
    comp = [0.4, 0.1, 0.1, 0.1, 0.1, 0.1]
    [s] = check.check([_record("ad-psgd", comp, 0.16), _record("d-psgd", comp, 0.42)], _load)
    ad, dp = s.rows
    # Each host at its own pace (1 MB at 1 Gbit is ~17 ms there and back, hidden under 0.1 s).
    assert ad.predicted == pytest.approx(sum(comp) / 6 + 0.01, rel=0.02)
    assert dp.predicted == pytest.approx(0.41, rel=0.03)     # the ring waits for the straggler
    assert s.recommended.contender == "ad-psgd" and s.recommendation_ok


def test_check_uses_the_ring_order_of_the_run():
    # two-sites-6: h1-h3 and h4-h6. Ranks in host order: the ring crosses the 50 Mbit cut twice;
    # ranks alternating the sites: every ring edge crosses it, six flows share the site link.
    comp = [0.1] * 6
    straight = check.check([_record("d-psgd", comp, 1.0, "two-sites-6")], _load)[0].rows[0].predicted
    mixed = check.check([_record("d-psgd", comp, 1.0, "two-sites-6", ranks=[0, 2, 4, 1, 3, 5])],
                        _load)[0].rows[0].predicted
    assert mixed > 1.5 * straight
    net = sources.network_from_profile(profile.load("two-sites-6", 6))
    p = sources.permute(net, [0, 3, 1, 4, 2, 5])
    assert p.bandwidth[1, 0] == net.bandwidth[3, 0] and p.sites == (0, 1, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="permutation"):
        sources.permute(net, [0, 0, 1, 2, 3, 4])


def test_check_falls_back_to_busy_share_for_old_records_and_skips_failed_runs():
    old = {"scenario": "s", "contender": "ddp", "profile": "straggler", "model_bytes": 1e6, "hosts": 6,
           "iter_time_s": 0.45, "per_host": {f"h{i + 1}": {"steps": 10, "duration_s": 4.5,
                                                          "idle_fraction": 0.1 if i == 0 else 0.8}
                                            for i in range(6)}}
    row = check.check([old], _load)[0].rows[0]
    assert not row.exact and 0.40 < row.predicted < 0.43        # h1 busy 0.405 s per iteration
    failed = {**_record("netmax", [0.1] * 6, 1.0), "error": "a host's process exited with code 1"}
    lines = [json.dumps(old), json.dumps(failed)]
    with pytest.raises(check.CheckError, match="failed"):
        check.parse_lines(lines)
    skipped: list[str] = []
    assert len(check.parse_lines(lines, "r.jsonl", skipped)) == 1
    assert skipped == ["r.jsonl:2: s/netmax failed, left out"]
    bad = {**_record("ddp", [0.1] * 6, 1.0)}
    del bad["per_host"]["h3"]
    with pytest.raises(check.CheckError, match="per_host lacks h3"):
        check.check([bad], _load)


def test_per_host_overheads_in_the_model():
    o = model.Options(overhead=(0.1, 0.2))
    assert list(o.overheads(2)) == [0.1, 0.2]
    assert list(model.Options(overhead=0.3).overheads(3)) == [0.3, 0.3, 0.3]
    with pytest.raises(ValueError, match="overhead"):
        o.overheads(3)
    net = model.Network.uniform(2, 1e15)
    comp = model.Compute.of(2, 0.1)
    # Synchronous: the slower host's overhead sets the pace; asynchronous: the mean.
    assert model.predict_one(net, comp, 1, "d-psgd", "ring", o) == pytest.approx(0.3, rel=1e-6)
    assert model.predict_one(net, comp, 1, "ad-psgd", "ring", o) == pytest.approx(0.25, rel=1e-6)


def test_check_simulates_coalescing_when_the_lab_daemons_ran_with_it():
    # The star, slow hosts side by side (ranks of the lab's adjacent runs): with the daemons'
    # --train-coalesce-updates a slow host hears its neighbours' newest tags and skips.
    comp = [0.1] * 6
    ranks = [2, 4, 0, 1, 3, 5]
    plain = _record("hop-backup-skip", comp, 1.0, "star-6", ranks=ranks, overhead=None)
    co = dict(plain, daemon_args="--no-train-spread-slow-hosts --train-coalesce-updates")
    [s] = check.check([plain, co], _load)
    assert s.rows[1].predicted < 0.7 * s.rows[0].predicted
    # Two sites, Hop with staleness: max-plus delivers every update, so with coalescing the
    # contender is simulated (the lab: 0.25-0.27 s per iteration with it, 0.47-0.49 s without).
    plain = _record("hop-staleness", comp, 1.0, "two-sites-6", overhead=None)
    co = dict(plain, daemon_args="--train-coalesce-updates")
    [s] = check.check([plain, co], _load)
    assert s.rows[1].predicted < 0.7 * s.rows[0].predicted
