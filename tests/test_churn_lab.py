"""Partitions and chaos in the lab (issue 8, items 3-4), with real daemons in network namespaces.

Runs as root (CI does); skips only where network namespaces cannot be made.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from peerd.config import Config
from peerd.lab import churn, lab, profile
from peerd.train.flat import flatten_module
from peerd.train.tasks import consensus_distance, get_task, train_local
from tests.test_daemon_lab import _WHY

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]
# Fast failure detection: a cut or a crash is seen within DEAD_AFTER.
DEAD_AFTER = 2.0
JOINED_MARGIN = 1.5   # consensus distance after the heal vs the joined swarm's before the cut
HEALED_FRACTION = 0.1  # ... and vs its value at the heal (the joined value reads high when the hosts'
                       # first checkpoints are of different iterations: a trainer that started late)
FAST = ("--heartbeat-interval", "0.3", "--suspect-after", "1.0", "--dead-after", str(DEAD_AFTER),
        "--rpc-timeout", "1.0", "--connect-retry-max", "1.0", "--link-min-probe-gap", "1")


@pytest.fixture
def make_lab(tmp_path):
    made = []

    def make(prof: profile.Profile, extra: tuple[str, ...] = ()) -> lab.Lab:
        d = tmp_path / f"lab{len(made)}"
        made.append(d)
        # A loaded machine starts a daemon slowly: a longer readiness bound than the default.
        lab.up(prof, d, Config(lab_ready_timeout=90.0), daemon_args=(*FAST, *extra))
        return lab.Lab(d)

    yield make
    for d in made:
        lab.down(d, Config(), purge=False)


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def alive_peers(lb: lab.Lab, host: str) -> int:
    """Peers the host's daemon holds alive, from its event log (the CLI takes tens of seconds to
    start on a CPU-starved machine; the log is the daemon's own record of the same transitions)."""
    events = lb.dir / host / "data" / "events.jsonl"
    state: dict[str, str] = {}
    if events.exists():
        for line in events.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "start":
                state.clear()
            elif e.get("event") == "peer":
                state[e["peer"]] = e["new"]
    return sum(v == "alive" for v in state.values())


def distance(lb: lab.Lab, task) -> float:
    """Consensus distance of the hosts' latest checkpoints."""
    flats = []
    for h in lb.hosts:
        ckpt = max((lb.dir / h / "data" / "checkpoints").glob("*/latest.pt"), key=lambda p: p.stat().st_mtime)
        m = task.build(0)
        m.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
        flats.append(flatten_module(m))
    return consensus_distance([f.buffer for f in flats], flats[0].layout)


def test_partition_and_heal_on_two_sites(make_lab):
    """Cut the two sites apart mid-run: each side goes on training (no host stalls past the failure
    detection bound + slack); heal: the sides re-admit each other and their models converge (the
    consensus distance, which the cut lets grow, returns to the joined swarm's level: at most
    JOINED_MARGIN x its value just before the cut and HEALED_FRACTION x its value at the heal; and
    every host reaches the accuracy bar)."""
    cfg = Config()
    prof = profile.load("two-sites")
    lb = make_lab(prof)
    wait(lambda: all(alive_peers(lb, h) == 3 for h in lb.hosts), 60, "a full swarm")
    # Paced steps, site b twice as slow as site a: joined, Hop holds a at b's pace; cut apart, a runs
    # ahead, so at the heal the sides are far more than max_ig apart (the case that used to hang).
    # 400 iterations (83 s; 600 took 109 s): the consensus distance after the run measured 0.040
    # against bounds of 0.22 and 0.38 (0.009 with 600); the side behind skips some 60 of them.
    args = ["--task", "digits", "--world", "4", "--iterations", "400", "--algo", "hop", "--eval-every", "200",
            "--step-time", "0.05"]
    slow = {h.name for h in prof.site_hosts("b")}
    streams = {h: churn.TrainStream(lb, h, args + (["--slowdown", "2"] if h in slow else [])) for h in lb.hosts}
    try:
        wait(lambda: all(s.iteration() >= 60 for s in streams.values()), 400, "iteration 60 everywhere")
        # A host that joined at a neighbour's iteration has no checkpoint until its next multiple
        # of the checkpoint interval.
        wait(lambda: all(any((lb.dir / h / "data" / "checkpoints").glob("*/latest.pt")) for h in lb.hosts), 120,
             "a checkpoint on every host")
        joined = distance(lb, get_task("digits"))
        t_cut = time.time()
        assert churn.cut(lb.dir) == ["a", "b"]
        k_cut = {h: s.iteration() for h, s in streams.items()}
        wait(lambda: all(alive_peers(lb, h) == 1 for h in lb.hosts), 30, "each side to see the other dead")
        # Each side trains on alone for a while.
        wait(lambda: all(s.iteration() >= k_cut[h] + 60 for h, s in streams.items()), 120,
             "60 iterations on both sides of the cut")
        drift = min(streams[h].iteration() for h in lb.hosts if h not in slow) - \
            max(streams[h].iteration() for h in slow)
        t_heal = time.time()
        task = get_task("digits")
        apart = distance(lb, task)
        assert churn.heal(lb.dir) == ["a", "b"]
        wait(lambda: all(alive_peers(lb, h) == 3 for h in lb.hosts), 60, "the sides to find each other again")
        runs = {h: s.finish(300) for h, s in streams.items()}
    finally:
        for s in streams.values():
            if s.proc.poll() is None:
                s.proc.kill()
    bound = DEAD_AFTER + cfg.lab.churn_stall_slack
    stalls = {h: churn.longest_stall(r, t_cut, t_heal) for h, r in runs.items()}
    print(f"stall per host during the cut: {stalls} (bound {bound} s); consensus distance at heal {apart:.3f}")
    assert max(stalls.values()) < bound, stalls
    # After the heal too: the side behind jumps to the side ahead (Hop's catch-up) instead of
    # holding it at the token bound, where it used to be waited out as silent (a stall of
    # train_silent_peer_timeout, 10 s, again and again). Measured: 2.0-2.5 s on a quiet machine,
    # 6.4-6.7 s at load 10-28.
    healed = {h: churn.longest_stall(r, t_heal, next(x["t"] for x in r if x.get("iteration", 0) >= r[-1]["iteration"]))
              for h, r in runs.items()}
    skipped = {h: r[-1].get("skipped", 0) for h, r in runs.items()}
    print(f"sides apart by {drift} iterations at the heal; stall per host after the heal: {healed}; "
          f"iterations skipped per host: {skipped}")
    assert drift > cfg.sync.hop_max_ig, drift                # the case under test did happen
    assert max(healed.values()) < cfg.train.silent_peer_timeout, healed
    assert all(skipped[h] > 0 for h in slow), skipped  # the side behind jumped
    for h, r in runs.items():
        assert r[-1]["state"] == "done" and r[-1]["metric"] >= 0.8, (h, r[-1])
    after = distance(lb, task)
    print(f"consensus distance: joined {joined:.3f}, at the heal {apart:.3f}, after the run {after:.3f}")
    assert after <= JOINED_MARGIN * joined and after <= HEALED_FRACTION * apart, (joined, apart, after)



# Chaos (issue 8, item 4): 20 kill/restart cycles over 6 hosts. A restart costs a daemon start, a
# `peerd train` start and a trainer start (each imports grpc and torch: 5-25 s each on the shared
# 2-core box, over a minute at a load of 40), so the cycles overlap: a kill every KILL_EVERY s, up to
# MAX_DOWN hosts down or rejoining at once, each restarted DOWN_FOR s after its kill (a reboot: its
# neighbours have seen it dead, or see its new incarnation). `--step-time` paces every step to a fixed
# wall time, so the run lasts ITERATIONS x STEP_TIME s however loaded the machine is. A uniform LAN
# and small link probes: the chaos is in the hosts, not in probe traffic (a restarted daemon probes
# every link afresh).
KILLS, KILL_EVERY, DOWN_FOR, MAX_DOWN = 20, 2.0, 0.5, 4
ITERATIONS, STEP_TIME = 380, 0.3     # the 20 kills take ~50 s of the 74 s chaos window
CHAOS_ARGS = ["--task", "digits", "--world", "6", "--algo", "hop", "--iterations", str(ITERATIONS),
              "--eval-every", "300"]
SMALL_PROBES = ("--link-probe-max-bytes", str(1 << 20))
# A restarted host's neighbours may wait on it (or it on them) while a trainer starts: the product
# bounds that wait by train_silent_peer_timeout (10 s by default; 3 s here, as a user who wants
# short stalls would set it), so a live host's stall bound is the larger of it and dead_after.
SILENT = 3.0


def calm_accuracy(seed: int) -> dict[str, float]:
    """Each host's final accuracy in a calm run of CHAOS_ARGS, computed in this process (6 s, where
    six daemons and trainers took 48 s). A calm Hop run in its standard mode mixes every ring
    neighbour's update of the same iteration: D-PSGD's arithmetic exactly
    (test_sync_hop.test_standard_mode_in_order_equals_dpsgd_exactly), which is what the synchronous
    LocalGroup of train_local computes, with the trainer's task, shards, seed and optimizer."""
    args = dict(zip(CHAOS_ARGS[::2], CHAOS_ARGS[1::2]))
    assert args["--algo"] == "hop" and "--topology" not in args, "the in-process calm run is Hop's standard mode on a ring"
    task = get_task(args["--task"])
    world = int(args["--world"])
    run = train_local(task, world=world, iterations=int(args["--iterations"]), topology="ring", seed=seed)
    return {f"h{r + 1}": task.evaluate(m)["accuracy"] for r, m in enumerate(run.models)}


def test_chaos_twenty_kill_restart_cycles_over_six_hosts(make_lab):
    """Every live host keeps training (no stall past churn.stall_bound: two waits of
    max(dead_after, train_silent_peer_timeout), downtimes overlap, + churn_stall_slack), every killed
    host is back, training and mixing, within churn_readmit_bound of its restart, and the run ends
    within chaos_accuracy_margin of a calm run's accuracy (the same run without chaos or pacing:
    pacing changes wall time, not the arithmetic; see calm_accuracy)."""
    cfg = Config(lab_ready_timeout=90.0)
    t0 = time.monotonic()
    calm_acc = calm_accuracy(seed=0)
    t1 = time.monotonic()
    lb = make_lab(profile.load("lan", 6), (*SMALL_PROBES, "--train-silent-peer-timeout", str(SILENT)))
    wait(lambda: all(alive_peers(lb, h) == 5 for h in lb.hosts), 90, "a full swarm")
    report = churn.chaos(lb.dir, [*CHAOS_ARGS, "--seed", "0", "--step-time", str(STEP_TIME)],
                         duration=ITERATIONS * STEP_TIME - 40, kill_every=KILL_EVERY, down_for=DOWN_FOR,
                         max_kills=KILLS, max_down=MAX_DOWN, timeout=400, cfg=cfg)
    rec = report.record()
    rec["calm_accuracy"] = calm_acc
    print(f"calm run {t1 - t0:.0f} s (in this process), lab and chaos run {time.monotonic() - t1:.0f} s")
    print(json.dumps(rec, indent=1))
    bound = churn.stall_bound(Config(dead_after=DEAD_AFTER), overlapping=MAX_DOWN > 1, silent=SILENT)
    assert len(report.kills) == KILLS, rec
    assert not rec["not_readmitted"] and rec["readmission_s_max"] <= cfg.lab.churn_readmit_bound, rec
    assert rec["longest_stall_s"] < bound, rec
    assert all(s == "done" for s in report.states.values()), report.states
    assert min(report.accuracy.values()) >= min(calm_acc.values()) - cfg.lab.chaos_accuracy_margin, rec
