"""Time a bare gloo all-reduce of DDP's two buckets for digits-wide (1,093,672 + 4,992 bytes)
between six processes in a star-6 lab, with (`daemons`, after the link warm-up) or without
(`bare`) peerd daemons beside them. `sizes` (no daemons) times one all-reduce of each of several
sizes instead, and fits T = a + b * bytes, to split a per-collective cost from a per-byte one.
Run as root from the repository root: .venv/bin/python docs/bench/experiments/allreduce_run.py bare"""
import sys, json, subprocess, time, statistics, tempfile
from pathlib import Path
from peerd.config import Config
from peerd.lab import lab, profile
from peerd.bench import scenarios as sc
daemons = sys.argv[1] == "daemons"
SIZES = [50_000, 200_000, 550_000, 1_100_000, 2_200_000, 4_400_000] if sys.argv[1] == "sizes" else None
prof = profile.load("star-6", 6)
d = tempfile.mkdtemp(prefix="ar-")
lab.up(prof, d, Config(), daemons=daemons, daemon_args=sc.DAEMON_ARGS)
try:
    lb = lab.Lab(d)
    if daemons:
        sc._wait_swarm(lb, 120); time.sleep(90)
    hosts = lb.hosts
    procs = [lb.popen(h, [sys.executable, str(Path(__file__).with_name("allreduce.py")), str(r), "6", lb.ip(hosts[0]), "12" if SIZES else "25"]
                      + ([",".join(map(str, SIZES))] if SIZES else []),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, h in enumerate(hosts)]
    out, err = procs[0].communicate(timeout=300)
    for p in procs[1:]: p.wait(timeout=60)
    res = json.loads(out.strip().splitlines()[-1])
    if SIZES:
        import numpy as np
        med = {int(k): statistics.median(v[2:]) for k, v in res.items()}
        for k, v in res.items():
            print(f"{int(k):>9} B: median {med[int(k)]:.3f} s  min {min(v[2:]):.3f}  max {max(v[2:]):.3f}", flush=True)
        b, a = np.polyfit(list(med), list(med.values()), 1)
        print(f"fit T = {a * 1000:.1f} ms + bytes / {1 / b / 1e6:.3f} MB/s", flush=True)
        sys.exit(0)
    ts = res[3:]
    print("daemons" if daemons else "bare", f"allreduce 1.09 MB + 5 KB on star-6: median {statistics.median(ts):.3f} s mean {statistics.mean(ts):.3f} min {min(ts):.3f} max {max(ts):.3f}", flush=True)
finally:
    lab.down(d, purge=True)
