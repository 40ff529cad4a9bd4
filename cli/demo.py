"""`peerd demo`: the main job on one machine. Four daemons find each other, then train the built-in
digit classifier together twice, with one host 4x slower: once with Hop (backup worker + iteration
skipping), once with D-PSGD (wait for every neighbour). It prints time to accuracy and final
accuracy side by side and writes a loss-versus-time plot of every host.

Compute is emulated with the trainer's pacing (`peerd train --step-time`, peerd/train/pace.py):
every step is padded with a sleep to a fixed time (the slow host's to `slowdown` times it), so the
hosts' relative speeds hold whatever else loads the machine. Stretching the real 1 ms step instead
(a factor on measured compute) multiplied every scheduling delay of a loaded machine by that factor:
the fast hosts' "0.1 s" steps measured 0.4-1.2 s on average, up to 15 s, and the 4x straggler was
often not the slowest host."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from peerd.net.auth import new_secret
from peerd.node.localswarm import LocalDaemon, peerd_cmd, run_cli, wait_until

FAST = ["--heartbeat-interval", "0.3", "--suspect-after", "1.5", "--dead-after", "3",
        "--connect-retry-max", "1.5"]
CONTENDERS = [("hop-backup-skip", "Hop, backup 1 + skipping"), ("d-psgd", "D-PSGD")]


def _step(msg: str) -> None:
    click.secho(f"\n==> {msg}", bold=True)


def run_training(swarm: list[LocalDaemon], algo: str, args: list[str], slow: int, slowdown: float,
                 step_time: float, timeout: float) -> list[list[dict]]:
    """`peerd train` on every host at once; each host's JSON progress records, with wall times."""
    procs, outputs = [], []
    for i, d in enumerate(swarm):
        extra = ["--step-time", str(step_time), "--slowdown", str(slowdown if i == slow else 1)]
        out = d.data_dir.parent / f"{d.data_dir.name}-{algo}.jsonl"
        outputs.append(out)
        with open(out, "w") as fh:  # a file, not a pipe: a full pipe would stall the progress stream
            procs.append(subprocess.Popen(peerd_cmd("train", "--data-dir", str(d.data_dir), "--json", "--algo",
                                                    algo, *args, *extra),
                                          stdout=fh, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise click.ClickException(f"{algo}: training did not finish within {timeout:.0f}s")
    records: list[list[dict]] = []
    for p, out in zip(procs, outputs):
        lines = out.read_text().splitlines()
        if p.returncode != 0:
            raise click.ClickException(f"{algo}: peerd train failed: {' '.join(lines[-5:])[-500:]}")
        records.append([json.loads(line) for line in lines if line.startswith("{")])
    return records


def training_start(records: list[list[dict]]) -> float:
    """When the first host finished its first iteration: the trainers' start-up before it (python,
    torch, the data; the same for every algorithm, from 10 s to 90 s on this 2-core machine
    depending on its load) is not part of the comparison. It counts one step of the first host
    (0.1 s with Hop's fast hosts, 0.4 s with D-PSGD, whose first step waits for the slow host)."""
    return min(r["t"] for host in records for r in host if r["state"] == "training" and r["iteration"] >= 1)


def startup(records: list[list[dict]]) -> float:
    return training_start(records) - min(r["t"] for host in records for r in host if r["state"] == "training")


def time_to_target(records: list[list[dict]], target: float) -> float | None:
    """Seconds from the start of training (`training_start`) until the hosts' models reach
    `target` accuracy on average (each host's newest evaluation counts; a host not evaluated yet
    counts as 0)."""
    events = sorted((r["t"], rank, r["metric"]) for rank, host in enumerate(records) for r in host
                    if r["metric_name"] == "accuracy")
    t0 = training_start(records)
    latest = [0.0] * len(records)
    for t, rank, metric in events:
        latest[rank] = metric
        if sum(latest) / len(latest) >= target:
            return t - t0
    return None


def averaged_accuracy(swarm: list[LocalDaemon], session_dirs: list[Path]) -> tuple[float, float]:
    import torch

    from peerd.train.flat import flatten_module
    from peerd.train.tasks import consensus_distance, evaluate_average, get_task

    task = get_task("digits")
    models = []
    for path in session_dirs:
        m = task.build(0)
        m.load_state_dict(torch.load(path / "latest.pt", weights_only=True)["model"])
        models.append(m)
    flats = [flatten_module(m) for m in models]
    return (evaluate_average(task, models)["accuracy"],
            consensus_distance([f.buffer for f in flats], flats[0].layout))


def newest_checkpoints(swarm: list[LocalDaemon]) -> list[Path]:
    return [max((d.data_dir / "checkpoints").iterdir(), key=lambda p: p.stat().st_mtime) for d in swarm]


def plot(results: dict[str, list[list[dict]]], path: Path, slow: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo("  (no plot: matplotlib is not installed; `pip install 'peerd[plot]'`)")
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), sharey=True)
    for ax, (algo, records) in zip(axes, results.items()):
        t0 = training_start(records)
        for rank, host in enumerate(records):
            pts = [(r["t"] - t0, r["loss"]) for r in host if r["state"] == "training" and r["loss"] > 0]
            if pts:
                label = f"host {rank + 1}" + (" (4x slower)" if rank == slow else "")
                ax.plot(*zip(*pts), label=label, lw=1.2)
        ax.set_title(dict(CONTENDERS).get(algo, algo))
        ax.set_xlabel("wall time from the first iteration (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


@click.command()
@click.option("--hosts", default=4, show_default=True, type=click.IntRange(3, 8), help="daemons to start")
@click.option("--iterations", default=120, show_default=True, help="training iterations per run")
@click.option("--slowdown", default=4.0, show_default=True, help="how much slower the last host computes")
@click.option("--target", default=0.9, show_default=True, help="accuracy every host must reach")
@click.option("--step-time", default=0.1, show_default=True, type=click.FloatRange(0, min_open=True),
              help="seconds of emulated compute per step on a fast host (the slow host's are --slowdown times "
                   "longer): a model whose compute outweighs the per-iteration overhead (the digit CNN itself "
                   "takes about 1 ms a step)")
@click.option("--dir", "workdir", default=".demo", show_default=True, type=click.Path(file_okay=False),
              help="data dirs, logs and the plot (wiped at start)")
def demo(hosts: int, iterations: int, slowdown: float, target: float, step_time: float, workdir: str) -> None:
    """Start a local swarm, then train the digit classifier with Hop and with D-PSGD while one host is
    several times slower; compare time to accuracy (mean of the hosts' models) and final accuracy
    (of the averaged model), and write a loss-versus-time plot."""
    root = Path(workdir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    secret = root / "secret"
    secret.write_text(new_secret() + "\n")
    secret.chmod(0o600)
    swarm: list[LocalDaemon] = []
    slow = hosts - 1
    results: dict[str, list[list[dict]]] = {}
    summary = []
    started = time.monotonic()
    try:
        _step(f"starting {hosts} daemons on 127.0.0.1, each seeded only with the previous one")
        for i in range(hosts):
            seeds = [swarm[-1].address] if swarm else []
            d = LocalDaemon(root / f"host{i + 1}", secret, seeds, FAST).start()
            d.wait_ready(60)   # a loaded machine starts a daemon slowly
            swarm.append(d)
            click.echo(f"  host{i + 1}: node {d.node_id} at {d.address}")
        ids = {d.node_id for d in swarm}
        t0 = time.monotonic()
        if not wait_until(lambda: all(d.peer_states() == {o: "alive" for o in ids - {d.node_id}} for d in swarm), 30):
            raise click.ClickException(f"the swarm did not form within 30 s; logs in {root}")
        click.echo(f"  every host lists the other {hosts - 1} as alive after {time.monotonic() - t0:.1f}s (gossip)")
        click.echo("\n" + run_cli("status", "--data-dir", str(swarm[0].data_dir)).stdout.rstrip())

        args = ["--task", "digits", "--world", str(hosts), "--iterations", str(iterations), "--eval-every", "20",
                "--topology", "ring"]
        for algo, title in CONTENDERS:
            _step(f"training with {title}: host{slow + 1} computes {slowdown:g}x slower than the others "
                  f"(steps paced to {step_time:g}s, {step_time * slowdown:g}s there, to emulate a heavier model)")
            t0 = time.monotonic()
            records = run_training(swarm, algo, args, slow, slowdown, step_time, timeout=240)
            results[algo] = records
            acc, dist = averaged_accuracy(swarm, newest_checkpoints(swarm))
            ttt = time_to_target(records, target)
            wall = time.monotonic() - t0
            skipped = max(r["skipped"] for r in records[slow])
            summary.append((title, ttt, acc, dist, wall, skipped))
            click.echo(f"  done in {wall:.1f}s (trainers' start-up {startup(records):.1f}s); hosts at {target:.0%} "
                       f"mean accuracy {'never' if ttt is None else f'{ttt:.1f}s'} after their first iteration; "
                       f"averaged model {acc:.3f}; slow host skipped {skipped} iterations")

        _step("results")
        header = f"  {'algorithm':<26}{'time to ' + format(target, '.0%'):>14}{'final acc':>11}{'consensus':>11}{'run':>8}"
        click.echo(header)
        for title, ttt, acc, dist, wall, _ in summary:
            click.echo(f"  {title:<26}{'missed' if ttt is None else f'{ttt:.1f}s':>14}{acc:>11.3f}{dist:>11.4f}"
                       f"{wall:>7.0f}s")
        (hop, dpsgd) = summary[0][1], summary[1][1]
        if hop and dpsgd:
            click.echo(f"\n  Hop reached {target:.0%} {dpsgd / hop:.1f}x sooner than D-PSGD with one host "
                       f"{slowdown:g}x slower.")
        png = root / "loss_vs_time.png"
        if plot(results, png, slow):
            click.echo(f"  loss-versus-time plot of every host: {png}")
        (root / "results.json").write_text(json.dumps(
            [{"algorithm": a, "time_to_target_s": t, "final_accuracy": acc, "consensus_distance": d,
              "run_s": w, "skipped": s} for a, t, acc, d, w, s in summary], indent=2))
    finally:
        _step("stopping every daemon with SIGTERM")
        for d in swarm:
            d.stop()
    click.secho(f"\ndemo finished in {time.monotonic() - started:.0f}s; logs, checkpoints and results in {root}",
                fg="green")
    sys.exit(0)
