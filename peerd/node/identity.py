"""What a daemon keeps in its data dir: a lock, its node id and its incarnation counter."""
from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path


class DataDirError(RuntimeError):
    """The data dir cannot be used (in use by another daemon, unwritable, corrupt)."""


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write via a temporary file, fsync and rename, so a crash leaves the old or the new content."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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

    def node_id(self) -> str:
        """The persistent node id, created on first start."""
        path = self.path / "node_id"
        if path.exists():
            value = path.read_text().strip()
            if not value or len(value) > 64 or not all(c.isalnum() or c in "-_" for c in value):
                raise DataDirError(f"{path} is corrupt ({value[:40]!r}); remove it to get a new node id")
            return value
        value = uuid.uuid4().hex[:16]
        atomic_write(path, f"{value}\n".encode())
        return value

    def next_incarnation(self) -> int:
        """1 on first start, then one more on every start."""
        path = self.path / "incarnation"
        try:
            current = int(path.read_text().strip()) if path.exists() else 0
        except ValueError:
            current = 0
        value = current + 1
        atomic_write(path, f"{value}\n".encode())
        return value


def slot_dir(data_dir: Path) -> Path:
    """Where a run's shared-memory slot files live: /dev/shm where it exists (memory, not disk),
    else the data dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else data_dir
