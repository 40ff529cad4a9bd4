"""The low-communication mode through real daemons on loopback: `peerd train --outer diloco` with
int8 increments on the wire (issue 29). Two hosts, fixed H and a time budget; the run finishes,
learns, mixes every sync, and the wire carried quantized increments after one keyframe."""
from __future__ import annotations

import pytest

from tests.daemons import control_status, wait_for
from tests.test_surface import free_port, scrape, value
from tests.test_training import finish, start_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _swarm(daemons):
    ports = [free_port(), free_port()]
    a = daemons("a", extra=["--metrics-port", str(ports[0])])
    b = daemons("b", seeds=[a.address], extra=["--metrics-port", str(ports[1])])
    wait_for(lambda: {p["node_id"]: p["state"] for p in (control_status(a) or {}).get("peers", [])}
             .get(b.node_id) == "alive", 60, "a swarm of two")
    return a, b


@pytest.mark.parametrize("round_args", [["--inner-steps", "8"], ["--round-seconds", "1.0"]],
                         ids=["fixed-H", "time-budget"])
def test_diloco_with_int8_increments_trains_and_sends_a_fraction_of_the_model(daemons, round_args):
    a, b = _swarm(daemons)
    syncs = 10
    args = ["--task", "digits", "--world", "2", "--algo", "d-psgd", "--topology", "complete",
            "--iterations", str(syncs), "--eval-every", "5", "--outer", "diloco", *round_args,
            "--compress", "int8", "--step-time", "0.05"]
    records = finish([start_train(d, *args) for d in (a, b)], timeout=400)
    for recs in records:
        last = recs[-1]
        assert last["state"] == "done" and last["iteration"] >= syncs - 1, last
        assert last["metric_name"] == "accuracy" and last["metric"] >= 0.8, last
        assert last["partial_mixes"] == 0 and last["mixes"] >= syncs - 1, last
    for d in (a, b):
        samples = scrape(control_status(d)["metrics_url"])
        increments = value(samples, "peerd_dataplane_transfers_total", event="copy_increments")
        keyframes = value(samples, "peerd_dataplane_transfers_total", event="copy_keyframes")
        # every sync is an increment (the first one from the zero copy both sides start with); a
        # keyframe only after a lost push. Their size is tests/test_copies.py's (the data plane's
        # byte counter also holds link probes).
        assert keyframes <= 1 and increments >= syncs - 1, (keyframes, increments)
