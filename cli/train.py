"""`peerd train`: have this host's daemon run the trainer, and show its progress."""
from __future__ import annotations

import json
import sys
import time

import click
import grpc

from cli.daemon_cmds import control_stub, data_dir_option
from cli.live import bits_per_byte, make_view, plain_line


@click.command()
@click.option("--task", default="", help="built-in task: digits, digits-wide, svm, lm (tiny, for tests), gpt "
                                         "(a 25M-parameter byte-level LM on the stdlib's source; docs/real-size.md)")
@click.option("--model-size", type=click.Choice(["tiny", "small", "base"]), default=None,
              help="gpt: tiny (0.45M parameters), small (25.5M, the default), base (99.8M)")
@click.option("--context", type=int, default=None, help="gpt: sequence length in bytes (default: the size's)")
@click.option("--eval-tokens", type=int, default=None, help="gpt: validation bytes per evaluation")
@click.option("--batch-size", type=int, default=None, help="sequences (gpt) or samples per step (default: the task's)")
@click.option("--init", "init_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="start from these model weights (a state_dict or a trainer checkpoint), e.g. a warm start "
                   "shared by every contender of a benchmark; the same file on every host (its sha256 is "
                   "part of the run's options, so a host with another file is refused)")
@click.option("--device", default="auto", show_default=True,
              help="where this host's trainer computes: auto (CUDA when present), cpu, cuda, cuda:N")
@click.option("--script", multiple=True, help="run your own script instead (it calls peerd.train.attach()), "
                                              "with the daemon's Python, in this directory; repeat for its "
                                              "arguments")
@click.option("--algo", "algorithm", default="hop", show_default=True,
              help="hop, hop-backup, hop-staleness, hop-backup-skip, hop-staleness-skip, d-psgd (dpsgd), "
                   "ad-psgd (adpsgd), sgp, aau, netmax, ...; auto: the daemon picks algorithm and topology "
                   "with the runtime model (`peerd plan`) and logs the choice and the runner-up")
@click.option("--model-bytes", type=int, default=None,
              help="--algo auto: model size to plan with (default: the built-in task's parameter bytes)")
@click.option("--topology", default="ring", show_default=True, help="ring, torus, exp, aer, complete (--algo auto picks its own)")
@click.option("--world", type=click.IntRange(min=1), required=True, help="hosts in the run, this one included")
@click.option("--max-world", type=click.IntRange(min=0), default=None,
              help="hosts the run may grow to: up to MAX_WORLD - WORLD new hosts may join it later (same "
                   "options on every host; default Config.train_max_world, 0: --world, nobody joins)")
@click.option("--iterations", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="same on every host: same initial model")
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
@click.option("--outer", type=click.Choice(["none", "diloco"]), default="none", show_default=True,
              help="diloco: the low-communication mode: many inner steps between syncs, outer Nesterov on the "
                   "mixed models (docs/low-communication.md); --iterations then counts syncs")
@click.option("--inner-steps", type=int, help="diloco: inner steps per round (a fixed H)")
@click.option("--round-seconds", type=float,
              help="diloco: seconds of inner steps per round (a time budget: a slow host takes fewer steps, "
                   "weighed by its steps in every mix)")
@click.option("--fragments", type=int, help="diloco: sync the model in this many fragments in turn (streaming)")
@click.option("--overlap", type=int, help="diloco: inner steps a sync's exchange overlaps")
@click.option("--outer-lr", type=float, help="diloco: outer learning rate (default 0.7; the digits tasks: 1.0)")
@click.option("--outer-momentum", type=float, help="diloco: outer Nesterov momentum (default 0.9; the digits tasks: 0)")
@click.option("--compress", type=click.Choice(["none", "fp16", "bf16", "int8", "int4"]), default=None,
              help="wire codec of model updates; int8/int4 send quantized increments of each host's public "
                   "copy with error feedback (default: Config.dataplane_compression)")
@click.option("--eval-every", type=click.IntRange(min=0), default=50, show_default=True, help="evaluate every N iterations")
@click.option("--join-timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for this host's daemon to answer and for the other hosts of the run")
@click.option("--json", "as_json", is_flag=True, help="one JSON progress record per line")
@click.option("--no-progress", is_flag=True, help="plain progress lines even on a terminal (no live view)")
@click.option("--progress-every", type=float, default=10.0, show_default=True,
              help="plain mode (not a terminal, or --no-progress): seconds between progress lines")
@data_dir_option
def train(task, model_size, context, eval_tokens, batch_size, init_path, device, script, algorithm, model_bytes, topology, world, max_world, iterations, seed, non_iid, backup, staleness, skip, max_gap,
          lr, optimizer, slowdown, step_time, slow_prob, slow_factor, trace, budget, eval_every, join_timeout, as_json,
          no_progress, progress_every, data_dir, **low_comm) -> None:
    """Train together with the other hosts: run this on each host of the run with the same options.

    The local daemon waits until WORLD hosts run `peerd train` with these options, starts the
    trainer (restarting it from its checkpoint if it crashes), drives the chosen sync algorithm
    and reports progress here: on a
    terminal a progress bar (ETA, loss, evaluation, it/s) and a line per peer (state, iteration gap,
    link rates); plain lines otherwise. It exits 0 when the run is done, 3 when it ended "degraded"
    (this host mixed without its neighbours most of the time), 1 when it failed. Ctrl+C stops this
    host's trainer.

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

    from peerd.net.wirecheck import strict_json_value
    from peerd.v1 import control_pb2 as cpb

    options = {k: str(v) for k, v in dict(backup=backup, staleness=staleness, max_ig=max_gap, lr=lr,
                                          optimizer=optimizer, step_time=step_time,
                                          slow_prob=slow_prob, slow_factor=slow_factor, model_size=model_size,
                                          context=context, eval_tokens=eval_tokens,
                                          batch_size=batch_size,
                                          cwd=os.getcwd() if script else None).items() if v is not None}
    if init_path:
        options.update(init_options(init_path))
    if device != "auto":
        options["device"] = device      # a host's own choice: the daemon must not make it part of the run
    check_task_options(task, model_size, context, eval_tokens)
    options.update(low_comm_options(**low_comm))
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
    channel, stub = _daemon_when_up(data_dir, join_timeout)
    last = None
    tty = sys.stderr.isatty()
    view = None if as_json else make_view(tty, no_progress, iterations, progress_every, stub, task)
    try:
        for p in stub.Train(req):
            last = p
            if as_json:
                # strict JSON: a diverged trainer's NaN loss is null
                click.echo(json.dumps(strict_json_value({
                    "t": p.wall_time or time.time(), "state": p.state, "iteration": p.iteration,
                    "loss": p.loss, "it_per_s": p.iterations_per_s, "metric_name": p.metric_name, "metric": p.metric,
                    "rank": p.rank, "gap": p.gap_to_fastest, "peers_in_last_mix": p.peers_in_last_mix,
                    "elapsed_s": p.elapsed_s, "restarts": p.trainer_restarts, "skipped": p.skipped,
                    "mixes": p.mixes, "partial_mixes": p.partial_mixes, "message": p.message,
                    **({"bpb": round(b, 4)} if (b := bits_per_byte(task, p)) is not None else {})}), allow_nan=False),
                           nl=True)
            else:
                view.update(p)
    except grpc.RpcError as e:
        if view is not None:
            view.close()
        if e.code() != grpc.StatusCode.CANCELLED:
            raise click.ClickException(f"{e.code().name}: {e.details()}") from None
    except KeyboardInterrupt:
        # Closing the stream is what stops the run: the daemon stops the trainer when its caller
        # leaves. Then exit at once; the interpreter's teardown (gRPC, torch) takes seconds.
        if view is not None:
            view.close()
        channel.close()
        click.echo("\nstopping this host's trainer", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    finally:
        channel.close()
    if view is not None:
        view.close()
    if last is not None and not as_json:
        click.echo(plain_line(last, iterations, task=task))
        if last.partial_mixes:
            click.echo(f"partial mixes: {last.partial_mixes} of {last.mixes} left out a neighbour ({last.partial_note})")
    # degraded: the run finished, but this host mixed without its neighbours most of the time
    sys.exit(0 if last is not None and last.state == "done" else 3 if last is not None and last.state == "degraded"
             else 1)


def check_task_options(task: str, model_size, context, eval_tokens) -> None:
    """Refuse a bad size or an option the task does not take here, not in the trainer."""
    if task and (model_size or context or eval_tokens):
        from peerd.train.tasks import get_task
        try:
            get_task(task, model_size=model_size, context=context, eval_tokens=eval_tokens)
        except ValueError as e:
            raise click.UsageError(str(e)) from None


def init_options(init_path: str) -> dict[str, str]:
    """--init: the file for the trainer, and its sha256, which makes the hosts' files part of the run."""
    import hashlib
    import os
    h = hashlib.sha256()
    with open(init_path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return {"init": os.path.abspath(init_path), "init_sha256": h.hexdigest()}


def low_comm_options(outer: str, inner_steps, round_seconds, fragments, overlap, outer_lr, outer_momentum,
                     compress) -> dict[str, str]:
    """The run options of --outer diloco and --compress, checked here rather than in the trainer."""
    diloco = dict(inner_steps=inner_steps, round_seconds=round_seconds, fragments=fragments, overlap=overlap,
                  outer_lr=outer_lr, outer_momentum=outer_momentum)
    given = {k: v for k, v in diloco.items() if v is not None}
    out = {"compress": compress} if compress else {}
    if outer == "none":
        if given:
            raise click.UsageError(f"--{next(iter(given)).replace('_', '-')} needs --outer diloco")
        return out
    if (inner_steps is None) == (round_seconds is None):
        raise click.UsageError("--outer diloco needs exactly one of --inner-steps (a fixed H) and --round-seconds")
    if (inner_steps is not None and inner_steps < 1) or (round_seconds is not None and round_seconds <= 0) \
            or (fragments is not None and fragments < 1) or (overlap is not None and overlap < 0):
        raise click.UsageError("--inner-steps, --round-seconds and --fragments must be positive, --overlap >= 0")
    return {**out, "outer": outer, **{k: str(v) for k, v in given.items()}}


def _daemon_when_up(data_dir: str | None, timeout: float):
    """This host's daemon, waiting up to `timeout` for it to start: `peerd up ... &` followed at once
    by `peerd train` finds a daemon still starting (about 2 s), not a missing one."""
    start = time.monotonic()
    deadline = start + timeout
    told = False
    while True:
        try:
            channel, stub = control_stub(data_dir)
            break
        except click.ClickException as e:
            if time.monotonic() >= deadline:
                raise
            if not told and time.monotonic() - start > SAY_WAITING_AFTER:
                click.echo(f"waiting up to {timeout:g} s (--join-timeout) for this host's daemon: {e.message}",
                           err=True)
                told = True
            time.sleep(0.2)
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=min(SAY_WAITING_AFTER, max(0.1, deadline - time.monotonic())))
    except grpc.FutureTimeoutError:
        if time.monotonic() < deadline:
            click.echo(f"waiting up to {timeout:g} s (--join-timeout) for this host's daemon to answer on its "
                       f"control socket", err=True)
        try:
            ready.result(timeout=max(0.1, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            channel.close()
            raise click.ClickException(f"this host's daemon did not answer within --join-timeout {timeout:g} s "
                                       f"(a socket left by a daemon that was killed? `peerd up` starts one)") from None
    return channel, stub


SAY_WAITING_AFTER = 2.0   # seconds of silent waiting for the daemon before `peerd train` says so


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
