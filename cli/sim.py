"""`peerd sim`: run sync policies through the discrete-event simulator and print what they achieve.

    peerd sim --scenario straggler|random-slowdown|two-sites [--workers N] [--json]
    peerd sim -a hop-backup-skip -a d-psgd --workers 64 --straggler 0:4 --iterations 300
    peerd sim -a d-psgd --workers 10000 --timing-only --iterations 20
    peerd sim -a d-psgd --topology ring --outer diloco --round-seconds 0.8 --fragments 2 --overlap 2 \
              --compress int8 --straggler 0:3 --sites 2           # DiLoCo (peerd/sim/outer.py)
    peerd sim --scenario two-sites-diloco
"""
from __future__ import annotations

import json
import sys

import click
import numpy as np

from peerd.config import Config
from peerd.sim.engine import SimSpec
from peerd.sim.outer import CODECS, OuterSpec, label
from peerd.sim.scenarios import SCENARIOS, claims, run, run_scenario
from peerd.sync import registry


def _pairs(values: tuple[str, ...], what: str) -> dict[int, float]:
    out = {}
    for v in values:
        a, sep, b = v.partition(":")
        try:
            if not sep:
                raise ValueError(v)
            out[int(a)] = float(b)
        except ValueError:
            raise click.BadParameter(f"expected WORKER:{what}, got {v!r}") from None
    return out


def _fmt(x: object, spec: str) -> str:
    width = spec.split(".")[0]
    return format("-", f">{width}") if x is None else format(x, spec)


def _table(records: list[dict]) -> str:
    w = max([20] + [len(r.get("label") or r["algorithm"]) for r in records])
    head = f"{'algorithm':{w}s} {'time_to_target':>14s} {'iters@target':>12s} {'MB@target':>10s} " \
           f"{'final_loss':>10s} {'idle':>6s} {'consensus':>9s} {'sim_time':>9s} {'iters':>7s} " \
           f"{'steps':>7s} {'MB_sent':>10s} {'B/wkr/step':>10s} {'wall_s':>7s}"
    rows = [head, "-" * len(head)]
    for r in records:
        mb = None if r["bytes_at_target"] is None else r["bytes_at_target"] / 1e6
        rows.append(f"{r.get('label') or r['algorithm']:{w}s} {_fmt(r['time_to_target'], '14.3f')} "
                    f"{_fmt(r['iterations_at_target'], '12.1f')} {_fmt(mb, '10.2f')} "
                    f"{_fmt(r['final_loss'], '10.2e')} {r['mean_idle_fraction']:6.2f} "
                    f"{_fmt(r['consensus_distance'], '9.3f')} {r['sim_time']:9.2f} "
                    f"{r['mean_iterations']:7.1f} {r['mean_computed']:7.1f} {r['bytes_sent'] / 1e6:10.2f} "
                    f"{r['bytes_per_worker_step']:10.0f} {r['wall_s']:7.2f}")
    return "\n".join(rows)


def _outer(mode: str | None, inner_steps: int, round_seconds: float, fragments: int, overlap: int,
           outer_lr: float, outer_momentum: float, equal_weights: bool) -> OuterSpec | None:
    if mode is None:
        if inner_steps or round_seconds or fragments != 1 or overlap or equal_weights:
            raise click.UsageError("--inner-steps, --round-seconds, --fragments, --overlap and --equal-weights "
                                   "need --outer diloco")
        return None
    if (inner_steps > 0) == (round_seconds > 0):
        raise click.UsageError("--outer diloco needs exactly one of --inner-steps H and --round-seconds T")
    return OuterSpec(inner_steps=inner_steps, round_seconds=round_seconds, fragments=fragments, overlap=overlap,
                     outer_lr=outer_lr, outer_momentum=outer_momentum, weigh_by_steps=not equal_weights)


@click.command("sim")
@click.option("--scenario", "scen", type=click.Choice(SCENARIOS),
              help="a named setting of the papers: runs every algorithm (or those given with -a) and "
                   "checks the papers' claims; only --workers, --seed, -a and --json apply to it "
                   "(two-sites-diloco runs its own rows: -a does not apply)")
@click.option("--workers", "-n", type=int, default=8, show_default=True)
@click.option("--algorithm", "-a", "algos", multiple=True, type=click.Choice(list(registry.ALGORITHMS)),
              help="algorithm to run (repeatable; default: all for a scenario, else Config.sync_algorithm)")
@click.option("--topology", default=None, help="ring, torus, complete, exp, exp-directed, aer (default: Config.sync_topology)")
@click.option("--weighting", type=click.Choice(["uniform", "mh"]), default=None,
              help="mixing weights (default: Config.sync_weighting)")
@click.option("--params", type=int, default=1000, show_default=True, help="model size (parameters)")
@click.option("--iterations", type=int, default=200, show_default=True, help="iterations per worker")
@click.option("--compute", type=float, default=0.1, show_default=True, help="seconds per gradient")
@click.option("--straggler", multiple=True, help="WORKER:FACTOR, a worker always FACTOR x slower (repeatable)")
@click.option("--p-slow", type=float, default=0.0, show_default=True, help="random slowdown: probability per iteration")
@click.option("--slow-factor", type=float, default=4.0, show_default=True, help="random slowdown: factor")
@click.option("--bandwidth", type=float, default=1e9, show_default=True, help="bytes/s per link")
@click.option("--latency", type=float, default=1e-4, show_default=True, help="seconds per link")
@click.option("--sites", type=int, default=1, show_default=True, help="split workers into this many sites")
@click.option("--inter-site-slowdown", type=float, default=10.0, show_default=True,
              help="inter-site links are this many times slower")
@click.option("--lr", type=float, default=0.05, show_default=True)
@click.option("--target", type=float, default=1e-3, show_default=True, help="relative suboptimality to reach")
@click.option("--hetero", type=float, default=0.1, show_default=True, help="non-i.i.d.-ness of the shards")
@click.option("--noise", type=float, default=0.01, show_default=True, help="gradient noise")
@click.option("--crash", multiple=True, help="WORKER:TIME, a worker crashes (repeatable)")
@click.option("--lose", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.0, show_default=True,
              help="probability that a pushed update fails on its way (the receiver mixes without it)")
@click.option("--timing-only", is_flag=True, help="protocol only, no parameters (very large N)")
@click.option("--sender", type=click.Choice(["daemon", "pipe"]), default="daemon", show_default=True,
              help="daemon: one ordered queue of pushes and grants per neighbour, each RPC's reply "
                   "awaited (what peerd does); pipe: updates back to back, grants after the latency only")
@click.option("--outer", type=click.Choice(["diloco"]), default=None,
              help="low-communication mode: DiLoCo outer rounds around the algorithm (peerd/sim/outer.py); "
                   "--iterations then counts syncs (F per round) and iters@target counts inner steps")
@click.option("--inner-steps", type=int, default=0, help="DiLoCo: a fixed H inner steps per round")
@click.option("--round-seconds", type=float, default=0.0,
              help="DiLoCo: a simulated time budget per round (a slow worker takes fewer steps)")
@click.option("--fragments", type=int, default=1, show_default=True, help="DiLoCo: F, streaming fragments")
@click.option("--overlap", type=int, default=0, show_default=True,
              help="DiLoCo: tau, inner steps between a sync's publish and its mix")
@click.option("--outer-lr", type=float, default=0.7, show_default=True)
@click.option("--outer-momentum", type=float, default=0.9, show_default=True, help="outer Nesterov momentum")
@click.option("--equal-weights", is_flag=True,
              help="DiLoCo: weigh every publish alike in the mix (default: by the inner steps it took)")
@click.option("--compress", type=click.Choice(CODECS), default=None,
              help="wire codec whose bytes the sim counts (not its rounding; default Config.dataplane_compression)")
@click.option("--no-stop", is_flag=True, help="run all iterations even after the target is reached")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON record per algorithm")
def sim(scen, workers, algos, topology, weighting, params, iterations, compute, straggler, p_slow,
        slow_factor, bandwidth, latency, sites, inter_site_slowdown, lr, target, hetero, noise, crash, lose,
        timing_only, sender, outer, inner_steps, round_seconds, fragments, overlap, outer_lr, outer_momentum,
        equal_weights, compress, no_stop, seed, as_json) -> None:
    """Simulate N workers running sync policies; report time to target, iterations, idle, bytes.

    The objective is least squares on non-i.i.d. synthetic shards; time to target is the simulated
    time at which the average model's relative suboptimality first drops below --target.
    """
    cfg = Config()
    compress = compress or cfg.dataplane.compression
    try:
        o = _outer(outer, inner_steps, round_seconds, fragments, overlap, outer_lr, outer_momentum, equal_weights)
        if scen:
            records = run_scenario(scen, workers, seed, list(algos) or None)
            checks = claims(scen, records)
        else:
            if sites < 1 or workers % sites:
                raise click.BadParameter(f"--sites {sites} must divide --workers {workers}")
            bw: object = bandwidth
            if sites > 1:
                site = np.arange(workers) // (workers // sites)
                bw = np.where(site[:, None] == site[None, :], bandwidth, bandwidth / inter_site_slowdown)
            spec = SimSpec(n=workers, params=params, iterations=iterations, compute=compute,
                           factors=_pairs(straggler, "FACTOR"), p_slow=p_slow, slow_factor=slow_factor,
                           bandwidth=bw, latency=latency, lr=lr, target=target, hetero=hetero,
                           noise=noise, crash=_pairs(crash, "TIME"), lose=lose, timing_only=timing_only,
                           stop_at_target=not no_stop and not timing_only, seed=seed, sender=sender,
                           compress=compress, outer=o)
            records = []
            for a in algos or (cfg.sync.algorithm,):
                topo = topology or cfg.sync.topology
                r = run(a, spec, topo, weighting=weighting or cfg.sync.weighting, **registry.options(cfg, a))
                records.append(r.record() | {"label": label(a, topo, o, compress)})
            checks = []
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        for r in records:
            click.echo(json.dumps(r))
        return
    click.echo(_table(records))
    for c in checks:
        status = "holds" if c["holds"] else ("n/a" if c["ratio"] is None else "FAILS")
        click.echo(f"{status:6s} {c['claim']}: ratio {_fmt(c['ratio'], '.2f')}")
    sys.stdout.flush()
