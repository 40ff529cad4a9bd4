"""`peerd demo`: a local multi-peer swarm on this machine, shown step by step."""
from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import click

from peerd.net.auth import new_secret
from peerd.node.localswarm import LocalDaemon, run_cli, wait_until

FAST = ["--heartbeat-interval", "0.3", "--suspect-after", "1.5", "--dead-after", "3",
        "--connect-retry-max", "1.5"]


def _step(msg: str) -> None:
    click.secho(f"\n==> {msg}", bold=True)


@click.command()
@click.option("--hosts", default=4, show_default=True, type=click.IntRange(2, 16), help="daemons to start")
@click.option("--dir", "workdir", default=".demo", show_default=True, type=click.Path(file_okay=False),
              help="where the daemons keep their data dirs and logs (wiped at start)")
def demo(hosts: int, workdir: str) -> None:
    """Start a swarm of daemons on loopback, seeded as a chain; watch them find each other by gossip,
    detect a crash, re-admit the restarted host under its old id, and shut down cleanly."""
    root = Path(workdir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    secret = root / "secret"
    secret.write_text(new_secret() + "\n")
    secret.chmod(0o600)
    swarm: list[LocalDaemon] = []
    ok = True
    try:
        _step(f"starting {hosts} daemons on 127.0.0.1, each seeded only with the previous one (a chain)")
        for i in range(hosts):
            seeds = [swarm[-1].address] if swarm else []
            d = LocalDaemon(root / f"host{i + 1}", secret, seeds, FAST).start()
            d.wait_ready()
            swarm.append(d)
            click.echo(f"  host{i + 1}: node {d.node_id} at {d.address}" + (f", seed {seeds[0]}" if seeds else ""))

        ids = {d.node_id for d in swarm}

        def everyone_alive() -> bool:
            return all(d.peer_states() == {o: "alive" for o in ids - {d.node_id}} for d in swarm)

        _step("waiting until every daemon lists every other as alive (gossip)")
        t0 = time.monotonic()
        if not wait_until(everyone_alive, 30):
            raise click.ClickException("the swarm did not converge within 30 s; see the logs in " + str(root))
        click.echo(f"  full membership on all {hosts} hosts after {time.monotonic() - t0:.1f}s")
        click.echo("\n" + run_cli("status", "--data-dir", str(swarm[0].data_dir)).stdout.rstrip())

        victim = swarm[len(swarm) // 2]
        others = [d for d in swarm if d is not victim]
        _step(f"SIGKILL {victim.data_dir.name} (node {victim.node_id}): no goodbye, the others must notice")
        victim.kill(signal.SIGKILL)
        t0 = time.monotonic()
        if not wait_until(lambda: all(d.peer_states().get(victim.node_id) == "dead" for d in others), 20):
            raise click.ClickException("the crash was not detected within 20 s")
        click.echo(f"  marked dead by all {len(others)} others after {time.monotonic() - t0:.1f}s "
                   f"(dead_after = 3 s in this demo)")

        _step(f"restarting {victim.data_dir.name} with the same data dir")
        old_id = victim.node_id
        victim.start()
        st = victim.wait_ready()
        t0 = time.monotonic()
        if not wait_until(everyone_alive, 20):
            raise click.ClickException("the restarted host was not re-admitted within 20 s")
        click.echo(f"  back as node {st['node_id']} (same id: {st['node_id'] == old_id}, incarnation "
                   f"{st['incarnation']}), alive everywhere after {time.monotonic() - t0:.1f}s")
        click.echo("\n" + run_cli("peers", "--data-dir", str(swarm[0].data_dir)).stdout.rstrip())
    except click.ClickException:
        ok = False
        raise
    finally:
        _step("stopping every daemon with SIGTERM (each says goodbye to its peers)")
        t0 = time.monotonic()
        for d in swarm:
            d.stop()
        click.echo(f"  all stopped in {time.monotonic() - t0:.1f}s; logs and data dirs in {root}")
    if ok:
        click.secho("\ndemo finished: peering, crash detection and re-admission all worked.", fg="green")
    sys.exit(0 if ok else 1)
