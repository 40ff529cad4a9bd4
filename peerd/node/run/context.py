"""The identity of one run on this host, shared by the pieces of peerd.node.run."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from peerd.config import Config
from peerd.node.run.env import RunEnv
from peerd.node.run.spec import RunSpec
from peerd.sync.policy import Policy


@dataclass
class RunContext:
    env: RunEnv
    spec: RunSpec
    nodes: list[str]          # by rank; "" for a vacant rank (peerd.node.run.joining); joiners fill them
    tag: str                  # every host of the run derives it; transfers carry it
    policy: Policy            # this worker's; fed events only through the run's PolicyDriver
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        self.rank = self.nodes.index(self.env.node_id)

    @property
    def cfg(self) -> Config:
        return self.env.cfg

    @property
    def n(self) -> int:
        return len(self.nodes)

    def kind(self, base: str) -> str:
        """A data-plane kind of this run ("model:<tag>"): a late transfer of one run never reaches the next."""
        return f"{base}:{self.tag}"

    def rank_of(self, node: str) -> int:
        """The rank of `node` in this run, -1 when it holds none."""
        return self.nodes.index(node) if node and node in self.nodes else -1

    def member(self, rank: int):
        """The membership entry of the host at `rank` (None: vacant or unknown)."""
        node = self.nodes[rank]
        return self.env.membership.get(node) if node else None

    def data_shard(self) -> tuple[int, int]:
        """(rank, world) the trainer deals its data by: the data is dealt over the founding world,
        a late joiner trains on the shard of its rank mod world."""
        return self.rank % self.spec.world, self.spec.world

    def others(self) -> list[int]:
        """The ranks of the run's other hosts (vacant ranks left out)."""
        return [i for i in range(self.n) if i != self.rank and self.nodes[i]]
