"""Writing a file so that a crash leaves the old content or the new, never a torn one."""
from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | memoryview, mode: int = 0o644) -> None:
    """Write via a temporary file (created with `mode`, never through a symlink), fsync and rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        try:
            view = memoryview(data)
            while view:                 # one write() may take less than all of a big buffer
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
