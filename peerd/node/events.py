"""The daemon's append-only event log (events.jsonl in the data dir): one JSON object per line."""
from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path, node_id: str) -> None:
        self.node_id = node_id
        self._file = open(path, "a", buffering=1)

    def __call__(self, kind: str, **fields) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"t": time.time(), "node": self.node_id, "event": kind, **fields}) + "\n")

    def close(self, **fields) -> None:
        if self._file is not None:
            self("stop", **fields)
            self._file.close()
            self._file = None
