"""Gloo's small-segment cost on star-6: one all-reduce of each size (as `allreduce_run.py sizes`),
each size in its own process group, with every host's TCP loss counters (its namespace's
/proc/net/snmp and /proc/net/netstat) read before and after, so a per-size time can be set beside
the retransmissions, retransmission timeouts and tail-loss probes it cost.
CC=cubic (or reno, bbr) sets every host's TCP congestion control first (this machine's default is bbr).
Run as root from the repository root: .venv/bin/python docs/bench/experiments/allreduce_tcp.py [SIZES]"""
import os
import sys, json, subprocess, statistics, tempfile
from pathlib import Path
from peerd.config import Config
from peerd.lab import lab, profile

SIZES = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "200000,550000,1100000,2200000,4400000").split(",")]
REPS = 12
KEYS = ["RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPLossProbeRecovery", "TCPFastRetrans",
        "TCPSlowStartRetrans", "TCPLostRetransmit", "TCPSackRecovery"]


def counters(lb, h) -> dict[str, int]:
    out = {}
    for f in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = lb.popen(h, ["cat", f], stdout=subprocess.PIPE, text=True).communicate(timeout=10)[0].splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            for k, v in zip(names.split()[1:], values.split()[1:]):
                if k in KEYS:
                    out[k] = int(v)
    return out


prof = profile.load("star-6", 6)
d = tempfile.mkdtemp(prefix="artcp-")
lab.up(prof, d, Config(), daemons=False)
try:
    lb = lab.Lab(d)
    hosts = lb.hosts
    if os.environ.get("CC"):
        for h in hosts:
            lb.popen(h, ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={os.environ['CC']}"]).wait(10)
    cc = {lb.popen(h, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], stdout=subprocess.PIPE,
                   text=True).communicate(timeout=10)[0].strip() for h in hosts}
    print(f"congestion control: {', '.join(sorted(cc))}", flush=True)
    for size in SIZES:
        before = {h: counters(lb, h) for h in hosts}
        procs = [lb.popen(h, [sys.executable, str(Path(__file__).with_name("allreduce.py")), str(r), "6",
                              lb.ip(hosts[0]), str(REPS), str(size)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, h in enumerate(hosts)]
        out, err = procs[0].communicate(timeout=300)
        for p in procs[1:]:
            p.wait(timeout=60)
        ts = json.loads(out.strip().splitlines()[-1])[str(size)][2:]
        after = {h: counters(lb, h) for h in hosts}
        n = REPS   # counters cover every repetition (and the barriers), times the last REPS - 2
        per = {h: {k: round((after[h][k] - before[h][k]) / n, 1) for k in KEYS if after[h][k] != before[h][k]} for h in hosts}
        print(f"{size:>9} B: median {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f}); "
              f"per all-reduce: {json.dumps(per)}", flush=True)
finally:
    lab.down(d, purge=True)
