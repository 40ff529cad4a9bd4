"""The algorithm core: sans-I/O sync policies (no sockets, no clocks, no sleeping).

    from peerd.sync import build, topology
    policies = build("hop-backup-skip", n, topology.ring(n), max_ig=4)   # one per worker
    actions = policies[i].on_event(Published(k), now)

Modules: events (the contract), policy (base class), topology (graphs and weights), hop, aau,
netmax, baselines (D-PSGD, SGP, AD-PSGD), registry (policies by name, options from Config).
"""
from peerd.sync.events import (CURRENT, Action, Average, Drop, Event, Grant, LinkEstimates, Mix,
                               MixRequested, PeerDown, PeerUp, Published, Pull, PullRequested, Send,
                               Skip, Tick, TokensArrived, UpdateArrived, UpdateLost, Wait)
from peerd.sync.policy import Policy
from peerd.sync.registry import ALGORITHMS, build, options

__all__ = ["CURRENT", "Action", "Average", "Drop", "Event", "Grant", "LinkEstimates", "Mix",
           "MixRequested", "PeerDown", "PeerUp", "Published", "Pull", "PullRequested", "Send", "Skip",
           "Tick", "TokensArrived", "UpdateArrived", "UpdateLost", "Wait", "Policy", "ALGORITHMS", "build", "options"]
