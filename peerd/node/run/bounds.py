"""How long a wait on one model transfer from a peer may last before it counts as a failure.

The fixed bounds (train_pull_timeout, train_silent_peer_timeout) are for failures, not for slow
links: each grows by `train_transfer_slack` times the model's expected transfer from that peer
(bytes over the link matrix's bandwidth, or over `dataplane_min_rate` where nobody measured it), up
to half of `train_mix_timeout` (the trainer's Mix must be answered within it, a failed pull and the
next one included). A 100 MB model takes 8 s over 100 Mbit; a fixed 5 s pull bound failed every pull.
"""
from __future__ import annotations

from peerd.node.run.env import RunEnv


def transfer_allowance(env: RunEnv, nbytes: int, node: str) -> float:
    """Extra seconds a wait on one transfer of `nbytes` from `node` gets on top of its fixed bound."""
    if not nbytes or not node:
        return 0.0
    matrix = env.link_matrix
    bw = matrix.bandwidth(node, env.node_id) if matrix is not None else None
    return env.cfg.train.transfer_slack * nbytes / (bw or env.cfg.dataplane.min_rate)


def transfer_bound(env: RunEnv, base: float, nbytes: int, node: str) -> float:
    """`base` plus the transfer allowance, at most half of train_mix_timeout, never below `base`."""
    return max(base, min(base + transfer_allowance(env, nbytes, node), env.cfg.train.mix_timeout / 2))
