"""How long a wait on one model transfer from a peer may last before it counts as a failure.

The fixed bounds (train_pull_timeout, train_silent_peer_timeout, train_mix_timeout) are for
failures, not for slow links: each grows by `train_transfer_slack` times the model's expected
transfer from that peer (bytes over the link matrix's bandwidth, or over `dataplane_min_rate` where
nobody measured it or measured less: a sender cuts a push slower than that rate). A 100 MB model
takes 8 s over 100 Mbit; a fixed 5 s pull bound failed every pull, and a 50 MB model over a 10 Mbit
link, 80 s with two pushes sharing it, left every mix of a lab run partial while the trainer's
Mix was bounded by a fixed 60 s.

- The trainer's Mix waits at most `mix_bound`: train_mix_timeout plus the longest allowance of
  a neighbour's update (plus two of the host's iterations, added by the run).
- A pull, or a wait on a neighbour that sends nothing, gets its own bound plus that peer's
  allowance, capped so that the Mix can still be answered in time (`transfer_bound`).
- A push gets the data plane's deadline (the floor rate, shared by our pushes in flight) plus
  the allowance of the link to its receiver, whose downlink other senders share.
"""
from __future__ import annotations

from typing import Iterable

from peerd.node.run.env import RunEnv


def transfer_allowance(env: RunEnv, nbytes: int, node: str, to_node: bool = False) -> float:
    """Extra seconds a wait on one transfer of `nbytes` from `node` (`to_node`: to it) gets on
    top of its fixed bound."""
    if not nbytes or not node:
        return 0.0
    matrix = env.link_matrix
    src, dst = (env.node_id, node) if to_node else (node, env.node_id)
    bw = matrix.bandwidth(src, dst) if matrix is not None else None
    return env.cfg.train.transfer_slack * nbytes / max(bw or 0.0, env.cfg.dataplane.min_rate)


def mix_bound(env: RunEnv, nbytes: int, nodes: Iterable[str]) -> float:
    """train_mix_timeout plus the longest transfer allowance of an update from one of `nodes`."""
    return env.cfg.train.mix_timeout + max((transfer_allowance(env, nbytes, n) for n in nodes), default=0.0)


def largest_mix_bound(env: RunEnv, nbytes: int) -> float:
    """`mix_bound` over the slowest link a transfer may use (dataplane_min_rate): what the daemon
    tells its trainer, whose own deadline on a Mix must be longer than any the daemon may take."""
    return env.cfg.train.mix_timeout + env.cfg.train.transfer_slack * nbytes / env.cfg.dataplane.min_rate


def transfer_bound(env: RunEnv, base: float, nbytes: int, node: str, cap: float) -> float:
    """`base` plus the transfer allowance, at most `cap`, never below `base`."""
    return max(base, min(base + transfer_allowance(env, nbytes, node), cap))
