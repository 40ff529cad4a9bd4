"""The stdlib corpus: the Python standard library's own source files, as bytes, on every machine.

    python -m peerd.train.corpus            # build (or find) the cache, print its statistics

What is in it: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` except test suites
(any directory named ``test`` or ``tests``, ``idlelib/idle_test``), installed packages
(``site-packages``, ``dist-packages``), ``pydoc_data`` (a generated dump of the documentation as
one string, 0.76 MB, which would otherwise be most of the validation set), the build's
``config-*`` directory and the machine-specific ``_sysconfigdata_*`` module, and files holding a
NUL byte. Files are sorted by their path relative
to the stdlib root (POSIX separators) and concatenated, each followed by one NUL byte that marks
the end of a file; the result is the token stream (byte-level: token = byte, vocabulary 256).

Split, by file: a file is in the validation set when the first 8 bytes of sha256(relative path),
read as an integer, fall below ``val_fraction * 2**64``. The split depends on the path alone, so it
is the same on every host and for every run, and never changes when other files come or go.

Shards, by file: each host trains on its own disjoint set of training files. iid (the default):
files sorted by size (largest first, ties by the path's hash) go one by one to the rank holding
the fewest bytes so far, so shards match in size within one file. non-iid: the path-ordered files
cut into ``world`` contiguous runs of about equal bytes (one host gets ``asyncio/``, another
``email/`` and ``encodings/``...).

Cache: ``<cache>/corpus-<key>/`` holds ``bytes.u8`` (the stream) and ``index.json`` (files,
offsets, lengths, split), where ``key`` hashes the stdlib root, the Python version and every file's
path, size and mtime; ``<cache>`` is ``$PEERD_CORPUS_CACHE_DIR`` or ``$XDG_CACHE_HOME/peerd`` or
``~/.cache/peerd``. It is built once: trainers that start together take an exclusive file lock,
the first builds (logging its progress) and renames the finished files into place, the others
find them when they get the lock. Trainers memory-map ``bytes.u8``; each reads only the pages of
its own shard and of the validation windows.

Different Python versions have different stdlibs: hosts of one run should run the same Python
minor version. ``Corpus.content_sha`` (the stream's sha256) is logged by every trainer, to check.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

log = logging.getLogger("peerd.corpus")

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "pydoc_data"})
VAL_FRACTION = 0.05
EOF_BYTE = 0
FORMAT = 1          # bump when the cache's contents change meaning


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    env = os.environ.get("PEERD_CORPUS_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "peerd"


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith("config-") or name.startswith(".")


def source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus's candidate files under ``root``, sorted."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]
        rel = Path(dirpath).relative_to(root)
        for f in filenames:
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                out.append((rel / f).as_posix())
    out.sort()
    return out


def path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")


def is_validation(rel: str, fraction: float = VAL_FRACTION) -> bool:
    return path_hash(rel) < fraction * 2.0 ** 64


@dataclass(frozen=True)
class FileEntry:
    path: str
    offset: int          # into the byte stream
    length: int          # bytes of the file plus its end-of-file byte
    val: bool


@dataclass
class Corpus:
    root: Path
    directory: Path      # the cache directory holding bytes.u8 and index.json
    files: list[FileEntry]
    data: np.ndarray     # uint8, memory-mapped: the whole stream
    content_sha: str
    build_s: float       # seconds the build took (0 when found in the cache)
    skipped: list[str]   # candidate files left out (a NUL byte: not text)

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])

    def split(self, val: bool) -> list[FileEntry]:
        return [f for f in self.files if f.val == val]

    def shard(self, rank: int, world: int, non_iid: bool = False) -> list[FileEntry]:
        return shard_files(self.split(False), rank, world, non_iid)

    def summary(self) -> dict:
        tr, va = self.split(False), self.split(True)
        return {"root": str(self.root), "cache": str(self.directory), "files": len(self.files),
                "bytes": self.nbytes, "train_files": len(tr), "train_bytes": sum(f.length for f in tr),
                "val_files": len(va), "val_bytes": sum(f.length for f in va), "skipped": len(self.skipped),
                "content_sha256": self.content_sha, "build_s": round(self.build_s, 2)}


def shard_files(train: Sequence[FileEntry], rank: int, world: int, non_iid: bool = False) -> list[FileEntry]:
    """This rank's training files (disjoint across ranks, together all of ``train``), path order."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    if len(train) < world:
        raise ValueError(f"{len(train)} training files cannot make {world} shards")
    if non_iid:
        ordered = sorted(train, key=lambda f: f.path)
        total = sum(f.length for f in ordered)
        lo, hi = rank * total / world, (rank + 1) * total / world
        mine, acc = [], 0
        for f in ordered:          # a file goes to the piece its first byte falls in
            if lo <= acc < hi:
                mine.append(f)
            acc += f.length
        return mine
    load = [0] * world
    owner: dict[str, int] = {}
    for f in sorted(train, key=lambda f: (-f.length, path_hash(f.path))):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += f.length
        owner[f.path] = r
    return sorted((f for f in train if owner[f.path] == rank), key=lambda f: f.path)


# -- building and finding the cache ------------------------------------------------------------

def _key(root: Path, files: list[str], val_fraction: float) -> str:
    h = hashlib.sha256(f"{FORMAT}\0{root}\0{sys.version_info[:3]}\0{val_fraction!r}\0".encode())
    for rel in files:
        st = (root / rel).stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def _open_cached(directory: Path, root: Path) -> Corpus | None:
    index = directory / "index.json"
    if not index.exists():
        return None
    meta = json.loads(index.read_text())
    files = [FileEntry(p, o, n, bool(v)) for p, o, n, v in meta["files"]]
    data = np.memmap(directory / "bytes.u8", dtype=np.uint8, mode="r")
    if data.shape[0] != meta["bytes"]:
        raise RuntimeError(f"corpus cache {directory} is damaged: bytes.u8 holds {data.shape[0]} bytes, "
                           f"index.json says {meta['bytes']}; delete the directory to rebuild it")
    return Corpus(root, directory, files, data, meta["content_sha256"], 0.0, meta["skipped"])


def _build(directory: Path, root: Path, files: list[str], val_fraction: float,
           progress: Callable[[str], None]) -> float:
    t0 = time.monotonic()
    tmp = directory / f"bytes.u8.tmp{os.getpid()}"
    entries, skipped, offset, last = [], [], 0, 0.0
    sha = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for i, rel in enumerate(files):
                raw = (root / rel).read_bytes()
                if b"\0" in raw:
                    skipped.append(rel)
                    continue
                raw += bytes([EOF_BYTE])
                out.write(raw)
                sha.update(raw)
                entries.append((rel, offset, len(raw), int(is_validation(rel, val_fraction))))
                offset += len(raw)
                now = time.monotonic()
                if now - last >= 1.0 or i == len(files) - 1:
                    last = now
                    progress(f"building the stdlib corpus in {directory}: {i + 1}/{len(files)} files, "
                             f"{offset / 1e6:.1f} MB")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, directory / "bytes.u8")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta = {"format": FORMAT, "root": str(root), "python": sys.version.split()[0], "bytes": offset,
            "val_fraction": val_fraction, "content_sha256": sha.hexdigest(), "skipped": skipped, "files": entries}
    itmp = directory / f"index.json.tmp{os.getpid()}"
    itmp.write_text(json.dumps(meta))
    os.replace(itmp, directory / "index.json")     # the index last: its presence means "complete"
    return time.monotonic() - t0


def load(root: Path | None = None, cache_dir: Path | None = None, val_fraction: float = VAL_FRACTION,
         lock_timeout: float | None = None, progress: Callable[[str], None] | None = None) -> Corpus:
    """The corpus of ``root`` (default: this Python's stdlib), built into the cache on first use.

    Waits at most ``lock_timeout`` seconds (default ``train_corpus_build_timeout``) for another
    process that is building the same cache."""
    if lock_timeout is None:
        from peerd.config import Config
        lock_timeout = Config().train.corpus_build_timeout
    progress = progress or log.info
    root = Path(root or stdlib_root()).resolve()
    files = source_files(root)
    if not files:
        raise FileNotFoundError(f"no Python source files under {root}: is it a Python standard library?")
    directory = Path(cache_dir or default_cache_dir()) / f"corpus-{_key(root, files, val_fraction)}"
    found = _open_cached(directory, root)
    if found is not None:
        return found
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lockf:
        deadline, told = time.monotonic() + lock_timeout, False
        while True:
            try:
                fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process held the corpus lock {directory / '.lock'} for "
                                       f"{lock_timeout:g}s (train_corpus_build_timeout)") from None
                if not told:
                    progress(f"waiting for another process building the corpus in {directory}")
                    told = True
                time.sleep(0.2)
        try:
            found = _open_cached(directory, root)       # built while we waited
            if found is not None:
                return found
            build_s = _build(directory, root, files, val_fraction, progress)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    corpus = _open_cached(directory, root)
    assert corpus is not None
    corpus.build_s = build_s
    return corpus


# -- reading windows ----------------------------------------------------------------------------

class Windows:
    """Windows of ``context + 1`` consecutive bytes over a list of files, read as one stream.

    The files' bytes (each with its end-of-file byte) are laid end to end in a virtual stream;
    a window starting anywhere in it may run from one of these files into the next of the list,
    never into a file outside it (a training window never reads validation bytes)."""

    def __init__(self, data: np.ndarray, files: Sequence[FileEntry], context: int) -> None:
        self.data, self.context = data, context
        self.offsets = np.array([f.offset for f in files], dtype=np.int64)
        lengths = np.array([f.length for f in files], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])   # virtual start of each file
        self.total = int(self.starts[-1])
        if self.total < context + 1:
            raise ValueError(f"{self.total} bytes cannot hold one window of {context + 1}")

    def read(self, vstart: np.ndarray) -> torch.Tensor:
        """Windows (len(vstart), context + 1) as int64 byte ids, from virtual start positions."""
        v = vstart.astype(np.int64)[:, None] + np.arange(self.context + 1, dtype=np.int64)
        f = np.searchsorted(self.starts, v, side="right") - 1
        pos = self.offsets[f] + (v - self.starts[f])
        return torch.from_numpy(self.data[pos].astype(np.int64))

    def sample(self, g: np.random.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.read(g.integers(0, self.total - self.context, size=batch))
        return w[:, :-1], w[:, 1:]

    def spread(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` windows at evenly spaced, non-overlapping starts (a fixed evaluation set)."""
        count = max(1, min(count, self.total // (self.context + 1)))
        step = (self.total - self.context - 1) // count
        w = self.read(np.arange(count, dtype=np.int64) * step)
        return w[:, :-1], w[:, 1:]

    def byte_counts(self) -> np.ndarray:
        """Occurrences of each byte value over these files (reads each file once)."""
        counts = np.zeros(256, dtype=np.int64)
        for off, a, b in zip(self.offsets, self.starts[:-1], self.starts[1:]):
            counts += np.bincount(self.data[off:off + (b - a)], minlength=256)
        return counts


def unigram_bits(counts: np.ndarray, targets: torch.Tensor) -> float:
    """Bits per byte of ``targets`` under the byte frequencies ``counts`` (add-one smoothed)."""
    p = (counts.astype(np.float64) + 1.0) / (counts.sum() + len(counts))
    return float(-np.log2(p)[targets.reshape(-1).numpy()].mean())


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m peerd.train.corpus",
                                 description="Build (or find) the stdlib corpus cache and print its statistics.")
    ap.add_argument("--root", help="a Python standard library (default: this Python's)")
    ap.add_argument("--cache-dir", help="default $PEERD_CORPUS_CACHE_DIR, $XDG_CACHE_HOME/peerd or ~/.cache/peerd")
    ap.add_argument("--world", type=int, default=4, help="show the shard sizes for this many hosts")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    c = load(Path(args.root) if args.root else None, Path(args.cache_dir) if args.cache_dir else None,
             progress=lambda m: print(m, file=sys.stderr))
    s = c.summary()
    s["load_s"] = round(time.monotonic() - t0, 2)
    shards = [c.shard(r, args.world) for r in range(args.world)]
    s[f"shard_bytes_world{args.world}"] = [sum(f.length for f in sh) for sh in shards]
    val = Windows(c.data, c.split(True), 256)
    x, y = val.spread(64)
    s["unigram_bpb_shard0"] = round(unigram_bits(Windows(c.data, shards[0], 256).byte_counts(), y), 3)
    s["unigram_bpb_all_train"] = round(unigram_bits(Windows(c.data, c.split(False), 256).byte_counts(), y), 3)
    print(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
