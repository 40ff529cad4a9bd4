"""What a daemon keeps in its data dir: a lock, its node key (and the id derived from it), its
incarnation and the revocations it knows."""
from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from peerd.files import atomic_write
from peerd.net import pki

log = logging.getLogger("peerd.daemon")

NODE_KEY_FILE = "node_key.pem"
REVOKED_FILE = "revoked.json"


class DataDirError(RuntimeError):
    """The data dir cannot be used (in use by another daemon, unwritable, corrupt)."""


class DataDir:
    """Owns the data dir for the life of one daemon (an exclusive lock keeps a second one out)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None

    def open(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DataDirError(f"cannot use data dir {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DataDirError(f"data dir {self.path} is in use by another peerd daemon "
                               "(one daemon per data dir; pass a different --data-dir)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def node_key(self) -> pki.PrivateKey:
        """This node's private key (`node_key.pem`, mode 600), created on first start. Its node id
        is derived from it (peerd.net.pki.node_id_of); `node_id` holds that id for people and tools.

        A data dir of peerd before keys (a `node_id` file with a random id and no key) gets a key and
        so a new node id; the old id is kept in `node_id.v1` and logged (ids are now bound to keys:
        the old one cannot be kept)."""
        path = self.path / NODE_KEY_FILE
        if path.exists():
            try:
                key = pki.load_key(path)
            except pki.PkiError as e:
                raise DataDirError(f"{e}; remove {path} to give this node a new key and node id") from None
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
        else:
            key = pki.new_key()
            pki.write_private(path, pki.key_pem(key))
        self.record_node_id(pki.node_id_of(key.public_key()))
        return key

    def record_node_id(self, node: str) -> None:
        """Write `node_id` (what `peerd keys show` and people read); an old random id moves aside."""
        path = self.path / "node_id"
        old = path.read_text().strip() if path.exists() else ""
        if old == node:
            return
        if old and not pki.is_node_id(old):
            atomic_write(self.path / "node_id.v1", f"{old[:64]}\n".encode())
            log.warning("node id %s came from a peerd before node keys; node ids are now derived from each "
                        "node's key: this node is %s from now on (the old id is kept in node_id.v1). Runs that "
                        "name the old id must be started again", old[:64], node)
        atomic_write(path, f"{node}\n".encode())

    def next_incarnation(self, now: float | None = None) -> int:
        """Grows on every start, and is the start time in milliseconds where the clock allows:
        peers refuse an incarnation beyond their clock plus the skew bound
        (peerd.net.membership), so none can be pushed out of reach by a forged or wild value."""
        path = self.path / "incarnation"
        try:
            current = int(path.read_text().strip()) if path.exists() else 0
        except ValueError:
            current = 0
        now_ms = int((time.time() if now is None else now) * 1000)
        value = max(current + 1, now_ms)
        if current > now_ms + 86_400_000:
            log.warning("stored incarnation %d is ahead of this host's clock by more than a day; starting "
                        "again from the clock (peers accept it once the old one is silent)", current)
            value = now_ms
        atomic_write(path, f"{value}\n".encode())
        return value


def slot_dir(data_dir: Path) -> Path:
    """Where a run's shared-memory slot files live: /dev/shm where it exists (memory, not disk),
    else the data dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else data_dir
