"""`peerd bench size` end to end on a small model: daemons, then plain TCP, then plain gRPC moving
the same bytes over the same graph; and each baseline's workers on their own (every iteration
timed, the sum after the wire)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peerd.bench import size


@pytest.mark.parametrize("module,extra", [("peerd.bench.rawtcp", ()), ("peerd.bench.rawgrpc", ("65536",))])
def test_baseline_workers_time_every_iteration(module, extra):
    res = size.Result(size.Case(3, "ring", 1 << 20), 3)
    outs = size._baseline(res, module, 3, *extra)
    assert outs is not None, res.error
    assert sorted(o["worker"] for o in outs) == [0, 1, 2]
    for o in outs:
        assert len(o["wire_s"]) == len(o["total_s"]) == 3
        assert all(0 < w <= t for w, t in zip(o["wire_s"], o["total_s"]))
        assert o["peak_rss_bytes"] > 1 << 20
    if module.endswith("rawgrpc"):      # gRPC's own loop lag: the reference for the daemon's
        assert all(o["loop_lag_p99_ms"] >= 0 for o in outs)


@pytest.mark.slow
def test_bench_size_reports_peerd_tcp_and_grpc_for_a_small_ring(tmp_path):
    out = tmp_path / "size.jsonl"
    p = subprocess.run([sys.executable, "-m", "cli.main", "bench", "size", "--case", "ring:3:1MB",
                        "--iterations", "4", "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["error"] == ""
    assert rec["peerd_s"] > 0 and rec["tcp_total_s"] > 0 and rec["grpc_total_s"] > 0
    assert rec["ratio_to_grpc"] == pytest.approx(rec["peerd_s"] / rec["grpc_total_s"])
    assert sum(d["mixes"]["partial"] for d in rec["daemon"].values()) == 0
    assert "| ring-3 1 MB |" in p.stdout and "plain gRPC" in p.stdout


def test_table_has_a_row_per_case_with_both_ratios():
    r = size.Result(size.Case(3, "ring", 100_000_000), 8, peerd_s=1.0, tcp_wire_s=0.1, tcp_total_s=0.25,
                    grpc_wire_s=0.4, grpc_total_s=0.5, grpc_lag_ms=12.4)
    text = size.table([r])
    assert "| ring-3 100 MB | 1.000 |" in text and "| 0 (12) |" in text
    assert "| 4.00x |" in text and "| 2.00x |" in text
