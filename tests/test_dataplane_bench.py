"""`peerd bench transport` end to end (tiny sizes: this checks the tool, not the machine)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from cli.bench import bench, parse_rate, parse_size


def test_parsers():
    assert parse_size("1MB") == 10**6 and parse_size("1GB") == 10**9 and parse_size("4MiB") == 4 << 20
    assert parse_rate("100mbit") == 10**8 and parse_rate("1gbit") == 10**9


def _records(args):
    res = CliRunner().invoke(bench, ["transport", "--json", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]


def test_loopback_records_are_ratios_of_measured_rates():
    recs = _records(["--sizes", "1MB,3MB", "--reps", "2", "--no-lab"])
    assert [(r["path"], r["size"]) for r in recs] == [("loopback", 10**6), ("loopback", 3 * 10**6)]
    for r in recs:
        assert len(r["raw_tcp_seconds"]) == len(r["peerd_seconds"]) == 2
        assert r["raw_tcp_bytes_per_s"] > 0 and r["peerd_bytes_per_s"] > 0
        pairs = sorted(a / b for a, b in zip(r["raw_tcp_seconds"], r["peerd_seconds"]))
        assert r["ratio"] == pytest.approx((pairs[0] + pairs[1]) / 2)
        assert r["rx_peak_extra_bytes"] is not None


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("pdbench-")}


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and tc")
def test_shaped_link_caps_both_paths_and_is_cleaned_up():
    before = _namespaces()
    recs = _records(["--sizes", "1MB", "--reps", "1", "--lab", "--rates", "100mbit", "--shaped-sizes", "3MB"])
    shaped = [r for r in recs if r["path"] == "shaped-100mbit"]
    assert len(shaped) == 1
    r = shaped[0]
    # raw TCP cannot beat the shaper; both paths must come close to it (headers cost ~5 %)
    assert 60 < r["raw_tcp_pct_of_shaped"] <= 100
    assert 40 < r["peerd_pct_of_shaped"] <= 100
    assert _namespaces() == before
