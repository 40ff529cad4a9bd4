"""`peerd plan`: predicted iteration time of every algorithm and topology, and the recommendation.

    peerd plan --profile two-sites --model-bytes 100000000 --step-time 0.2[,0.02]   # a lab profile
    peerd plan [--data-dir D] [--model-bytes N] [--step-time S]   # the running swarm of this daemon
    peerd plan check RESULTS.jsonl                                 # the model against measurements
    peerd plan --profile two-sites --model-bytes 100000000 --step-time 0.2 --compress int8 --fragments 4
                                           # DiLoCo rows with a fixed codec and F (peerd/plan/lowcomm.py)
"""
from __future__ import annotations

import json
import sys

import click

from cli.daemon_cmds import data_dir_option, timeout_option


def _step(value: str | None) -> tuple[float, float] | None:
    if value is None:
        return None
    mean, _, std = value.partition(",")
    try:
        m, s = float(mean), float(std or 0)
    except ValueError:
        raise click.BadParameter(f"expected MEAN[,STD] in seconds, got {value!r}", param_hint="--step-time") from None
    if m < 0 or s < 0:
        raise click.BadParameter(f"step times must be >= 0, got {value!r}", param_hint="--step-time")
    return m, s


def _live(data_dir: str | None, timeout: float, cfg, step: tuple[float, float] | None,
          model_bytes: int | None):
    """(network, compute, model bytes, notes) from the local daemon's Links and Status replies."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from cli.daemon_cmds import control_stub
    from peerd.plan import model, sources
    from peerd.v1 import control_pb2 as cpb

    channel, stub = control_stub(data_dir)
    try:
        links = MessageToDict(stub.Links(cpb.LinksRequest(), timeout=timeout), preserving_proto_field_name=True)
        status = stub.Status(cpb.StatusRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise click.ClickException(f"daemon did not answer: {e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    notes = []
    # The active run, else the last one that ended here (its step times are still this host's).
    last = status.training_json or status.last_training_json
    training = json.loads(last) if last else {}
    nodes = training.get("nodes") or None
    if nodes is None:
        alive = [p.node_id for p in status.peers if p.state == "alive"]
        nodes = sorted([status.node_id, *alive])
    net, warnings = sources.network_from_links(links, nodes, cfg)
    notes += warnings
    st = training.get("step_time") or {}
    if step is None:
        if st.get("samples", 0) >= 1:
            step = (float(st["compute_mean_s"]), float(st["compute_std_s"]))
            notes.append(f"step time {step[0]:.4f} s (spread {step[1]:.4f}) measured by this host's trainer, "
                         f"assumed for every host (daemons do not share step times yet)")
        else:
            raise click.ClickException("no step time: no trainer has reported one on this daemon; pass "
                                       "--step-time SECONDS[,STD]")
    if model_bytes is None:
        if training.get("model_bytes"):
            model_bytes = int(training["model_bytes"])
        else:
            raise click.ClickException("no model size: no run is active on this daemon; pass --model-bytes N")
    return net, model.Compute.of(net.n, *step), model_bytes, notes


def _table(preds, best, second) -> str:
    head = f"{'rank':>4s}  {'algorithm':20s} {'topology':13s} {'overlap':7s} {'iter_s':>10s} {'speedup':>8s}  method"
    lines = [head, "-" * len(head)]
    for i, p in enumerate(preds, 1):
        mark = "  <- recommended" if p is best else ("  <- runner-up" if p is second else "")
        lines.append(f"{i:4d}  {p.algorithm:20s} {p.topology:13s} {'on' if p.overlap else 'off':7s} "
                     f"{p.iter_time_s:10.4f} {p.speedup:7.2f}x  {p.method}{'' if p.connected else ', splits'}{mark}")
    return "\n".join(lines)


def _outer_table(op) -> str:
    head = (f"  {'name':10s} {'topology':9s} {'H':>4s} {'F':>3s} {'tau':>3s} {'codec':5s} {'step_s':>8s} "
            f"{'compute_s':>9s} {'round_s':>8s} {'MB/sync':>8s} {'MB/round':>9s} {'MB/step':>8s}  hides")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in op.rows:
        mark = "  <- recommended" if r is op.recommended else ""
        lines.append(f"  {r.name:10s} {r.topology:9s} {r.inner_steps:4d} {r.fragments:3d} {r.overlap:3d} {r.codec:5s} "
                     f"{r.step_s:8.4f} {r.compute_step_s:9.4f} {r.step_s * r.inner_steps:8.2f} "
                     f"{r.bytes_sync / 1e6:8.3f} {r.bytes_round / 1e6:9.3f} {r.bytes_step / 1e6:8.4f}  "
                     f"{'yes' if r.hidden else 'no'}{mark}")
    return "\n".join(lines)


def _outer_text(op) -> str:
    out = ["", "low-communication mode (DiLoCo around d-psgd; seconds and MB per host; time and bytes only, "
               "its convergence per step differs):", _outer_table(op)]
    r = op.recommended
    if r is not None:
        out.append(f"\nrecommended instead: DiLoCo on {r.topology} ({r.name}), H={r.inner_steps} inner steps, "
                   f"F={r.fragments} fragments, overlap tau={r.overlap}, codec {r.codec}")
    out.append(f"why: {op.why}")
    return "\n".join(out)


@click.group("plan", invoke_without_command=True)
@click.option("--profile", "prof", default=None, help="lab profile file or shipped name (two-sites, lan, star, "
                                                      "straggler); without it: the running swarm of this daemon")
@click.option("--hosts", type=int, default=None, help="with --profile: host count (default: the profile's)")
@click.option("--model-bytes", type=int, default=None, help="model size in bytes (live: the active run's)")
@click.option("--step-time", "step_time", default=None,
              help="seconds per gradient on an unslowed host, MEAN[,STD] (live: this host's trainer's)")
@click.option("--overhead", type=float, default=None, help="seconds per iteration added to every contender "
                                                           "(default Config.plan_overhead)")
@click.option("--top", type=int, default=0, help="print only the N fastest rows (0: all)")
@click.option("--runnable", is_flag=True, help="only rows peerd or DDP run as given (overlap on)")
@click.option("--inner-steps", type=int, default=0, help="DiLoCo rows: also show this H (default: only the "
                                                         "H the rule computes)")
@click.option("--fragments", type=int, default=0, help="DiLoCo rows: fix F (default: computed)")
@click.option("--overlap", type=int, default=-1, help="DiLoCo rows: fix tau, inner steps (default: computed)")
@click.option("--compress", type=click.Choice(["none", "fp16", "bf16", "int8", "int4"]), default=None,
              help="DiLoCo rows: fix the wire codec (default: the least lossy that hides the exchange)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object: predictions, recommendation, notes")
@data_dir_option
@timeout_option
@click.pass_context
def plan(ctx, prof, hosts, model_bytes, step_time, overhead, top, runnable, inner_steps, fragments, overlap,
         compress, as_json, data_dir, timeout) -> None:
    """Predict the per-iteration time of ring and hierarchical All-Reduce and of every decentralized
    algorithm and topology peerd offers, with and without overlap, from a lab profile or the live
    link matrix and step times; print them ranked with the speedup over ring All-Reduce and the
    recommendation (the fastest that runs as listed). The formulas are in peerd/plan/model.py. Then
    the low-communication mode's rows (DiLoCo on all hosts and as gossip, peerd/plan/lowcomm.py) and,
    when the best row is communication-bound, the DiLoCo setting recommended instead."""
    if ctx.invoked_subcommand is not None:
        return
    from peerd.config import Config
    from peerd.lab.profile import ProfileError, load
    from peerd.plan import lowcomm, model, sources

    cfg = Config()
    step = _step(step_time)
    notes: list[str] = []
    try:
        if prof:
            if model_bytes is None or step is None:
                raise click.UsageError("--profile needs --model-bytes and --step-time")
            p = load(prof, hosts)
            net = sources.network_from_profile(p, cfg)
            comp = sources.compute_from_profile(p, *step)
            source = f"profile {p.name} ({len(p.hosts)} hosts)"
        else:
            net, comp, model_bytes, notes = _live(data_dir, timeout, cfg, step, model_bytes)
            source = f"live swarm ({net.n} hosts)"
        opts = model.Options.from_config(cfg, overhead)
        preds = model.plan(net, comp, float(model_bytes), opts)
        best, second = model.recommend(preds, tie=cfg.plan.tie_fraction)
        oo = lowcomm.OuterOptions.from_config(cfg, inner_steps=inner_steps, fragments=fragments, overlap=overlap,
                                              codec=compress or "")
        op = lowcomm.plan_outer(net, comp, float(model_bytes), best, opts, oo)
    except (ProfileError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    shown = [p for p in preds if p.runnable] if runnable else preds
    shown = shown[:top] if top > 0 else shown
    if as_json:
        click.echo(json.dumps({"source": source, "model_bytes": model_bytes, "step_time_mean": float(comp.mean.min()),
                               "hosts": net.n, "predictions": [p.record() for p in shown],
                               "recommended": best.record(), "runner_up": second.record() if second else None,
                               "low_communication": op.record() if op else None, "notes": notes}, indent=2))
        return
    click.echo(f"{source}, model {model_bytes / 1e6:.1f} MB, step {comp.mean.min():.3f} s"
               f"{f' (spread {comp.std.min():.3f})' if comp.std.any() else ''}; seconds per iteration:")
    click.echo(_table(shown, best, second))
    click.echo(f"\nrecommended: {best.algorithm} on {best.topology} ({best.iter_time_s:.3f} s/iteration, "
               f"{best.speedup:.2f}x ring All-Reduce; rows within {cfg.plan.tie_fraction:.0%} of the fastest "
               f"are tied and go by a fixed preference)")
    if second:
        click.echo(f"runner-up:   {second.algorithm} on {second.topology} ({second.iter_time_s:.3f} s/iteration)")
    if any(not p.connected for p in shown):
        click.echo("splits: the updates it mixes in steady state do not connect the hosts (never recommended)")
    click.echo("per-iteration time only: the iterations each algorithm needs to reach a loss differ")
    if op is not None:
        click.echo(_outer_text(op))
    for n in notes:
        click.echo(f"note: {n}")
    sys.stdout.flush()


@plan.command("check")
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="one JSON record per scenario")
def check_cmd(results: str, as_json: bool) -> None:
    """Compare predicted with measured per-iteration times (`peerd bench scenarios` records: JSON
    lines with scenario, contender, profile, model_bytes, iter_time_s, hosts, per_host; optional
    topology). The model is fed each record's measured per-host compute and overhead. Flags errors
    above 25 % and says whether the recommended contender was the measured fastest or within 10 %;
    failed runs are left out and listed. Exits 1 when any prediction is flagged or any
    recommendation missed."""
    from peerd.config import Config
    from peerd.lab.profile import ProfileError, load
    from peerd.plan import check

    try:
        with open(results) as fh:
            skipped: list[str] = []
            records = check.parse_lines(fh, results, skipped)
        scens = check.check(records, lambda name, n: load(name, n), Config())
    except (check.CheckError, ProfileError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        for s in scens:
            click.echo(json.dumps(s.record()))
    else:
        click.echo(check.render(scens))
        for line in skipped:
            click.echo(f"note: {line}")
    ok = all(not r.flagged for s in scens for r in s.rows) and all(s.recommendation_ok for s in scens)
    sys.exit(0 if ok else 1)
