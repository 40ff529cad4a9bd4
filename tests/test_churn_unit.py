"""The chaos report's arithmetic (peerd/lab/churn.py), without a lab."""
from __future__ import annotations

from peerd.lab.churn import ChaosReport, _note_readmissions, longest_stall, longest_stall_window


def rec(t, k, mixed=1, state="training", message=""):
    return {"t": t, "iteration": k, "state": state, "peers_in_last_mix": mixed, "message": message}


def test_longest_stall_counts_gaps_between_advances_and_skips_excluded_time():
    rs = [rec(0.0, 1), rec(0.5, 2), rec(1.0, 2), rec(4.0, 3), rec(4.5, 4)]
    assert longest_stall(rs, 0.0, 5.0) == 3.5                 # 0.5 .. 4.0 at iteration 2
    assert longest_stall(rs, 0.0, 5.0, [(1.5, 3.5)]) == 1.5   # the host was down for 2 of those 3.5 s
    assert longest_stall(rs, 0.0, 9.0) == 4.5                 # no advance after 4.5 until the end
    assert longest_stall_window(rs, 0.0, 5.0) == (3.5, 0.5, 4.0)


def test_readmission_needs_progress_past_the_join_and_a_mix():
    class S:
        records = [rec(10.0, 0, 0), rec(11.0, 120, 0, message="started from x's parameters of iteration 120"),
                   rec(11.5, 121, 0)]
    report = ChaosReport(10.0, kills=[{"host": "h1", "_t": 9.0, "_kill": 4.0}])
    down, away = {"h1": [(5.0, float("inf"))]}, {"h1"}
    _note_readmissions(report, {"h1": S}, down, away)
    assert "readmitted_s" not in report.kills[0] and away == {"h1"}   # advanced, but mixed with nobody
    S.records.append(rec(12.0, 122, 1))
    _note_readmissions(report, {"h1": S}, down, away)
    k = report.kills[0]
    assert k["readmitted_s"] == 3.0 and k["back_after_kill_s"] == 8.0 and k["joined_at_iteration"] == 120 and "iteration 120" in k["join_note"]
    assert away == set() and down["h1"] == [(5.0, 12.0)]


def test_stall_bound_is_one_wait_or_two_where_downtimes_overlap():
    from peerd.config import Config
    from peerd.lab.churn import stall_bound
    cfg = Config(dead_after=2.0)
    assert stall_bound(cfg, overlapping=False, silent=3.0) == 3.0 + cfg.lab.churn_stall_slack
    assert stall_bound(cfg, overlapping=True, silent=3.0) == 6.0 + cfg.lab.churn_stall_slack
    assert stall_bound(cfg, overlapping=False) == cfg.train.silent_peer_timeout + cfg.lab.churn_stall_slack
