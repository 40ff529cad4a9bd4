"""`peerd lab calibrate`: measure what the lab's shaping and delay wire achieve on this machine.

Builds a throwaway lab (5 hosts, no daemons): host pairs shaped to 10 Mbit, 100 Mbit and 1 Gbit
inside one site; a second site behind a 50 Mbit / 20 ms link; a third behind an unshaped 20 ms
link (the delay wire's own ceiling). Sends one bounded TCP transfer per case and pings across the
wire, then tears the lab down. Expected goodput is the shaped rate times the TCP payload share of
what htb counts (shaping.GOODPUT_RATIO, about 95.6 %).
"""
from __future__ import annotations

import tempfile
from typing import Any

from peerd.config import Config
from peerd.lab import lab, profile, shaping

PROFILE = """
name = "calibrate"
hosts = 5
[sites.a]
hosts = ["h1", "h2", "h3"]
[sites.b]
hosts = ["h4"]
[sites.c]
hosts = ["h5"]
[[pairs]]
hosts = ["h1", "h2"]
rate = "10mbit"
[[pairs]]
hosts = ["h1", "h3"]
rate = "100mbit"
[[pairs]]
hosts = ["h2", "h3"]
rate = "1gbit"
[[site_links]]
sites = ["a", "b"]
rate = "50mbit"
delay = "20ms"
[[site_links]]
sites = ["a", "c"]
delay = "20ms"
"""

# (label, src, dst, shaped bit/s or None, bytes)
CASES = [
    ("pair 10 Mbit", "h1", "h2", 10**7, 3_000_000),
    ("pair 100 Mbit", "h1", "h3", 10**8, 15_000_000),
    ("pair 1 Gbit", "h2", "h3", 10**9, 120_000_000),
    ("site link 50 Mbit, 20 ms", "h1", "h4", 5 * 10**7, 20_000_000),
    ("site link unshaped, 20 ms (wire ceiling)", "h1", "h5", None, 60_000_000),
]


def run(cfg: Config | None = None) -> dict[str, Any]:
    import tomllib
    prof = profile.parse(tomllib.loads(PROFILE), source="calibrate profile")
    with tempfile.TemporaryDirectory(prefix="peerd-calibrate-") as d:
        lab.up(prof, d, cfg or Config(), daemons=False)
        try:
            lb = lab.Lab(d)
            rows = []
            for label, src, dst, rate, nbytes in CASES:
                got = lb.transfer(src, dst, nbytes)
                want = rate * shaping.GOODPUT_RATIO if rate else None
                rows.append({"case": label, "src": src, "dst": dst, "shaped_bps": rate, "bytes": nbytes,
                             "expected_goodput_bps": want, "goodput_bps": got["goodput_bps"],
                             "steady_bps": got["steady_bps"],
                             "ratio": got["goodput_bps"] / want if want else None})
            pings = lb.ping("h1", ["h4", "h2"], count=11, interval=0.05)
            rtt = {p["dst"]: sorted(r for r in p["rtts_ms"][1:] if r is not None) for p in pings}
            far, near = rtt[lb.ip("h4")], rtt[lb.ip("h2")]
            return {"transfers": rows,
                    "rtt_ms": {"through wire (2 x 20 ms configured)": {"min": far[0], "median": far[len(far) // 2]},
                               "same site": {"min": near[0], "median": near[len(near) // 2]}}}
        finally:
            lab.down(d)


def render(res: dict[str, Any]) -> str:
    out = [f"{'case':<42} {'shaped':>9} {'expected':>9} {'goodput':>9} {'steady':>9} {'ratio':>6}"]
    for r in res["transfers"]:
        m = lambda v: "-" if v is None else f"{v / 1e6:.1f}M"  # noqa: E731
        out.append(f"{r['case']:<42} {m(r['shaped_bps']):>9} {m(r['expected_goodput_bps']):>9} "
                   f"{m(r['goodput_bps']):>9} {m(r['steady_bps']):>9} "
                   f"{'-' if r['ratio'] is None else format(r['ratio'], '.3f'):>6}")
    for k, v in res["rtt_ms"].items():
        out.append(f"RTT {k}: min {v['min']:.2f} ms, median {v['median']:.2f} ms")
    return "\n".join(out)
