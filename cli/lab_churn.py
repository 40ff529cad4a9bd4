"""`peerd lab cut|heal|chaos`: partitions and churn in the lab (see peerd/lab/churn.py)."""
from __future__ import annotations

import json

import click

from cli.lab import _cfg, _config_opt, _dir, _dir_opt
from peerd.lab import churn
from peerd.lab import lab as lab_mod
from peerd.lab.netns import LabError


@click.command()
@_dir_opt
@click.option("--site", "sites", multiple=True, help="site to cut off the others (repeatable; default: every site)")
@_config_opt
def cut(lab_dir: str | None, sites: tuple[str, ...], config_file: str | None) -> None:
    """Cut the sites apart (a WAN outage): no traffic between sites until `peerd lab heal`."""
    cfg = _cfg(config_file)
    try:
        now = churn.cut(_dir(cfg, lab_dir), list(sites), cfg)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"cut: {', '.join(now) if now else 'nothing new (already cut)'}")


@click.command()
@_dir_opt
@_config_opt
def heal(lab_dir: str | None, config_file: str | None) -> None:
    """Undo every cut."""
    cfg = _cfg(config_file)
    try:
        was = churn.heal(_dir(cfg, lab_dir), cfg)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"healed: {', '.join(was) if was else 'nothing was cut'}")


@click.command()
@_dir_opt
@click.option("--duration", type=float, required=True, help="seconds of chaos once every host trains")
@click.option("--kill-every", type=float, required=True, help="seconds between kills")
@click.option("--down-for", type=float, default=None, help="seconds a killed host stays down (default: "
              "chaos_down_for in Config; keep it above dead_after so neighbours see it gone)")
@click.option("--cut-links", is_flag=True, help="every third cycle cuts the sites apart instead of a kill")
@click.option("--cut-for", type=float, default=3.0, show_default=True, help="seconds of each cut")
@click.option("--calm/--no-calm", default=True, show_default=True,
              help="first run the same training without chaos (seed + 1, so the two runs never share a tag)")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the training and of the chaos")
@click.option("--task", default="digits", show_default=True)
@click.option("--algo", default="hop", show_default=True)
@click.option("--iterations", type=int, default=300, show_default=True)
@click.option("--eval-every", type=int, default=100, show_default=True)
@click.option("--step-time", type=float, default=None,
              help="pad each training step to this many seconds (the chaos run only): the run lasts "
                   "iterations x step-time however loaded the machine is")
@click.option("--max-kills", type=int, default=None, help="end the chaos after this many kills")
@click.option("--max-down", type=int, default=None,
              help="most hosts down or rejoining at once (default: a third of the hosts)")
@_config_opt
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def chaos(lab_dir: str | None, duration: float, kill_every: float, down_for: float | None, cut_links: bool,
          cut_for: float, calm: bool, seed: int, task: str, algo: str, iterations: int, eval_every: int,
          step_time: float | None, max_kills: int | None, max_down: int | None, config_file: str | None,
          as_json: bool) -> None:
    """Train on every lab host while killing and restarting random hosts (and cutting links); report
    the longest stall of any live host, each restarted host's re-admission time, and the final
    accuracy against a calm run (the same training, unpaced)."""
    cfg = _cfg(config_file)
    d = _dir(cfg, lab_dir)
    try:
        lb = lab_mod.Lab(d)
        args = ["--task", task, "--algo", algo, "--world", str(len(lb.hosts)), "--iterations", str(iterations),
                "--eval-every", str(eval_every)]
        calm_acc = {}
        if calm:
            runs = churn.train_all(lb, [*args, "--seed", str(seed + 1)], timeout=600)
            calm_acc = {h: round(float(r[-1].get("metric", 0.0)), 4) if r else 0.0 for h, r in runs.items()}
        pace = ["--step-time", str(step_time)] if step_time else []
        report = churn.chaos(d, [*args, "--seed", str(seed), *pace], duration=duration, kill_every=kill_every,
                             down_for=cfg.lab.chaos_down_for if down_for is None else down_for, cut_links=cut_links,
                             cut_for=cut_for, seed=seed, max_kills=max_kills, max_down=max_down, cfg=cfg,
                             log=lambda m: click.echo(m, err=True))
        report.calm_accuracy = calm_acc
    except LabError as e:
        raise click.ClickException(str(e)) from None
    rec = report.record()
    rec["stall_bound_s"] = churn.stall_bound(cfg, overlapping=(max_down or max(1, len(lb.hosts) // 3)) > 1)
    if as_json:
        click.echo(json.dumps(rec, indent=1))
        return
    click.echo(f"chaos: {len(report.kills)} kills, {len(report.cuts)} cuts in {duration:g} s")
    click.echo(f"longest stall of a live host: {rec['longest_stall_s']} s (bound {rec['stall_bound_s']:g} s)")
    for h, s in rec["stall_per_host_s"].items():
        click.echo(f"  {h:<6} stall {s:6.2f} s  accuracy {report.accuracy.get(h, 0):.4f}"
                   + (f"  (calm {calm_acc[h]:.4f})" if h in calm_acc else "") + f"  {report.states.get(h, '')}")
    for k in report.kills:
        click.echo(f"  killed {k['host']} at {k['killed_at']:.1f} s, restarted at {k['restarted_at']:.1f} s, "
                   f"re-admitted after {k['readmitted_s'] if k['readmitted_s'] is not None else 'NEVER'} s"
                   + (f" ({k['back_after_kill_s']} s after the kill)" if "back_after_kill_s" in k else ""))
    if rec["not_readmitted"]:
        raise SystemExit(1)


COMMANDS = [cut, heal, chaos]
