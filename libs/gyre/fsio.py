"""Crash-safe file writes for the shared volume: readers see nothing or the complete file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file (written by someone else, e.g. `save_file`) or a folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths: Iterable[Path]) -> None:
    """fsync many files or folders at once: concurrent fsyncs share the filesystem's journal commits
    (ext4, xfs), so a folder of N files costs about one flush instead of N."""
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            fsync_file(path)
        return
    with ThreadPoolExecutor(min(16, len(paths))) as pool:
        for _ in pool.map(fsync_file, paths):  # re-raises the first error
            pass


def write_file(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Create `path` with `data`, not fsynced, not atomic: for files inside a folder that is fsynced
    and then renamed into view as a whole (`write_atomic` otherwise). `mode` as in `write_atomic`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # regardless of the umask
        f.write(data)
    return Path(path)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Write `data` to `path` via a temp file in the same folder, fsync, rename, fsync the folder.

    Invariant: at every instant `path` is either absent, its previous content, or exactly `data`.
    `mode` defaults to world-readable (mkstemp's 0600 would hide manifests from inference pods that
    run as another user of the volume's group).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
