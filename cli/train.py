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
                   "ad-psgd (adpsgd), sgp, aau, netmax, ...; auto: the daemon picks algorithm and topology "
                   "with the runtime model (`peerd plan`) and logs the choice and the runner-up")
@click.option("--model-bytes", type=int, default=None,
              help="--algo auto: model size to plan with (default: the built-in task's parameter bytes)")
@click.option("--topology", default="ring", show_default=True, help="ring, torus, exp, aer, complete (--algo auto picks its own)")
@click.option("--world", type=int, required=True, help="hosts in the run, this one included")
@click.option("--max-world", type=int, default=None,
              help="hosts the run may grow to: up to MAX_WORLD - WORLD new hosts may join it later (same "
                   "options on every host; default Config.train_max_world, 0: --world, nobody joins)")
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
                                              "compute (times --slowdown); --algo auto also plans with it "
                                              "until the trainer has measured steps (default "
                                              "Config.plan_default_step_time)")
@click.option("--slow-prob", type=float, help="experiments: chance that an iteration is --slow-factor slower "
                                             "(deterministic in seed, rank, iteration)")
@click.option("--slow-factor", type=float, help="experiments: factor of a randomly slowed iteration")
@click.option("--trace", is_flag=True, help="the trainer writes one JSON line per iteration to trace.jsonl "
                                            "in its checkpoint directory")
@click.option("--budget", type=click.Choice(["host", "swarm"]), default="host", show_default=True,
              help="host: each host runs --iterations; swarm: the hosts together run world x --iterations, "
                   "so a fast host goes on while the slow ones catch up (for asynchronous algorithms: "
                   "netmax, ad-psgd)")
@click.option("--eval-every", type=int, default=50, show_default=True, help="evaluate every N iterations")
@click.option("--join-timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for the other hosts of the run")
@click.option("--json", "as_json", is_flag=True, help="one JSON progress record per line")
@data_dir_option
def train(task, script, algorithm, model_bytes, topology, world, max_world, iterations, seed, non_iid, backup, staleness, skip, max_gap,
          lr, optimizer, slowdown, step_time, slow_prob, slow_factor, trace, budget, eval_every, join_timeout, as_json,
          data_dir) -> None:
    """Train together with the other hosts: run this on each host of the run with the same options.

    The local daemon waits until the run's world is present, starts the trainer (restarting it from
    its checkpoint if it crashes), drives the chosen sync algorithm and reports progress here.
    Ctrl+C stops this host's trainer.

    \b
    Joining a run under way: the daemon first asks the live peers what they run.
    - A run with the same options that lists this host (a restarted host): it takes its rank back.
    - A run with the same options, formed with --max-world above --world, and a rank free: this
      host joins it. One member admits it and every live member agrees on its rank; it pulls a
      neighbour's current parameters, starts at its iteration, trains on the data shard of
      (rank mod world) and is mixed from its first update.
    - The run is full, or the options differ: an error naming the first differing option (it
      waits up to --join-timeout for a different run of a would-be member to finish first).
    Hosts that have not joined yet are treated by every algorithm as dead workers.
    """
    import os

    from peerd.v1 import control_pb2 as cpb

    options = {k: str(v) for k, v in dict(backup=backup, staleness=staleness, max_ig=max_gap, lr=lr,
                                          optimizer=optimizer, step_time=step_time,
                                          slow_prob=slow_prob, slow_factor=slow_factor).items() if v is not None}
    if trace:
        options["trace"] = "true"
    if budget != "host":
        options["budget"] = budget
    if skip is not None:
        options["skip"] = "true" if skip else "false"
    if model_bytes:
        options["model_bytes"] = str(model_bytes)
    if slowdown is None:
        slowdown = float(os.environ.get("PEERD_SLOWDOWN", "1") or 1)
    req = cpb.TrainRequest(task=task, script=list(script), algorithm=algorithm, topology=topology, world=world,
                           iterations=iterations, seed=seed, non_iid=non_iid, slowdown=slowdown,
                           options=options, eval_every=eval_every, join_timeout_s=join_timeout,
                           max_world=max_world or 0)
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
        # Closing the stream is what stops the run: the daemon stops the trainer when its caller
        # leaves. Then exit at once; the interpreter's teardown (gRPC, torch) takes seconds.
        channel.close()
        click.echo("\nstopping this host's trainer", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    finally:
        channel.close()
    if last is not None and not as_json:
        click.echo(_line(last, iterations))
    sys.exit(0 if last is not None and last.state == "done" else 1)


ACTIONS = {"pause": "KIND_PAUSE", "resume": "KIND_RESUME", "checkpoint": "KIND_CHECKPOINT", "stop": "KIND_STOP",
           "skip-to": "KIND_SKIP_TO"}


@click.command()
@click.argument("action", type=click.Choice(list(ACTIONS)))
@click.argument("iteration", type=int, required=False)
@click.option("--reason", default="", help="recorded in the trainer's log")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="seconds to wait for the daemon")
@data_dir_option
def ctl(action, iteration, reason, timeout, data_dir) -> None:
    """Direct this host's trainer: pause, resume, checkpoint (now), stop (cleanly, after a final
    checkpoint), skip-to ITERATION.

    A paused host is announced to its neighbours, which go on without it; on resume it continues
    at their iteration.
    """
    from peerd.v1 import control_pb2 as cpb

    if (action == "skip-to") != (iteration is not None):
        raise click.UsageError("ITERATION goes with skip-to, and only with it")
    d = cpb.Directive(kind=cpb.Directive.Kind.Value(ACTIONS[action]), iteration=iteration or 0, reason=reason)
    channel, stub = control_stub(data_dir)
    try:
        reply = stub.Direct(cpb.DirectRequest(directive=d), timeout=timeout)
    except grpc.RpcError as e:
        raise click.ClickException(f"{e.code().name}: {e.details()}") from None
    finally:
        channel.close()
    if not reply.delivered:
        raise click.ClickException(f"{action}: no trainer attached to this host's run yet; try again")
    click.echo(f"{action}: sent to {reply.delivered} trainer(s)")
