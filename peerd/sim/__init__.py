"""Discrete-event simulator of many peers driving the very sync policies of peerd.sync.

    from peerd.sim import SimSpec, Simulator, run, scenario
    spec, topo = scenario("straggler", n=8)
    result = run("hop-backup-skip", spec, topo)      # SimResult; .record() for JSON
"""
from peerd.sim.engine import SimError, SimResult, SimSpec, Simulator
from peerd.sim.scenarios import SCENARIOS, claims, run, run_scenario, scenario

__all__ = ["SimError", "SimResult", "SimSpec", "Simulator", "SCENARIOS", "claims", "run",
           "run_scenario", "scenario"]
