"""Time chunked TCP transfers between star-6 lab hosts with no daemons: does a fast sender into a
slow host's queue lose time (retransmissions) against a sender on a slow link itself?
Run as root from the repository root: .venv/bin/python docs/bench/experiments/chunks_run.py"""
import sys, json, subprocess, time, statistics, tempfile
from pathlib import Path
from peerd.config import Config
from peerd.lab import lab, profile
prof = profile.load("star-6", 6)
d = tempfile.mkdtemp(prefix="rq-")
lab.up(prof, d, Config(), daemons=False)
def tcp_retrans(lb, h):
    out = lb.run(h, ["cat", "/proc/net/snmp"], timeout=5).stdout.splitlines()
    t = [l.split() for l in out if l.startswith("Tcp:")]
    return int(t[1][t[0].index("RetransSegs")])
try:
    lb = lab.Lab(d)
    rates = {"h1": 10, "h2": 100, "h3": 1000, "h4": 10, "h5": 100, "h6": 1000}
    port = 6000
    for n in (182_279, 1_100_000):
        for src, dst in (("h4", "h1"), ("h1", "h2"), ("h2", "h1"), ("h6", "h1"), ("h3", "h4")):
            port += 1
            srv = lb.popen(dst, [sys.executable, str(Path(__file__).with_name("chunks.py")), "server", str(port), str(n)],
                           stdout=subprocess.PIPE, text=True)
            srv.stdout.readline()
            r0 = tcp_retrans(lb, src)
            reps = 30 if n < 500_000 else 8
            out = lb.run(src, [sys.executable, str(Path(__file__).with_name("chunks.py")), "client", lb.ip(dst), str(port), str(n), str(reps), "0.05"], timeout=300)
            r1 = tcp_retrans(lb, src)
            ts = json.loads(out.stdout)[2:]
            srv.kill(); srv.wait()
            bott = min(rates[src], rates[dst]) * 1e6 / 8 * 1448 / 1514
            ideal = n / bott
            print(f"{n:>9} {src}({rates[src]}M)->{dst}({rates[dst]}M) median {statistics.median(ts)*1000:7.1f} ms  "
                  f"mean {statistics.mean(ts)*1000:7.1f}  max {max(ts)*1000:7.1f}  ideal {ideal*1000:7.1f}  "
                  f"ratio {statistics.mean(ts)/ideal:5.2f}  retrans {r1-r0}", flush=True)
finally:
    lab.down(d, purge=True)
