"""NetMax with a model whose pull takes longer than train_pull_timeout: 2 lab hosts joined by a
10 Mbit link, digits-wide (1.10 MB, about 0.92 s per pull), train_pull_timeout 0.5 s. Counts the
pulls each daemon gave up on and the progress records (every 0.5 s) whose last mix included the
peer's model, and prints each host's final accuracy and wall time.
Run as root from the repository root: .venv/bin/python docs/bench/experiments/pullbound_run.py"""
import json, re, subprocess, sys, tempfile, time
from pathlib import Path
import tomllib
from peerd.config import Config
from peerd.lab import lab, profile
from peerd.bench import scenarios as sc

PROFILE = """
name = "pullbound"
hosts = 2
[host.h1]
link = "10mbit"
"""
prof = profile.parse(tomllib.loads(PROFILE), source="pullbound")
d = Path(tempfile.mkdtemp(prefix="pb-"))
lab.up(prof, d, Config(), daemon_args=sc.DAEMON_ARGS + ("--train-pull-timeout", "0.5"))
try:
    lb = lab.Lab(d)
    sc._wait_swarm(lb, 120)
    time.sleep(20)   # a few link probes
    argv = [sys.executable, "-m", "cli.main", "train", "--task", "digits-wide", "--world", "2", "--iterations", "40",
            "--algo", "netmax", "--step-time", "0.1", "--eval-every", "40", "--json"]
    procs = {h: lb.popen(h, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in lb.hosts}
    for h, p in procs.items():
        out, err = p.communicate(timeout=400)
        recs = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        last = recs[-1]
        training = [r for r in recs if r.get("state") == "training" and r.get("iteration", 0) > 0]
        mixed = sum(r.get("peers_in_last_mix", 0) > 0 for r in training)
        log = (d / h / "daemon.log").read_text()
        gave_up = len(re.findall(r"pull from \S+ (?:failed|unanswered)", log))
        print(f"{h}: rc {p.returncode}, state {last.get('state')}, iteration {last.get('iteration')}, "
              f"accuracy {last.get('metric')}, {last.get('elapsed_s', 0):.1f} s; pulls given up {gave_up}; "
              f"progress records whose last mix had a peer's model: {mixed} of {len(training)}",
              flush=True)
        for line in re.findall(r".*pull from \S+ unanswered.*", log)[:2]:
            print("   ", line[-160:])
finally:
    lab.down(d, purge=True)
