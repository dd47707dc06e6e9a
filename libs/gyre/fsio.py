"""Crash-safe file writes for the shared volume: readers see nothing or the complete file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
