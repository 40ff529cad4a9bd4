"""`peerd train`: have this host's daemon run the trainer, and show its progress."""
from __future__ import annotations

import json
import sys
import time

import click
import grpc

from cli.daemon_cmds import control_stub, data_dir_option


def _line(p, iterations: int, width: int = 28) -> str:
    done = min(1.0, p.iteration / iterations) if iterations else 0.0
    bar = "#" * int(done * width) + "-" * (width - int(done * width))
    metric = f"  {p.metric_name} {p.metric:.3f}" if p.metric_name else ""
    skipped = f"  skipped {p.skipped}" if p.skipped else ""
    return (f"[{bar}] it {p.iteration}/{iterations}  loss {p.loss:.4f}{metric}  {p.iterations_per_s:.1f} it/s"
            f"  mixed with {p.peers_in_last_mix}  gap {p.gap_to_fastest:+d}{skipped}  {p.elapsed_s:.0f}s")


@click.command()
@click.option("--task", default="", help="built-in task: digits, svm, lm")
@click.option("--script", multiple=True, help="run your own script instead (it calls peerd.train.attach()); "
                                              "repeat for its arguments")
@click.option("--algo", "algorithm", default="hop", show_default=True,
              help="hop, hop-backup, hop-staleness, hop-backup-skip, hop-staleness-skip, d-psgd (dpsgd), "
                   "ad-psgd (adpsgd), sgp, aau, netmax, ...")
@click.option("--topology", default="ring", show_default=True, help="ring, torus, exp, aer, complete")
@click.option("--world", type=int, required=True, help="hosts in the run, this one included")
@click.option("--iterations", type=int, default=300, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="same on every host: same initial model")
@click.option("--non-iid", is_flag=True, help="skewed label shards")
@click.option("--backup", type=int, help="Hop: backup in-neighbours not waited for")
@click.option("--staleness", type=int, help="Hop: staleness bound s")
@click.option("--skip/--no-skip", default=None, help="Hop: iteration skipping for a slow host")
@click.option("--max-gap", type=int, help="Hop: max iteration gap per edge (tokens)")
@click.option("--lr", type=float, help="learning rate (default: the task's)")
@click.option("--optimizer", help="sgd, dadam, accumadam (default: the task's)")
@click.option("--slowdown", type=float, default=None, help="this host computes F times slower (experiments; "
                                                          "default $PEERD_SLOWDOWN or 1)")
@click.option("--step-time", type=float, help="experiments: pad each step to this many seconds of emulated "
                                              "compute (times --slowdown)")
@click.option("--slow-prob", type=float, help="experiments: chance that an iteration is --slow-factor slower "
                                             "(deterministic in seed, rank, iteration)")
@click.option("--slow-factor", type=float, help="experiments: factor of a randomly slowed iteration")
@click.option("--trace", is_flag=True, help="the trainer writes one JSON line per iteration to trace.jsonl "
                                            "in its checkpoint directory")
@click.option("--eval-every", type=int, default=50, show_default=True, help="evaluate every N iterations")
@click.option("--join-timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for the other hosts of the run")
@click.option("--json", "as_json", is_flag=True, help="one JSON progress record per line")
@data_dir_option
def train(task, script, algorithm, topology, world, iterations, seed, non_iid, backup, staleness, skip, max_gap,
          lr, optimizer, slowdown, step_time, slow_prob, slow_factor, trace, eval_every, join_timeout, as_json, data_dir) -> None:
    """Train together with the other hosts: run this on each host of the run with the same options.

    The local daemon waits until the run's world is present, starts the trainer (restarting it from
    its checkpoint if it crashes), drives the chosen sync algorithm and reports progress here.
    Ctrl+C stops this host's trainer.
    """
    import os

    from peerd.v1 import control_pb2 as cpb

    options = {k: str(v) for k, v in dict(backup=backup, staleness=staleness, max_ig=max_gap, lr=lr,
                                          optimizer=optimizer, step_time=step_time,
                                          slow_prob=slow_prob, slow_factor=slow_factor).items() if v is not None}
    if trace:
        options["trace"] = "true"
    if skip is not None:
        options["skip"] = "true" if skip else "false"
    if slowdown is None:
        slowdown = float(os.environ.get("PEERD_SLOWDOWN", "1") or 1)
    req = cpb.TrainRequest(task=task, script=list(script), algorithm=algorithm, topology=topology, world=world,
                           iterations=iterations, seed=seed, non_iid=non_iid, slowdown=slowdown,
                           options=options, eval_every=eval_every, join_timeout_s=join_timeout)
    channel, stub = control_stub(data_dir)
    last = None
    tty = sys.stderr.isatty() and not as_json
    try:
        for p in stub.Train(req):
            last = p
            if as_json:
                click.echo(json.dumps({"t": p.wall_time or time.time(), "state": p.state, "iteration": p.iteration,
                                       "loss": p.loss, "it_per_s": p.iterations_per_s,
                                       "metric_name": p.metric_name, "metric": p.metric, "rank": p.rank,
                                       "gap": p.gap_to_fastest, "peers_in_last_mix": p.peers_in_last_mix,
                                       "elapsed_s": p.elapsed_s, "restarts": p.trainer_restarts,
                                       "skipped": p.skipped, "message": p.message}), nl=True)
            elif p.state in ("waiting", "restarting", "failed", "done"):
                click.echo(("\n" if tty else "") + f"{p.state}: {p.message}", err=True)
            elif tty:
                click.echo("\r" + _line(p, iterations), nl=False, err=True)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            raise click.ClickException(f"{e.code().name}: {e.details()}") from None
    except KeyboardInterrupt:
        click.echo("\nstopping this host's trainer", err=True)
        sys.exit(130)
    finally:
        channel.close()
    if last is not None and not as_json:
        click.echo(_line(last, iterations))
    sys.exit(0 if last is not None and last.state == "done" else 1)
