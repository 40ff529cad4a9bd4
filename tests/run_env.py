"""A RunEnv of stand-ins, for in-process tests of a training run (no sockets, no trainer)."""
from __future__ import annotations

import types

from peerd.config import Config
from peerd.node.offences import PeerOffences
from peerd.node.run.env import RunEnv


class NoPeers:
    """Peer calls that fail the test if a run makes one it was not given."""

    def __getattr__(self, name):
        raise AssertionError(f"the run called {name} on a peer; give the stand-in one")


def stand_in_env(tmp_path, cfg: Config | None = None, node_id: str = "a", *, link_matrix=None, membership=None,
                 peers=None) -> RunEnv:
    cfg = cfg or Config().replace(run_id="t")
    return RunEnv(cfg=cfg, node_id=node_id, data_dir=tmp_path, caps={},
                  membership=membership or types.SimpleNamespace(get=lambda node: None, alive=lambda: []),
                  peers=peers or NoPeers(), link_matrix=link_matrix,
                  offences=PeerOffences(cfg.train.peer_max_offences, cfg.train.peer_cooldown),
                  set_layout=lambda kind, layout: None, report_offence=lambda peer, what: None)


def cancel_tasks(run) -> None:
    for task in list(run._tasks):
        task.cancel()
