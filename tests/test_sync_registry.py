"""Every algorithm builds from Config defaults, runs, and reports JSON-serialisable state."""
from __future__ import annotations

import json

import pytest

from peerd.config import Config
from peerd.sim.engine import Simulator
from peerd.sync import ALGORITHMS, build, options, topology as T
from peerd.sync.registry import ESTIMATES
from tests.sync_helpers import random_spec


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_builds_from_config_runs_and_reports_state(algo):
    n = 8
    pols = build(algo, n, T.ring(n), seed=1, **options(Config(), algo))
    spec = random_spec(2, n, params=8, iterations=10, estimates=ESTIMATES.get(algo, "none"))
    res = Simulator(spec, pols).run()
    assert min(res.iterations) >= 10 and not res.stalled
    for p in pols:
        s = p.state()
        json.dumps(s)
        assert s["algorithm"] == p.name and s["iteration"] == p.k and s["mixes"] >= 1


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="algorithm: unknown 'hopp'"):
        build("hopp", 4, T.ring(4))
