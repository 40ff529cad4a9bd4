"""Time a bare gloo all-reduce of DDP's two buckets for digits-wide (1,093,672 + 4,992 bytes)
between six processes in a star-6 lab, with (`daemons`, after the link warm-up) or without
(`bare`) peerd daemons beside them.
Run as root from the repository root: .venv/bin/python docs/bench/experiments/allreduce_run.py bare"""
import sys, json, subprocess, time, statistics, tempfile
from pathlib import Path
from peerd.config import Config
from peerd.lab import lab, profile
from peerd.bench import scenarios as sc
daemons = sys.argv[1] == "daemons"
prof = profile.load("star-6", 6)
d = tempfile.mkdtemp(prefix="ar-")
lab.up(prof, d, Config(), daemons=daemons, daemon_args=sc.DAEMON_ARGS)
try:
    lb = lab.Lab(d)
    if daemons:
        sc._wait_swarm(lb, 120); time.sleep(90)
    hosts = lb.hosts
    procs = [lb.popen(h, [sys.executable, str(Path(__file__).with_name("allreduce.py")), str(r), "6", lb.ip(hosts[0]), "25"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, h in enumerate(hosts)]
    out, err = procs[0].communicate(timeout=300)
    for p in procs[1:]: p.wait(timeout=60)
    ts = json.loads(out.strip().splitlines()[-1])[3:]
    print("daemons" if daemons else "bare", f"allreduce 1.09 MB + 5 KB on star-6: median {statistics.median(ts):.3f} s mean {statistics.mean(ts):.3f} min {min(ts):.3f} max {max(ts):.3f}", flush=True)
finally:
    lab.down(d, purge=True)
